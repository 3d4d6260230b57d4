#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Runs one deploy/ test script under Node.js (ctest's command for deploy_*):
#   run_node_test.sh NODE NPM WORKDIR SCRIPT [ARGS...]
# Skips (exit 77, a SKIPPED line) when Node.js is absent. Installs the pinned
# packages (npm ci from package-lock.json) into deploy/tests/node_modules when
# they are missing or older than the lock file, under a lock so tests that
# ctest runs in parallel install once.
set -eu
node=$1 npm=$2 workdir=$3 script=$4
shift 4
here=$(cd "$(dirname "$0")" && pwd)
if [ -z "$node" ] || ! command -v "$node" >/dev/null 2>&1; then
    echo "SKIPPED: node not found (Debian: apt-get install nodejs npm)"
    exit 77
fi
mkdir -p "$workdir"
stale() {
    [ ! -f "$here/node_modules/.package-lock.json" ] ||
        [ "$here/package-lock.json" -nt "$here/node_modules/.package-lock.json" ]
}
if stale; then
    if [ -z "$npm" ] || ! command -v "$npm" >/dev/null 2>&1; then
        echo "SKIPPED: node_modules missing and npm not found (Debian: apt-get install npm)"
        exit 77
    fi
    (
        flock 9
        if stale; then
            echo "npm ci in $here"
            cd "$here" && "$npm" ci --no-audit --no-fund --loglevel=error
        fi
    ) 9>"$workdir/npm-ci.lock"
fi
exec "$node" "$here/$script" "$@"
