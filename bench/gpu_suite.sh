#!/usr/bin/env bash
# The GPU test suite in one device call: the `-m gpu` tests' ids split round-robin into P shards, each shard its own
# pytest process on the one GPU, all at once. Most of a GPU test's time is the CuTe DSL compile on the CPU (one core
# a process), so P processes use P of the machine's cores; no GPU test asserts a timing, so sharing the GPU changes no
# verdict. One call ran test_gpu_kernels.py alone in ~226 s (s32-r2) and could not fit the rest beside it.
# Usage (device tool, carry [".carry"]):
#   bash bench/gpu_suite.sh [P] [test files...]     (default P = 6; files: every tests/test_gpu_*.py, test_tp_group.py)
# SUITE_S bounds each shard (default 420 s). Logs: $OUT/gpu-suite-<i>.log; the last lines sum the shards' counts.
# The exit status is non-zero when any shard failed, errored, was cut by SUITE_S, or the ids do not add up.
set -uo pipefail
P=${1:-6}
shift || true
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/test_gpu_*.py tests/test_tp_group.py)
out=${OUT:-$(mktemp -d)}
work=$(mktemp -d)
python3 -m pytest -m gpu --collect-only -q -p no:cacheprovider "${files[@]}" > $work/collect.log 2>&1 \
  || { echo "collection failed:"; tail -20 $work/collect.log; exit 1; }
grep '::' $work/collect.log > $work/ids
n=$(wc -l < $work/ids)
[ "$n" -gt 0 ] || { echo "no GPU tests collected in ${files[*]}"; exit 1; }
echo "$n GPU tests in ${files[*]}, $P shards"
for ((i = 0; i < P; i++)); do
  awk -v p=$P -v i=$i '(NR - 1) % p == i' $work/ids > $work/shard$i
  [ -s $work/shard$i ] || continue
  mapfile -t ids < $work/shard$i
  (start=$(date +%s)
   timeout ${SUITE_S:-420} python3 -m pytest -m gpu -q -p no:cacheprovider "${ids[@]}" > $out/gpu-suite-$i.log 2>&1
   echo "shard $i: rc=$? in $(( $(date +%s) - start )) s, ${#ids[@]} ids" >> $out/gpu-suite-$i.log) &
done
wait
status=0
total=0
declare -A sum=()
for ((i = 0; i < P; i++)); do
  [ -s $work/shard$i ] || continue
  log=$out/gpu-suite-$i.log
  tail -1 $log
  grep -E '^(FAILED|ERROR) ' $log
  grep -q 'rc=0 ' <(tail -1 $log) || status=1
  # pytest's summary line: "3 passed, 2 skipped, 1 deselected in 9.1s" (deselected: not -m gpu)
  for kind in passed skipped failed error xfailed xpassed; do
    c=$(grep -E "^=*.* in [0-9.]+s" $log | tail -1 | grep -oE "[0-9]+ $kind" | awk '{print $1}')
    total=$((total + ${c:-0}))
    sum[$kind]=$(( ${sum[$kind]:-0} + ${c:-0} ))
  done
done
echo "suite: ${sum[passed]} passed, ${sum[skipped]} skipped, ${sum[failed]} failed, ${sum[error]} errors" \
  "(${total} of $n ids reported)"
[ "$total" = "$n" ] || status=1
exit $status
