# SPDX-License-Identifier: Apache-2.0
"""Concurrency, disconnects and the bounded waiting queue of tandem-decode.

- 20 concurrent streams all finish, each with its own id, [DONE] and exact usage;
- a client that closes its connection mid-stream gets its request aborted: KV
  usage and running go back to 0 at once and request_success_total{abort} grows;
  so does one that leaves a request that is not streamed (nothing is written
  before its answer: the server probes the socket without writing);
- with --max-num-seqs 1 --max-waiting 1, a third request while one runs and one
  waits is refused with 503, an OpenAI error body and Retry-After.
"""
import json
import socket
import threading
import time

import decode_harness as h


def wait_idle(srv, what, timeout=10.0):
    deadline = time.time() + timeout
    while True:
        t = srv.metrics()
        r = h.metric_value(t, "vllm:num_requests_running")
        w = h.metric_value(t, "vllm:num_requests_waiting")
        kv = h.metric_value(t, "vllm:kv_cache_usage_perc")
        if r == 0 and w == 0 and kv == 0:
            return t
        h.check(time.time() < deadline, "%s: running=%g waiting=%g kv=%g" % (what, r, w, kv))
        time.sleep(0.02)


def wait_metric(srv, name, pred, what, timeout=10.0):
    deadline = time.time() + timeout
    while True:
        v = h.metric_value(srv.metrics(), name)
        if pred(v):
            return v
        h.check(time.time() < deadline, "%s (%s=%g)" % (what, name, v))
        time.sleep(0.01)


