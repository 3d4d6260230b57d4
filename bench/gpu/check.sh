#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/gpu/check.sh: the one prepared script for a machine with one NVIDIA GPU
# (written for 16 cores): everything issues 9, 10 and 25 can only prove on a
# GPU, in one run of at most 8 minutes, ending in one summary.
#
#   1 configure  -DTANDEM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native, Release
#   2 build      every target (-j cores)
#     (both skipped with --reuse-build or --pack: the rented H200 has no Debian
#     -dev packages, so it runs from a pack that bench/gpu/pack.sh made)
#   3 libs       LD_LIBRARY_PATH: the pack's lib/, CUDA's libraries (CUDA_HOME,
#                /usr/local/cuda) and NCCL (libnccl.so.2 under Python's
#                site-packages nvidia/nccl/lib); TANDEM_BACKEND_PATH the pack's
#                lib/ (the dlopen-loaded CUDA backend); every binary and
#                library of the pack must resolve all it links (ldd)
#   4 model      the Qwen2.5-0.5B-shaped model (tandem-mkmodel, 8192
#                positions) for engine, serve and pd; the tiny one for ids
#   5 ctest      the gpu-label tests but pd_gpu (op by op vs the CPU backend,
#                greedy tokens, graphs vs eager, batch invariance, the seed
#                walkthrough on --device cuda): ctest -L '^gpu$', or from a
#                pack its tests.tsv, each test run directly
#   5b gpu2      the gpu2-label tests when two or more GPUs are visible (P/D
#                over NCCL between cuda:1 and cuda:0: pd_gpu2); skipped, with a
#                line saying so, on one GPU
#   6 pd_gpu     the pd_gpu test alone (P/D on one GPU over CUDA IPC == the
#                decode worker alone, kill -9 of the prefill worker
#                mid-transfer), with no stack workaround: LD_PRELOAD is unset
#   7 probe      tandem-gpu-probe: HBM read/copy/d2d bandwidth, bf16 GEMM peak
#   8 engine     tandem-bench-engine --device cuda: decode tok/s at batch
#                1/8/16/32/64/256, prefill tok/s for 512- and 2048-token
#                chunks, and (--engine-loop) the serving engine's step beside
#                the forward's with its thread's CPU time per step; with
#                --batch-invariant where the bench has it (the mode compared)
#   8b engine_fast the decode batches 1/8/16/32/64 again with
#                --no-batch-invariant (GEMMs of up to 16 rows on Tandem's
#                GEMV); the summary prints the cost of batch invariance per
#                batch and issue 26 item 3's rule for the default (skipped,
#                with a line, when the bench has no such flag)
#   9 serve      one decode worker on --device cuda, tandem-bench at
#                concurrency 1, 64 and 256 (random 128-token prompts, 128
#                output tokens): output tok/s, TTFT and ITL p50/p99, and the
#                engine thread's share of a core (bench/gpu/gpu_steps.py serve)
#  10 pd         bench/pd/bench_pd.py with --kv-transfer cuda-ipc: TTFT with and
#                without disaggregation, exposed transfer, KV copy bandwidth
#                (device bytes copied / the prefill worker's summed copy time,
#                tandem:kv_copy_seconds_total; the summary divides it by the
#                probe's d2d bandwidth)
#  11 pd_nng     the same with --kv-transfer nng between the two GPU workers
#                (pd and pd_nng are skipped, with a line saying so, when the
#                workers have no --kv-transfer flag)
#  12 ids        greedy ids of tandem-generate --device cuda == --device cpu at
#                1000, 2048, 2049, 3000 and 3500 prompt tokens, prefill chunks
#                256 and 2048 (bench/gpu/gpu_steps.py ids)
#  13 summary    tandem-gpu-report: each figure as a ratio to the probe's
#                bandwidth or peak, and the goals met or missed; then the
#                serve, P/D over nng and ids tables
# Each step runs under its own time limit (and never past the 8-minute total;
# when configure and build run, the later limits shrink to fit); a failed step
# is reported and the rest still run where they can. A flag is probed by
# reading the binary's whole --help (help_has), never by piping it into grep -q.
# Logs and JSON go to $OUT when it is set (the device runner's folder), else to
# BUILD/check-logs; models and scratch files to BUILD/check-work.
#
#   bench/gpu/check.sh [--build DIR] [--reuse-build] [--pack DIR] [--dry-run]
#     --build DIR     build folder (default build-gpu-check in the repository)
#     --reuse-build   skip configure and build (a rerun on the same machine)
#     --pack DIR      run from a pack (bench/gpu/pack.sh): --build DIR
#                     --reuse-build; a --build folder holding a PACK file is
#                     taken as a pack too
#     --dry-run       print the plan and exit (after the GPU check)
# Exit 0: every step that ran passed (a skipped P/D step included); 1: a step
# failed; 2: bad usage; 77: no GPU visible (nothing built or run). NVIDIA_SMI
# names the nvidia-smi to ask (tests point it at a fake), TANDEM_PYTHON3 the
# Python (default python3).
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
self="$here/$(basename "$0")"
repo=$(cd "$here/../.." && pwd)
py=${TANDEM_PYTHON3:-python3}

