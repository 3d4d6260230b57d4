#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# bench_hostloop.sh: how much of a decode step is host work (issue 26's CPU
# proxy of "take the host off the critical path"). The model's compute is
# negligible (hidden 16, one layer) but its vocabulary is Qwen2's 151 936, so
# everything done per logits row (the LM head's tile, sampling, the token
# bookkeeping) is what a step costs. One tandem-decode is driven by
# tandem-bench with random 128-token prompts and 128 output tokens (greedy,
# ignore_eos), at concurrency 1 and then 64. A step at 64 does 64 times the
# host work of a step at 1; if that work were spread over the compute threads
# and cheap beside a real model's forward, ITL p50 at 64 would stay within a
# small multiple of ITL p50 at 1. Printed: ITL p50 at each level, output tok/s,
# the ratio ITL p50(64) / ITL p50(1) against the goal <= 8, and the CPU share of
# the engine thread (tdm-engine, from /proc/PID/task/*/stat: utime + stime over
# the bench's duration, first request to last answer; 1.0 = one core busy all
# along) and of the whole process,
# and the engine thread's wall time per engine step by phase (the worker's
# tandem:engine_thread_seconds_total{phase} over vllm:iteration_tokens_total's
# count, from /metrics before and after each level; idle less the script's
# time outside the bench's duration): forward (here mostly the LM head)
# beside finish (sampling, tokens, outputs), schedule and prepare.
# Ratios are measured in one run; the machine's speed cancels out of them.
#
# Usage: bench/hostloop/bench_hostloop.sh [BUILD_DIR] [WORK_DIR]
#   BUILD_DIR  holds tandem-decode, tandem-bench, tandem-mkmodel (default: build)
#   WORK_DIR   the model and the results (default: a temp dir; the model is
#              written once, ~10 MB)
# Environment: THREADS (compute threads, default 0 = all cores), INPUT_LEN (128),
#              OUTPUT_LEN (128), LEVELS ("1 64"), PORT (18124), TOKENIZER_FROM
#              (default: ../shared/models/qwen2-tokenizer beside the repo; without
#              it tandem-mkmodel's filler tokenizer is used and prompts may shrink).
set -eu
BUILD=${1:-build}
WORK=${2:-$(mktemp -d /tmp/bench_hostloop.XXXXXX)}
THREADS=${THREADS:-0}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-128}
LEVELS=${LEVELS:-"1 64"}
PORT=${PORT:-18124}
PY=/usr/bin/python3
[ -x "$PY" ] || PY=python3

DECODE=$BUILD/decode/tandem-decode
BENCH=$BUILD/bench/serve/tandem-bench
MKMODEL=$BUILD/tools/mkmodel/tandem-mkmodel
for b in "$DECODE" "$BENCH" "$MKMODEL"; do
    if [ ! -x "$b" ]; then
        echo "bench_hostloop: $b not built (cmake --build $BUILD --target tandem-decode tandem-bench tandem-mkmodel)" >&2
        exit 2
    fi
done
mkdir -p "$WORK"
MODEL=$WORK/model
TOKENIZER_FROM=${TOKENIZER_FROM:-$(dirname "$0")/../../../shared/models/qwen2-tokenizer}
if [ ! -f "$MODEL/model.safetensors" ]; then
    set -- --hidden 16 --intermediate 32 --layers 1 --heads 2 --kv-heads 1 --vocab 151936 \
        --out "$MODEL"
    if [ -f "$TOKENIZER_FROM/tokenizer.json" ]; then
        "$MKMODEL" "$@" --tokenizer-from "$TOKENIZER_FROM" >/dev/null
    else
        echo "($TOKENIZER_FROM missing: tandem-mkmodel's own tokenizer; random prompts may shrink)"
        "$MKMODEL" "$@" >/dev/null
    fi
fi

SERVER_PID=
cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
}
trap cleanup EXIT INT TERM

"$DECODE" --model "$MODEL" --host 127.0.0.1 --port "$PORT" --threads "$THREADS" \
    --served-model-name hostloop --max-model-len 4096 --max-num-seqs 64 \
    --kv-cache-memory 256MiB 2>"$WORK/server.log" &
SERVER_PID=$!
"$PY" - "$PORT" <<'PYEOF'
import http.client, sys, time
port, t0 = int(sys.argv[1]), time.time()
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
    if time.time() - t0 > 120:
        sys.exit("bench_hostloop: no /health 200 within 120 s")
    time.sleep(0.01)
PYEOF
grep "ready" "$WORK/server.log" || true

# CPU ticks (utime + stime) of the engine thread and of the whole process.
cpu_ticks() {
    "$PY" - "$SERVER_PID" <<'PYEOF'
import glob, sys
pid = sys.argv[1]
def ticks(path):
    f = open(path).read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])  # fields 14 and 15 of stat
eng = 0
for d in glob.glob("/proc/%s/task/*" % pid):
    try:
        if open(d + "/comm").read().strip() == "tdm-engine":
            eng += ticks(d + "/stat")
    except OSError:
        pass
print(eng, ticks("/proc/%s/stat" % pid))
PYEOF
}

