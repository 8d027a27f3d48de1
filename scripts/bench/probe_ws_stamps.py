"""Where spmm_ws (issue 21; docs/kernels-notes.md "v22 outcome"), with ``--kernel sp24`` sp24_ws (issue 22, "v25"),
or with ``--kernel pf`` spmm_pf (issue 21, "v29") spends its cycles, per role and step: one launch of the
time-stamped build (``sparsekit.kernels.spmm_ws_probe``, ``sp24_ws_probe``, ``spmm_pf.pf_stamps``) per shape and
token count, summarized as medians over every block's steady-state steps (the first ring's worth of steps left
out), in SM cycles:

- consumer (warp 0 of the first warpgroup): the whole step, and its parts: retiring the previous products and
  releasing their stage, waiting for "full" (sp24_ws up to 32 tokens a tile: first, then the retiring), decoding
  the A registers (sp24_ws: issuing their loads), issuing the products, the rest (spmm_pf: waiting for "full",
  decoding and storing the A tile, meeting the warpgroup and issuing, then retiring the previous step's products
  and releasing their stage);
- copy warp (sp24_ws: the producer): waiting for a free stage ("empty"), issuing the step's bulk copies;
- copies in flight: issued -> landed (the table warp sees "raw"; sp24_ws: issued -> the consumer sees "full");
- table: landed -> the consumer sees "full" (the table warp's publish, and any wait of the consumer's; none in
  sp24_ws);
- lead: how many cycles before the consumer wanted a stage its copies were issued;
- mean step (the median's skew shows a heavy tail), first full (a block's start-up: its first stage ready) and
  span (the median block's last products issued, cycles since its start);
- then, per launch, its blocks grouped by how many blocks their SM ran (the GPU's nanosecond timer): how long the
  median block of each group took and when the group's last one ended.

Also: the stamped and the shipped kernel's time per call (CUDA-graph replays over weight copies beyond the L2),
so the probe's own cost is visible. GPU only::

    python -m scripts.bench.probe_ws_stamps [--kernel sp24|pf] [--shapes 22016x4096] [--ns 1,32,64] [--sparsity 0.5] \
        [--plans default,s8,g2]

``--plans``: ``default`` and forced plans, each letters and a number joined by ``-``: ``s`` stages, ``g``
warpgroups per block, ``t`` tokens per tile (``s8-g1``: an 8-stage ring, one warpgroup), ``r`` tile rows per
warpgroup (sp24 only), and ``a`` first for two warpgroups taking turns on one tile row (``a``, ``a-s6``; spmm_ws
only); spmm_pf takes ``t`` and ``s`` only (default: 256 tokens a tile); a plan the kernel refuses (shared memory) is
one line and the sweep goes on. ``--sparsity`` is ignored
with ``--kernel sp24`` (random 2:4 weights).
"""
from __future__ import annotations

import argparse
import sys

import torch

from scripts.common import copies_for, cuda_or_exit, ints_arg, masked_weight, shapes_arg, time_calls


