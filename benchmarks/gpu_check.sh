#!/usr/bin/env bash
# The GPU checks of one device session, as one command (docs/benchmarks.md, "GPU"): the
# gpu-marked tests, then benchmarks/run.py on CUDA. Needs a Python whose torch, fbgemm-gpu
# (the CUDA build) and torchrec are the pinned three (README); writes its logs to $OUT.
#   PY=python3 OUT=/tmp/gpu bash benchmarks/gpu_check.sh   (at most 150 + 360 s: its timeouts; never run yet)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/gpu_check}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's recsys_dist, installed or not
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L 2>&1 | tee "$OUT/env.txt"
"$PY" -c "import torch, torchrec, fbgemm_gpu; print('torch', torch.__version__, 'torchrec', torchrec.__version__)
assert torch.cuda.is_available(), 'no CUDA device visible to torch'" 2>&1 | tee -a "$OUT/env.txt" || exit 1
timeout 150 "$PY" -m pytest -q -m gpu tests 2>&1 | tee "$OUT/gpu_tests.txt"
timeout 360 "$PY" benchmarks/run.py --device cuda --quick 2>&1 | tee "$OUT/bench.txt"