def twenty_streams(srv):
    results = [None] * 20
    errors = []

    def one(i):
        try:
            prompt = "Request number %d asks for a few words." % i
            _, _, tok = srv.post_json("/tokenize", {"prompt": prompt})
            max_tokens = 40 + 3 * i
            st = h.Stream(srv, "/v1/completions", {
                "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0.8, "seed": i, "stream_options": {"include_usage": True}})
            if st.status != 200:
                errors.append("stream %d: status %d" % (i, st.status))
                return
            ids, usage, done, finish = set(), None, False, None
            for ev in st.events():
                if ev == "[DONE]":
                    done = True
                    continue
                ids.add(ev["id"])
                if ev["choices"]:
                    if ev["choices"][0]["finish_reason"]:
                        finish = ev["choices"][0]["finish_reason"]
                else:
                    usage = ev["usage"]
            st.close()
            results[i] = (ids, usage, done, finish, tok["count"], max_tokens)
        except Exception as e:  # reported below; a thread must not die silently
            errors.append("stream %d: %r" % (i, e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    h.check(not errors, "; ".join(errors))
    all_ids = set()
    for i, r in enumerate(results):
        h.check(r is not None, "stream %d did not finish" % i)
        ids, usage, done, finish, n_prompt, max_tokens = r
        h.check(done, "stream %d: no [DONE]" % i)
        h.check(len(ids) == 1, "stream %d: ids %r" % (i, ids))
        h.check(finish == "length", "stream %d: finish %r" % (i, finish))
        h.check(usage == {"prompt_tokens": n_prompt, "completion_tokens": max_tokens,
                          "total_tokens": n_prompt + max_tokens},
                "stream %d: usage %r (prompt %d, max_tokens %d)" % (i, usage, n_prompt, max_tokens))
        all_ids |= ids
    h.check(len(all_ids) == 20, "ids not unique across streams")
    wait_idle(srv, "after 20 streams")


def disconnect(srv):
    t = srv.metrics()
    abort_before = h.metric_value(t, "vllm:request_success_total", {"finished_reason": "abort"})
    gen_before = h.metric_value(t, "vllm:generation_tokens_total")
    st = h.Stream(srv, "/v1/completions", {"prompt": "Tell me a very long story.",
                                           "max_tokens": 30000, "ignore_eos": True,
                                           "stream": True})
    h.check(st.status == 200, "status %d" % st.status)
    n = 0
    for ev in st.events():
        n += 1
        if n == 5:
            break
    kv = wait_metric(srv, "vllm:kv_cache_usage_perc", lambda v: v > 0, "no KV in use mid-stream")
    st.close()  # the client goes away
    t0 = time.time()
    t = wait_idle(srv, "after the disconnect", timeout=5.0)
    freed_s = time.time() - t0
    abort_after = h.metric_value(t, "vllm:request_success_total", {"finished_reason": "abort"})
    h.check(abort_after == abort_before + 1, "abort counter %g -> %g" % (abort_before, abort_after))
    gen = h.metric_value(t, "vllm:generation_tokens_total") - gen_before
    h.check(gen < 30000, "the aborted request generated all %d tokens" % gen)
    return kv, freed_s, gen


def disconnect_unstreamed(srv):
    """The same for a request that is not streamed: the client sends it and
    leaves while it runs; nothing was written to it, so only the server's probe
    of the socket can tell."""
    t = srv.metrics()
    abort_before = h.metric_value(t, "vllm:request_success_total", {"finished_reason": "abort"})
    gen_before = h.metric_value(t, "vllm:generation_tokens_total")
    body = json.dumps({"prompt": "Tell me a very long story.", "max_tokens": 30000,
                       "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_metric(srv, "vllm:num_requests_running", lambda v: v == 1, "the request is not running")
    wait_metric(srv, "vllm:kv_cache_usage_perc", lambda v: v > 0, "no KV in use")
    s.close()  # the client goes away before any byte of the answer
    t0 = time.time()
    t = wait_idle(srv, "after the client of a request not streamed left", timeout=5.0)
    freed_s = time.time() - t0
    abort_after = h.metric_value(t, "vllm:request_success_total", {"finished_reason": "abort"})
    h.check(abort_after == abort_before + 1, "abort counter %g -> %g" % (abort_before, abort_after))
    gen = h.metric_value(t, "vllm:generation_tokens_total") - gen_before
    h.check(gen < 30000, "the left request generated all %d tokens" % gen)
    return freed_s, gen


def overflow(args, model):
    srv = h.Server(args, model, "--max-num-seqs", "1", "--max-waiting", "1")
    body = {"prompt": "A long one.", "max_tokens": 30000, "ignore_eos": True, "stream": True}
    a = h.Stream(srv, "/v1/completions", body)
    wait_metric(srv, "vllm:num_requests_running", lambda v: v == 1, "first request not running")
    b = h.Stream(srv, "/v1/completions", body)
    wait_metric(srv, "vllm:num_requests_waiting", lambda v: v == 1, "second request not waiting")
    status, hdrs, err = srv.post_json("/v1/completions", {"prompt": "one too many",
                                                          "max_tokens": 4})
    h.check(status == 503, "queue overflow status %d (documented: 503)" % status)
    h.check(hdrs.get("retry-after") == "1", "Retry-After %r" % hdrs.get("retry-after"))
    e = err.get("error") if isinstance(err, dict) else None
    h.check(isinstance(e, dict) and e.get("code") == 503 and
            e.get("type") == "ServiceUnavailableError" and "queue" in e.get("message", ""),
            "overflow body %r" % err)
    # The waiting client leaves: the server's keep-alive probe notices and aborts
    # it while it still waits (a keeps running).
    b.close()
    t0 = time.time()
    wait_metric(srv, "vllm:num_requests_waiting", lambda v: v == 0,
                "a closed waiting request still waits", timeout=10.0)
    h.check(h.metric_value(srv.metrics(), "vllm:num_requests_running") == 1,
            "the running request stopped")
    waiting_gone_s = time.time() - t0
    a.close()
    wait_idle(srv, "after closing both overflow streams", timeout=15.0)
    h.check(srv.stop() == 0, "exit status")
    return waiting_gone_s


def main():
    args = h.parse_args()
    model = h.make_model(args, "tiny-long", ["--max-pos", "32768"])
    srv = h.Server(args, model)
    twenty_streams(srv)
    kv, freed_s, gen = disconnect(srv)
    un_freed_s, un_gen = disconnect_unstreamed(srv)
    h.check(srv.stop() == 0, "exit status")
    waiting_gone_s = overflow(args, model)
    print("PASS: 20 streams; disconnect freed kv %.5f in %.3f s after %d tokens; not streamed: "
          "freed in %.3f s after %d tokens; overflow 503; a waiting client that left was dropped "
          "after %.2f s" % (kv, freed_s, gen, un_freed_s, un_gen, waiting_gone_s))


if __name__ == "__main__":
    main()