def summarize(st: torch.Tensor, stages: int, late: bool = False, table: bool = True,
              pf: bool = False) -> dict[str, float]:
    """Median cycles of each part over the steady-state steps of every block (``st``: [blocks, steps, 8]).
    ``late``: the consumer waits for "full" (slot 2) before it retires and releases (slot 1); ``table``: slot 7 is
    the table warp's "landed" (spmm_ws; sp24_ws has none: in flight then runs to the consumer's "full"); ``pf``:
    spmm_pf's consumer order (begin, "full", stored, issued, retired: slots 0, 2, 3, 4, 1)."""
    st = st.double().cpu()
    live = st[:, :, 0] > 0                                   # steps a block ran (a block's first stamp is > 0)
    nxt = torch.roll(st[:, :, 0], -1, dims=1)
    prev_copied = torch.roll(st[:, :, 6], 1, dims=1)
    steady = live.clone()
    steady[:, :stages] = False
    steady &= torch.roll(live, -1, dims=1)                   # the next step exists too
    steady[:, -1] = False
    begin, retired, full = st[:, :, 0], st[:, :, 1], st[:, :, 2]
    landed = st[:, :, 7] if table else full
    parts = {
        "step": nxt - begin,
        "retire": retired - (full if late else begin),
        "wait full": full - (begin if late else retired),
        "decode": st[:, :, 3] - (retired if late else full),
        "issue": st[:, :, 4] - st[:, :, 3],
        "rest": nxt - st[:, :, 4],
        "wait empty": st[:, :, 5] - prev_copied,
        "copy issue": st[:, :, 6] - st[:, :, 5],
        "in flight": landed - st[:, :, 6],
        "table": full - landed if table else torch.full_like(full, float("nan")),
        "lead": (begin if late else retired) - st[:, :, 6],
    }
    if pf:
        parts.update({"wait full": full - begin, "decode": st[:, :, 3] - full, "retire": retired - st[:, :, 4],
                      "rest": nxt - retired, "lead": begin - st[:, :, 6]})
    out = {k: float(v[steady].median()) if steady.any() else float("nan") for k, v in parts.items()}
    out["mean step"] = float(parts["step"][steady].mean()) if steady.any() else float("nan")
    last = live.sum(dim=1) - 1                               # each block's last step
    rows = torch.arange(st.shape[0])
    out["first full"] = float(st[:, 0, 2].median())          # the block's start-up: its first stage ready
    out["span"] = float(st[rows, last, 4].median())          # the block's last products issued
    return out


def by_sm_load(plan: dict) -> str:
    """The blocks grouped by how many blocks their SM ran: per group the SMs, the median block's time from
    start to end and the latest end, in us from the launch's first start; then the whole launch."""
    sm, start, end = plan["sm"].cpu(), plan["start_ns"].cpu(), plan["end_ns"].cpu()
    ref = int(start.min())
    start, end = (start - ref) & 0xFFFFFFFF, (end - ref) & 0xFFFFFFFF
    load = torch.bincount(sm)[sm]
    parts = []
    for k in sorted(set(load.tolist())):
        sel = load == k
        parts.append(f"{k} a SM ({int(sel.sum()) // k} SMs): span {float((end - start)[sel].double().median()) / 1e3:.1f}, "
                     f"last end {int(end[sel].max()) / 1e3:.1f}")
    return "; ".join(parts) + f"; whole launch {int(end.max()) / 1e3:.1f} us"


