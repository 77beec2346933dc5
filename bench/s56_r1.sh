# Session 56 device calls. bash bench/s56_r1.sh STEP...  (each step checks the card; k = table named by the card)
#   ind-a / ind-b: the Inductor bar halves (s49-r1/r2's commands) on this card's table
#   probe: the late-trigger probe on the M = 16 class (wgmma_cktrig, TP8; GRID, PROBE_S override its grid and limit)
#   wide:  a wider late-trigger grid on TP8 q_a and kda.o_proj at M = 16
#   m16:   an M = 16 (or SPEC at MS) re-sweep with the trig families from this card's table, then bench new vs shipped side by side
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "GPU: $G"; date -u
source .carry/cutedsl/unpack.sh
case "$G" in *H200*) k=h200; HW=H200 ;; *) k=h100; HW=H100 ;; esac
DB=tuning_db/$k.sqlite
[ -n "${GRID:-}" ] || GRID='{"tile_m":[16],"split_k":[2,4,8],"bk":[128],"stages":[4,6],"pdl":[1],"late":[2,3,4,5,6,1024]}'
for step in "$@"; do
  echo "== $step $(date -u +%T)"
  case $step in
    ind-a) timeout 280 python3 bench/gemm.py --db $DB --ms 1,2,4,8 --inductor 1,2,4,8 --samples 9 --rounds 3 \
             --out $OUT/ind-a.json > $OUT/ind-a.log 2>&1; echo "rc $?"; tail -8 $OUT/ind-a.log ;;
    ind-b) timeout 300 python3 bench/gemm.py --db $DB --ms 16,32,64 --inductor 16,32,64 --samples 9 --rounds 3 \
             --out $OUT/ind-b.json > $OUT/ind-b.log 2>&1; echo "rc $?"; tail -8 $OUT/ind-b.log ;;
    probe) (cd bench && timeout ${PROBE_S:-150} python3 probe_gemm.py --family gemm.wgmma_cktrig --compile-procs 14 \
             --ops mla.q_a,mla.gate,moe.shared_w13,kda.o_proj,mla.o_proj --tps 8 --ms 16 \
             --grid "$GRID") \
             > $OUT/probe.log 2>&1; echo "rc $?"; grep BEST $OUT/probe.log
           # the same layouts triggering at the start: wgmma_ck's kernels (late 0 is not a wgmma_cktrig config; NO_CK=1: not)
           [ -n "${NO_CK:-}" ] && continue
           (cd bench && timeout 100 python3 probe_gemm.py --family gemm.wgmma_ck --compile-procs 14 \
             --ops mla.q_a,mla.gate,moe.shared_w13,kda.o_proj,mla.o_proj --tps 8 --ms 16 \
             --grid '{"tile_m":[16],"split_k":[2,4,8],"bk":[128],"stages":[4,6],"pdl":[1]}') \
             > $OUT/probe-ck.log 2>&1; echo "rc $?"; grep BEST $OUT/probe-ck.log ;;
    wide) (cd bench && timeout 200 python3 probe_gemm.py --family gemm.wgmma_cktrig --compile-procs 14 \
             --ops mla.q_a,kda.o_proj --tps 8 --ms 16 \
             --grid '{"tile_m":[16],"split_k":[2,4,7,8],"bk":[128],"stages":[3,4,5,6],"pdl":[1],"late":[2,3,4,5,6]}') \
             > $OUT/wide.log 2>&1; echo "rc $?"; grep BEST $OUT/wide.log ;;
    m16) export K3TUNE_EXTRA_FAMILIES=gemm.wgmma_cktrig  # s56-r1…r4 also offered gemm.splitk_trig (removed after r4)
         cp $DB /tmp/s.sqlite
         timeout ${SWEEP_S:-200} python3 bench/device_sweep.py --spec ${SPEC:-bench/s56_m16.toml} --db /tmp/s.sqlite --gpus 1 \
           > $OUT/sweep.log 2>&1; echo "sweep rc $?"; tail -3 $OUT/sweep.log
         xz -T0 -c /tmp/s.sqlite > $OUT/sweep.sqlite.xz
         python3 -m k3tune db export /tmp/s.sqlite $OUT/new.sqlite --hardware $HW; echo "export rc $?"
         timeout ${BENCH_S:-45} python3 bench/gemm.py --db $OUT/new.sqlite --ms ${MS:-16} --samples 9 --rounds 3 --out $OUT/bench-new.json \
           > $OUT/bench-new.log 2>&1; echo "new rc $?"; grep -v "^tp" $OUT/bench-new.log | tail -6
         unset K3TUNE_EXTRA_FAMILIES
         timeout ${BENCH_S:-45} python3 bench/gemm.py --db $DB --ms ${MS:-16} --samples 9 --rounds 3 --out $OUT/bench-old.json \
           > $OUT/bench-old.log 2>&1; echo "old rc $?"; grep -v "^tp" $OUT/bench-old.log | tail -6 ;;
  esac
done
date -u
