#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# ctest gpu_engine_json: tandem-bench-engine's --batches/--prefill/--json (what
# check.sh asks of it) on the tiny model, read back by tandem-gpu-report.
#   engine_json_test.sh MKMODEL BENCH_ENGINE GPU_REPORT WORKDIR
set -eu
mkmodel=$1 engine=$2 report=$3 work=$4
rm -rf "$work"
mkdir -p "$work"
"$mkmodel" --preset tiny --out "$work/tiny" >/dev/null
"$engine" --model "$work/tiny" --threads 1 --steps 1 --bf16-only --batches 1,3,64 \
    --prefill 8,40 --json "$work/engine.json" >"$work/engine.txt"
cat "$work/engine.txt" "$work/engine.json"
grep -q "decode batch 64" "$work/engine.txt"
cat >"$work/probe.json" <<'JSON'
{"device": {"name": "Fake GPU", "cc": "9.0", "sms": 132, "mem_bytes": 150000000000},
 "read_gbs": 4000.0, "copy_gbs": 7000.0, "d2d_gbs": 6500.0,
 "gemm": {"m": 8192, "n": 8192, "k": 8192}, "bf16_tflops": 700.0}
JSON
"$report" --probe "$work/probe.json" --engine "$work/engine.json" | tee "$work/summary.txt"
# Three decode rows, two prefill rows.
for n in 1 3 64 8 40; do
    grep -Eq "^  $n +[0-9.]+ +[0-9]+ +[0-9.]+$" "$work/summary.txt" ||
        { echo "no row for $n in the summary"; exit 1; }
done
# The CPU backend's figures: shown, not judged as the GPU's.
grep -q '"device": "cpu"' "$work/engine.json"
grep -q "ran on cpu, not a GPU" "$work/summary.txt"
grep -Eq "decode batch 64, tokens/s +not measured" "$work/summary.txt"
# The engine loop runs on the KV cache dtype of the forward it is compared
# with: the default (bf16, as the workers) and an explicit f32.
for dt in auto f32; do
    args=()
    [ "$dt" = auto ] || args=(--kv-cache-dtype "$dt")
    "$engine" --model "$work/tiny" --threads 1 --steps 1 --bf16-only --batches 1,3 --prefill 8 \
        --long-context 0 --engine-loop "${args[@]}" --json "$work/loop.json" >"$work/loop.txt"
    want=$([ "$dt" = auto ] && echo bf16 || echo "$dt")
    grep -q "\"kv_cache_dtype\": \"$want\"" "$work/loop.json" ||
        { cat "$work/loop.json"; echo "forward's KV dtype is not $want"; exit 1; }
    grep -q "\"engine_loop_kv_cache_dtype\": \"$want\"" "$work/loop.json" ||
        { cat "$work/loop.json"; echo "the engine loop's KV dtype is not $want"; exit 1; }
    grep -q "engine loop (bf16 weights, KV cache $want;" "$work/loop.txt" ||
        { cat "$work/loop.txt"; echo "the engine loop's header lacks KV cache $want"; exit 1; }
done
# Bad lists are refused.
if "$engine" --batches 1,257 >/dev/null 2>&1; then echo "--batches 257 accepted"; exit 1; fi
if "$engine" --prefill 8,x >/dev/null 2>&1; then echo "--prefill 8,x accepted"; exit 1; fi
echo PASS
