#!/usr/bin/env bash
# One device call: the staged route switches (bench/chain_ab.py) tested and A/B'd, then, for those that land
# (bench/chain_pick.py), their module defaults turned on in this copy of the tree and every MoE block decided again
# the cheap way on that code (bench/split_polish.sh: each block's old winner, BUDGET more trials, the WHOLE moves),
# in the time the call has left (a spec cut by its limit stops the rest: resume with START_DB/RESUME).
# The same defaults turned on locally (`sed -i "s/^NAME = False/NAME = True/" k3tune/kernels/moe_experts.py`) give
# the same keys. SPEC_B / SPEC_M: the sweep limit of a bf16 / MXFP4 spec (80 / 120 s).
# Usage (device tool, kind nvidia-h200, carry [".carry"]): bash bench/chain_land.sh
# POINTS, NAT_VARIANTS (the natural A/B's variants) and IMPOSED=0 (no imposed A/B) shorten the A/B part.
# Writes $OUT/land.log, imposed.json, natural.json, picked.txt, and split_polish's files.
set -uo pipefail
# first: an H100 draw then costs its start only, not the tests (s47: six H100s in one session)
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 ||
  { echo "not an H200: nothing to A/B against its winners or decide for tuning_db/h200.sqlite (s45-r2)"; exit 1; }
source .carry/cutedsl/unpack.sh || exit 1
log=$OUT/land.log
timeout ${TEST_S:-150} python3 -m pytest -q -m gpu tests/test_gpu_moe.py \
  -k "fast_routes or select_routes or gather_with_the_route or runs_the_top_k" > $OUT/tests.log 2>&1
rc=$?; tail -3 $OUT/tests.log; [ $rc = 0 ] || { echo "the staged switches' GPU tests failed (rc $rc)"; exit 1; }
(cd bench && timeout ${NAT_S:-110} python3 chain_ab.py --points ${POINTS:-bf16:16:1,mxfp4:16:1} \
  --variants ${NAT_VARIANTS:-redux,select,select+fused} --json $OUT/natural.json >> $log 2>&1
 [ "${IMPOSED:-1}" = 0 ] || timeout ${IMP_S:-110} python3 chain_ab.py --imposed \
  --points ${POINTS:-bf16:16:1,mxfp4:16:1} --variants topk,topk+select,topk+select+fused \
  --json $OUT/imposed.json >> $log 2>&1)
grep -E "^(bf16|mxfp4)" $log | cut -c1-800
imposed=$([ "${IMPOSED:-1}" = 0 ] || echo $OUT/imposed.json)  # IMPOSED=0: no imposed A/B, so GATHER_ROUTE stays off
on=$(python3 bench/chain_pick.py $OUT/natural.json $imposed)
echo "$on" > $OUT/picked.txt; echo "== picked: ${on:-nothing}"
[ -n "$on" ] || exit 0
for n in $on; do sed -i "s/^$n = False/$n = True/" k3tune/kernels/moe_experts.py; done
grep -E "^(W2_EARLY_L2|ROUTE_REDUX|ROUTE_SELECT|FORCED_TOPK|GATHER_ROUTE) =" k3tune/kernels/moe_experts.py
[ -n "${NO_SWEEP:-}" ] && exit 0
left=$((${CALL_S:-585} - SECONDS - 20))
[ $left -gt 120 ] || { echo "no time left to decide the blocks again ($left s)"; exit 0; }
# Each spec gets a fixed limit (s46-r5/r6 with BUDGET=2: 37-73 s a spec), and only the specs that fit what is left
# are started (a spec cut by its limit would stop the rest); the others are printed for a second call:
#   START_DB=split.sqlite.xz WHOLE=... BUDGET=... NEIGHBOURS=0 BENCH_S=0 bash bench/split_polish.sh <the rest>
specs=(bf16:16:uniform bf16:8:uniform bf16:16:zipf:1.2 bf16:8:zipf:1.2 mxfp4:16:uniform mxfp4:8:uniform
       mxfp4:16:zipf:1.2 mxfp4:8:zipf:1.2)
run=(); limits=(); rest=()
for s in "${specs[@]}"; do
  l=$([ "${s%%:*}" = bf16 ] && echo ${SPEC_B:-80} || echo ${SPEC_M:-120})
  if [ ${#rest[@]} = 0 ] && [ $l -le $left ]; then run+=($s); limits+=($l); left=$((left - l)); else rest+=($s); fi
done
echo "== deciding: ${run[*]:-nothing}; left for another call: ${rest[*]:-nothing}"
[ ${#run[@]} -gt 0 ] || exit 0
WHOLE=${WHOLE:-} BUDGET=${BUDGET:-4} NEIGHBOURS=0 BENCH_S=0 SWEEP_S="${limits[*]}" \
  bash bench/split_polish.sh "${run[@]}"
