#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# tandem-bench-engine --peer FILE refuses a missing or malformed FILE with one
# line on stderr and exit status 2, before it makes a model or runs a probe
# (nothing on stdout). The parser's own cases are in bench_peer_test.c.
# Usage: peer_flag_test.sh BENCH TESTDATA_DIR WORK_DIR
set -u
bench=$1 data=$2 work=$3
mkdir -p "$work"
fails=0

# refused NAME FILE WANT: the bench run with --peer FILE exits 2, prints nothing
# on stdout and one line on stderr that contains WANT.
refused() {
    "$bench" --peer "$2" --model "$work/no-model" >"$work/$1.out" 2>"$work/$1.err"
    rc=$?
    lines=$(wc -l <"$work/$1.err")
    if [ "$rc" -ne 2 ] || [ -s "$work/$1.out" ] || [ "$lines" -ne 1 ] ||
        ! grep -qF -- "$3" "$work/$1.err"; then
        echo "FAIL $1: exit $rc (want 2), $lines stderr lines (want 1 with '$3'):"
        cat "$work/$1.err" "$work/$1.out"
        fails=$((fails + 1))
    else
        echo "ok $1: $(cat "$work/$1.err")"
    fi
}

refused missing "$work/does-not-exist.json" "--peer $work/does-not-exist.json: "
refused truncated "$data/llamacpp_truncated.json" "llamacpp_truncated.json: not a JSON object"
refused no_q8_0 "$data/llamacpp_no_q8_0.json" "q8_0 missing or not an object"
[ "$fails" -eq 0 ]
