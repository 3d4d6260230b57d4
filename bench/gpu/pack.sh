#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/gpu/pack.sh: builds the CUDA variant here and packs what
# bench/gpu/check.sh needs on a rented GPU machine that has CUDA (nvcc, cmake,
# the toolkit's libraries under /usr/local/cuda) and Python (NCCL inside its
# site-packages), but no Debian -dev packages (libnng, libcivetweb,
# libprotobuf-c, libcjson, libpcre2, libutf8proc, libcurl ...) and no package
# registry, so it cannot configure the project itself. The pack travels beside
# the source tree (64 MiB at most), and check.sh runs from it:
#   bench/gpu/check.sh --pack PACK
#
#   PACK/bin/        the tandem-* binaries and the gpu/gpu2-label test
#                    executables (RUNPATH $ORIGIN/../lib, so <exe dir>/../lib
#                    finds the dlopen-loaded backend module)
#   PACK/lib/        every <build>/lib/libtandem-*.so (the CUDA backend modules)
#                    and the shared libraries the binaries and modules link that
#                    are not glibc, libgcc/libstdc++ or CUDA's own (cudart,
#                    cuBLAS*, NCCL, the driver: check.sh finds those on the
#                    machine and sets LD_LIBRARY_PATH)
#   PACK/src/        check.sh, gpu_steps.py, bench/pd/bench_pd.py and the
#                    integration tests and harness files the gpu tests run,
#                    at their paths in the source tree
#   PACK/tests.tsv   the gpu and gpu2 tests as ctest has them, one a line, with
#                    the build's paths rewritten to @BIN@ @SRC@ @WORK@ @PYTHON@
#                    (check.sh runs each directly; no ctest files travel)
#   PACK/PACK        what was packed (commit, CUDA architectures), no paths
# The pack is relocatable: no script, manifest or RUNPATH in it names the
# folder it was built in (checked here: a pack that does fails). Strings that
# a test executable has compiled in (TANDEM_BINARY_DIR) are listed as warnings.
#
#   bench/gpu/pack.sh [--build-dir DIR] [--no-build] [--out DIR] [--src DIR]
#                     [--max-mib N] [--jobs N]
#     --build-dir DIR  an existing CUDA build: not configured again (default:
#                      configure build-gpu-sm90, sm_90, Release)
#     --no-build       pack DIR as it is (no cmake --build)
#     --out DIR        the pack (default build-gpu-pack; emptied first)
#     --src DIR        the source tree the scripts are copied from (default
#                      this repository)
#     --max-mib N      size limit (default 64)
# Needs cmake/ctest, python3, ldd, readelf and objdump; strip when present.
# Exit 0 packed; 1 failed (the reason on one line); 2 bad usage.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
build="" out="$repo/build-gpu-pack" src="$repo" max_mib=64 nobuild=0
jobs=$(nproc 2>/dev/null || echo 2)
usage() {
    echo "usage: bench/gpu/pack.sh [--build-dir DIR] [--no-build] [--out DIR] [--src DIR]" \
        "[--max-mib N] [--jobs N]" >&2
    exit 2
}
while [ $# -gt 0 ]; do
    case "$1" in
    --build-dir | --out | --src | --max-mib | --jobs)
        [ $# -ge 2 ] || usage
        case "$1" in
        --build-dir) build=$2 ;; --out) out=$2 ;; --src) src=$2 ;;
        --max-mib) max_mib=$2 ;; --jobs) jobs=$2 ;;
        esac
        shift 2 ;;
    --no-build) nobuild=1; shift ;;
    *) usage ;;
    esac
done
die() { echo "pack.sh: $*" >&2; exit 1; }
python=${PYTHON:-python3}
ctest=${CTEST:-ctest}

# ---- configure and build -------------------------------------------------------------------
if [ -z "$build" ]; then
    build="$repo/build-gpu-sm90"
    cmake -S "$repo" -B "$build" -DTANDEM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DCMAKE_BUILD_TYPE=Release ||
        die "configure failed (cmake -S $repo -B $build ...)"