# The engine thread's seconds by phase and the engine's steps, as JSON.
phases() {
    "$PY" - "$PORT" <<'PYEOF'
import http.client, json, re, sys
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=10)
c.request("GET", "/metrics")
text = c.getresponse().read().decode()
got = {m.group(1): float(m.group(2)) for m in re.finditer(
    r'^tandem:engine_thread_seconds_total\{[^}]*phase="([a-z]+)"[^}]*\} (\S+)$', text, re.M)}
steps = sum(float(m.group(1)) for m in re.finditer(
    r'^vllm:iteration_tokens_total_count\{[^}]*\} (\S+)$', text, re.M))
if not got:
    sys.exit("bench_hostloop: no tandem:engine_thread_seconds_total on /metrics")
print(json.dumps({"phases": got, "steps": steps}))
PYEOF
}

for C in $LEVELS; do
    N=$((C * 2))
    [ "$N" -lt 16 ] && N=16
    phases >"$WORK/c$C.ph0"
    T0=$(cpu_ticks)
    W0=$("$PY" -c 'import time; print(time.time())')
    "$BENCH" --base-url "http://127.0.0.1:$PORT" --model hostloop --tokenizer "$MODEL" \
        --dataset random --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
        --num-prompts "$N" --max-concurrency "$C" --percentiles 50,99 --seed 1 --temperature 0 \
        --json "$WORK/c$C.json" >"$WORK/c$C.txt" 2>&1 || { cat "$WORK/c$C.txt"; exit 1; }
    W1=$("$PY" -c 'import time; print(time.time())')
    T1=$(cpu_ticks)
    phases >"$WORK/c$C.ph1"
    echo "$T0 $T1 $W0 $W1" >"$WORK/c$C.cpu"
done

"$PY" - "$WORK" "$LEVELS" <<'PYEOF'
import json, os, sys
work, levels = sys.argv[1], [int(c) for c in sys.argv[2].split()]
hz = os.sysconf("SC_CLK_TCK")
print()
print("%-6s %9s %9s %12s %10s %12s %8s" % ("conc", "ITL p50", "ITL p99", "out tok/s",
                                          "engine thr", "process CPU", "failed"))
rows = {}
for c in levels:
    j = json.load(open("%s/c%d.json" % (work, c)))
    e0, p0, e1, p1, w0, w1 = [float(x) for x in open("%s/c%d.cpu" % (work, c)).read().split()]
    # Over the bench's own duration (first request sent to last answer): the
    # script's wall also holds tandem-bench's start (its tokenizer, the
    # prompts), when the worker has nothing to do.
    wall = w1 - w0
    dur = j.get("duration") or wall
    j["engine_share"] = (e1 - e0) / hz / dur if dur > 0 else 0.0
    j["process_share"] = (p1 - p0) / hz / dur if dur > 0 else 0.0
    j["outside_s"] = max(0.0, wall - dur)
    rows[c] = j
    print("%-6d %7.2fms %7.2fms %12.1f %10.2f %12.2f %8d" % (
        c, j["p50_itl_ms"], j["p99_itl_ms"], j["output_throughput"], j["engine_share"],
        j["process_share"], j.get("failed", 0)))
print()
print("engine thread per engine step (ms, by phase):")
for c in levels:
    a, b = [json.load(open("%s/c%d.ph%d" % (work, c, k))) for k in (0, 1)]
    steps = b["steps"] - a["steps"]
    # The idle phase less the time outside the bench's duration (asleep then).
    d = {k: v - a["phases"].get(k, 0.0) for k, v in b["phases"].items()}
    if "idle" in d:
        d["idle"] = max(0.0, d["idle"] - rows[c]["outside_s"])
    per = {k: v / steps * 1e3 for k, v in d.items()} if steps > 0 else {}
    rows[c]["engine_phase_ms"] = per
    print("  conc %-4d %6d steps  %s" % (c, steps, "  ".join(
        "%s %.3f" % (k, per[k]) for k in ("schedule", "prepare", "forward", "wait", "finish",
                                           "other", "idle") if k in per)))
lo, hi = min(levels), max(levels)
if lo != hi and rows[lo]["p50_itl_ms"] > 0:
    r = rows[hi]["p50_itl_ms"] / rows[lo]["p50_itl_ms"]
    print()
    print("ITL p50(%d) / ITL p50(%d) = %.1f (goal <= 8: %s)" % (hi, lo, r,
          "met" if r <= 8 else "missed"))
    print("output tok/s at %d / at %d = %.1f" % (hi, lo, rows[hi]["output_throughput"] /
          rows[lo]["output_throughput"]))
    json.dump({"levels": {str(c): {k: rows[c][k] for k in ("p50_itl_ms", "p99_itl_ms",
               "output_throughput", "engine_share", "process_share", "engine_phase_ms")}
                          for c in levels},
               "itl_p50_ratio": r}, open("%s/summary.json" % work, "w"), indent=1)
print("results in %s" % work)
if any(rows[c].get("failed", 0) for c in levels):
    sys.exit("bench_hostloop: some requests failed")
PYEOF
