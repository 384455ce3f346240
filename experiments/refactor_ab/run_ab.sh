#!/usr/bin/env bash
# The H200 benchmarks of two trees in one device call, interleaved (base, head, per benchmark), then
# compare.py. Issue 11's proof that splitting modules changed no figure.
#   here:   rm -rf .ab && mkdir -p .ab/base && git archive BASE | tar -x -C .ab/base && echo BASE > .ab/base/COMMIT
#   device: carry [".whl", ".ab"], command: bash experiments/refactor_ab/run_ab.sh "transfer registration"
#           and then bash experiments/refactor_ab/run_ab.sh e2e (each call stays under 10 minutes)
#   SIDES="base refactor": compare two exported trees (.ab/base, .ab/refactor); "head" is this tree
#   ARGS_<BENCH>="...": overrides for one benchmark on every side, e.g. ARGS_HBM_TIER="sections=[peak,full_hit]"
# Results: $OUT/ab/{base,head}/<bench>/results.json, $OUT/ab/compare.{md,json,png}, $OUT/ab/run.log.
set -u
BENCHES=${1:-"transfer registration e2e"}
OUT=${OUT:-/tmp/out}
AB=$OUT/ab
mkdir -p "$AB"
exec > >(tee -a "$AB/run.log") 2>&1
SITE=/tmp/ab_site
[ -d "$SITE" ] || python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
SIDES=${SIDES:-"base head"}
side_dir() { if [ "$1" = head ]; then echo "$PWD"; else echo "$PWD/.ab/$1"; fi; }
for side in $SIDES; do echo "$side: $(cat "$(side_dir "$side")/COMMIT" 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo '?')"; done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import sys, torch, cuda.bindings; print(sys.version.split()[0], torch.__version__, cuda.bindings.__version__)"
for bench in $BENCHES; do
  args_var="ARGS_$(echo "$bench" | tr a-z A-Z)"
  for side in $SIDES; do
    dir=$(side_dir "$side")
    echo "=== $bench $side ($(date +%T))"
    (cd "$dir" && PYTHONPATH=$SITE:$dir PYTHONDONTWRITEBYTECODE=1 timeout 280 \
      python3 experiments/$bench/bench_$bench.py out_dir="$AB/$side/$bench" ${!args_var:-} 2>&1 | tail -4)
  done
done
set -- $SIDES
PYTHONPATH=$SITE python3 experiments/refactor_ab/compare.py "$AB/$1" "$AB/$2" "$AB" --label-base "$1" --label-head "$2" | tail -3
tar czf "$OUT/ab.tgz" -C "$OUT" ab