# ---- internal: check.sh --run-tests PACK WORK LABEL [--only NAME | --except NAME] ----------
# Runs a pack's tests of LABEL (its tests.tsv, written by pack.sh) one after
# the other, each under its own timeout, in WORK/NAME (or its working folder),
# with @BIN@ @SRC@ @WORK@ @PYTHON@ replaced; one result line each at the end.
# Exit 0 when none failed (a skip, the test's SKIP_RETURN_CODE, is not a
# failure), 1 otherwise or when no test matched.
if [ "${1:-}" = --run-tests ]; then
    [ $# -ge 4 ] || { echo "check.sh: --run-tests PACK WORK LABEL [--only|--except NAME]" >&2; exit 2; }
    pack=$2 work=$3 label=$4 only="" except=""
    case "${5:-}" in --only) only=${6:-} ;; --except) except=${6:-} ;; esac
    src="$pack/src"
    [ -d "$src" ] || src=$repo
    sub() {
        local v=${1//@BIN@/$pack/bin}
        v=${v//@SRC@/$src}
        v=${v//@WORK@/$work}
        [ "$v" = @PYTHON@ ] && v=$py
        printf '%s' "$v"
    }
    summary=() n=0 bad=0
    while IFS=$'\x1e' read -r name labels timeout skip cwd envs cmd; do
        [ -n "$name" ] || continue
        case ";$labels;" in *";$label;"*) ;; *) continue ;; esac
        [ -n "$only" ] && [ "$name" != "$only" ] && continue
        [ -n "$except" ] && [ "$name" = "$except" ] && continue
        argv=() envv=()
        IFS=$'\x1f' read -r -a parts <<<"$cmd"
        for a in "${parts[@]}"; do argv+=("$(sub "$a")"); done
        if [ -n "$envs" ]; then
            IFS=$'\x1f' read -r -a parts <<<"$envs"
            for a in "${parts[@]}"; do envv+=("$(sub "$a")"); done
        fi
        if [ -n "$cwd" ]; then cwd=$(sub "$cwd"); else cwd="$work/$name"; fi
        mkdir -p "$cwd"
        echo "---- test $name (timeout ${timeout}s): ${argv[*]}"
        t0=$(date +%s)
        (cd "$cwd" && exec env ${envv[@]+"${envv[@]}"} timeout --kill-after=5 "${timeout:-300}" \
            "${argv[@]}") </dev/null 2>&1
        rc=$?
        took=$(($(date +%s) - t0))
        n=$((n + 1))
        if [ "$rc" -eq 0 ]; then
            summary+=("$(printf '  test %-28s ok      %ss' "$name" "$took")")
        elif [ -n "$skip" ] && [ "$rc" -eq "$skip" ]; then
            summary+=("$(printf '  test %-28s skipped (exit %s) %ss' "$name" "$rc" "$took")")
        else
            bad=$((bad + 1))
            summary+=("$(printf '  test %-28s FAIL    (exit %s) %ss' "$name" "$rc" "$took")")
        fi
    done <"$pack/tests.tsv"
    echo "---- results"
    [ "$n" -gt 0 ] && printf '%s\n' "${summary[@]}"
    if [ "$n" -eq 0 ]; then
        echo "no test labelled $label${only:+ named $only} in $pack/tests.tsv"
        exit 1
    fi
    echo "$n test(s), $bad failed"
    [ "$bad" -eq 0 ]
    exit
fi

build="$repo/build-gpu-check"
reuse=0 dry=0 pack=0
while [ $# -gt 0 ]; do
    case "$1" in
    --build | --pack)
        [ $# -ge 2 ] || { echo "check.sh: $1 needs a folder" >&2; exit 2; }
        [ "$1" = --pack ] && pack=1 reuse=1
        build=$2; shift 2 ;;
    --reuse-build) reuse=1; shift ;;
    --dry-run) dry=1; shift ;;
    *) echo "usage: bench/gpu/check.sh [--build DIR] [--reuse-build] [--pack DIR] [--dry-run]" >&2
        exit 2 ;;
    esac
