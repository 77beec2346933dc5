#!/usr/bin/env bash
# The GPU test suite in one device call: the `-m gpu` tests' ids split round-robin into P shards, each shard its own
# pytest process on the one GPU, all at once. Most of a GPU test's time is the CuTe DSL compile on the CPU (one core
# a process), so P processes use P of the machine's cores; no GPU test asserts a timing, so sharing the GPU changes no
# verdict. One call ran test_gpu_kernels.py alone in ~226 s (s32-r2) and could not fit the rest beside it.
# Usage (device tool, carry [".carry"]):
#   bash bench/gpu_suite.sh [P] [test files...]     (default P = 6; files: every tests/test_gpu_*.py, test_tp_group.py)
# SUITE_S bounds each shard (default 420 s). Log: $OUT/gpu-suite.log, each shard's pytest output (and the re-run's)
# under a "==> shard <i>" header: one file, as the device returns at most 8 (s35-r1 lost its re-run's log to that).
# The last lines printed sum the shards' counts.
# Tests that ran out of GPU memory beside the other shards (s34-r9: 10 of 278 at P = 8, the 896-expert cases) are
# re-run alone after them (bench/pytest_plugins/oom_ids.py records them; the log's "==> shard retry" part), and count
# by that run's outcome. The exit status is non-zero when any test failed or errored (after that re-run), a shard was
# cut by SUITE_S, or the ids do not add up.
set -uo pipefail
P=${1:-6}
shift || true
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/test_gpu_*.py tests/test_tp_group.py)
out=${OUT:-$(mktemp -d)}
work=$(mktemp -d)
logs=$work/logs
mkdir -p $logs
plugins=$(cd "$(dirname "$0")" && pwd)/pytest_plugins
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
   K3TUNE_OOM_IDS=$work/oom$i PYTHONPATH="$plugins${PYTHONPATH:+:$PYTHONPATH}" timeout ${SUITE_S:-420} \
     python3 -m pytest -m gpu -q -p no:cacheprovider -p oom_ids "${ids[@]}" > $logs/shard-$i.log 2>&1
   echo "shard $i: rc=$? in $(( $(date +%s) - start )) s, ${#ids[@]} ids" >> $logs/shard-$i.log) &
done
wait
status=0
total=0
declare -A sum=()
counts() {  # pytest's summary line: "3 passed, 2 skipped, 1 deselected in 9.1s" (deselected: not -m gpu)
  local log=$1 kind c
  for kind in passed skipped failed error xfailed xpassed; do
    c=$(grep -E "^=*.* in [0-9.]+s" $log | tail -1 | grep -oE "[0-9]+ $kind" | awk '{print $1}')
    total=$((total + ${c:-0}))
    sum[$kind]=$(( ${sum[$kind]:-0} + ${c:-0} ))
  done
}
for ((i = 0; i < P; i++)); do
  [ -s $work/shard$i ] || continue
  log=$logs/shard-$i.log
  tail -1 $log
  grep -E '^(FAILED|ERROR) ' $log
  tail -1 $log | grep -qE 'rc=[01] ' || status=1  # cut by SUITE_S (124) or killed: not a test's verdict
  counts $log
done
cat $work/oom* 2>/dev/null | sort -u > $work/oom_all
if [ -s $work/oom_all ]; then  # ran out of GPU memory beside the other shards: alone now, their counts replaced
  m=$(wc -l < $work/oom_all)
  echo "$m ids ran out of GPU memory beside the other shards: re-run alone"
  sum[failed]=$(( ${sum[failed]:-0} - $(grep -c $'\tcall$' $work/oom_all) ))
  sum[error]=$(( ${sum[error]:-0} - $(grep -c $'\tsetup$' $work/oom_all) ))
  total=$((total - m))
  mapfile -t ids < <(cut -f1 $work/oom_all)
  timeout ${SUITE_S:-420} python3 -m pytest -m gpu -q -p no:cacheprovider "${ids[@]}" > $logs/shard-retry.log 2>&1
  echo "re-run: rc=$?, $m ids"
  grep -E '^(FAILED|ERROR) ' $logs/shard-retry.log
  counts $logs/shard-retry.log
fi
for f in $logs/shard-*.log; do echo "==> $(basename $f .log | tr - ' ')"; cat $f; done > $out/gpu-suite.log
echo "suite: ${sum[passed]:-0} passed, ${sum[skipped]:-0} skipped, ${sum[failed]:-0} failed, ${sum[error]:-0} errors" \
  "(${total} of $n ids reported)"
[ "$total" = "$n" ] || status=1
[ $(( ${sum[failed]:-0} + ${sum[error]:-0} )) = 0 ] || status=1
exit $status
