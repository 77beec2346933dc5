#!/usr/bin/env bash
# One device call: Nsight Compute on the dense GEMM kernels (bench/probe_gemm.py --profile) and the routed-expert
# kernels (bench/moe_experts.py --profile). Usage (device tool, carry [".carry"]):
#   PROBE_ARGS="--family gemm.splitk_tc --ops kda.qkvg_proj --tps 8 --ms 1,8" bash bench/ncu_session.sh gemm experts
# NCU_EXTRA: more ncu arguments, e.g. the stall reasons per issued instruction:
#   NCU_EXTRA='--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' 
set -uo pipefail
source .carry/cutedsl/unpack.sh || exit 1
NCU="ncu --clock-control none --nvtx --nvtx-include profile/ --print-nvtx-rename kernel --section SpeedOfLight
     --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats
     --section SchedulerStats --section InstructionStats ${NCU_EXTRA:-}"
for step in "$@"; do
  case $step in
    gemm) (cd bench && timeout ${NCU_S:-240} $NCU python3 probe_gemm.py --profile ${PROBE_ARGS:-}) > $OUT/ncu-gemm${TAG:-}.txt 2>&1
          grep -E "profiled|^  [a-z]|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Block Limit|Grid Size|Block Size|Stall|stalled|One or More|No Eligible|Issued Warp" $OUT/ncu-gemm${TAG:-}.txt | head -300 ;;
    experts) (cd bench && timeout ${NCU_S:-240} $NCU python3 moe_experts.py --profile ${EXPERTS_ARGS:-}) > $OUT/ncu-experts.txt 2>&1
          grep -E "^  [a-z]|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Grid Size|Block Size|One or More|No Eligible|Issued Warp" $OUT/ncu-experts.txt | head -200 ;;
  esac
done
