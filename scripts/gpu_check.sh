#!/usr/bin/env bash
# gpu_check.sh -- check mhagen's CUDA artifacts on an NVIDIA GPU (see scripts/gpu_check.py).
#
#   scripts/gpu_check.sh prepare [BUNDLE] [--target cuda-sm90] [--quick]
#       here (mhagen, TVM and nvcc installed: `make venv`): build the artifacts, their inputs
#       and float64 references into BUNDLE (default gpu_bundle/, at most 64 MiB; ~8 minutes)
#   BUNDLE/gpu_check.sh run [BUNDLE]
#       on the GPU machine (Python 3 with torch, the NVIDIA driver; no TVM, no mhagen, no
#       network): check every artifact against its reference, benchmark the fused attention
#       against torch's SDPA (flash backend), write BUNDLE/results.md; exit 0 when all pass
#
# The bundle carries everything the GPU machine runs: each artifact's kernels.fatbin and its
# libmha.so, which opens the CUDA driver itself (no TVM runtime, no CUDA toolkit needed there).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
step="${1:-}"
shift || true
case "$step" in
  prepare)
    out="gpu_bundle"
    if [[ $# -gt 0 && "$1" != --* ]]; then out="$1"; shift; fi
    python="${PYTHON:-$here/../.venv/bin/python}"
    [[ -x "$python" ]] || python=python3
    exec "$python" "$here/gpu_check.py" prepare --out "$out" "$@"
    ;;
  run)
    bundle="${1:-$here}"
    [[ $# -gt 0 ]] && shift
    exec "${PYTHON:-python3}" "$bundle/gpu_check.py" run "$bundle" "$@"
    ;;
  *)
    sed -n '2,14p' "$0" >&2
    exit 2
    ;;
esac
