#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# bench_decode.sh: the decode worker under load, measured the way `vllm bench
# serve` measures a server. Starts tandem-decode on the Qwen2.5-0.5B-shaped
# random model (made once with tandem-mkmodel), records the cold start (process
# start -> /health 200, weights in page cache), drives it with tandem-bench at
# concurrency 1, 8 and 32 (random prompts, ignore_eos, greedy) and prints TTFT
# and ITL p50/p99 and output tokens/s per level, then the serving overhead:
# the server's decode speed at concurrency 1 (1 / mean TPOT) divided by
# tandem-generate's decode tokens/s for the same prompt and output lengths.
#
# Usage: bench/decode/bench_decode.sh [BUILD_DIR] [MODEL_DIR]
#   BUILD_DIR  holds tandem-decode, tandem-bench, tandem-generate, tandem-mkmodel
#              (default: build)
#   MODEL_DIR  the 0.5B-shaped model (default: /tmp/tandem-qwen2.5-0.5b, made when
#              missing; ~1 GB) with the real Qwen2 tokenizer copied in when
#              TOKENIZER_FROM exists: the random dataset decodes random token ids to
#              text, and tandem-mkmodel's own filler tokenizer yields text that does
#              not survive as a JSON prompt (control bytes), so prompts would shrink.
# Environment: THREADS (compute threads, default 0 = all cores), INPUT_LEN (128),
#              OUTPUT_LEN (64), PORT (18123), OUT (result folder, default a temp dir),
#              TOKENIZER_FROM (default: ../shared/models/qwen2-tokenizer beside the repo).
set -eu
BUILD=${1:-build}
MODEL=${2:-/tmp/tandem-qwen2.5-0.5b}
THREADS=${THREADS:-0}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-64}
PORT=${PORT:-18123}
OUT=${OUT:-$(mktemp -d /tmp/bench_decode.XXXXXX)}
PY=/usr/bin/python3
[ -x "$PY" ] || PY=python3

DECODE=$BUILD/decode/tandem-decode
BENCH=$BUILD/bench/serve/tandem-bench
GENERATE=$BUILD/tools/generate/tandem-generate
MKMODEL=$BUILD/tools/mkmodel/tandem-mkmodel
for b in "$DECODE" "$BENCH" "$GENERATE" "$MKMODEL"; do
    if [ ! -x "$b" ]; then
        echo "bench_decode: $b not built (cmake --build $BUILD --target tandem-decode tandem-bench tandem-generate tandem-mkmodel)" >&2
        exit 2
    fi
done
mkdir -p "$OUT"
TOKENIZER_FROM=${TOKENIZER_FROM:-$(dirname "$0")/../../../shared/models/qwen2-tokenizer}
if [ ! -f "$MODEL/model.safetensors" ]; then
    echo "writing the 0.5B-shaped model to $MODEL"
    if [ -f "$TOKENIZER_FROM/tokenizer.json" ]; then
        "$MKMODEL" --preset qwen2.5-0.5b --tokenizer-from "$TOKENIZER_FROM" --out "$MODEL" >/dev/null
    else
        echo "($TOKENIZER_FROM missing: tandem-mkmodel's own tokenizer; random prompts shrink)"
        "$MKMODEL" --preset qwen2.5-0.5b --out "$MODEL" >/dev/null
    fi
fi
# Weights into the page cache, so the cold start measures the server, not the disk.
cat "$MODEL/model.safetensors" >/dev/null

SERVER_PID=
cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
}
trap cleanup EXIT INT TERM

# ---- cold start ---------------------------------------------------------------------
"$DECODE" --model "$MODEL" --host 127.0.0.1 --port "$PORT" --threads "$THREADS" \
    --served-model-name Qwen/Qwen2.5-0.5B-Instruct --max-model-len 4096 \
    --max-num-seqs 32 --kv-cache-memory 1GiB 2>"$OUT/server.log" &
