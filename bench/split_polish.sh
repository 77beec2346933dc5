#!/usr/bin/env bash
# One device call: re-decide MoE block winners of the shipped DB with every SM split of each winner tried ([search]
# whole, configs/sweep_h200_moe_mxfp4_split.toml), then bench them as served. Each FMT:TP:ROUTING runs in turn into
# one copy of tuning_db/h200.sqlite: redo (`k3tune db redo`) that format, tp and routing's blocks, sweep them
# with the split spec set to them under a time limit, checkpoint the WAL, then bench/moe.py --served on the copy.
# Usage (device tool, kind nvidia-h200, carry [".carry"]):
#   SWEEP_S=170 bash bench/split_polish.sh mxfp4:16:uniform bf16:16:uniform
# Writes $OUT/split.log (everything), $OUT/served-FMT-tpTP-ROUTING.json, $OUT/split.sqlite.xz (every trial) and
# $OUT/new.sqlite (the export to ship after `k3tune db diff` / `db verify`). A sweep cut by its limit stops the rest
# (its trials are kept: START_DB=split.sqlite.xz RESUME=1 resumes it, the first point then without a redo, the others
# with one). START_DB alone starts from that trial database and redoes every point (s41: two calls, each from the same
# trial DB, then `k3tune db merge`). SWEEP_S and BENCH_S may list one limit per point (the last one serves the rest),
# e.g. SWEEP_S="120 230"; a BENCH_S of 0 skips that point's bench.
# FMT:TP:ROUTING@M,M... redoes only those batch sizes' blocks (always, RESUME or not); the bench serves all of them.
# GPUS=N sweeps on N GPUs (a multi-GPU kind; default 1); the bench runs on the first. WHOLE='"shared_sms", "routed_on",
# "prefetch_mib"' replaces the spec's `whole` list (the knobs whose every value the polish tries on each winner);
# NEIGHBOURS=0 BUDGET=4 make it a cheap re-decide: each block's old winner (after the families' defaults) and one
# more trial, then only the whole moves of the winner, no neighbouring block's winner ([search] neighbours, budget).
# Another GPU kind (the H100): HW=H100 WARM_FROM=H200 NO_REDO=1 BASE="tuning_db/h200.sqlite tuning_db/h100.sqlite"
# starts from both tables merged (the blocks run the H100's dense winners), tries each H200 block winner first
# (`--warm-from`), redoes nothing and exports the H100's winners.
set -uo pipefail
source .carry/cutedsl/unpack.sh || exit 1
log=$OUT/split.log
db=/tmp/split.sqlite
[ -n "${RESUME:-}" ] && [ -z "${START_DB:-}" ] && { echo "RESUME needs START_DB"; exit 1; }
base=(${BASE:-tuning_db/h200.sqlite})
if [ -n "${START_DB:-}" ]; then xz -dc "$START_DB" > $db || exit 1
elif [ ${#base[@]} = 1 ]; then cp ${base[0]} $db
else python3 -m k3tune db merge $db "${base[@]}" >> $log 2>&1 || exit 1; fi
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu --format=csv >> $log
sweep_s=(${SWEEP_S:-170}); bench_s=(${BENCH_S:-120}); i=0
for point in "$@"; do
  limit=${sweep_s[$i]:-${sweep_s[-1]}}; blimit=${bench_s[$i]:-${bench_s[-1]}}; i=$((i + 1))
  batches=""
  case $point in *@*) batches=${point#*@}; point=${point%@*};; esac
  IFS=: read -r fmt tp routing <<< "$point"
  model=$([ "$fmt" = bf16 ] && echo kimi_k3_bf16_experts.json || echo kimi_k3_config.json)
  tag=$fmt-tp$tp-${routing%%:*}
  spec=/tmp/split-$tag.toml
  sed -e "s/^name = .*/name = \"h200_moe_split_$(echo $tag | tr - _)\"/" -e "s/^tp = .*/tp = [$tp]/" \
    -e "s/^routing = .*/routing = \"$routing\"/" -e "s/^config = .*/config = \"$model\"/" \
    ${WHOLE:+-e "s/^whole = .*/whole = [$WHOLE]/"} ${BUDGET:+-e "s/^budget = .*/budget = $BUDGET/"} \
    ${NEIGHBOURS:+-e "s/^polish = \(.*\)/polish = \1\nneighbours = $NEIGHBOURS/"} \
    configs/sweep_h200_moe_mxfp4_split.toml > $spec
  patterns=()
  for m in ${batches//,/ }; do patterns+=("moe.block[tp=$tp,M=$m,%format=$fmt,routing=$routing]"); done
  [ -z "$batches" ] && patterns=("moe.block[tp=$tp,%format=$fmt,routing=$routing]")
  # a resumed first point is decided already; NO_REDO (another kind's first sweep) redoes none
  if [ -z "${NO_REDO:-}" ] && { [ -z "${RESUME:-}" ] || [ $i -gt 1 ] || [ -n "$batches" ]; }; then
    python3 -m k3tune db redo $db "${patterns[@]}" >> $log 2>&1 || exit 1
  fi
  t0=$SECONDS
  timeout $limit python3 bench/device_sweep.py --spec $spec --db $db --gpus ${GPUS:-1} \
    ${WARM_FROM:+--warm-from $WARM_FROM} >> $log 2>&1
  rc=$?; echo "== $tag sweep rc=$rc $((SECONDS - t0)) s" | tee -a $log  # in the log too: what a resume reads
  python3 -c "import sqlite3; c = sqlite3.connect('$db'); c.execute('PRAGMA wal_checkpoint(TRUNCATE)'); c.close()"
  [ $rc = 0 ] || { echo "stopped: $tag did not finish"; break; }
  [ "$blimit" = 0 ] && continue  # BENCH_S 0: decide only (bench later with bench/moe.py --served on the export)
  t0=$SECONDS
  (cd bench && timeout $blimit python3 moe.py --db $db --served --served-routing row \
    --batches 1,2,4,8,16,32,64 --routings $routing --prefetch-mib 0 --shared-sms 16 --tps $tp --fmts $fmt \
    --model $model --out $OUT/served-$tag.json >> $log 2>&1)
  echo "== $tag bench rc=$? $((SECONDS - t0)) s"
done
grep -E '"(trials|failed|problems_done|polish_passes|polish_changed|polish_untimed)"|^tp[0-9]' $log | cut -c1-400
xz -T0 -c $db > $OUT/split.sqlite.xz
python3 -m k3tune db export $db $OUT/new.sqlite --hardware ${HW:-H200} >> $log 2>&1; echo "export rc=$?"
