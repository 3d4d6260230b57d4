#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/gpu/check.sh: the one prepared script for a machine with one NVIDIA GPU
# (written for 16 cores): everything issues 9 and 10 can only prove on a GPU,
# in one run of at most 8 minutes, ending in one summary.
#
#   1 configure  -DTANDEM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native, Release
#   2 build      every target (-j cores)
#   3 ctest      ctest -L '^gpu$' (op by op vs the CPU backend, greedy tokens,
#                graphs vs eager, batch invariance, the seed walkthrough on
#                --device cuda, P/D on one GPU over CUDA IPC == the decode worker
#                alone, kill -9 of the prefill worker mid-transfer: pd_gpu)
#   3b gpu2      ctest -L '^gpu2$' when two or more GPUs are visible (P/D over
#                NCCL between cuda:1 and cuda:0 == the decode worker alone,
#                kill -9 of the prefill worker mid-transfer: pd_gpu2); skipped,
#                with a line saying so, on one GPU
#   4 probe      tandem-gpu-probe: HBM read/copy/d2d bandwidth, bf16 GEMM peak
#   5 engine     tandem-bench-engine --device cuda: decode tok/s at batch
#                1/8/32/64, prefill tok/s for 512- and 2048-token chunks on the
#                Qwen2.5-0.5B-shaped model tandem-mkmodel writes
#   6 pd         bench/pd/bench_pd.py with --kv-transfer cuda-ipc: TTFT with and
#                without disaggregation, exposed transfer, KV copy bandwidth
#                (device bytes copied / the prefill worker's summed copy time,
#                tandem:kv_copy_seconds_total; the summary divides it by the
#                probe's d2d bandwidth)
#                (skipped, with a line saying so, when the workers have no
#                --kv-transfer flag)
#   7 summary    tandem-gpu-report: each figure as a ratio to the probe's
#                bandwidth or peak, and the goals met or missed
# Each step runs under its own time limit (and never past the 8-minute total);
# a failed step is reported and the rest still run where they can. Logs and
# JSON go to $OUT when it is set (the device runner's folder), else to
# BUILD/check-logs.
#
#   bench/gpu/check.sh [--build DIR] [--reuse-build] [--dry-run]
#     --build DIR     build folder (default build-gpu-check in the repository)
#     --reuse-build   skip configure and build (a rerun on the same machine)
#     --dry-run       print the plan and exit (after the GPU check)
# Exit 0: every step that ran passed (a skipped P/D step included); 1: a step
# failed; 2: bad usage; 77: no GPU visible (nothing built or run). NVIDIA_SMI
# names the nvidia-smi to ask (tests point it at a fake).
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
build="$repo/build-gpu-check"
reuse=0 dry=0
while [ $# -gt 0 ]; do
    case "$1" in
    --build) [ $# -ge 2 ] || { echo "check.sh: --build needs a folder" >&2; exit 2; }
        build=$2; shift 2 ;;
    --reuse-build) reuse=1; shift ;;
    --dry-run) dry=1; shift ;;
    *) echo "usage: bench/gpu/check.sh [--build DIR] [--reuse-build] [--dry-run]" >&2; exit 2 ;;
    esac
