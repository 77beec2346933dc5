#!/usr/bin/env bash
# One device call for a change that re-keys the dense winners (a kernel or its search space): the kernels' GPU
# tests, a dense sweep warm-started from the shipped DB on N GPUs, its export, then bench/gemm.py on the new DB
# (GPU 0, this tree) beside the shipped DB on the code it was tuned with (GPU 1, the tree unpacked from BASE, a
# `git archive` of the base commit: make it before the call, it travels as an untracked file), one process per GPU.
# Usage (device tool, kind nvidia-h200-x2, carry [".carry"]):
#   git archive --prefix=base/ main k3tune configs bench/gemm.py tuning_db pyproject.toml | xz > base.tar.xz
#   TESTS="splitk or wgmma" BASE=base.tar.xz bash bench/resweep_compare.sh [N]   (TESTS: a pytest -k expression)
# A staged family (k3tune/kernels/__init__.py STAGED) joins the sweep and the new DB's bench through
# K3TUNE_EXTRA_FAMILIES; then BASE=self benches the shipped DB on this same tree with the variable unset (the code the
# shipped winners were tuned with). With N=1 the two benches run one after the other on GPU 0. START_DB=file.sqlite.xz
# resumes a sweep that a time limit cut short (its $OUT/sweep.sqlite.xz, carried as an untracked file); BENCH=0 stops
# after the sweep's export (the resuming call benches). Failing GPU tests stop the call before the sweep. SPEC may name
# several specs (space-separated), swept one after the other into the same DB (a block spec's blocks run the dense
# kernels that DB holds: put the dense spec first; a spec that does not finish stops the rest), e.g.
#   SPEC="configs/sweep_h200_moe_bf16.toml configs/sweep_h200_moe_bf16_zipf.toml" SWEEP_S=270 BENCH=0 bash bench/resweep_compare.sh 1
# SWEEP_S may list one limit per spec, in SPEC's order (the last one serves the rest), e.g. SWEEP_S="150 150 330"
# (s19: the MXFP4 block specs need ~300 s, the bf16 ones ~130 s). REDO=pattern (SQL LIKE on problem keys,
# ';'-separated) marks those problems' winners stale in the starting copy, so the sweep decides them again starting
# from them, e.g. after a change to how trials are timed (search/method.py: old trials are then not reused),
# REDO="moe.block[%". Give REDO to the first call only: a resuming call (START_DB) would make stale again what the
# first call decided.
set -uo pipefail
source .carry/cutedsl/unpack.sh || exit 1
N=${1:-2}
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu --format=csv
if [ -n "${TESTS:-}" ]; then
  timeout ${TESTS_S:-150} python3 -m pytest -q -m gpu tests/test_gpu_kernels.py -k "$TESTS" > $OUT/gpu-tests.log 2>&1
  rc=$?; echo "gpu tests rc=$rc"; tail -3 $OUT/gpu-tests.log
  [ $rc = 0 ] || exit 1  # no sweep over kernels that fail their tests
fi
if [ -n "${START_DB:-}" ]; then  # resume a sweep cut short: its DB (xz) with every committed trial
  xz -dc "$START_DB" > /tmp/sweep.sqlite || exit 1
  python3 -m k3tune db upgrade /tmp/sweep.sqlite || exit 1  # one saved under an older schema (a no-op otherwise)
else
  cp tuning_db/h200.sqlite /tmp/sweep.sqlite
fi
if [ -n "${REDO:-}" ]; then  # re-decide problems whose winners are current (a measuring change re-keys nothing)
  IFS=";" read -ra pats <<< "$REDO"
  python3 -m k3tune db redo /tmp/sweep.sqlite "${pats[@]}" || exit 1
fi
cache=$(mktemp -d)  # one kernel cache for every spec's workers
limits=(${SWEEP_S:-240})
i=0
for spec in ${SPEC:-configs/sweep_h200_dense.toml}; do  # one after the other into the same DB, SWEEP_S each
  limit=${limits[$i]:-${limits[-1]}}; i=$((i + 1))
  K3TUNE_KERNEL_CACHE=$cache K3TUNE_WORKER_KERNEL_CACHE=1 timeout $limit python3 bench/device_sweep.py \
    --spec $spec --db /tmp/sweep.sqlite --gpus $N --compile-procs ${COMPILE_PROCS:-29} >> $OUT/sweep.log 2>&1
  rc=$?; echo "sweep $spec rc=$rc"
  # a spec cut short leaves problems undecided: the MoE block specs after it measure the dense kernels that
  # /tmp/sweep.sqlite holds (the workers' K3TUNE_SERVE_DB), so they wait for a resuming call (START_DB)
  [ $rc = 0 ] || { echo "stopped: $spec did not finish; resume with START_DB=<this call's sweep.sqlite.xz>"; break; }
done
grep -E '"(trials|seconds|failed|problems_done|polish_passes|polish_changed|polish_s|polish_plan_s|polish_build_s|worker_build_s)"' $OUT/sweep.log
# a sweep that a timeout killed leaves its committed trials in the WAL file: fold them into the main file first
python3 -c "import sqlite3; c = sqlite3.connect('/tmp/sweep.sqlite'); c.execute('PRAGMA wal_checkpoint(TRUNCATE)'); c.close()"
xz -T0 -c /tmp/sweep.sqlite > $OUT/sweep.sqlite.xz  # every trial, for the notebook (the export keeps winners only)
python3 -c "from k3tune.store.db import Database; from k3tune.store.inspect import is_current; \
from k3tune.store.transfer import export; \
print(export(Database('/tmp/sweep.sqlite', create=False), '$OUT/new.sqlite', hardware='H200', keep=is_current))" || exit 1
[ "${BENCH:-1}" = 0 ] && exit 0  # sweep only (a resume call benches)
GEMM_ARGS=${GEMM_ARGS:---samples 9 --rounds 3}
CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_S:-200} python3 bench/gemm.py --db $OUT/new.sqlite $GEMM_ARGS \
  --out $OUT/gemm-new.json > $OUT/gemm-new.log 2>&1 &
if [ "$N" = 1 ]; then wait; fi
BASE_GPU=$([ "$N" = 1 ] && echo 0 || echo 1)
if [ "${BASE:-}" = self ]; then
  env -u K3TUNE_EXTRA_FAMILIES CUDA_VISIBLE_DEVICES=$BASE_GPU timeout ${BENCH_S:-200} python3 bench/gemm.py \
    --db tuning_db/h200.sqlite $GEMM_ARGS --out $OUT/gemm-base.json > $OUT/gemm-base.log 2>&1
elif [ -n "${BASE:-}" ]; then
  mkdir -p /tmp/basetree && tar -xf $BASE -C /tmp/basetree
  (cd /tmp/basetree/base && CUDA_VISIBLE_DEVICES=$BASE_GPU PYTHONPATH=$PWD:$PYTHONPATH timeout ${BENCH_S:-200} python3 \
    bench/gemm.py --db tuning_db/h200.sqlite $GEMM_ARGS --out $OUT/gemm-base.json > $OUT/gemm-base.log 2>&1)
fi
wait
for f in $OUT/gemm-*.log; do
  echo "== $f"; grep -E '"geomean_speedup_vs_cublas_m_le_64"|min_roofline|slower_than' $f
  grep -A8 '"geomean_speedup_vs_cublas_by_m"' $f | tr -d '\n '; echo
done
xz -9 $OUT/*.json 2>/dev/null
