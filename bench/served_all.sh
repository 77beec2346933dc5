#!/usr/bin/env bash
# One device call: every MoE block configuration of the shipped H200 database served as a user runs it
# (bench/moe.py --served: TP8/TP16, batch 1-64, uniform and Zipf 1.2, bf16 then MXFP4 experts, each beside the stock
# path and the serial / even-split twins), then the block GPU tests with the time left (bench/gpu_suite.sh).
# Usage (device tool, kind nvidia-h200, carry [".carry"]):
#   CALL_S=380 bash bench/served_all.sh
# CALL_S bounds the whole call before the tests start (default 470 s: a test suite gets what is left, none under 60 s);
# SERVED_S bounds each format's bench (default 270 s). Writes $OUT/served-FMT.json and .txt, and $OUT/gpu-suite.log.
set -uo pipefail
source .carry/cutedsl/unpack.sh >/dev/null 2>&1 || { echo "no CuTe DSL bundle (.carry)"; exit 1; }
cd bench
for f in bf16 mxfp4; do
  m=$([ $f = bf16 ] && echo kimi_k3_bf16_experts.json || echo kimi_k3_config.json)
  t0=$SECONDS
  timeout ${SERVED_S:-270} python3 moe.py --served --served-routing row --batches 1,2,4,8,16,32,64 \
    --routings uniform,zipf:1.2 --prefetch-mib 0 --shared-sms 16 --tps 8,16 --fmts $f --model $m \
    --out $OUT/served-$f.json > $OUT/served-$f.txt 2>&1
  echo "== $f rc=$? $((SECONDS - t0)) s"
done
cd ..
left=$((${CALL_S:-470} - SECONDS))
if [ $left -gt 60 ]; then
  SUITE_S=$left bash bench/gpu_suite.sh 8 tests/test_gpu_moe.py tests/test_gpu_moe_tc.py > /dev/null 2>&1
  echo "suite rc=$? (limit $left s)"; tail -4 $OUT/gpu-suite.log
else
  echo "no time left for the GPU tests ($left s)"
fi
