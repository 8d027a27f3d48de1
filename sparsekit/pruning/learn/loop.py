"""The learning loop: Adam on the mask logits, the weights frozen.

Each step draws the masks of every linear (``masking.draw``), runs a batch of calibration windows
through the masked model and minimizes the language-modelling loss (plus, with ``distill``, the KL
divergence from the dense model's next-token distribution) plus ``reg`` times the sparsity
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
from sparsekit.pruning.learn.masking import draw, set_masks


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


def train(model, holders, bank, calib: torch.Tensor, *, sparsity: float, allocation: str, cfg, seed: int,
          device: torch.device, fingerprint: dict, checkpoint_dir, progress: Progress | None = None,
          warn: Callable[[str], object] = print) -> dict:
    """Run ``cfg.steps`` steps (from a checkpoint with ``cfg.resume``); returns the loss history and timings."""
    opt = torch.optim.Adam(list(bank.parameters()), lr=cfg.lr)
    history: list[float] = []
    start, resumed = 0, None
    if cfg.resume:
        state = checkpointing.load(checkpoint_dir, fingerprint)
        with torch.no_grad():
            for key, t in state["logits"].items():
                getattr(bank, key).copy_(t)
        opt.load_state_dict(state["optimizer"])
        start, history, resumed = state["step"], list(state["history"]), state["path"]
        warn(f"resuming mask learning from {resumed} (step {start} of {cfg.steps})")
    t0 = time.perf_counter()
    steps = cfg.steps
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
        loss = lm_loss(out, ids)
        if teacher is not None:
            loss = loss + kl_loss(out, teacher)
        total = loss + cfg.reg * reg
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        set_masks(holders, None)
        history.append(float(loss.detach()))
        del masks, out, teacher, loss, total
        done = step + 1
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < steps:
            checkpointing.save(checkpoint_dir, done, dict(bank.named_parameters()), opt.state_dict(), history, fingerprint)
        report(progress, "learning", done, steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"history": history, "seconds": time.perf_counter() - t0, "start_step": start, "resumed_from": resumed}


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
