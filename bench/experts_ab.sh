#!/usr/bin/env bash
# One device call for an expert-kernel change that is not a knob: the MoE GPU tests, bench/moe_experts.py on this
# tree and on the base tree (a `git archive` of the base commit, made before the call; it travels as an untracked
# file), then bench/experts_ab.py on the two. Exits non-zero when the tests fail (nothing is benched then) or when
# the new code lost (experts_ab.py's rule), so a later step of the same call (a sweep) can be made conditional.
# Usage (device tool, carry [".carry"]):
#   git archive --prefix=base/ <base commit> k3tune configs tuning_db pyproject.toml \
#     $(git ls-tree -r --name-only <base commit> bench | grep '\.py$') | xz > base.tar.xz
#   NEW_TC="x1=...;r2=..." NEW_VARIANTS=x1_mxfp4,r2_mxfp4 BASE_TC="x1=..." BASE_VARIANTS=x1_mxfp4 \
#     AB_VARIANTS=x1_mxfp4 bash bench/experts_ab.sh
# Optional: BASE (default base.tar.xz), MID (a third archive, `--prefix=mid/`, run with BASE_TC: new against it too,
# for the record; the exit status stays new against base), EXPERTS_ARGS (default --tps 16,8 --batches 1,8,64
# --routings uniform --samples 5), TESTS_S / BENCH_S (time limits, default 200 / 170 s). Outputs in $OUT:
# moe-tests.txt, experts-new.{json,log}, experts-base.{json,log}, experts-ab.txt (and experts-mid.*, experts-ab-mid.txt).
set -uo pipefail
source .carry/cutedsl/unpack.sh || exit 1
ARGS=${EXPERTS_ARGS:---tps 16,8 --batches 1,8,64 --routings uniform --samples 5}
timeout ${TESTS_S:-200} python3 -m pytest -m gpu -q tests/test_gpu_moe_tc.py tests/test_gpu_moe.py \
  > $OUT/moe-tests.txt 2>&1
rc=$?; tail -2 $OUT/moe-tests.txt; echo "gpu tests rc=$rc"
[ $rc = 0 ] || exit 1  # no timing of kernels that fail their tests
bench() {  # bench NAME ROOT TC VARIANTS: moe_experts.py of the tree at ROOT -> $OUT/experts-NAME.{json,log}
  (cd $2/bench && PYTHONPATH=$2:${PYTHONPATH:-} timeout ${BENCH_S:-170} python3 moe_experts.py $ARGS --tc "$3" \
    --variants "$4" --out $OUT/experts-$1.json > $OUT/experts-$1.log 2>&1) \
    || { echo "$1-tree bench failed"; tail -3 $OUT/experts-$1.log; exit 1; }
  grep -v "^#" $OUT/experts-$1.log
}
unpack() {  # unpack ARCHIVE NAME: a `git archive --prefix=NAME/` into /tmp/trees
  mkdir -p /tmp/trees && rm -rf /tmp/trees/$2 && tar -xJf "$1" -C /tmp/trees || exit 1
}
bench new $PWD "$NEW_TC" "$NEW_VARIANTS"
unpack "${BASE:-base.tar.xz}" base
bench base /tmp/trees/base "$BASE_TC" "$BASE_VARIANTS"
python3 bench/experts_ab.py $OUT/experts-new.json $OUT/experts-base.json --variants "${AB_VARIANTS:-}" \
  > $OUT/experts-ab.txt 2>&1
rc=$?; cat $OUT/experts-ab.txt; echo "experts_ab rc=$rc"
if [ -n "${MID:-}" ]; then  # a third tree (archive with prefix mid/, BASE_TC's knobs): new against it, for the record
  unpack "$MID" mid
  bench mid /tmp/trees/mid "$BASE_TC" "$BASE_VARIANTS"
  python3 bench/experts_ab.py $OUT/experts-new.json $OUT/experts-mid.json --variants "${AB_VARIANTS:-}" \
    > $OUT/experts-ab-mid.txt 2>&1
  echo "new against mid:"; cat $OUT/experts-ab-mid.txt
fi
exit $rc
