#!/usr/bin/env bash
# One device call on the lent H200: GPU tests, the measured dense sweep (resumable: its database lives in
# .device/, carried between calls), the export to tuning_db/h200.sqlite, and bench/gemm.py.
# Usage (device tool, carry [".carry", ".device"]):
#   bash bench/h200_session.sh [tests] [probe] [sweep] [bench] [chain] [moetests] [moebench] [moesweep] [moeserved]
# tests: TESTS_K selects (pytest -k); probe: bench/probe_gemm.py PROBE_ARGS; sweep: on SWEEP_GPUS GPUs (default 1);
# chain: bench/chain.py (a decode layer's dense projections back to back) on CHAIN_DB
# moeserved: the MoE sweep's winners merged into a copy of tuning_db/h200.sqlite, then bench/moe.py --served
# moetc: the tensor-core expert kernels' GPU tests, then bench/moe_experts.py (MOE_EXPERTS_ARGS)
# pack: last step: every output in one outputs.tgz (a call returns at most 8 files)
set -uo pipefail
source .carry/cutedsl/unpack.sh || exit 1
mkdir -p .device
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee $OUT/gpu.txt
for step in "$@"; do
  case $step in
    tests) timeout ${TESTS_S:-300} python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu_kernels.py \
             ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee $OUT/gpu-tests.log | tail -15 ;;
    probe) (cd bench && timeout ${PROBE_S:-200} python3 probe_gemm.py ${PROBE_ARGS:-}) 2>&1 | tee -a $OUT/probe.log \
             | grep "^BEST\|WRONG\|Error" ;;
    sweep) # a carried .device/h200-sweep.sqlite.xz (an earlier sweep: its trials of unchanged kernels are reused)
           [ -f .device/h200-sweep.sqlite ] || [ ! -f .device/h200-sweep.sqlite.xz ] || \
             python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('.device/h200-sweep.sqlite.xz'), open('.device/h200-sweep.sqlite','wb'))"
           [ ! -f .device/h200-sweep.sqlite ] || python3 -m k3tune db upgrade .device/h200-sweep.sqlite  # schema of an older k3tune
           timeout ${SWEEP_S:-300} python3 bench/device_sweep.py --spec configs/sweep_h200_dense.toml \
             --db .device/h200-sweep.sqlite --gpus ${SWEEP_GPUS:-1} \
             --compile-procs ${COMPILE_PROCS:-0} 2>&1 | tee $OUT/sweep.log | tail -25
           python3 -c "import sqlite3; c=sqlite3.connect('.device/h200-sweep.sqlite'); c.execute('PRAGMA wal_checkpoint(TRUNCATE)')"
           cp .device/h200-sweep.sqlite $OUT/ ;;
    bench) timeout ${BENCH_S:-300} python3 bench/gemm.py --db .device/h200-sweep.sqlite --out $OUT/bench-gemm.json \
             ${BENCH_ARGS:-} 2>&1 | tee $OUT/bench-gemm.log | tail -40 ;;
    chain) (cd bench && timeout ${BENCH_S:-300} python3 chain.py --db ../${CHAIN_DB:-tuning_db/h200.sqlite} \
             --out $OUT/bench-chain.json ${CHAIN_ARGS:-}) 2>&1 | tee $OUT/bench-chain.log | tail -30 ;;
    moetests) timeout ${TESTS_S:-300} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_moe.py 2>&1 \
             | tee $OUT/gpu-moe-tests.log | tail -15 ;;
    moebench) (cd bench && timeout ${BENCH_S:-300} python3 moe.py --out $OUT/bench-moe.json ${MOE_ARGS:-}) 2>&1 \
             | tee $OUT/bench-moe.log | tail -40 ;;
    moesweep) # MOE_SPEC (default bf16 experts) into MOE_DB; blocks measure with the dense winners of
           # .device/h200-sweep.sqlite when a dense sweep ran in this call, else the shipped database
           MOE_SPEC=${MOE_SPEC:-configs/sweep_h200_moe_bf16.toml}; MOE_DB=${MOE_DB:-.device/h200-moe.sqlite}
           [ -f .device/h200-sweep.sqlite ] && export K3TUNE_DB=.device/h200-sweep.sqlite
           timeout ${SWEEP_S:-300} python3 bench/device_sweep.py --spec $MOE_SPEC --db $MOE_DB 2>&1 \
             | tee $OUT/$(basename $MOE_DB .sqlite)-sweep.log | tail -25
           unset K3TUNE_DB
           python3 -c "import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); c.execute('PRAGMA wal_checkpoint(TRUNCATE)')" $MOE_DB
           cp $MOE_DB $OUT/ ;;
    moetc) timeout ${TESTS_S:-300} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_moe_tc.py 2>&1 \
             | tee $OUT/gpu-moe-tc-tests.log | tail -15
           (cd bench && timeout ${BENCH_S:-300} python3 moe_experts.py --out $OUT/bench-moe-experts.json \
             ${MOE_EXPERTS_ARGS:-}) 2>&1 | tee $OUT/bench-moe-experts.log | grep -v "^ \|^{\|^}" ;;
    moeserved) # the dense winners (this call's dense sweep, else the shipped database) and every MoE sweep's
           python3 -c "import glob,os; from k3tune.store.db import Database; from k3tune.store.transfer import merge; \
               d='.device/h200-sweep.sqlite'; d=d if os.path.exists(d) else 'tuning_db/h200.sqlite'; \
               merge('.device/served.sqlite', [Database(p) for p in [d, *sorted(glob.glob('.device/h200-moe*.sqlite'))]])"
           (cd bench && timeout ${BENCH_S:-300} python3 moe.py --db ../.device/served.sqlite --served \
             --out $OUT/bench-moe-served.json ${MOE_ARGS:-}) 2>&1 | tee $OUT/bench-moe-served.log | grep -v "^ \|^{\|^}" ;;
    pack)  # only 8 files come back from a device call: everything written so far into one archive
           rm -f $OUT/*-wal $OUT/*-shm
           tar -C $OUT -czf /tmp/outputs.tgz . && find $OUT -mindepth 1 -delete && mv /tmp/outputs.tgz $OUT/ ;;
  esac
done