done
case "$build" in /*) ;; *) build="$PWD/$build" ;; esac
if [ -f "$build/PACK" ]; then
    pack=1 reuse=1
elif [ "$pack" = 1 ]; then
    echo "check.sh: $build is not a pack (no PACK file; bench/gpu/pack.sh makes one)" >&2
    exit 2
fi
# Scripts (bench_pd.py, gpu_steps.py) come from the pack when it carries them.
scripts=$repo
[ "$pack" = 1 ] && [ -d "$build/src" ] && scripts="$build/src"

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
# RUN_STEPS add up to 465; when configure and build run (210 s), each of them
# is cut to its share of the 270 s left.
TOTAL=480
BUILD_STEPS="configure:45 build:165"
RUN_STEPS="libs:5 model:25 ctest:90 gpu2:30 pd_gpu:60 probe:20 engine:45 engine_fast:20 serve:70 pd:35 pd_nng:35 ids:25 summary:5"
if [ "$reuse" = 1 ]; then
    STEPS="$BUILD_STEPS"
    for s in $RUN_STEPS; do STEPS="$STEPS $s"; done
else
    STEPS="$BUILD_STEPS"
    for s in $RUN_STEPS; do
        l=$((${s##*:} * 270 / 465))
        [ "$l" -lt 5 ] && l=5
        STEPS="$STEPS ${s%%:*}:$l"
    done
fi
jobs=$(nproc 2>/dev/null || echo 4)
logs=${OUT:-$build/check-logs}
work="$build/check-work"
if [ "$dry" = 1 ]; then
    echo "plan (build $build$([ "$pack" = 1 ] && echo ", a pack"), logs $logs, $jobs jobs, total limit ${TOTAL}s):"
    sum=0
    for s in $STEPS; do
        name=${s%%:*} limit=${s##*:}
        skip=""
        if [ "$reuse" = 1 ] && { [ "$name" = configure ] || [ "$name" = build ]; }; then
            skip=" (skipped: $([ "$pack" = 1 ] && echo "a pack" || echo "--reuse-build"))"
        else
            sum=$((sum + limit))
        fi
        echo "  step $name limit ${limit}s$skip"
    done
    echo "  sum of limits ${sum}s"
    exit 0
fi
mkdir -p "$logs" "$build" "$work" || exit 1

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
    timeout --kill-after=5 "$limit" "$@" >"$logs/$name.log" 2>&1 </dev/null
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
    help=$("$1" --help 2>&1 </dev/null)
    grep -q -- "$2" <<<"$help"
}

# ---- 1, 2: configure and build -------------------------------------------------------------
if [ "$reuse" = 1 ]; then
    why=$([ "$pack" = 1 ] && echo "running from a pack" || echo "--reuse-build")
    record configure skip "$why"
    record build skip "$why"
else
    if run_step configure cmake -S "$repo" -B "$build" -DCMAKE_BUILD_TYPE=Release \
        -DTANDEM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native; then
        run_step build cmake --build "$build" -j"$jobs"
    else
        record build skip "configure failed"
    fi
fi
bin() {
    if [ "$pack" = 1 ]; then
        [ -x "$build/bin/$1" ] && echo "$build/bin/$1"
        return 0
    fi
    find "$build" -type f -name "$1" -perm -u+x ! -path '*/CMakeFiles/*' -print -quit 2>/dev/null
}

# ---- 3: libraries ----------------------------------------------------------------------------
# The stack workaround of issue 25 (an LD_PRELOAD that enlarged thread stacks)
# must not be needed: nothing is preloaded.
unset LD_PRELOAD
libdirs=() notes=""
[ "$pack" = 1 ] && libdirs+=("$build/lib")
cudalib=""
for d in ${CUDA_HOME:+"$CUDA_HOME"} /usr/local/cuda /usr/local/cuda-*; do
    for l in "$d/lib64" "$d"/targets/*/lib; do
        if [ -z "$cudalib" ] && ls "$l"/libcudart.so* >/dev/null 2>&1; then cudalib=$l; fi
    done
