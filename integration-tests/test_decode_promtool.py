# SPDX-License-Identifier: Apache-2.0
"""/metrics of a busy tandem-decode passes `promtool check metrics`.

After a stream, a non-stream request, a chat request and an aborted stream,
/metrics must hold the vLLM set (labels model_name and engine="0", counters
with _total, histograms with _bucket/_sum/_count) plus vllm:cache_config_info
with block_size, num_gpu_blocks and enable_prefix_caching, and promtool must
accept it (apart from the two lints vLLM's own names trigger). Skipped (77)
when promtool is not installed (Debian package `prometheus`).
"""
import re
import shutil
import sys

import decode_harness as h

NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:cache_config_info",
]


def main():
    args = h.parse_args()
    if shutil.which(args.promtool) is None:
        print("SKIPPED: promtool not found (Debian package prometheus)")
        sys.exit(77)
    model = h.make_model(args)
    srv = h.Server(args, model, "--served-model-name", "Qwen/Qwen2.5-0.5B-Instruct",
                   "--block-size", "32", "--num-kv-blocks", "200")
    st = h.Stream(srv, "/v1/completions", {"prompt": "a b c", "max_tokens": 20, "stream": True})
    list(st.events())
    st.close()
    srv.post_json("/v1/completions", {"prompt": "a b c", "max_tokens": 5})
    srv.post_json("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 5})
    st = h.Stream(srv, "/v1/completions", {"prompt": "x", "max_tokens": 3000, "ignore_eos": True,
                                           "stream": True})
    next(iter(st.events()))
    st.close()
    text = srv.metrics()
    for name in NAMES:
        h.metric_value(text, name)  # fails when absent
    for line in text.splitlines():
        if line.startswith("vllm:") and not line.startswith("vllm:cache_config_info"):
            h.check('model_name="Qwen/Qwen2.5-0.5B-Instruct"' in line and 'engine="0"' in line,
                    "labels missing: %s" % line)
    info = [l for l in text.splitlines() if l.startswith("vllm:cache_config_info")]
    h.check(len(info) == 1, "cache_config_info lines %r" % info)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info[0]))
    h.check(labels.get("block_size") == "32" and labels.get("num_gpu_blocks") == "200" and
            labels.get("enable_prefix_caching") == "True" and labels.get("engine") == "0",
            "cache_config_info labels %r" % labels)
    h.check(h.metric_value(text, "vllm:request_success_total", {"finished_reason": "abort"}) >= 0,
            "abort series")
    ok, out = h.promtool_check(args.promtool, text)
    h.check(ok, "promtool check metrics:\n" + out)
    h.check(srv.stop() == 0, "exit status")
    print("PASS: promtool accepts %d lines of /metrics" % len(text.splitlines()))


if __name__ == "__main__":
    main()
