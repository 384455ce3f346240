#!/usr/bin/env bash
# The H200 benchmarks of two trees in one device call, interleaved (base, head, per benchmark), then
# compare.py. Issue 11's proof that splitting modules changed no figure.
#   here:   rm -rf .ab && mkdir -p .ab/base && git archive BASE | tar -x -C .ab/base && echo BASE > .ab/base/COMMIT
#   device: carry [".whl", ".ab"], command: bash experiments/refactor_ab/run_ab.sh "transfer registration"
#           and then bash experiments/refactor_ab/run_ab.sh e2e (each call stays under 10 minutes)
# Results: $OUT/ab/{base,head}/<bench>/results.json, $OUT/ab/compare.{md,json,png}, $OUT/ab/run.log.
set -u
BENCHES=${1:-"transfer registration e2e"}
OUT=${OUT:-/tmp/out}
AB=$OUT/ab
mkdir -p "$AB"
exec > >(tee -a "$AB/run.log") 2>&1
SITE=/tmp/ab_site
[ -d "$SITE" ] || python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
HEAD_DIR=$PWD
BASE_DIR=$PWD/.ab/base
echo "base $(cat "$BASE_DIR/COMMIT" 2>/dev/null || echo '?') head $(git -C "$HEAD_DIR" rev-parse --short HEAD 2>/dev/null || cat "$HEAD_DIR/.ab/HEAD_COMMIT" 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import sys, torch, cuda.bindings; print(sys.version.split()[0], torch.__version__, cuda.bindings.__version__)"
for bench in $BENCHES; do
  for side in base head; do
    dir=$HEAD_DIR; [ "$side" = base ] && dir=$BASE_DIR
    echo "=== $bench $side ($(date +%T))"
    (cd "$dir" && PYTHONPATH=$SITE:$dir PYTHONDONTWRITEBYTECODE=1 timeout 280 \
      python3 experiments/$bench/bench_$bench.py out_dir="$AB/$side/$bench" 2>&1 | tail -4)
  done
done
PYTHONPATH=$SITE python3 experiments/refactor_ab/compare.py "$AB/base" "$AB/head" "$AB" \
  --label-base "base $(cat "$BASE_DIR/COMMIT" 2>/dev/null)" --label-head head | tail -3
tar czf "$OUT/ab.tgz" -C "$OUT" ab
