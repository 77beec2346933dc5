#!/usr/bin/env bash
# Multi-GPU checks of issue 5 on an N-GPU device: the same problems swept on 1 GPU and on N (throughput,
# winners compared later with `k3tune db diff`), then an N-GPU sweep with one worker killed -9 mid-run.
# Usage (device tool, kind nvidia-h200-x2, carry [".carry"]): bash bench/multi_gpu.sh [N] [SPEC]
# K3TUNE_WORKER_KERNEL_CACHE=1: workers share compiled kernels through the disk cache (each sweep below
# starts from an empty cache directory, so the 1- and N-GPU runs compile alike); COMPILE_PROCS=P: P CPU
# processes compile queued candidates ahead into that cache (`--compile-procs`, implies the shared cache).
# CPU_SHARE=1: each sweep gets the CPU cores of as many GPUs as it uses (the g-GPU sweep runs pinned to g/N of
# the machine's physical cores with their sibling threads, bench/cpu_share.py, compiling with all of those threads
# but one per worker and one for the driver), as a node of g GPUs would have; without it both sweeps share
# COMPILE_PROCS on the whole machine. RUNS="2" (or "1", or "2 1"): which GPU counts' sweeps, in that order, e.g. the
# N-GPU one in one call and the 1-GPU one beside other work pinned to the other cores. WARM=1: a short untimed sweep
# on every GPU first (session 9: whichever timed sweep ran first on a fresh machine was the slower one).
# LOADED=1: a g-GPU sweep smaller than the machine runs as N/g independent copies at once, copy i on GPUs
# i*g.. and (with CPU_SHARE=1) the i-th share of the cores, so that one GPU's throughput is measured on a node
# whose other GPUs and cores are busy too, as in serving fleets (alone, it also has the idle half's turbo
# headroom, last-level cache and memory bandwidth); copy i > 0 writes gpus<g>-copy<i>.*
set -uo pipefail
source .carry/cutedsl/unpack.sh || exit 1
N=${1:-2}; SPEC=${2:-configs/sweep_h200_scaling.toml}
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu --format=csv | tee $OUT/gpu.txt
python3 bench/cpu_share.py --describe | tee -a $OUT/gpu.txt
if [ "${WARM:-0}" = 1 ]; then
  K3TUNE_KERNEL_CACHE=$(mktemp -d) timeout ${WARM_S:-40} python3 bench/device_sweep.py --spec configs/sweep_h200_scaling.toml \
    --db $(mktemp -d)/warm.sqlite --gpus $N > /dev/null 2>&1; echo "warm-up sweep rc=$?"
fi
for g in ${RUNS:-1 $N}; do
  copies=1; [ "${LOADED:-0}" = 1 ] && copies=$((N / g))
  tags=""; pids=""
  for ((i = 0; i < copies; i++)); do
    export K3TUNE_KERNEL_CACHE=$(mktemp -d)
    PIN=""; PROCS=${COMPILE_PROCS:-0}
    if [ "${CPU_SHARE:-0}" = 1 ]; then
      cpus=$(python3 bench/cpu_share.py $g $N $i); share=$(echo $cpus | tr ',' '\n' | wc -l)
      PIN="taskset -c $cpus"; PROCS=$((share - g - 1 > 0 ? share - g - 1 : 0))
      echo "gpus=$g copy $i: CPUs $cpus, $PROCS compile processes"
    fi
    tag=gpus$g; [ $i -gt 0 ] && tag=gpus$g-copy$i
    tags="$tags $tag"
    CUDA_VISIBLE_DEVICES=$(seq -s, $((i * g)) $((i * g + g - 1))) $PIN timeout ${SWEEP_S:-120} python3 bench/device_sweep.py \
      --spec $SPEC --db $OUT/$tag.sqlite --gpus $g --compile-procs $PROCS > $OUT/$tag.log 2>&1 &
    pids="$pids $!"
  done
  set -- $pids
  for tag in $tags; do
    wait $1; echo "$tag rc=$?"; shift; grep -E '"(trials|seconds|failed|problems_done|workers_replaced|workers_ready_s|first_result_s|pool_started_s|ready_s|backend_s|opened_early|polished|polish_passes|polish_changed|polish_s|polish_plan_s|polish_build_s|worker_busy_s|worker_busy_cpu_s|worker_build_s)"' $OUT/$tag.log
  done
done
if [ "${KILL:-1}" = 1 ]; then  # KILL=0: the throughput runs only
export K3TUNE_KERNEL_CACHE=$(mktemp -d)
# on KILL_SPEC (default the small scaling spec: without a compile farm the full dense spec outlasts SWEEP_S)
timeout ${SWEEP_S:-120} python3 bench/device_sweep.py --spec ${KILL_SPEC:-configs/sweep_h200_scaling.toml} \
  --db $OUT/killed.sqlite --gpus $N --compile-procs 0 > $OUT/killed.log 2>&1 &
P=$!
sleep ${KILL_AFTER:-15}
victim=$(pgrep -f spawn_main | head -1); echo "killing worker pid $victim"; kill -9 $victim  # no farm: only workers spawn
wait $P; echo "killed run rc=$?"
grep -E '"(trials|seconds|failed|problems_done|workers_replaced|workers_retired)"' $OUT/killed.log
fi
shopt -s nullglob
for f in $OUT/*.sqlite; do python3 -c "import sqlite3,sys; sqlite3.connect(sys.argv[1]).execute('PRAGMA wal_checkpoint(TRUNCATE)')" $f; done
# winners 1 vs N GPUs, and 1 vs 1 (two loaded copies): up to the run-to-run noise the sweeps themselves show
[ -f $OUT/gpus1.sqlite ] && [ -f $OUT/gpus$N.sqlite ] && python3 bench/winners_agree.py $OUT/gpus1.sqlite $OUT/gpus$N.sqlite
[ -f $OUT/gpus1.sqlite ] && [ -f $OUT/gpus1-copy1.sqlite ] && python3 bench/winners_agree.py $OUT/gpus1.sqlite $OUT/gpus1-copy1.sqlite
rm -f $OUT/*-wal $OUT/*-shm  # only 8 files come back from a device call
