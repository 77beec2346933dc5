#!/usr/bin/env bash
# Session 57 device calls. bash bench/s57.sh STEP...
#   vs: bench/gemm.py on a re-swept dense table NEW_DB (.sqlite, or .sqlite.xz kept in the tree; default
#       bench/s58_h100_new.sqlite.xz, the landing's H100 export, whose dense winners are s57-r1's; swept under
#       K3TUNE_EXTRA_FAMILIES=gemm.wgmma_cktrig) and on the shipped tuning_db/h100.sqlite, one after the other, at MS
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "GPU: $G"; date -u
source .carry/cutedsl/unpack.sh || exit 1
NEW_DB=${NEW_DB:-bench/s58_h100_new.sqlite.xz}
[ -f "$NEW_DB" ] || { echo "s57.sh: $NEW_DB not found"; exit 1; }
case $NEW_DB in *.xz) xz -dc "$NEW_DB" > /tmp/s57-new.sqlite || exit 1; NEW_DB=/tmp/s57-new.sqlite ;; esac
for step in "$@"; do
  echo "== $step $(date -u +%T)"
  case $step in
    vs) K3TUNE_EXTRA_FAMILIES=gemm.wgmma_cktrig timeout ${BENCH_S:-150} python3 bench/gemm.py \
          --db $NEW_DB --ms ${MS:-16,32,64} --samples 9 --rounds 3 --out $OUT/bench-new.json \
          > $OUT/bench-new.log 2>&1; echo "new rc $?"; grep -v "^tp" $OUT/bench-new.log | tail -8
        timeout ${BENCH_S:-150} python3 bench/gemm.py --db tuning_db/h100.sqlite --ms ${MS:-16,32,64} --samples 9 \
          --rounds 3 --out $OUT/bench-old.json > $OUT/bench-old.log 2>&1; echo "old rc $?"
        grep -v "^tp" $OUT/bench-old.log | tail -8 ;;
  esac
done
date -u
