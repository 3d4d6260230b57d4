#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/peer/llamacpp.sh: llama.cpp measured on this machine, on the model
# Tandem's engine bench uses, as the peer of tandem-bench-engine's ratios
# (--peer FILE) and of the serving figures in docs/engine.md. llama.cpp is a
# bench-only peer: never a dependency, nothing of it in this repository. The
# script takes a llama.cpp source folder (a clone or an unpacked archive of
# github.com/ggml-org/llama.cpp) and:
#
#   1 build    cmake -DGGML_NATIVE=ON, Release, the targets llama-bench,
#              llama-server and llama-quantize only, into BUILD (default
#              build/peer/llama.cpp-build, ignored by git); an existing build
#              of the same source folder is reused (cmake rebuilds what changed)
#   2 convert  MODEL_DIR (Hugging Face layout, Qwen2; default the engine
#              bench's build/bench/engine/qwen2.5-0.5b-random) to a bf16 GGUF
#              with bench/peer/hf_to_gguf.py (llama.cpp's own converter needs
#              torch), then Q8_0 with llama-quantize; both kept beside the
#              JSON and remade only when the checkpoint is newer
#   3 bench    llama-bench -p 512 -n 128 -t THREADS -r REPS on both GGUFs: pp512
#              and tg128 tokens/s, the best repetition (tandem-bench-engine
#              keeps its best decode step and prefill; on a shared machine the
#              best is the least disturbed), with the mean and each repetition
#              as pp512_mean, pp512_samples, ... beside it. With --q8-no-amx the
#              Q8_0 run loads a second ggml-cpu built without AMX (into
#              BUILD-noamx, only that library; LD_LIBRARY_PATH puts it before
#              the build's RUNPATH): at 81ff7abe5 llama.cpp's AMX Q8_0 GEMM
#              dies of SIGILL (tilezero in tinygemm_kernel_amx) on the Xeon this
#              was written on, at any prompt of more than one token
#   4 serve    with --serve only: llama-server on the bf16 GGUF (-np 8, -c
#              8192, one thread pool of THREADS) on 127.0.0.1:PORT, and Tandem's
#              own tandem-bench against it (OpenAI /v1/completions, streaming,
#              random prompts from MODEL_DIR's tokenizer, ignore_eos): 8 streams
#              of 128 in / 256 out, then 1 stream of 128 / 128
#
# and writes one JSON (default build/peer/llamacpp.json):
#   {"peer": "llama.cpp", "commit": SHA, "threads": N, "cpu": MODEL NAME,
#    "model": MODEL_DIR, "bf16": {"pp512": tok/s, "tg128": tok/s, "pp512_mean": ...},
#    "q8_0": {...}, "q8_0_amx": true|false, "serve": {"bf16": {"c8_in128_out256": {...}, "c1_in128_out128": {...}}}}
# "serve" only with --serve; each of its runs keeps tandem-bench's vLLM-named
# figures (output_throughput, mean/median/p99 TTFT, TPOT, ITL in ms, completed).
#
# Usage: bench/peer/llamacpp.sh [options] LLAMA_SRC [MODEL_DIR]
#   --out FILE        the JSON written (default build/peer/llamacpp.json)
#   --build DIR       llama.cpp's build folder (default build/peer/llama.cpp-build)
#   --tandem-build D  Tandem's build folder, for tandem-bench (default build)
#   --commit SHA      the commit recorded when LLAMA_SRC is not a git checkout
#                     (default: git rev-parse HEAD there, else llama-bench's
#                     build_commit, else "unknown")
#   --threads N       llama-bench -t and llama-server -t (default 2, as
#                     tandem-bench-engine's default)
#   --reps N          llama-bench -r (default 5)
#   --jobs N          build parallelism (default 2)
#   --q8-no-amx       Q8_0 on ggml-cpu without AMX (see step 3)
#   --serve           also run step 4
#   --port P          llama-server's port (default 8089)
#   --prompts N       requests of the 8-stream run (default 16; the 1-stream run 4)
# Exit status: 0 written, 1 a step failed (the step and its log are named), 2 bad
# arguments. Needs cmake, a C/C++ compiler, Debian's python3 with python3-numpy,
# curl, and for --serve a built tandem-bench.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=$root/build/peer/llamacpp.json
build=$root/build/peer/llama.cpp-build
tandem_build=$root/build
commit=""
threads=2
reps=5
jobs=2
serve=0
q8_amx=1
port=8089
prompts=16

usage() {
    sed -n 's/^# \{0,1\}//; /^Usage:/,/^Exit status/p' "$0" | sed '$d' >&2
    exit 2
}

