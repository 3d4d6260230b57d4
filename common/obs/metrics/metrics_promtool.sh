#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Renders the vLLM metric set with metrics_dump and checks it with
# `promtool check metrics` (Debian package `prometheus`). promtool's lint
# objects to two things vLLM itself does and Tandem must copy: ':' in metric
# names ("vllm:...") and the histogram vllm:iteration_tokens_total ending in
# _total. Those lines are accepted; any other problem, including a parse
# error, fails. Exits 77 (ctest: skipped) when promtool is not installed.
# Usage: metrics_promtool.sh PROMTOOL METRICS_DUMP
promtool=$1
dump=$2
if ! command -v "$promtool" >/dev/null 2>&1; then
    echo "promtool not found: skipped"
    exit 77
fi
out=$("$dump" | "$promtool" check metrics 2>&1)
rc=$?
printf '%s\n' "$out"
[ $rc -eq 0 ] && exit 0
problems=$(printf '%s\n' "$out" | grep -v -e '^$' \
    -e "metric names should not contain ':'\$" \
    -e '^vllm:iteration_tokens_total non-counter metrics should not have "_total" suffix$')
if [ -n "$problems" ]; then
    echo "promtool found problems:"
    printf '%s\n' "$problems"
    exit 1
fi
echo "only the accepted vLLM naming lints"
exit 0
