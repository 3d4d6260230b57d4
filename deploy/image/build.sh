#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds Tandem's CPU container image (deploy/Dockerfile) with buildah, without
# Docker or Docker Hub, and smoke-tests it.
#
#   bash deploy/image/build.sh [options]
#
#   (default)               the full two-stage build: the build stage compiles
#                           the services in the image (about a minute on 2 cores),
#                           the runtime stage installs their shared libraries
#   --runtime-from BUILD    only the runtime stage, over the service binaries of
#                           an existing Release or RelWithDebInfo CMake build
#                           made on Debian bookworm (stripped copies; nothing is
#                           compiled): what .ci/run does after the README build
#   --tag NAME              image name (default tandem:<project version>, stored
#                           as localhost/tandem:<version>)
#   --refresh-base          remake the base image even if the cached one is fresh
#   --no-cache              rebuild every layer (the full build caches its layers)
#   --no-smoke              build only
#   -h, --help              this text
#
# The base, debian:bookworm-slim, is made from Debian's archive with mmdebstrap
# (variant minbase, merged /usr, no docs/man/locales, no apt caches: the shape
# of Docker's official slim image), kept as a tarball in
# ${XDG_CACHE_HOME:-~/.cache}/tandem/image/ and reused for 30 days, and imported
# into buildah's store as localhost/debian:bookworm-slim, which the build uses
# with --pull=never (the Dockerfile's ARG DEBIAN_IMAGE).
#
# The smoke test runs in the image (buildah run): `tandem-decode --help`, then
# the seed scenario: tandem-mkmodel writes the demo model, tandem-decode serves
# it, a streamed completion ends with `data: [DONE]`, vllm:num_requests_running
# reads 0 before, 1 during a long stream and 0 after; and the image's
# uncompressed size stays under TANDEM_IMAGE_MAX_MB (default 150).
#
# Runs as root, or as a user with subordinate ids in /etc/subuid and
# /etc/subgid (it runs itself again under `buildah unshare`). Nothing is
# written into the clone.
#
# Environment: DEBIAN_MIRROR, DEBIAN_SECURITY_MIRROR (the archive the base and
# the runtime packages come from), BUILDAH_ISOLATION (default chroot: needs no
# OCI runtime or nested namespaces; buildah's own default, oci, fails on the
# development machines: crun cannot use their hybrid cgroups), STORAGE_DRIVER (buildah's;
# when the default store cannot be used, the script falls back to vfs in
# ~/.cache/tandem/image/storage and says so).
#
# Exit status: 0 built (and smoke-tested), 1 failed, 2 usage, 77 skipped: the
# tools are missing or cannot run here (the message says which and why).
set -euo pipefail

usage() { sed -n '3,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }

repo=$(cd "$(dirname "$0")/../.." && pwd)
args=("$@")
runtime_from=""
tag=""
refresh_base=0
no_cache=()
smoke=1
while [ $# -gt 0 ]; do
    case "$1" in
    --runtime-from) [ $# -ge 2 ] || { usage >&2; exit 2; }; runtime_from=$2; shift 2 ;;
    --tag) [ $# -ge 2 ] || { usage >&2; exit 2; }; tag=$2; shift 2 ;;
    --refresh-base) refresh_base=1; shift ;;
    --no-cache) no_cache=(--no-cache); shift ;;
    --no-smoke) smoke=0; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "build.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
done

say() { echo "image: $*"; }
# A signal (CI's timeout, Ctrl-C) runs the EXIT trap: the server and the
# working container are cleaned up.
trap 'exit 143' TERM INT
skip() { echo "image: SKIPPED: $*" >&2; exit 77; }
die() { echo "image: FAILED: $*" >&2; exit 1; }

