# Session 63, third call (H200 only): the re-swept dense table (s63-r2, gemm.wgmma_cktrig offered) beside the shipped
# one, M = 1..64, one bench each in the same call.
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "GPU: $G"; date -u
case "$G" in *H200*) ;; *) echo "not an H200"; exit 0 ;; esac
source .carry/cutedsl/unpack.sh
xz -dc bench/s63_new_h200.sqlite.xz > /tmp/new.sqlite
for t in new:/tmp/new.sqlite shipped:tuning_db/h200.sqlite; do
  [ ${t%%:*} = new ] && x=gemm.wgmma_cktrig || x=  # the new table is current only with the family offered
  K3TUNE_EXTRA_FAMILIES=$x timeout ${BENCH_S:-140} python3 bench/gemm.py --db ${t#*:} --ms 1,2,4,8,16,32,64 --samples 9 --rounds 3 \
    --out $OUT/bench-${t%%:*}.json > $OUT/bench-${t%%:*}.log 2>&1; echo "${t%%:*} rc $?"
  grep -v "^tp" $OUT/bench-${t%%:*}.log | tail -14
done; date -u
