#!/usr/bin/env bash
# One device call: MoE blocks served from a re-swept table NEW (an xz-compressed export kept in the tree, e.g.
# bench/s58_h100_new.sqlite.xz) and from the shipped table OLD, one after the other in the same call (bench/moe.py
# --served, row routing, shared experts beside the routed ones as served). What a landing checks before it ships.
# Usage (device tool, carry [".carry"]):
#   NEW=bench/s58_h100_new.sqlite.xz OLD=tuning_db/h100.sqlite FMT=mxfp4 TP=16 ROUTING=zipf:1.2 BATCHES=2,16 \
#     EXTRA=gemm.wgmma_cktrig bash bench/served_vs.sh
# EXTRA is the staged family the new table was swept with (K3TUNE_EXTRA_FAMILIES, new side only). EACH_S bounds each
# side (default 115 s). Writes $OUT/served-new.json/.log and $OUT/served-old.json/.log; prints both tables, then each
# point's ratio and whether it differs beyond the spread, by moe.py's rule (bench/served_compare.py).
# (s58-r4/r5 ran this inline; the script is those commands.)
set -uo pipefail
: "${NEW:?NEW=<new export .sqlite.xz>}" "${OLD:?OLD=<shipped table>}" "${FMT:?FMT=bf16|mxfp4}" "${TP:?TP=8|16}"
[ -f "$NEW" ] && [ -f "$OLD" ] || { echo "served_vs: $NEW or $OLD not found"; exit 1; }
source .carry/cutedsl/unpack.sh >/dev/null 2>&1 || { echo "served_vs: no CuTe DSL bundle (.carry)"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
xz -dc "$NEW" > /tmp/served-new.sqlite || exit 1
model=$([ "$FMT" = bf16 ] && echo kimi_k3_bf16_experts.json || echo kimi_k3_config.json)
for side in new old; do
  db=/tmp/served-new.sqlite; [ $side = old ] && db=$(realpath "$OLD")
  (
    cd bench
    [ $side = new ] && [ -n "${EXTRA:-}" ] && export K3TUNE_EXTRA_FAMILIES=$EXTRA
    timeout ${EACH_S:-115} python3 moe.py --db $db --served --served-routing row --batches ${BATCHES:-1,4,16,64} \
      --routings ${ROUTING:-uniform} --prefetch-mib 0 --shared-sms 16 --tps $TP --fmts $FMT --model $model \
      --out $OUT/served-$side.json > $OUT/served-$side.log 2>&1
    echo "$side rc $?"; grep -E "^tp" $OUT/served-$side.log
  )
done
python3 bench/served_compare.py $OUT/served-new.json $OUT/served-old.json  # each point: ratio, beyond the IQR?
date -u
