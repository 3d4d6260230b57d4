# SPDX-License-Identifier: Apache-2.0
"""stack_walkthrough: the seed walkthrough through the router's picked decode worker.

`tandem up --prefill 1 --decode 2`; a request goes through the router, the
decode workers' own metrics tell which one served it (its
vllm:request_success_total moved, the other's did not; the router's
tandem:router_endpoint_picks_total agrees), and then the walkthrough runs
against that worker's own port, as an operator port-forwarding to one decode
pod would: both gauges 0 idle; during a long stream vllm:num_requests_running
is 1 and vllm:kv_cache_usage_perc > 0 and never falls; both 0 after; the
chunks are well formed and end with finish_reason length and [DONE]. The same
greedy request gives the same text through the router (disaggregated) and
directly (prefilled locally).
"""
import time

from stack_harness import (Stack, Stream, check, make_model, metric_sum, metrics, parse_args, post)

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
PROMPT = "Explain, in detail, why serving a large language model is hard."


def gauge(port, name):
    return metric_sum(metrics(port), name)


def main():
    args = parse_args()
    model = make_model(args)
    st = Stack(args, "--model", model, "--prefill", "1", "--decode", "2", "--pd-mode", "always",
               "--served-model-name", MODEL)
    decodes = ["decode-0", "decode-1"]
    dport = {d: st.port(d) for d in decodes}

    # Through the router: which decode worker served it?
    before = {d: metric_sum(metrics(p), "vllm:request_success_total") for d, p in dport.items()}
    s, _, via_router = post(st.port(), "/v1/completions",
                            {"model": MODEL, "prompt": PROMPT, "max_tokens": 24,
                             "temperature": 0, "ignore_eos": True})
    check(s == 200, "router completion %d: %s" % (s, via_router))
    after = {d: metric_sum(metrics(p), "vllm:request_success_total") for d, p in dport.items()}
    served = [d for d in decodes if after[d] == before[d] + 1]
    idle = [d for d in decodes if after[d] == before[d]]
    check(len(served) == 1 and len(idle) == 1,
          "request_success_total before %s after %s: not exactly one worker served it"
          % (before, after))
    picked = served[0]
    port = dport[picked]
    picks = metrics(st.port())
    key = 'tandem:router_endpoint_picks_total{endpoint="127.0.0.1:%d",role="decode"}' % port
    check(picks.get(key) == 1, "router picks %s, expected %s = 1" %
          ({k: v for k, v in picks.items() if "endpoint_picks" in k}, key))
    print("the router picked %s (port %d)" % (picked, port))

    # The same greedy request straight to that worker: the same text.
    s, _, direct = post(port, "/v1/completions",
                        {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                         "ignore_eos": True})
    check(s == 200, "direct completion %d: %s" % (s, direct))
    check(direct["choices"][0]["text"] == via_router["choices"][0]["text"],
          "greedy text differs: router %r, %s directly %r"
          % (via_router["choices"][0]["text"], picked, direct["choices"][0]["text"]))

    # The walkthrough on the picked worker's own port.
    check(gauge(port, "vllm:num_requests_running") == 0, "running != 0 while idle")
    check(gauge(port, "vllm:kv_cache_usage_perc") == 0, "kv usage != 0 while idle")
    n_tokens = 4000
    gen0 = gauge(port, "vllm:generation_tokens_total")
    stream = Stream(port, "/v1/completions",
                    {"model": MODEL, "prompt": PROMPT, "max_tokens": n_tokens, "stream": True,
                     "ignore_eos": True, "stream_options": {"include_usage": True}}, timeout=120)
    check(stream.status == 200, "stream status %d" % stream.status)
    rid, chunks, finish, usage, done = None, 0, None, None, False
    samples = []
    last_poll = 0.0
    for ev in stream.events():
        if ev == "[DONE]":
            done = True
            break
        check("error" not in ev, "error event: %s" % ev)
        rid = rid or ev["id"]
        check(ev["id"] == rid and ev["object"] == "text_completion" and ev["model"] == MODEL,
              "bad chunk: %s" % ev)
        if ev.get("usage") and not ev["choices"]:
            usage = ev["usage"]
            continue
        chunks += 1
        ch = ev["choices"][0]
        check(ch["index"] == 0 and isinstance(ch["text"], str), "bad choice: %s" % ch)
        if ch.get("finish_reason"):
            finish = ch["finish_reason"]
        now = time.time()
        if finish is None and now - last_poll > 0.05:
            last_poll = now
            m = metrics(port)
            # The engine runs ahead of this reader by whatever the socket
            # buffers hold, so near the end it may have finished while chunks
            # are still unread: a sample counts only while the worker's own
            # token counter says generation is still going (with a margin for
            # the tokens made while one scrape is rendered).
            if metric_sum(m, "vllm:generation_tokens_total") - gen0 < n_tokens - 16:
                samples.append((metric_sum(m, "vllm:num_requests_running"),
                                metric_sum(m, "vllm:kv_cache_usage_perc")))
    stream.close()
    check(done and finish == "length", "stream ended without length/[DONE] (finish %s)" % finish)
    check(usage and usage["completion_tokens"] == n_tokens, "usage chunk: %s" % usage)
    check(len(samples) >= 3, "only %d metric samples during the stream" % len(samples))
    check(all(r == 1 for r, _ in samples), "running during the stream: %s" % samples[:20])
    check(all(k > 0 for _, k in samples), "kv usage 0 during the stream: %s" % samples[:20])
    check(all(b >= a for (_, a), (_, b) in zip(samples, samples[1:])),
          "kv usage fell during the stream: %s" % [k for _, k in samples])
    check(samples[-1][1] > samples[0][1], "kv usage did not grow: %s" % [k for _, k in samples])
    time.sleep(0.2)
    check(gauge(port, "vllm:num_requests_running") == 0, "running != 0 after the stream")
    check(gauge(port, "vllm:kv_cache_usage_perc") == 0, "kv usage != 0 after the stream")
    other = dport[idle[0]]
    check(gauge(other, "vllm:num_requests_running") == 0, "the other worker ran something")
    print("walkthrough on %s: %d chunks, %d samples, kv usage up to %.4f"
          % (picked, chunks, len(samples), samples[-1][1]))

    rc = st.stop()
    check(rc == 0, "tandem up exited %d:\n%s" % (rc, st.log()))
    st.check_children_gone()
    print("PASS")


if __name__ == "__main__":
    main()