version=$(sed -n 's/^project(tandem VERSION \([0-9.]*\).*/\1/p' "$repo/CMakeLists.txt")
[ -n "$tag" ] || tag="tandem:${version:-latest}"
case "$tag" in */*) ;; *) tag="localhost/$tag" ;; esac
cache="${XDG_CACHE_HOME:-$HOME/.cache}/tandem/image"
base_tar="$cache/debian-bookworm-slim.tar"
base_image=localhost/debian:bookworm-slim
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security_mirror=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
max_mb=${TANDEM_IMAGE_MAX_MB:-150}
export BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}
# The service binaries (the Dockerfile's build targets), as paths in a CMake build tree.
SERVICE_BINARIES="router/tandem-router prefill/tandem-prefill decode/tandem-decode
    tools/download/tandem-download tools/mkmodel/tandem-mkmodel"

# ---- tools --------------------------------------------------------------------------
command -v buildah >/dev/null || skip "buildah is not installed (Debian: apt-get install buildah mmdebstrap)"
command -v curl >/dev/null || skip "curl is not installed (the smoke test's client)"
mkdir -p "$cache"

# Not root: buildah's mounts and mmdebstrap's chroot need a user namespace with
# the user's subordinate ids (/etc/subuid, /etc/subgid); buildah unshare makes
# one and runs this script again inside it.
if [ "$(id -u)" -ne 0 ] && [ -z "${_CONTAINERS_USERNS_CONFIGURED:-}" ]; then
    why=$(buildah unshare true 2>&1) ||
        skip "not root, and buildah cannot make a user namespace here: $why"
    exec buildah unshare -- bash "$0" "${args[@]}"
fi

# buildah's own store when it works here, else vfs in the cache (no overlay
# mounts, e.g. inside an unprivileged container). A probe container shows it.
probe_store() {
    local c
    c=$(buildah from scratch 2>&1) || { echo "$c" | tr '\n' ' '; return 1; }
    buildah mount "$c" >/dev/null 2>&1 || { buildah rm "$c" >/dev/null 2>&1; echo "cannot mount a container"; return 1; }
    buildah rm "$c" >/dev/null
}
if ! why=$(probe_store); then
    [ -z "${STORAGE_DRIVER:-}" ] || skip "buildah cannot use its store with STORAGE_DRIVER=$STORAGE_DRIVER: $why"
    say "buildah's default store is unusable here ($why): using vfs in $cache/storage"
    cat >"$cache/storage.conf" <<EOF
[storage]
driver = "vfs"
graphroot = "$cache/storage"
runroot = "$cache/storage-run"
rootless_storage_path = "$cache/storage"
EOF
    export CONTAINERS_STORAGE_CONF="$cache/storage.conf"
    why=$(probe_store) || skip "buildah cannot run here, even with vfs storage: $why"
    say "(podman and buildah find the image with CONTAINERS_STORAGE_CONF=$cache/storage.conf)"
fi

# ---- base image: debian:bookworm-slim from Debian's archive ------------------------
# The apt settings of Docker's slim images: no package caches left in a layer.
APT_CLEAN='DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";'

make_base_tar() {
    command -v mmdebstrap >/dev/null ||
        skip "mmdebstrap is not installed and no cached base in $base_tar (apt-get install mmdebstrap)"
    say "making the debian:bookworm-slim base with mmdebstrap from $mirror (about half a minute)"
    local t0=$SECONDS
    # shellcheck disable=SC2016 # mmdebstrap passes the chroot to a hook as $1
    mmdebstrap --quiet --variant=minbase --format=tar --skip=output/dev \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/groff/*' --dpkgopt='path-exclude=/usr/share/linda/*' \
        --dpkgopt='path-exclude=/usr/share/lintian/*' \
        --aptopt='Acquire::Languages "none"' \
        --customize-hook="printf '%s\n' '$APT_CLEAN' >\"\$1/etc/apt/apt.conf.d/docker-clean\"" \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/log/*.log' \
        bookworm "$base_tar.tmp" \
        "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
        "deb $security_mirror bookworm-security main" ||
        { rm -f "$base_tar.tmp"; die "mmdebstrap failed (is $mirror reachable?)"; }
    mv "$base_tar.tmp" "$base_tar"
    say "base made in $((SECONDS - t0)) s: $base_tar ($(($(stat -c %s "$base_tar") / 1000000)) MB)"
}

if [ "$refresh_base" = 1 ] || [ ! -s "$base_tar" ] || [ -n "$(find "$base_tar" -mtime +30)" ]; then
    make_base_tar
else
    say "reusing the base $base_tar (made $(date -r "$base_tar" +%F); --refresh-base remakes it)"
fi
# Import it unless the store already holds this very tarball (by its sha256).
base_sum=$(sha256sum "$base_tar" | cut -d' ' -f1)
have_sum=$(buildah inspect --type image --format '{{index .OCIv1.Config.Labels "tandem.base.tar-sha256"}}' \
    "$base_image" 2>/dev/null || true)
if [ "$have_sum" != "$base_sum" ]; then
    say "importing the base into buildah's store as $base_image"
    c=$(buildah from scratch)
    buildah add --quiet "$c" "$base_tar" / >/dev/null
    buildah config --cmd '["bash"]' --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --label "tandem.base.tar-sha256=$base_sum" "$c"
    buildah commit --quiet --rm "$c" "$base_image" >/dev/null
fi

# ---- build ---------------------------------------------------------------------------
# Docker format: the OCI format drops SHELL (and with it pipefail). Layers are
# cached (a rebuild reuses the package installs; --no-cache refreshes them).
# --force-rm: buildah 1.28 leaves the alias stage's container behind without it.
build_args=(--pull=never --format docker --layers --force-rm "${no_cache[@]}" --file "$repo/deploy/Dockerfile"
    --build-arg "DEBIAN_IMAGE=$base_image" --tag "$tag")
old_id=$(buildah images --quiet --no-trunc "$tag" 2>/dev/null || true)
t0=$SECONDS
if [ -n "$runtime_from" ]; then
    # A context holding only bin/: the runtime stage takes the stripped binaries
    # from it (BINARIES=prebuilt) and nothing is compiled.
    [ -f "$runtime_from/CMakeCache.txt" ] || die "$runtime_from is not a CMake build folder"
    build_type=$(sed -n 's/^CMAKE_BUILD_TYPE:STRING=//p' "$runtime_from/CMakeCache.txt")
    sanitize=$(sed -n 's/^TANDEM_SANITIZE:STRING=//p' "$runtime_from/CMakeCache.txt")
    case "$build_type" in Release | RelWithDebInfo) ;;
    *) die "$runtime_from is a $build_type build: the image takes Release or RelWithDebInfo (both -O2)" ;;
    esac
    [ -z "$sanitize" ] || die "$runtime_from is a sanitizer build ($sanitize): not for an image"
    # shellcheck disable=SC1091
    codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    [ "$codename" = bookworm ] ||
        die "this machine is not Debian bookworm ($codename): its binaries would not fit the image's libraries"
    ctx=$(mktemp -d "$cache/context.XXXXXX")
    trap 'rm -rf "$ctx"' EXIT
    mkdir "$ctx/bin"
    for b in $SERVICE_BINARIES; do
        [ -x "$runtime_from/$b" ] || die "$runtime_from/$b is not built (cmake --build $runtime_from)"
        install -m 0755 -s "$runtime_from/$b" "$ctx/bin/"
    done
    say "building $tag: the runtime stage over $runtime_from's $build_type binaries"
    buildah build "${build_args[@]}" --build-arg BINARIES=prebuilt --target runtime "$ctx" ||
        die "buildah build failed"
else
    say "building $tag: both stages (the services are compiled in the image)"
    # BINARIES=build is the Dockerfile's default, named here because buildah
    # 1.28 resolves an ARG in FROM for skipping unused stages only from
    # --build-arg (without it the build stage is skipped and "build" is unknown).
    buildah build "${build_args[@]}" --build-arg BINARIES=build --ignorefile "$repo/deploy/Dockerfile.dockerignore" "$repo" ||
        die "buildah build failed"
fi
say "built $tag in $((SECONDS - t0)) s"
# The image this tag named before, unless something else still uses it.
new_id=$(buildah images --quiet --no-trunc "$tag")
[ -z "$old_id" ] || [ "$old_id" = "$new_id" ] || buildah rmi "$old_id" >/dev/null 2>&1 || true

# ---- size and smoke test -------------------------------------------------------------
t0=$SECONDS
ctr=$(buildah from --pull=never "$tag")
server=""
log=""
cleanup() {
    [ -z "$server" ] || { kill -TERM "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; }
    buildah rm "$ctr" >/dev/null 2>&1 || true
    [ -z "${ctx:-}" ] || rm -rf "$ctx"
    [ -z "$log" ] || rm -f "$log" "$log.long"
}
trap cleanup EXIT
# The size: the image's file tree as a container mounts it, uncompressed.
size=$(du -sxb "$(buildah mount "$ctr")" | cut -f1)
buildah umount "$ctr" >/dev/null
size_mb=$(((size + 999999) / 1000000))
say "size: $size_mb MB uncompressed ($size bytes, MB = 10^6; goal < $max_mb MB)"
[ "$smoke" = 1 ] || exit 0
[ "$size_mb" -lt "$max_mb" ] || die "the image is $size_mb MB, over the $max_mb MB goal"

in_image() { buildah run "$ctr" -- "$@"; }

help=$(in_image tandem-decode --help 2>&1) || die "tandem-decode --help failed in the image: $help"
grep -q '^usage: tandem-decode' <<<"$help" || die "tandem-decode --help printed: $help"
say "ok: tandem-decode --help runs in the image (user $(in_image id -u))"

in_image tandem-mkmodel --preset demo --out /home/tandem/demo >/dev/null || die "tandem-mkmodel failed"
# chroot isolation shares the host's network: any free port on loopback, read
# from the ready line.
log=$(mktemp "$cache/decode-log.XXXXXX")
buildah run "$ctr" -- tandem-decode --model /home/tandem/demo --host 127.0.0.1 --port 0 >"$log" 2>&1 &
server=$!
url=""
for _ in $(seq 100); do
    url=$(sed -n 's/.* ready .*listening=\(http:[^ ]*\).*/\1/p' "$log" | head -1)
    [ -z "$url" ] || break
    kill -0 "$server" 2>/dev/null || { cat "$log" >&2; die "tandem-decode exited in the image"; }
    sleep 0.2
