# Session 63, second call (H200 only): the rows s63-r1's ind-a lost to its timeout (TP16 M 1-8 of four ops), then the
# landing's H200 dense sweep for as long as the call allows (resumable next session: START=<sweep.sqlite.xz>).
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "GPU: $G"; date -u
case "$G" in *H200*) ;; *) echo "not an H200"; exit 0 ;; esac
source .carry/cutedsl/unpack.sh
timeout ${IND_S:-150} python3 bench/gemm.py --db tuning_db/h200.sqlite --tps 16 --ms 1,2,4,8 --inductor 1,2,4,8 \
  --ops moe.router_latent,moe.shared_w13,moe.shared_w2,moe.latent_up --samples 9 --rounds 3 --out $OUT/ind-c.json \
  > $OUT/ind-c.log 2>&1; echo "ind-c rc $?"; grep "^tp" $OUT/ind-c.log; date -u
K3TUNE_EXTRA_FAMILIES=gemm.wgmma_cktrig BASE=tuning_db/h200.sqlite WARM=0 SWEEP_S=${SWEEP_S:-330} BENCH_S=0 \
  bash bench/kind_dense.sh; date -u
