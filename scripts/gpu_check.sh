#!/usr/bin/env bash
# What one GPU proves in about five minutes: one PASS/FAIL line per check (scripts/gpu_check.py).
# Usage: bash scripts/gpu_check.sh [--out DIR]   (exit 0: all passed; 1: a check failed; 2: no CUDA device)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