fi
[ -d "$build" ] || die "no build folder $build"
build=$(cd "$build" && pwd -P)
src=$(cd "$src" && pwd -P) || die "no source folder"
if [ "$nobuild" = 0 ]; then
    cmake --build "$build" -j"$jobs" || die "build failed (cmake --build $build)"
fi
# The source folder the build was configured from (its ctest files name it).
built_src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt" 2>/dev/null)
[ -n "$built_src" ] || built_src=$src

case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
case "$build/" in "$out"/*) die "--out $out holds the build folder" ;; esac
rm -rf "$out" && mkdir -p "$out/bin" "$out/lib" "$out/src" || die "cannot create $out"
out=$(cd "$out" && pwd -P)

# ---- the gpu tests, as ctest has them, rewritten -------------------------------------------
# Each test's command and working folder: a file the build made -> @BIN@/name
# (copied to bin/), a file of the source tree -> @SRC@/path (copied to src/),
# anything else under the build -> @WORK@/path (a scratch folder check.sh
# makes), the Python that ran it -> @PYTHON@. A path it cannot place fails.
"$ctest" --test-dir "$build" --show-only=json-v1 >"$out/ctest.json" 2>"$out/ctest.err" ||
    die "ctest --show-only failed in $build: $(head -c 300 "$out/ctest.err")"
"$python" - "$out/ctest.json" "$build" "$built_src" "$out" <<'EOF' || die "the test list could not be rewritten"
import json, os, re, sys
doc, build, src, out = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3], sys.argv[4]
FS, US = "\x1e", "\x1f"
bins, srcs, lines, bad = set(), set(), [], []

def under(p, root):
    return p == root or p.startswith(root + "/")

def place(p, what):
    if under(p, build):
        if os.path.isfile(p) and os.access(p, os.X_OK):
            bins.add(p)
            return "@BIN@/" + os.path.basename(p)
        return "@WORK@/" + os.path.relpath(p, build)
    if under(p, src):
        rel = os.path.relpath(p, src)
        if os.path.isfile(p):
            srcs.add(rel)
        return "@SRC@/" + rel
    return None

def rewrite(a, what):
    if re.match(r"^/.*python3?(\.\d+)?$", a) and os.path.basename(a).startswith("python"):
        return "@PYTHON@"
    if a.startswith("/"):
        r = place(a, what)
        if r is not None:
            return r
    m = re.match(r"^(-[-\w]+=)(/.*)$", a)
    if m and place(m.group(2), what) is not None:
        return m.group(1) + place(m.group(2), what)
    if build in a or src in a:
        bad.append("%s: %r" % (what, a))
    return a

for t in doc.get("tests", []):
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    labels = props.get("LABELS", [])
    if "gpu" not in labels and "gpu2" not in labels:
        continue
    name = t["name"]
    if not t.get("command"):  # ctest lists no command for an executable not built
        bad.append("%s: not built (ctest has no command for it)" % name)
        continue
    cmd = [rewrite(a, name) for a in t["command"]]
    if cmd[0].startswith("@WORK@"):
        bad.append("%s: %s is not built" % (name, t["command"][0]))
    cwd = rewrite(props.get("WORKING_DIRECTORY", ""), name) if props.get("WORKING_DIRECTORY") else ""
    env = [e.split("=", 1)[0] + "=" + rewrite(e.split("=", 1)[1], name) if "=" in e else e
           for e in props.get("ENVIRONMENT", [])]
    lines.append(FS.join([name, ";".join(labels), str(int(float(props.get("TIMEOUT", 300)))),
                          str(props.get("SKIP_RETURN_CODE", "")), cwd, US.join(env), US.join(cmd)]))
if bad:
    sys.exit("gpu tests that cannot travel:\n  " + "\n  ".join(bad))
with open(os.path.join(out, "tests.tsv"), "w") as f:
    f.write("".join(l + "\n" for l in lines))
with open(os.path.join(out, "files.txt"), "w") as f:
    f.write("".join("BIN %s\n" % b for b in sorted(bins)) + "".join("SRC %s\n" % s for s in sorted(srcs)))
print("pack.sh: %d gpu tests" % len(lines))
EOF
rm -f "$out/ctest.json" "$out/ctest.err"

# ---- binaries ------------------------------------------------------------------------------
# A build puts its executables at most three folders down (decode/,
# tools/mkmodel/); deeper ones are the tests' scratch (fakes among them).
{
    find "$build" -maxdepth 3 -type f -perm -u+x -name 'tandem-*' ! -name '*.so*' \
        ! -path "$build/*/CMakeFiles/*" ! -path "$build/*/check_script_test/*" \
        ! -path "$build/*check-work/*" \
        ! -path "$out/*"
    sed -n 's/^BIN //p' "$out/files.txt"
} | sort -u >"$out/bins.txt"
while IFS= read -r f; do
    name=$(basename "$f")
    [ -e "$out/bin/$name" ] && die "two binaries named $name in the build ($f)"
    cp "$f" "$out/bin/$name" || die "cannot copy $f"
done <"$out/bins.txt"
[ -n "$(ls "$out/bin")" ] || die "no tandem-* binary in $build (not built?)"
for f in "$build"/lib/libtandem-*.so*; do
    [ -f "$f" ] && { cp "$f" "$out/lib/" || die "cannot copy $f"; }
done

# ---- the shared libraries they link --------------------------------------------------------
# Not copied: glibc's, libgcc_s, libstdc++ (the machine's own) and CUDA's
# (cudart, cuBLAS*, NCCL, the driver and the rest of the toolkit: check.sh
# finds them there, under /usr/local/cuda and Python's nvidia/ packages).
is_elf() { [ "$(head -c 4 "$1" 2>/dev/null | od -An -c | tr -d ' ')" = '177ELF' ]; }
system_lib() {
    case "$1" in
    linux-vdso.so* | linux-gate.so* | ld-linux*.so* | libc.so* | libm.so* | libmvec.so* | \
        libpthread.so* | libdl.so* | librt.so* | libresolv.so* | libutil.so* | libanl.so* | \
        libnsl.so* | libgcc_s.so* | libstdc++.so*) return 0 ;;
    libcuda.so* | libcudart.so* | libcublas*.so* | libnccl.so* | libnvidia-*.so* | libnvrtc*.so* | \
        libnvJitLink.so* | libcufft*.so* | libcurand.so* | libcusparse*.so* | libcusolver*.so* | \
        libcupti.so* | libnvToolsExt.so* | libnvtx*.so*) return 0 ;;
    esac
    case "$2" in /usr/local/cuda*) return 0 ;; esac
    return 1
}
missing=""
for f in "$out"/bin/* "$out"/lib/*; do
    is_elf "$f" || continue
    while read -r name arrow path _; do
        [ "$arrow" = "=>" ] || continue
        system_lib "$name" "$path" && continue
        if [ "$path" = "not" ]; then
            missing="$missing $(basename "$f")->$name"
            continue
        fi
        [ -e "$out/lib/$name" ] || cp -L "$path" "$out/lib/$name" || die "cannot copy $path"
    done < <(ldd "$f" 2>/dev/null)
done
[ -z "$missing" ] || die "libraries not found here (ldd):$missing"

# ---- strip, and RUNPATH $ORIGIN-relative ----------------------------------------------------
if command -v strip >/dev/null 2>&1; then
    for f in "$out"/bin/* "$out"/lib/*; do
        is_elf "$f" && { strip --strip-unneeded "$f" 2>/dev/null || true; }
    done
fi
# A RUNPATH (or RPATH) the linker wrote names build and toolkit folders. It is
# rewritten in place, in the dynamic string table: bin/ -> $ORIGIN/../lib,
# lib/ -> $ORIGIN, NUL-padded to the old length (emptied when that is too short).
for f in "$out"/bin/* "$out"/lib/*; do
    is_elf "$f" || continue
    old=$(readelf -dW "$f" 2>/dev/null | sed -n 's/.*(R\(UN\)\{0,1\}PATH).*\[\(.*\)\]$/\2/p' | head -n 1)
    [ -n "$old" ] || continue
    case "$f" in "$out"/bin/*) new='$ORIGIN/../lib' ;; *) new='$ORIGIN' ;; esac
    "$python" - "$f" "$old" "$new" <<'EOF' || die "cannot rewrite the RUNPATH of $f"
import sys
path, old, new = sys.argv[1], sys.argv[2].encode(), sys.argv[3].encode()
data = bytearray(open(path, "rb").read())
if len(new) > len(old):
    new = b""
needle, n = b"\0" + old + b"\0", 0
i = data.find(needle)
while i >= 0:
    data[i + 1:i + 1 + len(old)] = new + b"\0" * (len(old) - len(new))
    n += 1
    i = data.find(needle, i + 1)
if n == 0:
    sys.exit("RUNPATH %r not found in the file" % old.decode())
open(path, "wb").write(data)
EOF
done

# ---- scripts -------------------------------------------------------------------------------
{
    printf '%s\n' bench/gpu/check.sh bench/gpu/gpu_steps.py bench/pd/bench_pd.py
    (cd "$src" && ls integration-tests/*_harness.py 2>/dev/null)
    sed -n 's/^SRC //p' "$out/files.txt"
} | sort -u | while IFS= read -r rel; do
    [ -f "$src/$rel" ] || die "$rel is not in $src"
    mkdir -p "$out/src/$(dirname "$rel")" && cp -p "$src/$rel" "$out/src/$rel" || die "cannot copy $rel"
done || exit 1
rm -f "$out/files.txt" "$out/bins.txt"
{
    echo "tandem GPU pack (bench/gpu/pack.sh; run: bench/gpu/check.sh --pack THIS_FOLDER)"
    echo "commit $(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "cuda_architectures $(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$build/CMakeCache.txt" 2>/dev/null)"
    echo "packed $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    # The newest glibc symbol version anything in it needs: the libraries came
    # from this machine, so the GPU machine's glibc must be at least this.
    for f in "$out"/bin/* "$out"/lib/*; do
        is_elf "$f" && objdump -T "$f" 2>/dev/null | grep -o 'GLIBC_[0-9][0-9.]*'
    done | sed 's/GLIBC_//' | sort -t. -k1,1n -k2,2n -u | tail -n 1 | sed 's/^/glibc_needed /'
} >"$out/PACK"

# ---- relocatable? ----------------------------------------------------------------------------
left=$(grep -rIl -F -e "$build" -e "$built_src" -e "$src" "$out" 2>/dev/null)
[ -z "$left" ] || die "files that name the build or source folder: $(echo $left)"
for f in "$out"/bin/* "$out"/lib/*; do
    is_elf "$f" || continue
    rp=$(readelf -dW "$f" 2>/dev/null | grep -E '\((RUN)?PATH\)')
    case "$rp" in *"$build"* | *"$built_src"*) die "$(basename "$f") still has $rp" ;; esac
    if grep -q -a -F "$build" "$f"; then
        echo "pack.sh: warning: $(basename "$f") has the build folder compiled in (harmless as a" \
            "fallback search path; a folder it writes to, e.g. TANDEM_BINARY_DIR, is not there)" >&2
    fi
done

# ---- size ----------------------------------------------------------------------------------
bytes=$(du -sb "$out" | cut -f1)
limit=$((max_mib * 1024 * 1024))
if [ "$bytes" -gt "$limit" ]; then
    echo "pack.sh: the pack is $((bytes / 1024 / 1024)) MiB, over the ${max_mib} MiB that can travel:" >&2
    du -sb "$out"/bin/* "$out"/lib/* | sort -rn | head -n 8 | sed 's/^/  /' >&2
    exit 1
fi
echo "pack.sh: $out: $(ls "$out/bin" | wc -l) binaries, $(ls "$out/lib" | wc -l) libraries," \
    "$(wc -l <"$out/tests.tsv") gpu tests, $((bytes / 1024)) KiB of ${max_mib} MiB"