done
[ -n "$url" ] || { cat "$log" >&2; die "tandem-decode not ready after 20 s"; }
curl -sf "$url/health" >/dev/null || { cat "$log" >&2; die "$url/health does not answer 200"; }
running() { curl -sf "$url/metrics" | sed -n 's/^vllm:num_requests_running{.*} \([0-9.e+]*\)$/\1/p' | head -1; }
[ "$(running)" = 0 ] || die "vllm:num_requests_running is '$(running)' before any request, expected 0"

out=$(curl -sN "$url/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt":"hello","max_tokens":50,"stream":true}')
chunks=$(grep -c '^data: {' <<<"$out" || true)
[ "$(grep '^data: ' <<<"$out" | tail -1)" = "data: [DONE]" ] ||
    die "the stream does not end with data: [DONE]: $(tail -c 300 <<<"$out")"
[ "$chunks" -ge 2 ] || die "the stream carried $chunks chunks: $out"
say "ok: a streamed completion: $chunks chunks, then data: [DONE]"

# A long stream: the gauge reads 1 while it runs.
curl -sN "$url/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt":"hello","max_tokens":2000,"ignore_eos":true,"stream":true}' >"$log.long" &
long=$!
seen=""
for _ in $(seq 200); do
    r=$(running)
    [ "$r" != 1 ] || { seen=1; break; }
    kill -0 "$long" 2>/dev/null || break
    sleep 0.05
done
wait "$long" || die "the long stream failed"
tail -1 "$log.long" | grep -q '^data: \[DONE\]' || grep -q '^data: \[DONE\]' "$log.long" ||
    die "the long stream does not end with data: [DONE]"
[ "$seen" = 1 ] || die "vllm:num_requests_running never read 1 during a long stream"
[ "$(running)" = 0 ] || die "vllm:num_requests_running is '$(running)' after the streams, expected 0"
say "ok: vllm:num_requests_running 0 before, 1 during a stream, 0 after"
kill -TERM "$server"
wait "$server" || true
server=""
say "smoke test passed in $((SECONDS - t0)) s: $tag ($size_mb MB)"
