#!/usr/bin/env bash
# One device call on a GPU kind other than the H200 (the H100 the device tool mostly lends): the dense spec swept
# for it, each problem starting from the H200's winner (`--warm-from H200`: a copy of tuning_db/h200.sqlite is the
# sweep's database), its current winners exported to $OUT/<kind>.sqlite (ship as tuning_db/<kind>.sqlite), then
# bench/gemm.py on that table in BENCH_S seconds (BENCH_S=0: none; BENCH_ARGS, e.g. "--ms 1,2,4,8,16,32,64
# --inductor 1,2,4,8,16,32,64").
# Resumable: START=<an earlier call's sweep.sqlite.xz, copied into the tree> goes on from its trials.
# Re-sweeping a kind's own table (a landing: K3TUNE_EXTRA_FAMILIES=<staged family> in the environment):
# BASE=tuning_db/<kind>.sqlite WARM=0 starts from that table, whose winners (stale under the new key) come first
# (on the H200 too: BASE=tuning_db/h200.sqlite WARM=0).
# Usage (device tool, carry [".carry"]): SWEEP_S=420 BENCH_S=0 bash bench/kind_dense.sh
set -uo pipefail
source .carry/cutedsl/unpack.sh || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee $OUT/gpu.txt
kind=$(python3 -c "import torch; from k3tune.plan.hardware import spec_for_device_name as f
s = f(torch.cuda.get_device_name()); print(s.key if s else '')")
[ -n "$kind" ] && { [ "$kind" != h200 ] || [ "${WARM:-1}" = 0 ]; } || \
  { echo "kind_dense: unknown GPU kind, or the H200 without WARM=0 (it cannot warm from its own table): '$kind'"; exit 1; }
db=/tmp/$kind-sweep.sqlite
if [ -n "${START:-}" ]; then xz -dc "$START" > $db || exit 1; else cp ${BASE:-tuning_db/h200.sqlite} $db; fi
warm=(--warm-from H200); [ "${WARM:-1}" = 0 ] && warm=()
timeout ${SWEEP_S:-420} python3 bench/device_sweep.py --spec configs/sweep_h200_dense.toml --db $db --gpus 1 \
  "${warm[@]}" > $OUT/sweep.log 2>&1
echo "sweep rc $?"; tail -22 $OUT/sweep.log
xz -T0 -c $db > $OUT/sweep.sqlite.xz  # every trial: the next call's START
python3 -m k3tune db export $db $OUT/$kind.sqlite --hardware ${kind^^}; echo "export rc $?"
[ "${BENCH_S:-0}" -gt 0 ] || exit 0
timeout $BENCH_S python3 bench/gemm.py --db $OUT/$kind.sqlite --out $OUT/bench-gemm.json ${BENCH_ARGS:-} \
  > $OUT/bench-gemm.log 2>&1
echo "bench rc $?"; grep -v "^tp" $OUT/bench-gemm.log | tail -30
