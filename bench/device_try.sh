#!/usr/bin/env bash
# One device call that does what the card it lands on is good for (kind nvidia-h200 gives an H100 most times):
# on an H200 the issue-4 figures on its shipped table (bench/served_all.sh, its tests skipped), then the dense and
# block GPU tests in the time left; on any other card the dense and block GPU tests only.
# Usage (device tool, kind nvidia-h200, carry [".carry"]): bash bench/device_try.sh
# CALL_S bounds the whole call (default 570 s); the tests get what is left, none under 60 s.
set -uo pipefail
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "GPU: $G"; date -u
source .carry/cutedsl/unpack.sh >/dev/null 2>&1 || { echo "no CuTe DSL bundle (.carry)"; exit 1; }
case "$G" in
  *H200*) CALL_S=0 bash bench/served_all.sh ;;
esac
left=$((${CALL_S:-570} - SECONDS))
if [ $left -gt 60 ]; then
  SUITE_S=$left bash bench/gpu_suite.sh 8 tests/test_gpu_dense.py tests/test_gpu_moe.py tests/test_gpu_moe_tc.py \
    > /dev/null 2>&1
  echo "suite rc=$? (limit $left s)"; tail -4 ${OUT:-.}/gpu-suite.log
else
  echo "no time left for the GPU tests ($left s)"
fi
date -u
