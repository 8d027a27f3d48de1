#!/usr/bin/env bash
# On a GPU machine: install sparsekit from the project's own files into a fresh virtual environment
# and run one kernel; then hide numba-cuda and check that the kernels are refused at load time with
# one line naming the fix, and that a packed layer still runs (the reference path), never crashing.
#
# Usage (repo root; wheels for packages the machine lacks in .whl/, e.g. datasets, dill, multiprocess, gguf):
#   bash scripts/checks/gpu_install.sh
set -euo pipefail
VENV=${VENV:-/tmp/sparsekit-fresh}
rm -rf "$VENV"
python3 -m venv "$VENV"
# torch, numba and numba-cuda come from the machine's Python (which may itself be a venv): a .pth puts
# its site-packages on the new environment's path, so pip sees them as installed
SITE=$(python3 -c 'import site; print(site.getsitepackages()[0])')
echo "$SITE" > "$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')/machine-site.pth"
if ! "$VENV/bin/python" -m pip install -q --no-index --find-links .whl --no-build-isolation -e ".[gpu]"; then
    # offline machines whose CUDA toolkit is not the pip-wheel one lack numba-cuda[cu13]'s toolkit wheels
    # (nvidia-cuda-cccl, nvidia-nvvm): install what the extra names without the toolkit extra instead
    echo "(the [gpu] extra's toolkit wheels are not available offline: installing numba-cuda and cuda-core without them)"
    "$VENV/bin/python" -m pip install -q --no-index --find-links .whl --no-build-isolation -e . "cuda-core>=0.5"
    # numba-cuda into this environment itself (a wheel in .whl), so that its import redirector (a .pth) runs here
    "$VENV/bin/python" -m pip install -q --no-index --find-links .whl --no-deps --ignore-installed "numba-cuda>=0.30"
fi
"$VENV/bin/python" -m pip check || true
echo "== with numba-cuda (the [gpu] extra):"
"$VENV/bin/sparsekit" env
"$VENV/bin/python" - <<'PY'
import numpy, torch
numpy.row_stack = numpy.vstack
from sparsekit.kernels.health import kernel_status
status = kernel_status()
print(status.line)
if not status.ok:
    raise SystemExit(1)
from sparsekit.kernels import tcabme_matmul
from sparsekit.packed.tcabme import encode
w = torch.randn(4096, 4096, device="cuda")
w = torch.where(torch.rand_like(w) < 0.5, torch.zeros_like(w), w).half()
x = torch.randn(8, 4096, device="cuda").half()
p = encode(w)
y = torch.full((8, 4096), float("nan"), device="cuda", dtype=torch.half)
tcabme_matmul(x, p, out=y)
ref = x.double() @ w.double().t()
print("one kernel, 4096x4096 at 50%, N=8: rel. error", float((y.double() - ref).norm() / ref.norm()))
PY
echo "== without numba-cuda (numba's built-in CUDA target):"
rm -rf /tmp/sparsekit-pkg
"$VENV/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/sparsekit-pkg .
# -S skips the .pth files, so numba-cuda's redirector never runs and numba.cuda is numba's own
cd /tmp   # not the repo root, whose sparsekit/ source folder would shadow the installed package
PYTHONPATH=/tmp/sparsekit-pkg:$SITE python3 -S - <<'PY'
import warnings, numpy, torch
numpy.row_stack = numpy.vstack
from numba import cuda
print("numba.cuda implementation:", cuda.implementation)
from sparsekit.kernels.health import kernel_status
print(kernel_status().line)
from sparsekit.runtime.sparse_linear import SparseLinear
lin = torch.nn.Linear(256, 128, bias=False).half()
lin.weight.data = torch.where(torch.rand_like(lin.weight) < 0.5, torch.zeros_like(lin.weight), lin.weight)
sl = SparseLinear.from_linear(lin).cuda()
x = torch.randn(4, 256, device="cuda").half()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    y = sl(x); y = sl(x)
print("forward ran; notices:", [str(c.message) for c in caught])
ref = x.float() @ lin.weight.cuda().float().t()
print("rel. error", float((y.float() - ref).norm() / ref.norm()))
PY
