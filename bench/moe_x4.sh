#!/usr/bin/env bash
# Issue 4 in one call on a 4-GPU machine (nvidia-h200-x4, carry [".carry"]): both MoE block sweeps at once
# (bf16 experts on GPUs 0-1, MXFP4 on GPUs 2-3, each `--gpus 2`), their winners merged with the shipped dense
# winners, then the served block benchmarked, bf16 on GPU 0 and MXFP4 on GPU 1 (each bench times only its own
# GPU) while the MoE GPU tests run on GPUs 2 and 3, and every output packed into one archive.
set -uo pipefail
source .carry/cutedsl/unpack.sh || exit 1
mkdir -p .device $OUT/mxfp4
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu --format=csv > $OUT/gpu.txt
sweep() {  # GPUS SPEC DB
  CUDA_VISIBLE_DEVICES=$1 timeout ${SWEEP_S:-200} python3 bench/device_sweep.py --spec $2 --db $3 --gpus 2 \
    > $OUT/$(basename $3 .sqlite)-sweep.log 2>&1; echo "$2 rc=$?"
  python3 -c "import sqlite3,sys; sqlite3.connect(sys.argv[1]).execute('PRAGMA wal_checkpoint(TRUNCATE)')" $3
  cp $3 $OUT/
}
sweep 0,1 configs/sweep_h200_moe_bf16.toml .device/h200-moe.sqlite &
sweep 2,3 configs/sweep_h200_moe_mxfp4.toml .device/h200-moe-mxfp4.sqlite &
wait
grep -hE '"(trials|seconds|failed|problems_done)"' $OUT/*-sweep.log
python3 -c "from k3tune.store.db import Database; from k3tune.store.transfer import merge; \
  merge('.device/served.sqlite', [Database(p) for p in ['tuning_db/h200.sqlite', '.device/h200-moe.sqlite', '.device/h200-moe-mxfp4.sqlite']])"
cd bench
CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_S:-330} python3 moe.py --db ../.device/served.sqlite --served \
  --out $OUT/bench-moe-served.json ${MOE_ARGS:-} > $OUT/bench-moe-served.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout ${BENCH_S:-330} python3 moe.py --db ../.device/served.sqlite --served \
  --model kimi_k3_config.json --fmts mxfp4 --shared-sms 16 --prefetch-mib 0 \
  --out $OUT/mxfp4/bench-moe-served-mxfp4.json > $OUT/mxfp4/bench-moe-served-mxfp4.log 2>&1 &
cd ..  # meanwhile the GPU tests of this code on the other two GPUs
CUDA_VISIBLE_DEVICES=2 timeout ${BENCH_S:-330} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_moe_tc.py \
  > $OUT/gpu-moe-tc-tests.log 2>&1 &
CUDA_VISIBLE_DEVICES=3 timeout ${BENCH_S:-330} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_moe.py \
  > $OUT/gpu-moe-tests.log 2>&1 &
wait
tail -1 $OUT/gpu-moe-tc-tests.log $OUT/gpu-moe-tests.log
grep -v "^ \|^{\|^}" $OUT/bench-moe-served.log | cut -c1-60 | tail -3
bash bench/h200_session.sh pack > /dev/null