def plan_arg(text: str) -> dict:
    """``s8-g2`` -> {"stages": 8, "groups": 2}; ``a-s6`` -> {"stages": 6, "alt": True}; ``default`` -> {}."""
    names = {"s": "stages", "g": "groups", "t": "tokens", "r": "strips"}
    if text == "default":
        return {}
    parts = text.split("-")
    plan = {names[part[0]]: int(part[1:]) for part in parts if part != "a"}
    return {**plan, "alt": True} if "a" in parts else plan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", default="tcabme", choices=("tcabme", "sp24", "pf"),
                    help="spmm_ws (TCA-BME), sp24_ws (2:4) or spmm_pf (TCA-BME prefill)")
    ap.add_argument("--shapes", default="22016x4096,28672x8192")
    ap.add_argument("--ns", default="1,32,64")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--plans", default="default")
    args = ap.parse_args()
    sp24, pf = args.kernel == "sp24", args.kernel == "pf"
    try:
        plans = [(text, plan_arg(text)) for text in args.plans.split(",")]
    except (KeyError, ValueError, IndexError):
        print(f"--plans: letters s, g, t, r and a number joined by '-', or 'default' (got {args.plans!r})",
              file=sys.stderr)
        return 2
    if sp24 and any(kw.get("alt") for _, kw in plans) or not sp24 and any("strips" in kw for _, kw in plans):
        print("--plans: 'a' (two warpgroups taking turns) is spmm_ws's, 'r' (tile rows) sp24_ws's", file=sys.stderr)
        return 2
    if pf and any(set(kw) - {"tokens", "stages"} for _, kw in plans):
        print("--plans: spmm_pf takes 't' (tokens a tile) and 's' (stages) only", file=sys.stderr)
        return 2
    cuda_or_exit("the stamp probe")
    if sp24:
        from sparsekit.kernels.sp24 import sp24_matmul
        from sparsekit.kernels.sp24_ws_probe import ws_stamps
        from sparsekit.packed.sp24 import transcode as encode

        def shipped(x, w, **kw):
            return sp24_matmul(x, w, kernel="ws", splits=1, **kw)
    elif pf:
        from sparsekit.kernels.spmm_pf import pf_stamps as ws_stamps
        from sparsekit.kernels.spmm_pf import tcabme_pf_matmul as shipped
        from sparsekit.packed.tcabme import encode
    else:
        from sparsekit.kernels.spmm_ws import tcabme_ws_matmul
        from sparsekit.kernels.spmm_ws_probe import ws_stamps
        from sparsekit.packed.tcabme import encode

        def shipped(x, w, **kw):
            return tcabme_ws_matmul(x, w, splits=1, **kw)

    gen = torch.Generator(device="cuda").manual_seed(0)
    clock = torch.cuda.get_device_properties(0).clock_rate if hasattr(torch.cuda.get_device_properties(0),
                                                                       "clock_rate") else None
    cols = ["step", "retire", "wait full", "decode", "issue", "rest", "wait empty", "copy issue", "in flight",
            "table", "lead", "mean step", "first full", "span"]
    loads = []
    print("| M x K | N | plan | shipped us | stamped us | " + " | ".join(cols) + " |")
    print("|---|---:|---|---:|---:|" + "---:|" * len(cols))
    for m, k in shapes_arg(args.shapes):
        dense = [masked_weight(m, k, "2:4" if sp24 else args.sparsity, gen) for _ in range(copies_for(m * k * 2))]
        packed = [encode(w) for w in dense]
        for n in ints_arg(args.ns):
            x = torch.randn(n, k, device="cuda", generator=gen).half()
            ref = x.double() @ dense[0].double().t()
            for text, kw in plans:
                try:
                    y, st, plan = ws_stamps(x, packed[0], **kw)
                except ValueError as e:
                    print(f"| {m}x{k} | {n} | {text}: refused ({e}) |")
                    continue
                err = float((y.double() - ref).norm() / ref.norm())
                if not err < 1e-3:
                    print(f"FAIL {m}x{k} N={n} {text}: the stamped build's rel err {err}", file=sys.stderr)
                    return 1
                ts, _ = time_calls([lambda p=p: ws_stamps(x, p, **kw) for p in packed], graph=False)
                tw, _ = time_calls([lambda p=p: shipped(x, p, **kw) for p in packed], graph=False)
                _, st, plan = ws_stamps(x, packed[-1], **kw)      # a copy not used last: cold in the L2
                torch.cuda.synchronize()
                s = summarize(st, plan["stages"], late=plan.get("late", False), table=not sp24, pf=pf)
                shape = f"r{plan['strips']} " if sp24 else ""
                alt = " alt" if plan.get("alt") else ""
                desc = (f"t{plan['tokens']} s{plan['stages']} {shape}g{plan.get('groups', 2)}{alt} b{plan['blocks']} "
                        f"k{plan['steps']}")
                print(f"| {m}x{k} | {n} | {desc} | {tw:.1f} | {ts:.1f} | " + " | ".join(f"{s[c]:.0f}" for c in cols)
                      + " |", flush=True)
                loads.append(f"{m}x{k} N={n} {desc}: {by_sm_load(plan)}")
        del dense, packed
        torch.cuda.empty_cache()
    print("\nBlocks by their SM's load (us, the stamped build, GPU timer):")
    for line in loads:
        print(f"- {line}")
    if clock:
        print(f"(SM clock {clock / 1e6:.2f} GHz as torch reports it; the stamps count SM cycles)")
    print("Eager launches for both timings (no graph: the probe allocates its buffers per call); no K split.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
