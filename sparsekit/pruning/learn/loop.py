"""The learning loop: Adam on the mask logits, the weights frozen.

Each step draws the masks of every linear (``masking.draw``), runs a batch of calibration windows
through the masked model and minimizes the language-modelling loss (with ``distill``, the KL
divergence from the dense model's next-token distribution instead) plus ``reg`` times the sparsity
regularizer. On CUDA the forward runs under bf16 autocast; logits and optimizer state stay fp32.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
import torch.nn.functional as F

from sparsekit.progress import Progress, report
from sparsekit.pruning.learn import checkpointing, schedule as sch
from sparsekit.pruning.learn.masking import draw, final_masks, set_masks


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in float32."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def kl_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student), in float32."""
    s = F.log_softmax(student.float(), dim=-1).reshape(-1, student.shape[-1])
    t = F.log_softmax(teacher.float(), dim=-1).reshape(-1, teacher.shape[-1])
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


@torch.no_grad()
def calibration_loss(model, holders, masks, calib: torch.Tensor, device: torch.device, batch_size: int) -> float:
    """Mean LM loss of the model under ``masks`` (None: dense) over all windows of ``calib``."""
    set_masks(holders, masks)
    total, n = 0.0, 0
    for a in range(0, calib.shape[0], batch_size):
        ids = calib[a:a + batch_size].to(device)
        with autocast(device):
            out = model(input_ids=ids, use_cache=False).logits
        total += float(lm_loss(out, ids)) * ids.shape[0]
        n += ids.shape[0]
    set_masks(holders, None)
    return total / max(1, n)


def _heldout_loss(model, holders, bank, heldout, sparsity, allocation, device, batch_size) -> float:
    masks = {n: m.float() for n, m in final_masks(bank, sparsity, allocation).items()}
    return calibration_loss(model, holders, masks, heldout, device, batch_size)


def _snapshot(bank) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in bank.named_parameters()}


def train(model, holders, bank, calib: torch.Tensor, *, sparsity: float, allocation: str, cfg, seed: int,
          device: torch.device, fingerprint: dict, checkpoint_dir, heldout: torch.Tensor | None = None,
          progress: Progress | None = None, warn: Callable[[str], object] = print) -> dict:
    """Run ``cfg.steps`` steps (from a checkpoint with ``cfg.resume``) and leave in ``bank`` the logits
    whose mask had the lowest LM loss on the ``heldout`` windows (checked every ``eval_every`` steps
    and at the end; the starting mask counts, so learning never returns a mask worse there than the
    one it started from). Returns the loss history, the selection and timings."""
    opt = torch.optim.Adam(list(bank.parameters()), lr=cfg.lr)
    steps = cfg.steps
    warmup = max(1, int(round(steps * cfg.warmup)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / warmup))
    eval_every = max(1, steps // 20)
    ev = dict(sparsity=sparsity, allocation=allocation, device=device, batch_size=cfg.batch_size)
    history: list[float] = []
    start, resumed = 0, None
    best = {"step": 0, "loss": None, "state": None, "curve": []}
    if cfg.resume:
        state = checkpointing.load(checkpoint_dir, fingerprint)
        with torch.no_grad():
            for key, t in state["logits"].items():
                getattr(bank, key).copy_(t)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start, history, resumed = state["step"], list(state["history"]), state["path"]
        best = state["best"]
        if best["state"] is not None:
            best["state"] = {k: v.to(device) for k, v in best["state"].items()}
        warn(f"resuming mask learning from {resumed} (step {start} of {steps})")
    elif heldout is not None:
        best.update(loss=_heldout_loss(model, holders, bank, heldout, **ev), state=_snapshot(bank))
        best["curve"].append([0, best["loss"]])
    t0 = time.perf_counter()
    for step in range(start, steps):
        masks, reg = draw(bank, sparsity, allocation, step, steps, cfg, seed, device)
        ids = calib[sch.batch_indices(seed, step, calib.shape[0], cfg.batch_size)].to(device)
        teacher = None
        if cfg.distill:
            set_masks(holders, None)
            with torch.no_grad(), autocast(device):
                teacher = model(input_ids=ids, use_cache=False).logits
        set_masks(holders, masks)
        with autocast(device):
            out = model(input_ids=ids, use_cache=False).logits
        loss = lm_loss(out, ids) if teacher is None else kl_loss(out, teacher)
        total = loss + cfg.reg * reg
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        sched.step()
        set_masks(holders, None)
        history.append(float(loss.detach()))
        del masks, out, teacher, loss, total
        done = step + 1
        if heldout is not None and (done % eval_every == 0 or done == steps):
            val = _heldout_loss(model, holders, bank, heldout, **ev)
            best["curve"].append([done, val])
            if val < best["loss"]:
                best.update(step=done, loss=val, state=_snapshot(bank))
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < steps:
            saved_best = {**best, "state": None if best["state"] is None else {k: v.cpu() for k, v in best["state"].items()}}
            checkpointing.save(checkpoint_dir, done, dict(bank.named_parameters()),
                               {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "best": saved_best},
                               history, fingerprint)
        report(progress, "learning", done, steps)
    if heldout is not None:
        with torch.no_grad():
            for key, p in bank.named_parameters():
                p.copy_(best["state"][key])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    selection = None
    if heldout is not None:
        selection = {"heldout_windows": int(heldout.shape[0]), "eval_every": eval_every, "best_step": best["step"],
                     "heldout_loss_start": best["curve"][0][1] if best["curve"] else None,
                     "heldout_loss_best": best["loss"], "heldout_curve": best["curve"]}
    return {"history": history, "seconds": time.perf_counter() - t0, "start_step": start, "resumed_from": resumed,
            "selection": selection}


def summarize(history: list[float], points: int = 20) -> dict:
    """The loss curve in sparsekit.json: first/last/min and the mean of ``points`` equal stretches."""
    if not history:
        return {"steps": 0}
    n = len(history)
    k = min(points, n)
    bounds = [round(i * n / k) for i in range(k + 1)]
    curve = [sum(history[a:b]) / (b - a) for a, b in zip(bounds, bounds[1:])]
    tail = history[-max(1, n // 10):]
    return {"steps": n, "first": history[0], "last": history[-1], "min": min(history),
            "last_10pct_mean": sum(tail) / len(tail), "curve": curve, "curve_points": k}
