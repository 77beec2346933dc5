#!/usr/bin/env bash
# One device call that does what the card it lands on is good for (kind nvidia-h200 gives an H100 most times):
# on an H200 the issue-3 figures on its shipped table (bench/gemm.py, M = 1..512), then the issue-4 figures
# (bench/served_all.sh, its tests skipped), then the dense and block GPU tests in the time left; on any other card
# the dense and block GPU tests only.
# Usage (device tool, kind nvidia-h200, carry [".carry"]): bash bench/device_try.sh
# CALL_S bounds the whole call (default 570 s; GEMM_S 150 and SERVED_S 210 a format bound the benches within the
# device's 600 s); the tests get what is left, none under 60 s. ONLY_H200=1: off an H200, exit at once (the tests
# already ran on this code).
set -uo pipefail
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "GPU: $G"; date -u
case "$G" in *H200*) ;; *) [ "${ONLY_H200:-0}" = 1 ] && { echo "not an H200: nothing to do"; exit 3; } ;; esac
source .carry/cutedsl/unpack.sh >/dev/null 2>&1 || { echo "no CuTe DSL bundle (.carry)"; exit 1; }
case "$G" in
  *H200*) timeout ${GEMM_S:-150} python3 bench/gemm.py --ms 1,2,4,8,16,32,64,128,256,512 --samples 9 --rounds 3 \
            --out $OUT/gemm.json > $OUT/gemm.log 2>&1; echo "gemm rc=$? at $SECONDS s"; grep -v "^tp" $OUT/gemm.log | tail -14
          CALL_S=0 SERVED_S=${SERVED_S:-210} bash bench/served_all.sh ;;  # s46-r7: both formats and the block tests in 427 s
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
