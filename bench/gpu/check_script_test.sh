#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# ctest gpu_check_script: bench/gpu/check.sh's logic on a machine without a GPU.
#   check_script_test.sh CHECK_SH WORKDIR TANDEM_GPU_REPORT [PACK_SH CC CTEST PYTHON3]
#  1 no GPU (nvidia-smi absent, or listing none): "no GPU visible", exit 77,
#    nothing built (the build folder is not created)
#  2 a fake nvidia-smi listing a GPU, --dry-run: the plan, every step with a
#    limit, the limits adding up to at most 480 s (8 minutes), exit 0
#  3 a fake GPU and a fake build folder (--reuse-build): a probe printing fixed
#    JSON, a gpu-labelled ctest that passes, a tandem-bench-engine without
#    --device and a tandem-decode without --kv-transfer, the real
#    tandem-gpu-report: the engine step FAILS with a clear line (never runs the
#    CPU path; engine_fast skipped), the P/D step is skipped with a clear line, the summary carries
#    the probe's figures, logs land in $OUT, exit 1
#  4 two GPUs: the gpu2 step runs the gpu2-labelled tests
#  5 binaries whose --help names the flags first and then runs past a pipe's
#    buffer: the engine and P/D steps run (a help piped into grep -q died of
#    SIGPIPE under pipefail and read as a missing flag)
#  6 pack.sh on a fake build folder (fake binaries, a real ELF whose RUNPATH
#    names the build and links a library there, the real tandem-gpu-report, a
#    fake backend module, ctest files naming the build and source folders):
#    bin/ lib/ src/ tests.tsv made; the pack moved and the build deleted: no
#    file names the old folders, the ELF runs from its new place; a size
#    limit it exceeds, or a gpu test not built, fails with a message
#  7 check.sh --pack on that moved pack with a fake GPU: every step runs and
#    passes (gpu2 skipped on one GPU; the engine bench run in both GEMM
#    modes, the summary with the cost of batch invariance): the libraries resolved through
#    LD_LIBRARY_PATH (NCCL found in Python's nvidia/nccl/lib), the tests of
#    tests.tsv run directly, pd_gpu alone, the serving bench against a worker
#    whose tdm-engine thread is measured, P/D over cuda-ipc and nng, the ids
#    check, and the summary carries the tables
# 6 and 7 run when PACK_SH is given (CC, CTEST and PYTHON3 then too).
set -u
check=$1 work=$2 report=$3 pack_sh=${4:-} cc=${5:-cc} ctest=${6:-ctest} python=${7:-python3}
python=$(command -v "$python") # the fake binaries' #! line
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
steps="configure build libs model ctest gpu2 pd_gpu probe engine engine_fast serve pd pd_nng ids summary"
for step in $steps; do
    expect "dry run: step $step has a limit" grep -Eq "step $step limit [0-9]+s" <<<"$out"
done
sum=$(grep -E '^  step ' <<<"$out" | grep -Eo 'limit [0-9]+s' | grep -Eo '[0-9]+' | paste -sd+ | bc)
expect "dry run: limits add up to $sum <= 480" [ "${sum:-999}" -le 480 ]
expect "dry run: builds nothing" [ ! -e "$work/b2" ]
out=$(NVIDIA_SMI="$work/bin/smi-one" "$check" --dry-run --reuse-build --build "$work/b2" 2>&1)
echo "$out"
sum=$(grep -E '^  step ' <<<"$out" | grep -v skipped | grep -Eo 'limit [0-9]+s' | grep -Eo '[0-9]+' |
    paste -sd+ | bc)
expect "dry run, --reuse-build: configure and build skipped" \
    [ "$(grep -c 'skipped: --reuse-build' <<<"$out")" -eq 2 ]
expect "dry run, --reuse-build: the steps that run add up to $sum <= 480" [ "${sum:-999}" -le 480 ]
out=$(NVIDIA_SMI="$work/bin/smi-one" "$check" --dry-run --pack "$work/b2" 2>&1)
expect "--pack on a folder without PACK: exit 2 naming it" \
    bash -c '[ "$1" -eq 2 ] && grep -q "is not a pack" <<<"$0"' "$out" "$?"

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
expect "fake run: engine_fast skipped, pointing at the engine step" \
    grep -Eq "^  engine_fast +skip +see the engine step" <<<"$out"
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

