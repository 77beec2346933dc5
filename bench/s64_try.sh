#!/usr/bin/env bash
# Session 64's device call: on an H200, the rest of its landing (bench/land_h200.sh); on any other card, the dense
# and block GPU tests on main's code (the s62-s64 changes to the selector's slow path, `problem_for`, the specs).
# Usage (device tool, kind nvidia-h200, carry [".carry"]): bash bench/s64_try.sh
set -uo pipefail
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "GPU: $G"; date -u
case "$G" in
  *H200*) bash bench/land_h200.sh ;;
  *) source .carry/cutedsl/unpack.sh >/dev/null 2>&1 || exit 1
     SUITE_S=${SUITE_S:-300} bash bench/gpu_suite.sh 8 tests/test_gpu_dense.py tests/test_gpu_moe.py \
       tests/test_gpu_moe_tc.py ;;
esac
date -u