done
if [ -n "$cudalib" ]; then libdirs+=("$cudalib"); else notes="$notes; no libcudart under CUDA_HOME or /usr/local/cuda*"; fi
# NCCL: the Python environment's (pip's nvidia-nccl-cu13, as torch uses it)
# first, else the system's (ldconfig).
nccl=""
sites=$("$py" -c 'import site, sys
print("\n".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))' 2>/dev/null)
while IFS= read -r d; do
    if [ -z "$nccl" ] && [ -n "$d" ] && [ -e "$d/nvidia/nccl/lib/libnccl.so.2" ]; then
        nccl="$d/nvidia/nccl/lib"
    fi
done <<<"$sites"
if [ -n "$nccl" ]; then
    libdirs+=("$nccl")
elif ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libnccl\.so\.2 '; then
    notes="$notes; no libnccl.so.2 ($py's nvidia/nccl/lib, ldconfig)"
fi
if [ ${#libdirs[@]} -gt 0 ]; then
    LD_LIBRARY_PATH=$(IFS=:; echo "${libdirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export LD_LIBRARY_PATH
fi
if [ "$pack" = 1 ]; then
    export TANDEM_BACKEND_PATH="$build/lib"
elif [ -d "$build/lib" ]; then
    export TANDEM_BACKEND_PATH="$build/lib"
fi
{
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    echo "TANDEM_BACKEND_PATH=${TANDEM_BACKEND_PATH:-}"
} >"$logs/libs.log"
unresolved=""
if [ "$pack" = 1 ]; then
    for f in "$build"/bin/* "$build"/lib/*; do
        [ -f "$f" ] || continue
        miss=$(ldd "$f" 2>/dev/null | grep 'not found' | awk '{print $1}' | sort -u | paste -sd, -)
        [ -n "$miss" ] && unresolved="$unresolved $(basename "$f") ($miss)"
        echo "$(basename "$f"): ${miss:+not found: $miss}" >>"$logs/libs.log"
    done
fi
# The pack's libraries came from the machine that packed it: its glibc must
# not be newer than this one's.
if [ "$pack" = 1 ]; then
    need=$(sed -n 's/^glibc_needed //p' "$build/PACK")
    have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
    if [ -n "$need" ] && [ -n "$have" ] &&
        [ "$(printf '%s\n%s\n' "$need" "$have" | sort -t. -k1,1n -k2,2n | tail -n 1)" != "$have" ]; then
        unresolved="$unresolved (the pack needs glibc $need, this machine has $have)"
    fi
fi
if [ -n "$unresolved" ]; then
    record libs FAIL "unresolved libraries:$unresolved$notes"
else
    record libs ok "$(printf '%s' "${LD_LIBRARY_PATH:-}" | tr ':' ' ' | cut -c1-160)$notes"
fi

# ---- 4: models -----------------------------------------------------------------------------
# The Qwen2.5-0.5B shape as bench_pd.py writes it (so it reuses it) for the
# engine, serve and pd steps; the tiny model with 8192 positions for ids.
mkmodel=$(bin tandem-mkmodel)
big="$work/qwen2.5-0.5b" tiny="$work/tiny-8k"
have_models=0
if [ -z "$mkmodel" ]; then
    record model FAIL "tandem-mkmodel not built"
elif run_step model sh -c '
    [ -e "$2/model.safetensors" ] || "$1" --preset qwen2.5-0.5b --max-pos 8192 --out "$2" || exit 1
    [ -e "$3/model.safetensors" ] || "$1" --preset tiny --max-pos 8192 --out "$3"' \
    sh "$mkmodel" "$big" "$tiny"; then
    have_models=1
fi

# ---- 5: the gpu-label tests (pd_gpu apart) ---------------------------------------------------
if [ "$pack" = 1 ]; then
    run_step ctest "$self" --run-tests "$build" "$work/tests" gpu --except pd_gpu
else
    run_step ctest ctest --test-dir "$build" -L '^gpu$' -E '^pd_gpu$' --no-tests=error \
        --output-on-failure -j1
fi

# ---- 5b: the gpu2-label tests (NCCL between two GPUs) ---------------------------------------
if [ "$(echo "$gpus" | wc -l)" -lt 2 ]; then
    record gpu2 skip "one GPU visible: P/D over NCCL between two GPUs not run"
elif [ "$pack" = 1 ]; then
    run_step gpu2 "$self" --run-tests "$build" "$work/tests" gpu2
else
    run_step gpu2 ctest --test-dir "$build" -L '^gpu2$' --no-tests=error --output-on-failure -j1
fi

# ---- 6: pd_gpu, P/D on one GPU over CUDA IPC, no workaround ----------------------------------
if [ "$pack" = 1 ]; then
    run_step pd_gpu "$self" --run-tests "$build" "$work/tests" gpu --only pd_gpu
else
    run_step pd_gpu ctest --test-dir "$build" -L '^gpu$' -R '^pd_gpu$' --no-tests=error \
        --output-on-failure -j1
fi

# ---- 7: the probe ------------------------------------------------------------------------
probe=$(bin tandem-gpu-probe)
have_probe=0
if [ -z "$probe" ]; then
    record probe FAIL "tandem-gpu-probe not built (a CUDA build makes it)"
elif run_step probe sh -c '"$1" >"$2"' sh "$probe" "$logs/probe.json"; then
    have_probe=1
fi

# ---- 8: the engine bench on the GPU ----------------------------------------------------------
engine=$(bin tandem-bench-engine)
have_engine=0 have_fast=0 engine_ok=0 modes=0
if [ -z "$engine" ]; then
    record engine FAIL "tandem-bench-engine not built"
elif ! help_has "$engine" --device; then
    # Never measure the CPU and call it the GPU.
    record engine FAIL "tandem-bench-engine has no --device flag (this build has no CUDA backend); not running it on the CPU"
elif ! help_has "$engine" --json; then
    record engine FAIL "tandem-bench-engine has no --json flag to report to the summary"
else
    engine_ok=1
    # Without --model it writes its own model where it was built (a folder
    # the GPU machine does not have): give it the model step's.
    model_args=()
    [ "$have_models" = 1 ] && help_has "$engine" --model && model_args=(--model "$big")
    extra=()
    # The serving engine's step and its thread's CPU time per step beside the
    # forward's (issue 26 item 1), where the bench has it.
    help_has "$engine" --engine-loop && extra+=(--engine-loop)
    # Both GEMM modes where the bench has them (issue 26 item 3): this run
    # says --batch-invariant whatever the default is, engine_fast the other.
    help_has "$engine" --no-batch-invariant && modes=1 && extra+=(--batch-invariant)
    if run_step engine "$engine" ${model_args[@]+"${model_args[@]}"} ${extra[@]+"${extra[@]}"} \
        --device cuda --bf16-only --batches 1,8,16,32,64,256 --prefill 512,2048 \
        --json "$logs/engine.json"; then
        have_engine=1
    fi
fi

# ---- 8b: the engine bench without batch invariance ------------------------------------------
if [ "$engine_ok" = 0 ]; then
    record engine_fast skip "see the engine step: the cost of batch invariance not measured"
elif [ "$modes" = 0 ]; then
    record engine_fast skip "tandem-bench-engine has no --no-batch-invariant: the cost of batch invariance not measured"
elif run_step engine_fast "$engine" ${model_args[@]+"${model_args[@]}"} --device cuda \
    --bf16-only --no-batch-invariant --batches 1,8,16,32,64 --prefill 512 --long-context 0 \
    --json "$logs/engine_fast.json"; then
    have_fast=1
fi

# ---- 9: the serving benchmark, one decode worker on the GPU -----------------------------------
decode=$(bin tandem-decode)
bench=$(bin tandem-bench)
if [ -z "$decode" ] || [ -z "$bench" ]; then
    record serve FAIL "tandem-decode or tandem-bench not built"
elif ! help_has "$decode" --device; then
    record serve FAIL "tandem-decode has no --device flag; not serving from the CPU"
elif [ "$have_models" = 0 ]; then
    record serve FAIL "no model (see the model step)"
else
    wargs="--device cuda"
    help_has "$decode" --gpu-memory-utilization && wargs="$wargs --gpu-memory-utilization 0.5"
    run_step serve "$py" "$scripts/bench/gpu/gpu_steps.py" serve --decode "$decode" \
        --bench "$bench" --model "$big" --workdir "$work/serve" --json "$logs/serve.json" \
        --concurrency 1,64,256 --input-len 128 --output-len 128 --worker-args "$wargs"
fi

# ---- 10, 11: P/D on one GPU over CUDA IPC and over nng --------------------------------------
# bench_pd.py finds the binaries as a build lays them out; a pack's bin/ is
# shown to it so through links (a binary's own folder, /proc/self/exe, is
# still the pack's bin/, beside lib/).
pdbuild=$build
if [ "$pack" = 1 ]; then
    pdbuild="$work/build-view"
    rm -rf "$pdbuild"
    for p in router/tandem-router prefill/tandem-prefill decode/tandem-decode \
        tools/mkmodel/tandem-mkmodel; do
        mkdir -p "$pdbuild/$(dirname "$p")"
        ln -s "$build/bin/$(basename "$p")" "$pdbuild/$p"
    done
fi
have_pd=0
if [ -z "$decode" ] || ! help_has "$decode" --kv-transfer; then
    why="tandem-decode has no --kv-transfer (issue 10's GPU transfer is not in this build)"
    record pd skip "$why: P/D on one GPU over CUDA IPC not measured"
    record pd_nng skip "$why: P/D on one GPU over nng not measured"
else
    for kv in cuda-ipc nng; do
        step=pd json=pd.json
        [ "$kv" = nng ] && step=pd_nng json=pd_nng.json
        if run_step "$step" "$py" "$scripts/bench/pd/bench_pd.py" --build "$pdbuild" \
            --sizes 512,2048 --reps 3 --model "$big" --json "$logs/$json" \
            --worker-args "--device cuda --kv-transfer $kv --gpu-memory-utilization 0.4"; then
            [ "$kv" = cuda-ipc ] && have_pd=1
        fi
    done
fi

# ---- 12: greedy ids, --device cuda vs cpu ----------------------------------------------------
generate=$(bin tandem-generate)
if [ -z "$generate" ]; then
    record ids FAIL "tandem-generate not built"
elif ! help_has "$generate" --device || ! help_has "$generate" --prompt-ids; then
    record ids FAIL "tandem-generate has no --device or --prompt-ids flag"
elif [ "$have_models" = 0 ]; then
    record ids FAIL "no model (see the model step)"
else
    run_step ids "$py" "$scripts/bench/gpu/gpu_steps.py" ids --generate "$generate" \
        --model "$tiny" --json "$logs/ids.json" --lengths 1000,2048,2049,3000,3500 --chunks 256,2048
fi

# ---- 13: summary -------------------------------------------------------------------------
report=$(bin tandem-gpu-report)
echo
echo "==== summary ($(($(date +%s) - start))s of ${TOTAL}s)"
printf '%s\n' "${results[@]}"
if [ "$have_probe" = 1 ] && [ -n "$report" ]; then
    args=(--probe "$logs/probe.json")
    [ "$have_engine" = 1 ] && args+=(--engine "$logs/engine.json")
    [ "$have_engine" = 1 ] && [ "$have_fast" = 1 ] && args+=(--engine-fast "$logs/engine_fast.json")
    [ "$have_pd" = 1 ] && args+=(--pd "$logs/pd.json")
    if ! timeout "$(limit_of summary)" "$report" "${args[@]}" | tee "$logs/summary.txt"; then
        echo "  summary    FAIL tandem-gpu-report could not read the steps' JSON"
        failed=1
    fi
else
    echo "  (no probe figures, so no ratios: see the probe step)" | tee "$logs/summary.txt"
fi
# The tables the report does not hold, from the steps' logs.
{
    [ -s "$logs/serve.log" ] && sed -n '/^serving, one decode worker/,$p' "$logs/serve.log"
    if [ -s "$logs/pd_nng.log" ]; then
        echo "P/D over nng between the two GPU workers (bench_pd.py):"
        sed -n '/^tokens  prefill_s/,/^goal:/p' "$logs/pd_nng.log" | sed 's/^/  /'
    fi
    [ -s "$logs/ids.log" ] && sed -n '/^ids, --device cuda vs cpu/,$p' "$logs/ids.log"
} | tee -a "$logs/summary.txt"
echo "logs: $logs"
exit "$failed"