if [ -z "$pack_sh" ]; then
    echo "$fails failure(s) (pack.sh not tested: no PACK_SH given)"
    [ "$fails" -eq 0 ]
    exit
fi

# 6: pack.sh on a fake build folder. fs is the source tree it was configured
# from (the real check.sh and gpu_steps.py, fake P/D bench and tests), fb the
# build: fake binaries at a build's paths, ctest files naming both folders.
fs=$work/fake-src fb=$work/fake-build
mkdir -p "$fs/bench/gpu" "$fs/bench/pd" "$fs/integration-tests" "$fb/lib" "$fb/deps"
cp "$check" "$(dirname "$check")/gpu_steps.py" "$fs/bench/gpu/"
echo "# the harness the tests import" >"$fs/integration-tests/proc_harness.py"
# The fake P/D bench: the binaries where a build has them, JSON as bench_pd.py's.
cat >"$fs/bench/pd/bench_pd.py" <<'EOF'
import argparse, json, os, sys
ap = argparse.ArgumentParser()
for f in ("--build", "--sizes", "--reps", "--model", "--json", "--worker-args"):
    ap.add_argument(f)
a = ap.parse_args()
for b in ("router/tandem-router", "prefill/tandem-prefill", "decode/tandem-decode"):
    if not os.access(os.path.join(a.build, b), os.X_OK):
        sys.exit("no %s under %s" % (b, a.build))
kv = a.worker_args.split("--kv-transfer ")[1].split()[0]
print("tokens  prefill_s  transfer_s  transfer/prefill  kv_window_s  ttft_direct_s  ttft_pd_s  kv_bytes")
print("   512      0.010      0.0001            0.0100       0.0010          0.012      0.013  1000 %s" % kv)
print("goal: transfer/prefill <= 0.02")
pts = [{"tokens": n, "ttft_direct_s": 0.012, "ttft_pd_s": 0.013, "transfer_s": 0.0001,
        "prefill_s": 0.01, "kv_window_s": 0.001, "kv_bytes": 1e6} for n in (512, 2048)]
json.dump({"transport": kv, "reps": 3, "sizes": pts}, open(a.json, "w"))
EOF
# The fake integration tests: each binary they are given runs, the workdir is
# writable, and no argument names the build or source folder it was packed
# from (FAKE_OLD_DIRS: the script itself must not name them either).
cat >"$fs/integration-tests/test_pd_gpu.py" <<'EOF'
import os, sys
args = sys.argv[1:]
for i, a in enumerate(args):
    if any(d and d in a for d in os.environ["FAKE_OLD_DIRS"].split(":")):
        sys.exit("an argument names the old folder: " + a)
    if a in ("--router", "--prefill", "--decode", "--mkmodel") and not os.access(args[i + 1], os.X_OK):
        sys.exit("not runnable: " + args[i + 1])
    if a == "--workdir":
        os.makedirs(args[i + 1], exist_ok=True)
        open(os.path.join(args[i + 1], "ran"), "w").write(" ".join(args))
print("test_pd_gpu ok", args)
EOF
sed 's/test_pd_gpu ok/test_decode_walkthrough ok/' "$fs/integration-tests/test_pd_gpu.py" \
    >"$fs/integration-tests/test_decode_walkthrough.py"
mkdir -p "$fb/bench/gpu" "$fb/bench/engine" "$fb/bench/serve" "$fb/decode" "$fb/prefill" \
    "$fb/router" "$fb/tools/mkmodel" "$fb/tools/generate" "$fb/common/engine/model/cuda"
