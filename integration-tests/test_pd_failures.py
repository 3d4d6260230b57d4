# SPDX-License-Identifier: Apache-2.0
"""Failures in disaggregated serving, on router + 2 prefill + 2 decode:
  - a prefill worker killed: requests still succeed (next prefill worker or
    local prefill) with the same output as direct;
  - a decode worker killed mid-stream: the client gets an SSE error event within
    2 s, the router counts that one failure once in
    tandem:router_upstream_errors_total, and new requests succeed on the survivor;
  - the killed workers restarted on the same addresses serve again within
    seconds (no stale connection state in router, decode or prefill);
  - a client that disconnects mid-stream: KV usage returns to 0 on every worker;
    so does one that leaves a request that is not streamed (the router probes
    its socket without writing and cancels upstream);
  - a router stopped for longer than the decode worker's send timeout while
    a stream runs: the stream waits and then completes, every token, "length".
"""
import atexit
import json
import os
import random
import shutil
import signal
import socket
import tempfile
import time

from pd_harness import (Cluster, Stream, check, metric_sum, metrics, parse_args, post,
                        stream_text)


def direct(cl, body):
    live = [w for w in cl.decode if w.proc.poll() is None]
    st, _, d = post(live[0].http_port, "/v1/completions", body)
    check(st == 200, "direct status %d" % st)
    return d["choices"][0]["text"]


def upstream_errors(cl, endpoint):
    """The router's tandem:router_upstream_errors_total for one endpoint (all kinds)."""
    return sum(v for k, v in metrics(cl.router_port).items()
               if k.startswith("tandem:router_upstream_errors_total{")
               and 'endpoint="%s"' % endpoint in k)


def routed_ok(cl, body, n, what, want=None):
    served = []
    want = want if want is not None else direct(cl, body)
    for i in range(n):
        st, hdr, r = post(cl.router_port, "/v1/completions", body)
        check(st == 200, "%s: request %d status %d: %s" % (what, i, st, r))
        check(r["choices"][0]["text"] == want, "%s: request %d output differs" % (what, i))
        served.append(hdr.get("x-tandem-decode"))
    return served