while [ $# -gt 0 ]; do
    case $1 in
    --out) out=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --tandem-build) tandem_build=$2; shift 2 ;;
    --commit) commit=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --serve) serve=1; shift ;;
    --q8-no-amx) q8_amx=0; shift ;;
    --port) port=$2; shift 2 ;;
    --prompts) prompts=$2; shift 2 ;;
    -h | --help) usage ;;
    -*) echo "llamacpp.sh: unknown option $1" >&2; usage ;;
    *) break ;;
    esac
done
[ $# -ge 1 ] && [ $# -le 2 ] || usage
src=$(cd "$1" && pwd) || { echo "llamacpp.sh: $1: not a folder" >&2; exit 2; }
model=${2:-$tandem_build/bench/engine/qwen2.5-0.5b-random}
if [ ! -f "$src/CMakeLists.txt" ] || [ ! -d "$src/gguf-py/gguf" ]; then
    echo "llamacpp.sh: $src: not a llama.cpp source folder (no CMakeLists.txt, gguf-py)" >&2
    exit 2
fi
if [ ! -f "$model/config.json" ]; then
    echo "llamacpp.sh: $model: no config.json (the default model is written by one run of" \
        "build/bench/engine/tandem-bench-engine; or give MODEL_DIR)" >&2
    exit 2
fi
model=$(cd "$model" && pwd)
py=/usr/bin/python3 # Debian's, with python3-numpy (as the model reference test)
[ -x "$py" ] || py=python3
work=$(dirname "$out")
mkdir -p "$work" "$build"
logs=$work/logs
mkdir -p "$logs"

step() { echo "llamacpp.sh: $*" >&2; }
die() {
    echo "llamacpp.sh: $1 failed; see $2" >&2
    tail -5 "$2" >&2 || true
    exit 1
}

# ---- 1 build ---------------------------------------------------------------------------
# (only a checkout of its own: an unpacked archive inside another repository is not one)
if [ -z "$commit" ] && [ "$(git -C "$src" rev-parse --show-toplevel 2>/dev/null)" = "$src" ]; then
    commit=$(git -C "$src" rev-parse HEAD)
fi
if [ ! -f "$build/CMakeCache.txt" ] ||
    ! grep -qxF "CMAKE_HOME_DIRECTORY:INTERNAL=$src" "$build/CMakeCache.txt"; then
    step "configuring llama.cpp from $src in $build"
    cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
        >"$logs/configure.log" 2>&1 || die "cmake configure" "$logs/configure.log"
fi
step "building llama-bench, llama-server, llama-quantize (-j$jobs; first build takes a while)"
cmake --build "$build" -j "$jobs" --target llama-bench llama-server llama-quantize \
    >"$logs/build.log" 2>&1 || die "build" "$logs/build.log"
bin=$build/bin

# ---- 2 convert -------------------------------------------------------------------------
name=$(basename "$model")
gguf_bf16=$work/$name-bf16.gguf
gguf_q8=$work/$name-q8_0.gguf
newest=$(ls -t "$model"/*.safetensors "$model"/config.json "$model"/tokenizer.json | head -1)
if [ ! -s "$gguf_bf16" ] || [ "$newest" -nt "$gguf_bf16" ]; then
    step "converting $model to $gguf_bf16"
    "$py" "$here/hf_to_gguf.py" --llama-src "$src" "$model" "$gguf_bf16" \
        >"$logs/convert.log" 2>&1 || die "hf_to_gguf.py" "$logs/convert.log"
fi
if [ ! -s "$gguf_q8" ] || [ "$gguf_bf16" -nt "$gguf_q8" ]; then
    step "quantizing to $gguf_q8"
    "$bin/llama-quantize" "$gguf_bf16" "$gguf_q8" Q8_0 "$threads" \
        >"$logs/quantize.log" 2>&1 || die "llama-quantize" "$logs/quantize.log"
fi

# ---- 3 bench ---------------------------------------------------------------------------
q8_libs=""
if [ "$q8_amx" = 0 ]; then
    noamx=$build-noamx
    if [ ! -f "$noamx/CMakeCache.txt" ]; then
        step "configuring a ggml-cpu without AMX in $noamx"
        flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" # explicit -mno-* outlive -march=native
        cmake -S "$src" -B "$noamx" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
            -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DCMAKE_C_FLAGS="$flags" \
            -DCMAKE_CXX_FLAGS="$flags" >"$logs/configure-noamx.log" 2>&1 ||
            die "cmake configure (no AMX)" "$logs/configure-noamx.log"
    fi
    step "building ggml-cpu without AMX (-j$jobs)"
    cmake --build "$noamx" -j "$jobs" --target ggml-cpu >"$logs/build-noamx.log" 2>&1 ||
        die "build (no AMX)" "$logs/build-noamx.log"
    q8_libs=$noamx/bin
fi
# bench KEY GGUF: llama-bench's JSON rows in $logs/llama-bench-KEY.json
bench() {
    step "llama-bench pp512 tg128 on $1, -t $threads -r $reps"
    LD_LIBRARY_PATH=${3:-}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$bin/llama-bench" -m "$2" \
        -p 512 -n 128 -t "$threads" -r "$reps" -o json >"$logs/llama-bench-$1.json" \
        2>"$logs/llama-bench-$1.log" && return
    rc=$?
    [ "$1" = q8_0 ] && [ "$rc" = 132 ] &&
        echo "llamacpp.sh: llama-bench died of SIGILL on Q8_0: try --q8-no-amx (step 3)" >&2
    die "llama-bench ($1, exit $rc)" "$logs/llama-bench-$1.log"
}
bench bf16 "$gguf_bf16"
bench q8_0 "$gguf_q8" "$q8_libs"

# ---- 4 serve ---------------------------------------------------------------------------
serve_files=()
if [ "$serve" = 1 ]; then
    tb=$tandem_build/bench/serve/tandem-bench
    [ -x "$tb" ] || { echo "llamacpp.sh: --serve: $tb not built" >&2; exit 1; }
    step "llama-server -np 8 -c 8192 -t $threads on 127.0.0.1:$port"
    "$bin/llama-server" -m "$gguf_bf16" --alias "$name" -np 8 -c 8192 -t "$threads" \
        --host 127.0.0.1 --port "$port" >"$logs/llama-server.log" 2>&1 &
    server_pid=$!
    trap 'kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true' EXIT
    for _ in $(seq 1 120); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
        kill -0 "$server_pid" 2>/dev/null || die "llama-server start" "$logs/llama-server.log"
        sleep 1
    done
    curl -sf "http://127.0.0.1:$port/health" >/dev/null || die "llama-server /health" \
        "$logs/llama-server.log"
    # run KEY CONCURRENCY INPUT OUTPUT PROMPTS
    run() {
        step "tandem-bench against llama-server: $2 streams, $3 in / $4 out, $5 requests"
        "$tb" --base-url "http://127.0.0.1:$port" --model "$model" --served-model-name "$name" \
            --input-len "$3" --output-len "$4" --num-prompts "$5" --max-concurrency "$2" \
            --json "$logs/serve-$1.json" >"$logs/serve-$1.log" 2>&1 ||
            die "tandem-bench ($1)" "$logs/serve-$1.log"
        serve_files+=("$1=$logs/serve-$1.json")
    }
    run c8_in128_out256 8 128 256 "$prompts"
    run c1_in128_out128 1 128 128 $(((prompts + 3) / 4))
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    trap - EXIT
fi

# ---- the JSON --------------------------------------------------------------------------
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
"$py" - "$logs" "$out" "$commit" "$threads" "$cpu" "$model" "$q8_amx" \
    "${serve_files[@]}" <<'EOF' || die "writing the JSON" "$logs/llama-bench-bf16.json"
import json, sys

logs, out, commit, threads, cpu, model, q8_amx = sys.argv[1:8]
doc = {"peer": "llama.cpp", "commit": commit, "threads": int(threads), "cpu": cpu,
       "model": model}
for key in ("bf16", "q8_0"):
    bench = f"{logs}/llama-bench-{key}.json"
    with open(bench) as f:
        rows = json.load(f)
    figs = {}
    for r in rows:
        test = {(512, 0): "pp512", (0, 128): "tg128"}.get((r["n_prompt"], r["n_gen"]))
        if test is None:
            continue
        # the best repetition, as tandem-bench-engine keeps its best step and prefill;
        # the mean and every repetition beside it
        figs[test] = max(r["samples_ts"])
        figs[test + "_mean"] = r["avg_ts"]
        figs[test + "_samples"] = r["samples_ts"]
    if not {"pp512", "tg128"} <= set(figs):
        sys.exit(f"{bench}: no pp512 and tg128 rows")
    doc[key] = figs
doc["q8_0_amx"] = q8_amx == "1"
if not doc["commit"]:
    doc["commit"] = rows[0].get("build_commit") or "unknown"
doc["build_number"] = rows[0].get("build_number")
doc["cpu_info"] = rows[0].get("cpu_info")
keep = ("completed", "failed", "duration", "output_throughput", "total_token_throughput",
        "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
        "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
        "total_input_tokens", "total_output_tokens", "max_concurrency")
serve = {}
for arg in sys.argv[8:]:
    key, path = arg.split("=", 1)
    with open(path) as f:
        s = json.load(f)
    serve[key] = {k: s[k] for k in keep if k in s}
if serve:
    doc["serve"] = {"bf16": serve}
with open(out, "w") as f:
    json.dump(doc, f, indent=1)
    f.write("\n")
EOF
step "wrote $out"
cat "$out"
