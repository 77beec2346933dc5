# Session 63, fourth call (H200 only): the landing's H200 blocks over s63-r2's dense winners, bf16 first (s57-r4's
# knobs on the H100). Resumable: START_DB=<split.sqlite.xz> RESUME=1.
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "GPU: $G"; date -u
case "$G" in *H200*) ;; *) echo "not an H200"; exit 0 ;; esac
xz -dc bench/s63_new_h200.sqlite.xz > /tmp/new.sqlite || { echo "s63_r4: bench/s63_new_h200.sqlite.xz unreadable (parked?)"; exit 1; }
K3TUNE_EXTRA_FAMILIES=gemm.wgmma_cktrig NO_REDO=1 BUDGET=4 NEIGHBOURS=0 WHOLE='"shared_sms", "routed_on"' BENCH_S=0 \
  BASE="tuning_db/h200.sqlite /tmp/new.sqlite" SWEEP_S="${SWEEP_S:-90 90 90 90}" \
  bash bench/split_polish.sh ${POINTS:-bf16:16:uniform bf16:8:uniform bf16:16:zipf:1.2 bf16:8:zipf:1.2}
echo "split rc $?"; grep -E "problems|rc|interrupted|exported" $OUT/split.log | tail -20; date -u
