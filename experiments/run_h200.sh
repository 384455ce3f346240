#!/usr/bin/env bash
# One device call on the H200: the GPU tests of the Plan data path, then the three benchmarks.
# Results go to $OUT/results (packed into $OUT/results.tgz after every step, so a step that runs
# out of time still leaves the earlier ones); the whole log is $OUT/run.log.
#   run tool: carry [".whl/plan_site"], command: bash experiments/run_h200.sh
set -u
export PYTHONPATH=$PWD/.whl/plan_site:$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/out}
R=$OUT/results
mkdir -p "$R"
exec > >(tee -a "$OUT/run.log") 2>&1
pack() { tar czf "$OUT/results.tgz" -C "$OUT" results; }
step() { echo; echo "=== $1 ($(date +%T))"; }

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current,clocks.sm --format=csv
grep -H . /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled
grep -E "MemTotal|MemFree|HugePages_Total" /proc/meminfo; nproc
python3 -c "import torch, cuda.bindings, sys; print(sys.version.split()[0], torch.__version__, cuda.bindings.__version__)"

step "GPU tests"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rs tests/plan/test_plan_cuda.py tests/plan/test_plan_tier_overlap.py tests/plan/test_transfer_async.py 2>&1 | tail -25 | tee "$R/pytest_gpu.txt"
pack

step "transfer"
timeout ${T_TRANSFER:-120} python3 experiments/transfer/bench_transfer.py out_dir=$R/transfer ${TRANSFER_ARGS:-}
pack

step "e2e"
timeout ${T_E2E:-230} python3 experiments/e2e/bench_e2e.py out_dir=$R/e2e ${E2E_ARGS:-}
pack

step "registration"
timeout ${T_REG:-140} python3 experiments/registration/bench_registration.py out_dir=$R/registration ${REG_ARGS:-}
pack
step "done"