done
case "$build" in /*) ;; *) build="$PWD/$build" ;; esac

# ---- is there a GPU? ----------------------------------------------------------------------
smi=${NVIDIA_SMI:-nvidia-smi}
gpus=""
if command -v "$smi" >/dev/null 2>&1; then
    gpus=$("$smi" -L 2>/dev/null | grep -E '^GPU [0-9]+:' || true)
fi
if [ -z "$gpus" ]; then
    echo "check.sh: no GPU visible ($smi missing or lists no GPU): nothing built or run"
    exit 77
fi
echo "check.sh: $(echo "$gpus" | head -n 1)$([ "$(echo "$gpus" | wc -l)" -gt 1 ] && echo " (+ more; GPU 0 is used)")"

# ---- plan: step, time limit (seconds). The limits add up to at most 480. -------------------
TOTAL=480
STEPS="configure:45 build:165 ctest:75 gpu2:40 probe:30 engine:70 pd:50 summary:5"
jobs=$(nproc 2>/dev/null || echo 4)
logs=${OUT:-$build/check-logs}
if [ "$dry" = 1 ]; then
    echo "plan (build $build, logs $logs, $jobs jobs, total limit ${TOTAL}s):"
    sum=0
    for s in $STEPS; do
        name=${s%%:*} limit=${s##*:}
        skip=""
        if [ "$reuse" = 1 ] && { [ "$name" = configure ] || [ "$name" = build ]; }; then
            skip=" (skipped: --reuse-build)"
        fi
        echo "  step $name limit ${limit}s$skip"
        sum=$((sum + limit))
    done
    echo "  sum of limits ${sum}s"
    exit 0
fi
mkdir -p "$logs" "$build" || exit 1

start=$(date +%s)
results=()
failed=0
limit_of() { for s in $STEPS; do [ "${s%%:*}" = "$1" ] && echo "${s##*:}"; done; }
# run_step NAME CMD...: runs CMD under NAME's limit (cut to what remains of
# TOTAL), output to $logs/NAME.log, the log's tail shown on failure.
run_step() {
    local name=$1
    shift
    local limit left t0 rc
    limit=$(limit_of "$name")
    left=$((TOTAL - ($(date +%s) - start)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -le 0 ]; then
        record "$name" FAIL "no time left of the ${TOTAL}s total"
        return 1
    fi
    echo "== $name (limit ${limit}s): $*"
    t0=$(date +%s)
    timeout --kill-after=5 "$limit" "$@" >"$logs/$name.log" 2>&1
    rc=$?
    local took=$(($(date +%s) - t0))
    if [ "$rc" -eq 0 ]; then
        record "$name" ok "${took}s"
        return 0
    fi
    tail -n 25 "$logs/$name.log" | sed 's/^/   | /'
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        record "$name" FAIL "timed out after ${limit}s (log $logs/$name.log)"
    else
        record "$name" FAIL "exit $rc after ${took}s (log $logs/$name.log)"
    fi
    return 1
}
record() {
    results+=("$(printf '  %-10s %-5s %s' "$1" "$2" "$3")")
    [ "$2" = FAIL ] && failed=1
    echo "-- $1: $2 $3"
}
help_has() { # help_has BINARY FLAG: does BINARY's --help (or usage) name FLAG?
    # The help is read whole before grep looks at it: piped into grep -q, which
    # exits at its first match, the binary died of SIGPIPE (141) and, under
    # pipefail, a flag it has read as missing (the P/D step was skipped so).
    local help
    [ -x "$1" ] || return 1
    help=$("$1" --help 2>&1)
    grep -q -- "$2" <<<"$help"
}

# ---- 1, 2: configure and build -------------------------------------------------------------
if [ "$reuse" = 1 ]; then
    record configure skip "--reuse-build"
    record build skip "--reuse-build"
else
    if run_step configure cmake -S "$repo" -B "$build" -DCMAKE_BUILD_TYPE=Release \
        -DTANDEM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native; then
        run_step build cmake --build "$build" -j"$jobs"
    else
        record build skip "configure failed"
    fi
fi
bin() { find "$build" -type f -name "$1" -perm -u+x -print -quit 2>/dev/null; }

# ---- 3: the gpu-label tests ----------------------------------------------------------------
run_step ctest ctest --test-dir "$build" -L '^gpu$' --no-tests=error --output-on-failure -j1

# ---- 3b: the gpu2-label tests (NCCL between two GPUs) ---------------------------------------
if [ "$(echo "$gpus" | wc -l)" -lt 2 ]; then
    record gpu2 skip "one GPU visible: P/D over NCCL between two GPUs not run"
else
    run_step gpu2 ctest --test-dir "$build" -L '^gpu2$' --no-tests=error --output-on-failure -j1
fi

# ---- 4: the probe ------------------------------------------------------------------------
probe=$(bin tandem-gpu-probe)
have_probe=0
if [ -z "$probe" ]; then
    record probe FAIL "tandem-gpu-probe not built (a CUDA build makes it)"
elif run_step probe sh -c '"$1" >"$2"' sh "$probe" "$logs/probe.json"; then
    have_probe=1
fi

# ---- 5: the engine bench on the GPU ----------------------------------------------------------
engine=$(bin tandem-bench-engine)
have_engine=0
if [ -z "$engine" ]; then
    record engine FAIL "tandem-bench-engine not built"
elif ! help_has "$engine" --device; then
    # Never measure the CPU and call it the GPU.
    record engine FAIL "tandem-bench-engine has no --device flag (this build has no CUDA backend); not running it on the CPU"
elif ! help_has "$engine" --json; then
    record engine FAIL "tandem-bench-engine has no --json flag to report to the summary"
elif run_step engine "$engine" --device cuda --bf16-only --batches 1,8,32,64 \
    --prefill 512,2048 --json "$logs/engine.json"; then
    have_engine=1
fi

# ---- 6: P/D on one GPU over CUDA IPC --------------------------------------------------------
decode=$(bin tandem-decode)
have_pd=0
if [ -z "$decode" ] || ! help_has "$decode" --kv-transfer; then
    record pd skip "tandem-decode has no --kv-transfer (issue 10's GPU transfer is not in this build): P/D on one GPU not measured"
elif run_step pd python3 "$repo/bench/pd/bench_pd.py" --build "$build" --sizes 512,2048 \
    --reps 3 --model "$build/qwen2.5-0.5b-pd" --json "$logs/pd.json" \
    --worker-args "--device cuda --kv-transfer cuda-ipc --gpu-memory-utilization 0.4"; then
    have_pd=1
fi

# ---- 7: summary --------------------------------------------------------------------------
report=$(bin tandem-gpu-report)
echo
echo "==== summary ($(($(date +%s) - start))s of ${TOTAL}s)"
printf '%s\n' "${results[@]}"
if [ "$have_probe" = 1 ] && [ -n "$report" ]; then
    args=(--probe "$logs/probe.json")
    [ "$have_engine" = 1 ] && args+=(--engine "$logs/engine.json")
    [ "$have_pd" = 1 ] && args+=(--pd "$logs/pd.json")
    if ! timeout "$(limit_of summary)" "$report" "${args[@]}" | tee "$logs/summary.txt"; then
        echo "  summary    FAIL tandem-gpu-report could not read the steps' JSON"
        failed=1
    fi
else
    echo "  (no probe figures, so no ratios: see the probe step)"
fi
echo "logs: $logs"
exit "$failed"
