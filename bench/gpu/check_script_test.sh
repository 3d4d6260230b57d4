#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# ctest gpu_check_script: bench/gpu/check.sh's logic on a machine without a GPU.
#   check_script_test.sh CHECK_SH WORKDIR TANDEM_GPU_REPORT
#  1 no GPU (nvidia-smi absent, or listing none): "no GPU visible", exit 77,
#    nothing built (the build folder is not created)
#  2 a fake nvidia-smi listing a GPU, --dry-run: the plan, every step with a
#    limit, the limits adding up to at most 480 s (8 minutes), exit 0
#  3 a fake GPU and a fake build folder (--reuse-build): a probe printing fixed
#    JSON, a gpu-labelled ctest that passes, a tandem-bench-engine without
#    --device and a tandem-decode without --kv-transfer, the real
#    tandem-gpu-report: the engine step FAILS with a clear line (never runs the
#    CPU path), the P/D step is skipped with a clear line, the summary carries
#    the probe's figures, logs land in $OUT, exit 1
#  4 two GPUs: the gpu2 step runs the gpu2-labelled tests
#  5 binaries whose --help names the flags first and then runs past a pipe's
#    buffer: the engine and P/D steps run (a help piped into grep -q died of
#    SIGPIPE under pipefail and read as a missing flag)
set -u
check=$1 work=$2 report=$3
rm -rf "$work"
mkdir -p "$work/bin"
fails=0
expect() { # expect WHAT COND...
    local what=$1
    shift
    if "$@"; then echo "ok   $what"; else echo "FAIL $what"; fails=$((fails + 1)); fi
}

# 1: no GPU.
out=$(NVIDIA_SMI="$work/bin/no-such-nvidia-smi" "$check" --build "$work/b1" 2>&1)
rc=$?
echo "$out"
expect "no nvidia-smi: exit 77" [ "$rc" -eq 77 ]
expect "no nvidia-smi: says no GPU visible" grep -q "no GPU visible" <<<"$out"
expect "no nvidia-smi: builds nothing" [ ! -e "$work/b1" ]
printf '#!/bin/sh\necho "No devices were found"\nexit 6\n' >"$work/bin/smi-none"
chmod +x "$work/bin/smi-none"
out=$(NVIDIA_SMI="$work/bin/smi-none" "$check" --dry-run 2>&1)
rc=$?
expect "nvidia-smi lists none, --dry-run: exit 77" [ "$rc" -eq 77 ]
expect "nvidia-smi lists none: says no GPU visible" grep -q "no GPU visible" <<<"$out"

# 2: a fake GPU, dry run.
printf '#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: GPU-fake)"\n' >"$work/bin/smi-one"
chmod +x "$work/bin/smi-one"
out=$(NVIDIA_SMI="$work/bin/smi-one" "$check" --dry-run --build "$work/b2" 2>&1)
rc=$?
echo "$out"
expect "dry run: exit 0" [ "$rc" -eq 0 ]
expect "dry run: names the GPU" grep -q "GPU 0: NVIDIA H200" <<<"$out"
for step in configure build ctest gpu2 probe engine pd summary; do
    expect "dry run: step $step has a limit" grep -Eq "step $step limit [0-9]+s" <<<"$out"
done
sum=$(grep -E '^  step ' <<<"$out" | grep -Eo 'limit [0-9]+s' | grep -Eo '[0-9]+' | paste -sd+ | bc)
expect "dry run: limits add up to $sum <= 480" [ "${sum:-999}" -le 480 ]
expect "dry run: builds nothing" [ ! -e "$work/b2" ]

# 3: a fake GPU and a fake build folder.
b=$work/b3
mkdir -p "$b/bench/gpu" "$b/bench/engine" "$b/decode" "$b/tests"
cat >"$b/bench/gpu/tandem-gpu-probe" <<'EOF'
#!/bin/sh
echo '{"device": {"name": "Fake GPU", "cc": "9.0", "sms": 132, "mem_bytes": 150000000000},
 "read_gbs": 4000.0, "copy_gbs": 7000.0, "d2d_gbs": 6500.0,
 "gemm": {"m": 8192, "n": 8192, "k": 8192}, "bf16_tflops": 700.0}'
