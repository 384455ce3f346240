#!/usr/bin/env bash
# Device calls on the H200: named steps, each a GPU test run or a benchmark, in the order given.
#   run tool: carry [".whl"], command: bash experiments/run_h200.sh tests copy_kernel transfer
# Steps: tests (every test marked cuda), transfer, e2e, registration, copy_kernel, action_keys,
# warmup, hbm_tier, live_restore, telefuser_480p (the gate on TeleFuser's real-width DiT, its Wan VAE
# and umT5 encoder), telefuser_480p_rolling (the same on a rolling ring L=6 S=3, Plan tier and no
# cache), interactive (workload=interactive at lingbot_480p, Plan tier), interactive_14b (the same on
# TeleFuser's real-width pipeline), shared_index (a 480p chunk restored from a record another process wrote,
# against the same process's restore, LocalDisk), codecs (KV codecs: ratios, encode/decode GiB/s and nvCOMP's where
# .whl/ carries nvidia_nvcomp_cu13 and nvidia_libnvcomp_cu13, restore wall per tier against store.codec=none), metrics (issue 34: the recording cost per call and
# per restored chunk, and a 480p live-session run on the Plan tier scraped over loopback: hits
# against chunks restored, restore GiB/s per tier against the link's peak), root_open (a LocalDisk root of 100k and 1M committed chunks
# opened, CPU only: the host's 16 cores and its own disk), session_reuse (issue 32: frames handed out, KV
# restored only where a session computes; A/B/C on the Plan tier and HBM at 14B, live chunks, the
# divergence sweep), session_reuse_profile (a restored live chunk sub-step by sub-step, both tiers, ~1 min). Results go to $OUT/results/<step>/ (packed into $OUT/results.tgz after every
# step, so a step that runs out of time still leaves the earlier ones); the log is $OUT/run.log.
# Per step: T_<STEP>= (seconds, upper case) and ARGS_<STEP>= (overrides of its conf/*.yaml; for
# tests, the test paths: ARGS_TESTS="tests/core/test_weights_fingerprint.py ...").
set -u
OUT=${OUT:-/tmp/out}
R=$OUT/results
mkdir -p "$R"
exec > >(tee -a "$OUT/run.log") 2>&1
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v "^WARNING" || true
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
pack() { tar czf "$OUT/results.tgz" -C "$OUT" results; }
var() { local n="$1_$(echo "$2" | tr a-z A-Z)"; echo "${!n:-$3}"; }

echo "=== machine ($(date +%T))"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current,clocks.sm --format=csv
grep -E "MemTotal|MemAvailable" /proc/meminfo; nproc
python3 -c "import torch, cuda.bindings, sys; print(sys.version.split()[0], torch.__version__, cuda.bindings.__version__)"

declare -A DEFAULT_T=([tests]=200 [transfer]=150 [e2e]=230 [registration]=140 [copy_kernel]=120 [action_keys]=120 [warmup]=200 [hbm_tier]=420 [live_restore]=240 [interactive]=240 [interactive_14b]=150 [metrics]=240 [telefuser_480p]=330 [telefuser_480p_rolling]=170 [shared_index]=300 [codecs]=470 [root_open]=580 [session_reuse]=560 [session_reuse_profile]=300)
declare -A FIXED_ARGS=([action_keys]="device=cuda old_runs=1"
    [metrics]="geometry=lingbot_480p device=cuda store=fluxon_plan store_overrides=['store.backing=private'] runtime_overrides=['runtime.compute_gemm_dim=8192','runtime.compute_gemms=8'] sessions=8 depth=3 branching=2"
    [telefuser_480p_rolling]="stores=[fluxon_plan,nocache] frames_cache=false profile_b=false runtime_overrides=['runtime.local_attn_size=6','runtime.sink_size=3']")
declare -A BENCH=([telefuser_480p_rolling]=telefuser_480p)  # steps that run another step's script
for s in "$@"; do
    echo; echo "=== $s ($(date +%T))"
    t=$(var T "$s" "${DEFAULT_T[$s]:-300}")
    mkdir -p "$R/$s"
    if [ "$s" = tests ]; then
        timeout "$t" python3 -m pytest -q -p no:cacheprovider -rs -m cuda $(var ARGS "$s" tests) 2>&1 | tail -30 | tee "$R/tests/pytest_cuda.txt"
    elif [ "$s" = shared_index ]; then
        timeout "$t" python3 experiments/shared_index/cross_process.py --device cuda --geometry lingbot_480p \
            --chunks 3 --root /tmp/cs-shared-root --out "$R/shared_index" $(var ARGS "$s" "")
        rm -rf /tmp/cs-shared-root
    elif [ "$s" = root_open ]; then
        timeout "$t" python3 experiments/root_open/measure.py --dir /tmp --out "$R/root_open/results.json" $(var ARGS "$s" "")
        rm -rf /tmp/cs-root-open-*
    elif [ "$s" = session_reuse_profile ]; then
        timeout "$t" python3 experiments/session_reuse/profile_live.py out_dir="$R/$s" $(var ARGS "$s" "live_sessions=5") \
            2>&1 | grep -v "^\s*$" | tail -70
    elif [ "$s" = interactive ]; then
        timeout "$t" python3 -m cacheseek workload=interactive runtime.geometry=lingbot_480p runtime.device=cuda \
            runtime.compute_gemm_dim=8192 runtime.compute_gemms=8 +store=fluxon_plan store.backing=private \
            $(var ARGS "$s" "workload.sessions=8 workload.depth=3 workload.branching=2") \
            hydra.run.dir="$R/interactive" 2>&1 | grep -v "^\s*$" | tail -25
    elif [ "$s" = interactive_14b ]; then
        timeout "$t" python3 -m cacheseek workload=interactive runtime=telefuser +model=lingbot_world_14b +store=fluxon_plan \
            store.backing=private $(var ARGS "$s" "workload.sessions=6 workload.depth=3 workload.branching=2") \
            hydra.run.dir="$R/interactive_14b" 2>&1 | grep -v "^\s*$" | tail -25
    else
        b=${BENCH[$s]:-$s}
        timeout "$t" python3 "experiments/$b/bench_$b.py" out_dir="$R/$s" ${FIXED_ARGS[$s]:-} $(var ARGS "$s" "")
    fi
    pack
done
echo "=== done ($(date +%T))"
