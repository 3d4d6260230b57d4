#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# check_no_cuda_link.sh [--module MODULE] BINARY...: no binary links a CUDA
# library (cudart, cuBLAS/cuBLASLt, NCCL, the driver), directly or through
# another library (ldd is recursive): the CUDA backend is a module they load
# (common/engine/model/backend_module.h). With --module, that module must link
# cudart and cuBLASLt (the check would otherwise pass on a module that lost
# them). One line per offender; exit 1 when there is one.
set -euo pipefail
cuda_re='lib(cudart|cublas|cublasLt|nccl|cuda)\.so'
module=""
if [ "${1:-}" = "--module" ]; then
    module=$2
    shift 2
fi
[ $# -gt 0 ] || { echo "usage: $0 [--module MODULE] BINARY..." >&2; exit 2; }
bad=0
for b in "$@"; do
    [ -x "$b" ] || { echo "$b: not built" >&2; bad=1; continue; }
    libs=$(ldd "$b" 2>&1) || { echo "$b: ldd failed: $libs" >&2; bad=1; continue; }
    hits=$(printf '%s\n' "$libs" | grep -E "$cuda_re" | awk '{print $1}' | tr '\n' ' ' || true)
    if [ -n "$hits" ]; then
        echo "$(basename "$b") links CUDA libraries: $hits" >&2
        bad=1
    fi
done
if [ -n "$module" ]; then
    libs=$(ldd "$module" 2>&1) || { echo "$module: ldd failed: $libs" >&2; exit 1; }
    for want in libcudart libcublasLt; do
        printf '%s\n' "$libs" | grep -q "$want" ||
            { echo "$(basename "$module") does not link $want" >&2; bad=1; }
    done
fi
[ "$bad" = 0 ] && echo "ok: $# binaries link no CUDA library${module:+; $(basename "$module") does}"
exit "$bad"