SERVER_PID=$!
COLD_S=$("$PY" - "$PORT" "$SERVER_PID" <<'EOF'
import http.client, os, sys, time
port, pid = int(sys.argv[1]), int(sys.argv[2])
# Process start time from /proc (ticks since boot), so the launch itself counts.
ticks = os.sysconf("SC_CLK_TCK")
start = int(open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()[19]) / ticks
uptime = float(open("/proc/uptime").read().split()[0])
t_start = time.time() - (uptime - start)
while True:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/health")
        r = c.getresponse()
        r.read()
        if r.status == 200:
            break
    except OSError:
        pass
    if time.time() - t_start > 300:
        sys.exit("no /health 200 within 300 s")
    time.sleep(0.005)
print("%.3f" % (time.time() - t_start))
EOF
)
echo "cold start to /health 200: ${COLD_S} s"
grep "ready" "$OUT/server.log" || true

# ---- tandem-generate at batch 1 (the same lengths, no server) ---------------------------
# Run right before and right after the concurrency-1 run (the mean is used), so
# that a machine shared with other work disturbs both sides alike.
PROMPT_IDS=$("$PY" -c "print(','.join(str(1000 + 37 * i % 50000) for i in range($INPUT_LEN)))")
run_generate() {
    "$GENERATE" --model "$MODEL" --prompt-ids "$PROMPT_IDS" --max-tokens "$OUTPUT_LEN" \
        --ignore-eos --threads "$THREADS" --json >"$OUT/generate$1.json"
}

# ---- serving at concurrency 1, 8, 32 -------------------------------------------------
for C in 1 8 32; do
    [ "$C" = 1 ] && run_generate 1
    N=$((C * 2))
    [ "$N" -lt 8 ] && N=8
    "$BENCH" --base-url "http://127.0.0.1:$PORT" --model Qwen/Qwen2.5-0.5B-Instruct \
        --tokenizer "$MODEL" --dataset random --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
        --num-prompts "$N" --max-concurrency "$C" --percentiles 50,99 --seed 1 \
        --json "$OUT/c$C.json" >"$OUT/c$C.txt" 2>&1 || { cat "$OUT/c$C.txt"; exit 1; }
    [ "$C" = 1 ] && run_generate 2
done

"$PY" - "$OUT" "$COLD_S" <<'EOF'
import json, sys
out, cold = sys.argv[1], float(sys.argv[2])
print()
print("%-6s %9s %9s %9s %9s %12s %8s" % ("conc", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                                         "out tok/s", "failed"))
rows = {}
for c in (1, 8, 32):
    j = json.load(open("%s/c%d.json" % (out, c)))
    rows[c] = j
    print("%-6d %7.1fms %7.1fms %7.1fms %7.1fms %12.1f %8d" % (
        c, j["p50_ttft_ms"], j["p99_ttft_ms"], j["p50_itl_ms"], j["p99_itl_ms"],
        j["output_throughput"], j.get("failed", 0)))
gens = [json.load(open("%s/generate%d.json" % (out, i)))["timings"] for i in (1, 2)]
gen_tps = sum(g["decode_tokens_per_s"] for g in gens) / 2
load_s = min(g["load_s"] for g in gens)
srv_tps = 1000.0 / rows[1]["mean_tpot_ms"] if rows[1]["mean_tpot_ms"] > 0 else 0.0
print()
print("server decode at concurrency 1: %.2f tok/s (1 / mean TPOT %.1f ms)" %
      (srv_tps, rows[1]["mean_tpot_ms"]))
print("tandem-generate decode:         %.2f tok/s (mean of %.2f before and %.2f after)" %
      (gen_tps, gens[0]["decode_tokens_per_s"], gens[1]["decode_tokens_per_s"]))
print("ratio server / generate:        %.3f (1.0 = no serving overhead)" %
      (srv_tps / gen_tps if gen_tps > 0 else 0.0))
print("batching: output tok/s at 32 / at 1 = %.2f" %
      (rows[32]["output_throughput"] / rows[1]["output_throughput"]))
print("cold start to /health 200: %.3f s (tandem-generate's model load alone: %.3f s)" %
      (cold, load_s))
print("results in %s" % out)
EOF
