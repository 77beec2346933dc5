#!/usr/bin/env bash
# Issue 4 on a 2- or 4-GPU machine (nvidia-h200-x2/x4, carry [".carry", ".device"]), steps in order:
#   sweep   both MoE block sweeps at once: bf16 experts on the first half of the GPUs, MXFP4 on the second
#           (into .device/h200-moe.sqlite and .device/h200-moe-mxfp4.sqlite, copied to $OUT)
#   sweep-bf16 / sweep-mxfp4   one of the two alone (on the same GPUs as in sweep), to run beside other work
#   tests   the MoE GPU tests: tensor-core kernels on GPU 0, the block on GPU 1
#   sweep-zipf both sweeps again under Zipf 1.2 routing (their own DBs), for SERVED_ROUTING=row
#   served  the sweeps' winners merged with the shipped dense winners, then the served block benchmarked,
#           bf16 on GPU 0 and MXFP4 on GPU 1 (each bench times only its own GPU)
#   pack    every output in one archive (a call returns at most 8 files)
# Usage: SWEEP_S=190 BENCH_S=330 MOE_ARGS="..." bash bench/moe_multi.sh sweep tests pack
set -uo pipefail
source .carry/cutedsl/unpack.sh || exit 1
mkdir -p .device $OUT/mxfp4
N=$(nvidia-smi -L | wc -l); H=$((N / 2))
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu --format=csv > $OUT/gpu.txt
sweep() {  # GPUS SPEC DB; a new DB starts as a copy of the shipped one: its winners (stale ones too) warm-start
  [ -f $3 ] || cp tuning_db/h200.sqlite $3  # the search, and problems whose winner is current are not redone
  CUDA_VISIBLE_DEVICES=$1 timeout ${SWEEP_S:-200} python3 bench/device_sweep.py --spec $2 --db $3 --gpus $H \
    > $OUT/$(basename $3 .sqlite)-sweep.log 2>&1; echo "$2 rc=$?"
  python3 -c "import sqlite3,sys; sqlite3.connect(sys.argv[1]).execute('PRAGMA wal_checkpoint(TRUNCATE)')" $3
  cp $3 $OUT/
}
for step in "$@"; do
  case $step in
    sweep) sweep $(seq -s, 0 $((H - 1))) configs/sweep_h200_moe_bf16.toml .device/h200-moe.sqlite &
           sweep $(seq -s, $H $((N - 1))) configs/sweep_h200_moe_mxfp4.toml .device/h200-moe-mxfp4.sqlite &
           wait; grep -HE '"(trials|seconds|failed|problems_done)"' $OUT/*-sweep.log ;;
    sweep-zipf) # the same two specs under Zipf 1.2 routing (served with --served-routing row)
           sweep $(seq -s, 0 $((H - 1))) configs/sweep_h200_moe_bf16_zipf.toml .device/h200-moe-zipf.sqlite &
           sweep $(seq -s, $H $((N - 1))) configs/sweep_h200_moe_mxfp4_zipf.toml .device/h200-moe-mxfp4-zipf.sqlite &
           wait; grep -HE '"(trials|seconds|failed|problems_done)"' $OUT/*zipf-sweep.log ;;
    sweep-bf16) sweep $(seq -s, 0 $((H - 1))) configs/sweep_h200_moe_bf16.toml .device/h200-moe.sqlite ;;
    sweep-mxfp4) sweep $(seq -s, $H $((N - 1))) configs/sweep_h200_moe_mxfp4.toml .device/h200-moe-mxfp4.sqlite ;;
    tests) CUDA_VISIBLE_DEVICES=0 timeout ${TESTS_S:-200} python3 -m pytest -m gpu -q -p no:cacheprovider \
             tests/test_gpu_moe_tc.py > $OUT/gpu-moe-tc-tests.log 2>&1 &
           CUDA_VISIBLE_DEVICES=1 timeout ${TESTS_S:-200} python3 -m pytest -m gpu -q -p no:cacheprovider \
             tests/test_gpu_moe.py > $OUT/gpu-moe-tests.log 2>&1 &
           wait; tail -n1 $OUT/gpu-moe-tc-tests.log $OUT/gpu-moe-tests.log ;;
    served) python3 -c "import glob; from k3tune.store.db import Database; from k3tune.store.transfer import merge; \
             merge('.device/served.sqlite', [Database(p) for p in ['tuning_db/h200.sqlite', \
             *sorted(glob.glob('.device/h200-moe*.sqlite'))]])"
           (cd bench && CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_S:-330} python3 moe.py --db ../.device/served.sqlite \
             --served --served-routing ${SERVED_ROUTING:-uniform} --out $OUT/bench-moe-served.json ${MOE_ARGS:-} \
             > $OUT/bench-moe-served.log 2>&1) &
           (cd bench && CUDA_VISIBLE_DEVICES=1 timeout ${BENCH_S:-330} python3 moe.py --db ../.device/served.sqlite \
             --served --served-routing ${SERVED_ROUTING:-uniform} --model kimi_k3_config.json --fmts mxfp4 \
             --shared-sms 16 --prefetch-mib 0 \
             --out $OUT/mxfp4/bench-moe-served-mxfp4.json > $OUT/mxfp4/bench-moe-served-mxfp4.log 2>&1) &
           wait; grep -v "^ \|^{\|^}" $OUT/bench-moe-served.log | cut -c1-60 | tail -3 ;;
    pack)  bash bench/h200_session.sh pack > /dev/null ;;
  esac
done
