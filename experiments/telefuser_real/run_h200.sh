#!/usr/bin/env bash
# One device call on the H200 for the real client: every CUDA test, the gate matrix on TeleFuser's
# real pipeline with runtime.device=cuda, and the CLI gate at lingbot_480p on the Plan tier and on
# the tiered store. Wheels (hydra, telefuser --no-deps, diffusers, ftfy, loguru, ...) travel in .whl.
#   run tool: carry [".whl"], command: bash experiments/telefuser_real/run_h200.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
step() { echo; echo "=== $1 ($(date +%T))"; }
step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, cuda.bindings, sys; print(sys.version.split()[0], torch.__version__, cuda.bindings.__version__)"
git log -1 --format=%h 2>/dev/null || true
step "CUDA tests"
timeout 170 python3 -m pytest -q -p no:cacheprovider -rs -m cuda tests 2>&1 | tail -15
step "gate matrix on the real pipeline, CUDA"
timeout 200 python3 experiments/telefuser_real/run_matrix.py --device cuda --tag h200 --out "$OUT" 2>&1 | grep -E "^\[|^PASS|^FAIL|Error|error"
step "lingbot_480p gate, Plan tier and tiered (hbm > fluxon_plan)"
timeout 100 python3 -m cacheseek +store=fluxon_plan +experiment=lingbot_480p hydra.run.dir=$OUT/g480_plan 2>&1 | tail -12
timeout 100 python3 -m cacheseek +store=tiered +experiment=lingbot_480p hydra.run.dir=$OUT/g480_tiered 2>&1 | tail -12
step "done"