EOF
cat >"$b/bench/engine/tandem-bench-engine" <<EOF
#!/bin/sh
echo "usage: tandem-bench-engine [--model DIR] [--threads N] [--steps N] [--bf16-only]" >&2
[ "\$1" = --help ] || touch "$work/engine-ran"   # measuring, not asked for its flags
exit 2
EOF
cat >"$b/decode/tandem-decode" <<'EOF'
#!/bin/sh
echo "usage: tandem-decode --model DIR [--port N]"
EOF
cp "$report" "$b/bench/gpu/tandem-gpu-report"
chmod +x "$b"/bench/gpu/* "$b/bench/engine/tandem-bench-engine" "$b/decode/tandem-decode"
cat >"$b/CTestTestfile.cmake" <<'EOF'
add_test(fake_gpu_test "/bin/true")
set_tests_properties(fake_gpu_test PROPERTIES LABELS "gpu")
add_test(fake_gpu2_test "/bin/false")
set_tests_properties(fake_gpu2_test PROPERTIES LABELS "gpu2")
EOF
out=$(OUT="$work/out" NVIDIA_SMI="$work/bin/smi-one" "$check" --build "$b" --reuse-build 2>&1)
rc=$?
echo "$out"
expect "fake run: exit 1 (the engine step failed)" [ "$rc" -eq 1 ]
expect "fake run: ctest -L gpu passed (the gpu2 test not in it)" grep -Eq "^  ctest +ok" <<<"$out"
expect "fake run: gpu2 skipped on one GPU" grep -Eq "^  gpu2 +skip .*one GPU visible" <<<"$out"
expect "fake run: probe passed" grep -Eq "^  probe +ok" <<<"$out"
expect "fake run: engine FAILS naming --device" grep -Eq "^  engine +FAIL .*no --device flag" <<<"$out"
expect "fake run: the engine bench was not run on the CPU" [ ! -e "$work/engine-ran" ]
expect "fake run: pd skipped naming --kv-transfer" grep -Eq "^  pd +skip .*--kv-transfer" <<<"$out"
expect "fake run: summary has the probe figures" grep -q "read 4000 GB/s" <<<"$out"
expect "fake run: summary has the goals, not measured" grep -q "decode batch 1, ms per token *not measured" <<<"$out"
expect "fake run: logs in \$OUT" [ -s "$work/out/probe.json" ] && [ -s "$work/out/summary.txt" ]

# 4: two GPUs: the gpu2 step runs the gpu2-labelled tests (the fake one fails).
printf '#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: GPU-a)"\necho "GPU 1: NVIDIA H200 (UUID: GPU-b)"\n' \
    >"$work/bin/smi-two"
chmod +x "$work/bin/smi-two"
out=$(OUT="$work/out2" NVIDIA_SMI="$work/bin/smi-two" "$check" --build "$b" --reuse-build 2>&1)
echo "$out"
expect "two GPUs: ctest -L gpu still passes" grep -Eq "^  ctest +ok" <<<"$out"
expect "two GPUs: gpu2 ran the gpu2 tests" grep -Eq "^  gpu2 +FAIL" <<<"$out"
expect "two GPUs: the gpu2 log names the test" grep -q fake_gpu2_test "$work/out2/gpu2.log"

# 5: flags named early in a long --help (tandem-decode's is ~10 KB): grep -q
# stops reading at its match, and a help piped into it died of SIGPIPE, which
# pipefail made read as "no such flag" (the P/D step was skipped on the H200).
b5=$work/b5
mkdir -p "$b5/bench/gpu" "$b5/bench/engine" "$b5/decode"
cp "$b/bench/gpu/tandem-gpu-probe" "$b/bench/gpu/tandem-gpu-report" "$b5/bench/gpu/"
cp "$b/CTestTestfile.cmake" "$b5/"
for bin in bench/engine/tandem-bench-engine decode/tandem-decode; do
    cat >"$b5/$bin" <<'EOF'
#!/bin/sh
if [ "$1" = --help ]; then
    echo "usage: $0 --device cuda --json FILE --kv-transfer nng|cuda-ipc|nccl"
    i=0
    while [ $i -lt 4000 ]; do echo "  --flag-$i N    a flag that pads the help past a pipe's buffer"; i=$((i + 1)); done
    exit 0
fi
exit 3
EOF
    chmod +x "$b5/$bin"
done
out=$(OUT="$work/out5" NVIDIA_SMI="$work/bin/smi-one" "$check" --build "$b5" --reuse-build 2>&1)
echo "$out"
expect "long help: the engine step ran (its --device was seen)" \
    bash -c '! grep -Eq "^  engine +FAIL .*no --(device|json) flag" <<<"$0"' "$out"
expect "long help: the P/D step ran (its --kv-transfer was seen)" \
    bash -c '! grep -Eq "^  pd +skip" <<<"$0"' "$out"

echo "$fails failure(s)"
[ "$fails" -eq 0 ]
