#!/usr/bin/env bash
# The GPU acceptance check (bench/gpu_check.py) on a CUDA machine, from any directory:
#   bash bench/gpu_check.sh [--skip-tests] [--skip-lora] [--skip-kernels] [--skip-e2e] [--skip-busy] [--skip-tp] [--num-requests N]
# PYTHON picks the interpreter (default python3, the one holding CUDA torch and triton).
# With OUT set, the summary table also lands in $OUT/gpu_report.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec timeout 590 "${PYTHON:-python3}" -m bench.gpu_check "$@"