def main():
    args = parse_args()
    # The router without stream migration: this test is the error-event path
    # (a lost stream continuing elsewhere is test_stream_migration's).
    cl = Cluster(args, n_prefill=2, n_decode=2, policy="round_robin", pd_mode="always",
                 router_args=["--no-stream-migration"]).start()
    rnd = random.Random(11)
    body = {"prompt": [rnd.randrange(3, 500) for _ in range(300)], "max_tokens": 8,
            "temperature": 0.7, "seed": 3}
    routed_ok(cl, body, 4, "baseline")

    # 1. Prefill worker killed: every request still succeeds.
    p0 = cl.prefill[0]
    before = metric_sum(metrics(cl.prefill[1].http_port), "tandem:pd_prefill_requests_total")
    cl.kill(p0)
    t0 = time.time()
    routed_ok(cl, body, 6, "prefill killed")
    took = time.time() - t0
    after = metric_sum(metrics(cl.prefill[1].http_port), "tandem:pd_prefill_requests_total")
    check(after > before, "the surviving prefill worker was not used")
    print("prefill killed: 6 requests ok in %.2f s" % took, flush=True)

    # 2. Decode worker killed mid-stream: error event within 2 s.
    long_body = {"prompt": [rnd.randrange(3, 500) for _ in range(40)], "max_tokens": 7000,
                 "ignore_eos": True, "temperature": 0, "stream": True}
    s = Stream(cl.router_port, "/v1/completions", long_body)
    check(s.status == 200, "stream status %d" % s.status)
    victim = [w for w in cl.decode if w.name == s.headers.get("x-tandem-decode")]
    check(len(victim) == 1, "no decode header: %s" % s.headers)
    victim = victim[0]
    events = s.events()
    first = next(events)
    check(isinstance(first, dict) and "choices" in first, "first event %r" % first)
    errors_before = upstream_errors(cl, victim.name)
    cl.kill(victim)
    t_kill = time.time()
    got_error, finished_normally = False, False
    for ev in events:
        if ev == "[DONE]":
            break
        if "error" in ev:
            got_error = True
        elif any(c.get("finish_reason") for c in ev.get("choices", [])):
            finished_normally = True
    waited = time.time() - t_kill
    s.close()
    check(not finished_normally, "generation finished before the kill: make it longer")
    check(got_error, "no SSE error event after the decode worker died")
    check(waited <= 2.0, "error event after %.2f s (> 2 s)" % waited)
    print("decode killed mid-stream: error event after %.2f s" % waited, flush=True)
    # One failed request, one upstream error (the router once counted it twice).
    t0 = time.time()
    while upstream_errors(cl, victim.name) == errors_before and time.time() - t0 < 3:
        time.sleep(0.05)
    time.sleep(0.3)  # a second count, if any, lands right after the first
    counted = upstream_errors(cl, victim.name) - errors_before
    check(counted == 1, "router_upstream_errors_total grew by %g for one failure" % counted)
    survivor = [w for w in cl.decode if w is not victim][0]
    served = routed_ok(cl, body, 6, "decode killed")
    check(all(x == survivor.name for x in served), "served by %s, not the survivor" % served)

    # 3. Restarts: both killed workers come back on the same addresses.
    cl.restart(victim)
    cl.restart(p0)
    p0_before = 0.0
    t0 = time.time()
    back = False
    while time.time() - t0 < 10 and not back:
        served = routed_ok(cl, body, 2, "after restart")
        back = victim.name in served
        if not back:
            time.sleep(0.2)
    check(back, "the restarted decode worker served nothing within 10 s")
    t1 = time.time()
    used = False
    while time.time() - t1 < 10 and not used:
        routed_ok(cl, body, 2, "after prefill restart")
        used = metric_sum(metrics(p0.http_port), "tandem:pd_prefill_requests_total") > p0_before
    check(used, "the restarted prefill worker was never used within 10 s")
    print("restarted workers serve again after %.2f s / %.2f s" % (t1 - t0, time.time() - t1),
          flush=True)

    # 3b. A hung prefill worker (SIGSTOP: connected, silent) costs at most the
    # decode worker's liveness window (2 s), never a hang.
    hung = cl.prefill[1]
    hung.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.time()
        for i in range(4):
            t1 = time.time()
            routed_ok(cl, body, 1, "prefill hung")
            check(time.time() - t1 < 4.0, "request %d took %.1f s with a hung prefill worker"
                  % (i, time.time() - t1))
        print("hung prefill worker: 4 requests ok in %.2f s" % (time.time() - t0), flush=True)
    finally:
        hung.proc.send_signal(signal.SIGCONT)

    # 4. Client disconnect mid-stream frees KV on every worker.
    for i in range(3):
        s = Stream(cl.router_port, "/v1/completions", dict(long_body, prompt=[
            rnd.randrange(3, 500) for _ in range(1500)], max_tokens=6000))
        check(s.status == 200, "stream status %d" % s.status)
        next(s.events())
        s.close()
    cl.wait_kv_free(timeout=10)
    def decode_aborts():
        return sum(v for w in cl.decode for k, v in metrics(w.http_port).items()
                   if k.startswith("vllm:request_success_total{") and
                   'finished_reason="abort"' in k)
    aborts0 = decode_aborts()
    un = json.dumps({"prompt": [rnd.randrange(3, 500) for _ in range(200)], "max_tokens": 6000,
                     "ignore_eos": True, "temperature": 0}).encode()
    sock = socket.create_connection(("127.0.0.1", cl.router_port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(un), un))
    t0 = time.time()
    while sum(metric_sum(metrics(w.http_port), "vllm:num_requests_running")
              for w in cl.decode) < 1:
        check(time.time() - t0 < 10, "the request that is not streamed never ran")
        time.sleep(0.01)
    sock.close()  # the client leaves before any byte of the answer
    cl.wait_kv_free(timeout=5)
    check(decode_aborts() == aborts0 + 1, "the request whose client left was not aborted "
          "(decode aborts %g -> %g): it ran to its end" % (aborts0, decode_aborts()))
    print("client disconnects (3 streams, 1 not streamed): KV freed everywhere", flush=True)

    # 4b. A stalled router slows a stream, never ends it. The router stopped
    # (SIGSTOP) for longer than the decode worker's 2 s send timeout while a
    # stream runs: the decode worker's TokenChunks fill the connection and
    # its sends wait; once the router runs again the stream completes with
    # every token and finish_reason "length" (it ended with "abort", or lost
    # a chunk, when a send that timed out aborted the request). The router's
    # inbox is a Unix socket here: a stopped reader blocks its sender after a
    # few hundred chunks (TCP on loopback buffers megabytes first).
    cl.router_proc.kill()
    cl.router_proc.wait(timeout=20)
    # A short path (a socket's is at most 107 bytes; a CI workdir may be longer).
    sock_dir = tempfile.mkdtemp(prefix="tdm-router-")
    atexit.register(shutil.rmtree, sock_dir, True)
    cl.start_router(nng_url="ipc://" + os.path.join(sock_dir, "inbox.sock"))
    routed_ok(cl, body, 2, "router on a Unix socket")
    stall_body = dict(long_body, max_tokens=3000, stream_options={"include_usage": True})
    s = Stream(cl.router_port, "/v1/completions", stall_body, timeout=120)
    check(s.status == 200, "stream status %d" % s.status)
    stalled_on = [w for w in cl.decode if w.name == s.headers.get("x-tandem-decode")][0]
    log_path = os.path.join(cl.args.workdir, "decode%d-%d.log" % (stalled_on.idx, os.getpid()))
    slow_lines0 = open(log_path, "rb").read().count(b"the router is slow to read")
    events = s.events()
    next(events)
    cl.router_proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(5.0)
    finally:
        cl.router_proc.send_signal(signal.SIGCONT)
    finish, usage, error = None, None, None
    for ev in events:
        if ev == "[DONE]":
            break
        if "error" in ev:
            error = ev["error"]
        for c in ev.get("choices", []):
            finish = c.get("finish_reason") or finish
        usage = ev.get("usage") or usage
    s.close()
    check(error is None, "router stalled 5 s: the stream failed: %s" % error)
    check(finish == "length", "router stalled 5 s: the stream ended with %r" % finish)
    check(usage and usage["completion_tokens"] == 3000,
          "router stalled 5 s: %s tokens of 3000" % (usage and usage["completion_tokens"]))
    slow = open(log_path, "rb").read().count(b"the router is slow to read") - slow_lines0
    check(slow >= 1, "the stream never waited for the router (no 'the router is slow to read' "
          "in %s): stop the router longer" % log_path)
    cl.wait_kv_free(timeout=10)
    print("router stalled 5 s: the stream waited and completed (3000 tokens, length)",
          flush=True)

    # 5. A draining decode worker (SIGTERM) finishes its stream, refuses new
    # work, and the router sends that work to the other worker: no failures.
    s = Stream(cl.router_port, "/v1/completions", dict(long_body, max_tokens=3000))
    check(s.status == 200, "stream status %d" % s.status)
    draining = [w for w in cl.decode if w.name == s.headers.get("x-tandem-decode")][0]
    events = s.events()
    next(events)
    want = direct(cl, body)
    draining.proc.send_signal(signal.SIGTERM)
    served = routed_ok(cl, body, 6, "during drain", want)
    check(draining.name not in served[1:], "a draining worker took new work: %s" % served)
    finish = None
    for ev in events:
        if ev == "[DONE]":
            break
        check("error" not in ev, "the draining worker's stream failed: %s" % ev)
        for c in ev.get("choices", []):
            finish = c.get("finish_reason") or finish
    s.close()
    check(finish == "length", "the draining worker's stream ended with %r" % finish)
    draining.proc.wait(timeout=60)
    print("drain: running stream finished, new requests rerouted", flush=True)
    print("PASS", flush=True)


if __name__ == "__main__":
    main()