cp "$b/bench/gpu/tandem-gpu-probe" "$fb/bench/gpu/"
cp "$report" "$fb/bench/gpu/tandem-gpu-report" # a real ELF: its libraries (cJSON ...) travel
long_help='i=0; while [ $i -lt 3000 ]; do echo "  --flag-$i N  pads the help past a pipe buffer"; i=$((i + 1)); done'
# Its batch-1 step: 0.5 ms batch invariant, 0.4 ms with --no-batch-invariant.
cat >"$fb/bench/engine/tandem-bench-engine" <<EOF
#!/bin/sh
if [ "\$1" = --help ]; then echo "usage: tandem-bench-engine [--model DIR] --device D --json FILE [--batch-invariant | --no-batch-invariant]"; $long_help; exit 0; fi
bi=true b1=0.0005
for a in "\$@"; do [ "\$a" = --no-batch-invariant ] && bi=false b1=0.0004; done
while [ \$# -gt 1 ]; do [ "\$1" = --json ] && out=\$2; shift; done
echo '{"device": "cuda", "batch_invariant": '\$bi', "weight_bytes": 1000000000,
 "decode": [{"batch": 1, "seconds": '\$b1'}, {"batch": 64, "seconds": 0.002}],
 "prefill": [{"tokens": 2048, "seconds": 0.01, "flops": 2.8e12}]}' >"\$out"
EOF
# The fake decode worker: listens, answers /health, and runs a thread named
# tdm-engine that spends 0.3 s of CPU on each request before it is answered;
# its /metrics has that time as tandem:engine_thread_seconds_total's forward
# phase.
cat >"$fb/decode/tandem-decode" <<EOF
#!$python
import ctypes, http.server, sys, threading, time
if "--help" in sys.argv:
    print("usage: tandem-decode --model DIR --device D --kv-transfer nng|cuda-ipc --gpu-memory-utilization F")
    for i in range(3000):
        print("  --flag-%d N  pads the help past a pipe buffer" % i)
    sys.exit(0)
busy = threading.Event()
forward_s = [0.0]
def engine():
    ctypes.CDLL(None).prctl(15, b"tdm-engine", 0, 0, 0)  # PR_SET_NAME
    while True:
        busy.wait()
        t = time.monotonic()
        while time.monotonic() - t < 0.3:  # a request's compute: 30 clock ticks
            pass
        forward_s[0] += time.monotonic() - t
        busy.clear()
threading.Thread(target=engine, daemon=True).start()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/metrics":
            self.send_response(200)
            self.end_headers()
            for ph, v in (("forward", forward_s[0]), ("wait", 0.0)):
                self.wfile.write(('tandem:engine_thread_seconds_total{model_name="x",engine="0",'
                                  'phase="%s"} %.6f\\n' % (ph, v)).encode())
            return
        busy.set()
        while busy.is_set():
            time.sleep(0.01)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')
    def log_message(self, *a):
        pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print("ready model=x listening=http://127.0.0.1:%d args=%s" % (s.server_port, " ".join(sys.argv[1:])),
      file=sys.stderr, flush=True)
s.serve_forever()
EOF
# The fake serving bench: one request to the worker, vLLM's keys in --json.
cat >"$fb/bench/serve/tandem-bench" <<EOF
#!$python
import json, sys, urllib.request
a = sys.argv
url, out, c = a[a.index("--base-url") + 1], a[a.index("--json") + 1], int(a[a.index("--max-concurrency") + 1])
urllib.request.urlopen(url + "/health", timeout=10).read()
json.dump({"completed": 2 * c, "output_throughput": 100.0 * c, "median_ttft_ms": 5.0,
           "p99_ttft_ms": 9.0, "median_itl_ms": 1.5, "p99_itl_ms": 2.5}, open(out, "w"))
