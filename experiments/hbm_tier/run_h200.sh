#!/usr/bin/env bash
# One device call on the H200 for issue 14: the GPU tests of the HBM tier and the tiered store,
# then the benchmark. Results go to $OUT/results (packed into $OUT/results.tgz after each step, so
# a step that runs out of time still leaves the earlier ones); the whole log is $OUT/run.log.
#   run tool: carry [".whl/plan_site"], command: bash experiments/hbm_tier/run_h200.sh
#   optional: T_TESTS= T_BENCH= (seconds), BENCH_ARGS= (overrides of conf/hbm_tier.yaml)
set -u
export PYTHONPATH=$PWD/.whl/plan_site:$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/out}
R=$OUT/results
mkdir -p "$R"
exec > >(tee -a "$OUT/run.log") 2>&1
pack() { tar czf "$OUT/results.tgz" -C "$OUT" results; }
step() { echo; echo "=== $1 ($(date +%T))"; }

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,pcie.link.gen.current,clocks.sm --format=csv
grep -E "MemTotal|MemAvailable" /proc/meminfo; nproc
python3 -c "import torch, cuda.bindings, sys; print(sys.version.split()[0], torch.__version__, cuda.bindings.__version__)"

step "GPU tests"
timeout ${T_TESTS:-150} python3 -m pytest -q -p no:cacheprovider -rs -m cuda tests/tiers tests/plan/test_plan_cuda.py \
    2>&1 | tail -25 | tee "$R/pytest_gpu.txt"
pack

step "bench"
timeout ${T_BENCH:-420} python3 experiments/hbm_tier/bench_hbm_tier.py out_dir=$R/hbm_tier ${BENCH_ARGS:-}
pack
step "done"
