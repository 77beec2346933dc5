#!/usr/bin/env bash
# One device call (an H200): the rest of gemm.wgmma_cktrig's H200 landing after session 63, where the dense table
# and 35 of the 56 blocks were re-swept. In turn, within the call's 600 s:
#   1. the last 21 MXFP4 blocks from s63-r5's trials (bench/s63_r4.sh, START_DB=bench/s63_split.sqlite.xz; SWEEP_S);
#   2. the export checked: `db verify` against the dense spec and the four block specs (under the variable), and
#      `db diff` against the shipped table ($OUT/diff.json);
#   3. the blocks the diff flags slower (regressions) served beside the shipped ones, one bench/served_vs.sh per
#      (format, tp, routing) group under $OUT/vs-<group>/ (EACH_S a side), while SERVE_S seconds last.
# Writes $OUT/new.sqlite (the export to ship), $OUT/split.sqlite.xz (every trial: START_DB for a resume),
# $OUT/verify.txt, $OUT/diff.json, $OUT/flagged.txt. Usage (device tool, kind nvidia-h200, carry [".carry"]):
#   bash bench/land_h200.sh
# A second call that only checks and serves an export fetched from the first (xz-compressed into the tree):
#   NEW_XZ=bench/s64_new.sqlite.xz bash bench/land_h200.sh
set -uo pipefail
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "GPU: $G"; date -u
case "$G" in *H200*) ;; *) echo "land_h200: not an H200"; exit 0 ;; esac
t0=$SECONDS
if [ -n "${NEW_XZ:-}" ]; then xz -dc "$NEW_XZ" > $OUT/new.sqlite || exit 1
else
  for f in "${START_DB:-bench/s63_split.sqlite.xz}" bench/s63_new_h200.sqlite.xz; do
    [ -f "$f" ] || { echo "land_h200: $f is missing (parked?)"; exit 1; }
  done
  START_DB=${START_DB:-bench/s63_split.sqlite.xz} RESUME=1 SWEEP_S="${SWEEP_S:-130 130 130}" \
    POINTS="${POINTS:-mxfp4:8:uniform mxfp4:16:zipf:1.2 mxfp4:8:zipf:1.2}" bash bench/s63_r4.sh
fi
source .carry/cutedsl/unpack.sh >/dev/null 2>&1 || exit 1
export K3TUNE_EXTRA_FAMILIES=gemm.wgmma_cktrig  # the export's winners are current only with the family offered
for s in h200_dense h200_moe_bf16 h200_moe_bf16_zipf h200_moe_mxfp4 h200_moe_mxfp4_zipf; do
  python3 -m k3tune db verify $OUT/new.sqlite --spec $s 2>&1 | grep -E "coverage|stale|OK" | sed "s/^/$s: /"
done | tee $OUT/verify.txt
python3 -m k3tune db diff tuning_db/h200.sqlite $OUT/new.sqlite --json > $OUT/diff.json; echo "diff rc $?"
# the flagged blocks, a line per (format, tp, routing): FMT TP ROUTING BATCHES
python3 - $OUT/diff.json > $OUT/flagged.txt <<'EOF'
import json, re, sys
groups = {}
for r in json.load(open(sys.argv[1]))["rows"]:
    if r["change"] == "regression" and r["problem"].startswith("moe.block["):
        d = dict(kv.split("=", 1) for kv in re.match(r"moe\.block\[(.*)\]$", r["problem"]).group(1).split(","))
        groups.setdefault((d["format"], d["tp"], d["routing"]), []).append(int(d["M"]))
for (fmt, tp, routing), ms in sorted(groups.items()):
    print(fmt, tp, routing, ",".join(map(str, sorted(ms))))
EOF
echo "flagged (format tp routing batches):"; cat $OUT/flagged.txt
unset K3TUNE_EXTRA_FAMILIES
xz -T0 -c $OUT/new.sqlite > /tmp/land-new.sqlite.xz
while read -r fmt tp routing batches; do
  left=$(( ${SERVE_S:-560} - (SECONDS - t0) ))
  [ $left -gt $(( 2 * ${EACH_S:-60} + 20 )) ] || { echo "no time left to serve $fmt tp$tp $routing"; continue; }
  mkdir -p $OUT/vs-$fmt-tp$tp-${routing%%:*}
  OUT=$OUT/vs-$fmt-tp$tp-${routing%%:*} NEW=/tmp/land-new.sqlite.xz OLD=tuning_db/h200.sqlite FMT=$fmt TP=$tp \
    ROUTING=$routing BATCHES=$batches EXTRA=gemm.wgmma_cktrig EACH_S=${EACH_S:-60} bash bench/served_vs.sh < /dev/null
done < $OUT/flagged.txt
date -u
