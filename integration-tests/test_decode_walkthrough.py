# SPDX-License-Identifier: Apache-2.0
"""The operator walkthrough of issue 4, replayed as a script would.

An operator port-forwards to one decode pod, sends a long streaming request
and watches `vllm:num_requests_running` and `vllm:kv_cache_usage_perc`:
both read 0 when idle; while tokens stream, running is 1 and KV usage is
above 0 and grows; when the request ends both are back to 0. Every SSE chunk
is parsed and checked field by field, then the usage chunk and `[DONE]`.
"""
import threading
import time

import decode_harness as h

MODEL_NAME = "Qwen/Qwen2.5-0.5B-Instruct"
PROMPT = "Explain, in detail, why serving a large language model is hard."


def main():
    args = h.parse_args()
    model = h.make_model(args)
    # A small pool (300 blocks = 4800 tokens) so that one long request moves the
    # usage fraction visibly.
    srv = h.Server(args, model, "--served-model-name", MODEL_NAME, "--num-kv-blocks", "300")
    h.check("kv_capacity_tokens=4800" in srv.ready_line, "startup line: %s" % srv.ready_line)
    status, _, _ = srv.request("GET", "/health")
    h.check(status == 200, "/health %d when ready" % status)

    # Idle: both gauges read 0.
    text = srv.metrics()
    h.check(h.metric_value(text, "vllm:num_requests_running") == 0, "running != 0 when idle")
    h.check(h.metric_value(text, "vllm:kv_cache_usage_perc") == 0, "kv usage != 0 when idle")
    length_before = h.metric_value(text, "vllm:request_success_total",
                                   {"finished_reason": "length"})
    gen_before = h.metric_value(text, "vllm:generation_tokens_total")

    status, _, tok = srv.post_json("/tokenize", {"model": MODEL_NAME, "prompt": PROMPT})
    h.check(status == 200, "/tokenize %d" % status)
    n_prompt = tok["count"]
    max_tokens = min(4000, tok["max_model_len"] - n_prompt)

    samples = []  # (time, running, usage) while the stream runs
    done = threading.Event()

    def watch():
        while not done.is_set():
            t = srv.metrics()
            samples.append((time.time(), h.metric_value(t, "vllm:num_requests_running"),
                            h.metric_value(t, "vllm:kv_cache_usage_perc")))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    st = h.Stream(srv, "/v1/completions", {
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True}})
    h.check(st.status == 200, "stream status %d" % st.status)
    h.check(st.headers.get("content-type", "").startswith("text/event-stream"),
            "content-type %r" % st.headers.get("content-type"))

    rid = created = None
    text_out = []
    finish = None
    usage = None
    saw_done = False
    n_events = 0
    for ev in st.events():
        h.check(not saw_done, "an event after [DONE]")
        n_events += 1
        if ev == "[DONE]":
            saw_done = True
            continue
        if rid is None:
            rid, created = ev.get("id"), ev.get("created")
            h.check(isinstance(rid, str) and rid.startswith("cmpl-"), "id %r" % rid)
            h.check(isinstance(created, int) and abs(created - time.time()) < 300,
                    "created %r" % created)
        if ev.get("choices") == []:
            # The usage chunk (stream_options.include_usage): last before [DONE].
            h.check(usage is None, "two usage chunks")
            h.check(finish is not None, "usage chunk before the finish")
            h.check(ev["id"] == rid and ev["object"] == "text_completion" and
                    ev["created"] == created and ev["model"] == MODEL_NAME, "usage chunk %r" % ev)
            usage = ev.get("usage")
            continue
        h.check(usage is None, "a token chunk after the usage chunk")
        h.check(finish is None, "a chunk after finish_reason was set")
        c = h.check_completion_chunk(ev, rid, created, MODEL_NAME)
        h.check("usage" not in ev or ev["usage"] is None, "usage on a token chunk")
        text_out.append(c["text"])
        if c["finish_reason"] is not None:
            finish = c["finish_reason"]
            h.check(c.get("stop_reason") is None, "stop_reason %r" % c.get("stop_reason"))
        else:
            h.check(c["text"] != "", "an empty chunk before the end")
    done.set()
    watcher.join(5)
    st.close()
    h.check(saw_done, "no [DONE]")
    h.check(finish == "length", "finish_reason %r (ignore_eos, max_tokens)" % finish)
    h.check(usage == {"prompt_tokens": n_prompt, "completion_tokens": max_tokens,
                      "total_tokens": n_prompt + max_tokens}, "usage %r" % usage)
    h.check("".join(text_out) != "", "no text streamed")

    # During the stream: running = 1, usage > 0 and growing.
    during = [s for s in samples if s[1] == 1]
    h.check(len(during) >= 3, "saw running=1 in only %d of %d scrapes" % (len(during), len(samples)))
    h.check(all(s[2] > 0 for s in during), "kv usage 0 while running: %r" % during[:5])
    usages = [s[2] for s in during]
    h.check(all(b >= a for a, b in zip(usages, usages[1:])), "kv usage fell while running")
    h.check(usages[-1] > usages[0], "kv usage did not grow: %r" % usages)
    h.check(max(s[1] for s in samples) == 1, "running above 1")

    # After: both back to 0 (the engine publishes at its next idle point).
    deadline = time.time() + 10
    while True:
        text = srv.metrics()
        running = h.metric_value(text, "vllm:num_requests_running")
        kv = h.metric_value(text, "vllm:kv_cache_usage_perc")
        if running == 0 and kv == 0:
            break
        h.check(time.time() < deadline, "after the stream running=%g kv=%g" % (running, kv))
        time.sleep(0.05)
    h.check(h.metric_value(text, "vllm:request_success_total", {"finished_reason": "length"}) ==
            length_before + 1, "request_success_total{length} not incremented")
    h.check(h.metric_value(text, "vllm:generation_tokens_total") == gen_before + max_tokens,
            "generation_tokens_total did not grow by %d" % max_tokens)
    h.check(srv.stop() == 0, "exit status after SIGTERM")
    print("PASS: %d events, %d tokens, %d scrapes (%d while running), kv usage %.3f -> %.3f" %
          (n_events, max_tokens, len(samples), len(during), usages[0], usages[-1]))


if __name__ == "__main__":
    main()