print("Output token throughput (tok/s): %.1f" % (100.0 * c))
EOF
cat >"$fb/tools/mkmodel/tandem-mkmodel" <<'EOF'
#!/bin/sh
while [ $# -gt 1 ]; do [ "$1" = --out ] && out=$2; shift; done
mkdir -p "$out" && echo '{"vocab_size": 1000}' >"$out/config.json" && : >"$out/model.safetensors"
EOF
cat >"$fb/tools/generate/tandem-generate" <<EOF
#!/bin/sh
if [ "\$1" = --help ]; then echo "usage: tandem-generate --model DIR --prompt-ids 1,2 --device cpu|cuda --chunk N --json"; $long_help; exit 0; fi
echo '{"ids": [5, 6, 7], "text": "x"}'
EOF
for f in router/tandem-router prefill/tandem-prefill; do
    printf '#!/bin/sh\necho "usage: %s --device D --kv-transfer T"\n' "$f" >"$fb/$f"
done
printf '#!/bin/sh\necho "cuda ops on the GPU: ok"\n' >"$fb/common/engine/model/cuda/cuda_ops_gpu_test"
printf '#!/bin/sh\nexit 1\n' >"$fb/common/engine/model/cuda/unit_only_test"
chmod +x "$fb"/bench/*/tandem-* "$fb"/decode/* "$fb"/prefill/* "$fb"/router/* "$fb"/tools/*/* \
    "$fb"/common/engine/model/cuda/*
# A real ELF linking a library of the build folder through a RUNPATH naming it,
# and a backend module in lib/.
printf 'int fakedep(void) { return 42; }\n' >"$work/fakedep.c"
printf '#include <stdio.h>\nint fakedep(void);\nint main(void) { printf("fakedep %%d\\n", fakedep()); return 0; }\n' \
    >"$work/fakeelf.c"
printf 'int tdm_backend_init(void) { return 0; }\n' >"$work/fakemod.c"
"$cc" -shared -fPIC -o "$fb/deps/libfakedep.so" "$work/fakedep.c" &&
    "$cc" -o "$fb/tools/tandem-fake-elf" "$work/fakeelf.c" -L"$fb/deps" -lfakedep \
        -Wl,-rpath,"$fb/deps:/usr/local/cuda/lib64" -Wl,--enable-new-dtags &&
    "$cc" -shared -fPIC -o "$fb/lib/libtandem-cuda.so" "$work/fakemod.c"
expect "pack: the fake ELF and libraries compiled" [ -x "$fb/tools/tandem-fake-elf" ]
echo "CMAKE_HOME_DIRECTORY:INTERNAL=$fs" >"$fb/CMakeCache.txt"
echo "CMAKE_CUDA_ARCHITECTURES:STRING=90" >>"$fb/CMakeCache.txt"
cat >"$fb/CTestTestfile.cmake" <<EOF
add_test(cuda_ops_gpu_test "$fb/common/engine/model/cuda/cuda_ops_gpu_test")
set_tests_properties(cuda_ops_gpu_test PROPERTIES LABELS "gpu" SKIP_RETURN_CODE "77" TIMEOUT "60" WORKING_DIRECTORY "$fb/common/engine/model/cuda")
add_test(unit_only_test "$fb/common/engine/model/cuda/unit_only_test")
set_tests_properties(unit_only_test PROPERTIES LABELS "unit")
add_test(decode_walkthrough_cuda "$(command -v "$python")" "$fs/integration-tests/test_decode_walkthrough.py" "--decode" "$fb/decode/tandem-decode" "--mkmodel" "$fb/tools/mkmodel/tandem-mkmodel" "--workdir" "$fb/integration-tests/work-cuda" "--server-flags" "--device cuda")
set_tests_properties(decode_walkthrough_cuda PROPERTIES LABELS "gpu" SKIP_RETURN_CODE "77" TIMEOUT "300")
add_test(pd_gpu "$(command -v "$python")" "$fs/integration-tests/test_pd_gpu.py" "--kv-transfer" "cuda-ipc" "--router" "$fb/router/tandem-router" "--prefill" "$fb/prefill/tandem-prefill" "--decode" "$fb/decode/tandem-decode" "--mkmodel" "$fb/tools/mkmodel/tandem-mkmodel" "--workdir" "$fb/integration-tests/work-pd-gpu" "--deadline" "280")
set_tests_properties(pd_gpu PROPERTIES LABELS "gpu" SKIP_RETURN_CODE "77" TIMEOUT "300")
add_test(pd_gpu2 "$(command -v "$python")" "$fs/integration-tests/test_pd_gpu.py" "--kv-transfer" "nccl" "--workdir" "$fb/integration-tests/work-pd-gpu2")
set_tests_properties(pd_gpu2 PROPERTIES LABELS "gpu2" SKIP_RETURN_CODE "77" TIMEOUT "300")
EOF
out=$(CTEST=$ctest PYTHON=$python "$pack_sh" --build-dir "$fb" --no-build --src "$fs" \
    --out "$work/pack-here" 2>&1)
rc=$?
echo "$out"
p=$work/pack-there
expect "pack: exit 0" [ "$rc" -eq 0 ]
expect "pack: 4 gpu tests listed (the unit test left out)" [ "$(wc -l <"$work/pack-here/tests.tsv")" -eq 4 ]
mv "$work/pack-here" "$p"
mv "$fb" "$work/fake-build-gone" # the build's folder no longer exists
for f in bin/tandem-decode bin/tandem-gpu-report bin/tandem-fake-elf bin/cuda_ops_gpu_test \
    lib/libtandem-cuda.so lib/libfakedep.so src/bench/gpu/check.sh src/bench/gpu/gpu_steps.py \
    src/bench/pd/bench_pd.py src/integration-tests/test_pd_gpu.py \
    src/integration-tests/proc_harness.py PACK; do
    expect "pack: has $f" [ -e "$p/$f" ]
done
expect "pack: no unit-only test" [ ! -e "$p/bin/unit_only_test" ]
expect "pack: cJSON, which tandem-gpu-report links, is in lib/" bash -c 'ls "$0"/lib/libcjson.so* >/dev/null' "$p"
expect "pack: glibc and CUDA libraries are not" bash -c '! ls "$0"/lib/ | grep -Eq "^lib(c|m|stdc\+\+|gcc_s|cudart|cublas.*|nccl)\.so"' "$p"
expect "pack: no file names the build folder" bash -c '! grep -rl -a -F "$1" "$0"' "$p" "$fb"
expect "pack: no file names the source folder" bash -c '! grep -rl -a -F "$1" "$0"' "$p" "$fs"
expect "pack: the ELF's RUNPATH is \$ORIGIN/../lib" \
    bash -c 'readelf -dW "$0" | grep -Eq "PATH\).*\[\\\$ORIGIN/\.\./lib\]"' "$p/bin/tandem-fake-elf"
expect "pack: the ELF runs from the moved pack" \
    bash -c '[ "$(env -u LD_LIBRARY_PATH "$0")" = "fakedep 42" ]' "$p/bin/tandem-fake-elf"
expect "pack: tests.tsv in placeholders" grep -q "@BIN@/cuda_ops_gpu_test" "$p/tests.tsv"
mv "$work/fake-build-gone" "$fb"
out=$(CTEST=$ctest PYTHON=$python "$pack_sh" --build-dir "$fb" --no-build --src "$fs" \
    --out "$work/pack-small" --max-mib 0 2>&1)
rc=$?
echo "$out"
expect "pack over its size limit: exit 1" [ "$rc" -eq 1 ]
expect "pack over its size limit: says so" grep -q "over the 0 MiB that can travel" <<<"$out"
rm -rf "$work/pack-small"
cat >>"$fb/CTestTestfile.cmake" <<EOF
add_test(kvx_cuda_test "$fb/common/engine/kvx/kvx_cuda_test")
set_tests_properties(kvx_cuda_test PROPERTIES LABELS "gpu")
EOF
out=$(CTEST=$ctest PYTHON=$python "$pack_sh" --build-dir "$fb" --no-build --src "$fs" \
    --out "$work/pack-small" 2>&1)
rc=$?
echo "$out"
expect "pack with a gpu test not built: exit 1" [ "$rc" -eq 1 ]
expect "pack with a gpu test not built: names it" grep -q "kvx_cuda_test: .*not built" <<<"$out"
rm -rf "$work/pack-small"
mv "$fb" "$work/fake-build-gone"

# 7: check.sh from the moved pack: every step runs and passes.
mkdir -p "$work/site/nvidia/nccl/lib"
: >"$work/site/nvidia/nccl/lib/libnccl.so.2"
out=$(OUT="$work/out7" FAKE_OLD_DIRS="$fb:$fs" PYTHONPATH="$work/site" TANDEM_PYTHON3=$python NVIDIA_SMI="$work/bin/smi-one" \
    "$p/src/bench/gpu/check.sh" --pack "$p" 2>&1)
rc=$?
echo "$out"
expect "pack run: exit 0" [ "$rc" -eq 0 ]
for step in libs model ctest pd_gpu probe engine engine_fast serve pd pd_nng ids; do
    expect "pack run: step $step ok" grep -Eq "^  $step +ok" <<<"$out"
done
expect "pack run: configure and build skipped (a pack)" \
    [ "$(grep -Ec '^  (configure|build) +skip +running from a pack' <<<"$out")" -eq 2 ]
expect "pack run: gpu2 skipped on one GPU" grep -Eq "^  gpu2 +skip .*one GPU visible" <<<"$out"
expect "pack run: LD_LIBRARY_PATH has the pack's lib/ and NCCL's folder" \
    bash -c 'grep -q "^LD_LIBRARY_PATH=$1/lib:.*$2" "$0"' "$work/out7/libs.log" "$p" "$work/site/nvidia/nccl/lib"
expect "pack run: TANDEM_BACKEND_PATH is the pack's lib/" grep -q "^TANDEM_BACKEND_PATH=$p/lib$" "$work/out7/libs.log"
expect "pack run: ctest ran cuda_ops_gpu_test and the walkthrough, not pd_gpu" \
    bash -c 'grep -Eq "test cuda_ops_gpu_test +ok" "$0" && grep -Eq "test decode_walkthrough_cuda +ok" "$0" &&
        ! grep -q "test pd_gpu " "$0"' "$work/out7/ctest.log"
expect "pack run: pd_gpu ran alone, its workdir in the pack's scratch" \
    bash -c 'grep -Eq "test pd_gpu +ok" "$0" && [ -e "$1/check-work/tests/integration-tests/work-pd-gpu/ran" ]' \
    "$work/out7/pd_gpu.log" "$p"
expect "pack run: the serving bench at concurrency 1, 64, 256" \
    bash -c 'for c in 1 64 256; do grep -Eq "^ +$c +[0-9]+ " <<<"$0" || exit 1; done' "$out"
expect "pack run: the engine thread's share was measured" \
    "$python" -c 'import json, sys; r = json.load(open(sys.argv[1]))["runs"]
sys.exit(0 if len(r) == 3 and all(x["engine_core_share"] is not None and x["engine_core_share"] > 0 for x in r) else 1)' \
    "$work/out7/serve.json"
expect "pack run: the engine thread's phases were read from /metrics" \
    "$python" -c 'import json, sys; r = json.load(open(sys.argv[1]))["runs"]
sys.exit(0 if len(r) == 3 and all(x["engine_phases"] and x["engine_phases"]["forward"] > 0 and
                                  x["engine_phases"]["wait"] == 0 for x in r) else 1)' \
    "$work/out7/serve.json"
expect "pack run: the phases in the serving table" grep -q "engine thread's wall by phase: forward" "$work/out7/serve.log"
expect "pack run: the worker got --device cuda" grep -q "worker: .*--device cuda" "$work/out7/serve.log"
expect "pack run: P/D over cuda-ipc in the report, nng in the tables" \
    bash -c 'grep -q "cuda-ipc" "$0/pd.json" && grep -q "P/D over nng" "$0/summary.txt" &&
        grep -q "1000 nng" "$0/summary.txt"' "$work/out7"
expect "pack run: ids equal at 1000 to 3500 tokens" \
    bash -c 'for n in 1000 2048 2049 3000 3500; do grep -Eq "^ +$n tokens, chunk +256: equal" "$0" || exit 1; done' \
    "$work/out7/summary.txt"
expect "pack run: no LD_PRELOAD reached the steps" bash -c '! grep -rq "LD_PRELOAD=" "$0"' "$work/out7"
expect "pack run: the engine step ran --batch-invariant, engine_fast --no-batch-invariant" \
    bash -c 'grep -q "\"batch_invariant\": true" "$0/engine.json" &&
        grep -q "\"batch_invariant\": false" "$0/engine_fast.json"' "$work/out7"
expect "pack run: the summary has the cost of batch invariance and the rule's verdict" \
    bash -c 'grep -Eq "^  1 +0.500 +0.400 +\+25.0%" "$0" &&
        grep -q "make --no-batch-invariant the default" "$0"' "$work/out7/summary.txt"

echo "$fails failure(s)"
[ "$fails" -eq 0 ]
