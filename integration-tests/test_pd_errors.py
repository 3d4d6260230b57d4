# SPDX-License-Identifier: Apache-2.0
"""One failure, one answer: a full waiting queue on the decode worker gets the
same status (503, vLLM's answer), Retry-After and OpenAI error body on every path:
the decode worker directly or through the router, streamed or not (before the
error table was shared the router said 429 streamed and 502 not). Router + 1
prefill + 1 decode worker with --max-num-seqs 1 --max-waiting 1, pd_mode never.
The prefill worker answers a completion sent to its own port and counts it.

Busy is not the end when another worker has room: with two such decode
workers behind a round-robin router and the first one's queue full, every
request routed to it is refused there before any token (the router's
admission check lets single requests through, the worker decides) and
retried on the second: all succeed, the first stays healthy (busy is not
dead), and the router counts the retries. That router runs with
--stream-interval 3: after the first token its streams send at least 3 tokens
per event.
"""
import json
import os
import subprocess
import time

from pd_harness import Cluster, Stream, check, metrics, parse_args, post, request


def wait_metric(port, name, pred, what, timeout=30):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = sum(x for k, x in metrics(port).items() if k == name or k.startswith(name + "{"))
        if pred(v):
            return
        time.sleep(0.05)
    check(False, what)


def refused(port, stream):
    """A request the full queue refuses: (status, retry-after, body)."""
    body = {"prompt": "one too many", "max_tokens": 4, "stream": stream}
    if stream:
        s = Stream(port, "/v1/completions", body)
        raw = s.resp.read()
        s.close()
        return s.status, s.headers.get("retry-after"), json.loads(raw)
    st, hdr, b = post(port, "/v1/completions", body)
    return st, hdr.get("retry-after"), b


def fill_queue(d):
    """One running and one waiting on decode worker port d, sent directly
    (its stream starts at once); the caller closes both."""
    long = {"prompt": "A long one.", "max_tokens": 30000, "ignore_eos": True, "stream": True}
    a = Stream(d, "/v1/completions", long)
    wait_metric(d, "vllm:num_requests_running", lambda v: v == 1, "first request not running")
    b = Stream(d, "/v1/completions", long)
    wait_metric(d, "vllm:num_requests_waiting", lambda v: v == 1, "second request not waiting")
    return a, b


def busy_elsewhere(args, model):
    # The router also runs with --stream-interval 3: its streams send tokens
    # at least 3 per event after the first (checked on the streamed requests).
    cl = Cluster(args, n_prefill=0, n_decode=2, pd_mode="never", model=model,
                 worker_args=["--max-num-seqs", "1", "--max-waiting", "1"],
                 router_args=["--stream-interval", "3"]).start()
    full, free = cl.decode
    a, b = fill_queue(full.http_port)
    served = []
    for i in range(6):
        body = {"prompt": "request %d" % i, "max_tokens": 4, "stream": i % 2 == 1}
        if body["stream"]:
            body.update(max_tokens=10, ignore_eos=True, return_token_ids=True)
            s = Stream(cl.router_port, "/v1/completions", body)
            events = list(s.events())
            s.close()
            check(s.status == 200 and events and all("error" not in e for e in events),
                  "streamed request %d: %d %r" % (i, s.status, events))
            per = [len(e["choices"][0]["token_ids"]) for e in events
                   if isinstance(e, dict) and e.get("choices")]
            check(sum(per) == 10 and all(n >= 3 for n in per[1:-1]) and len(per) <= 5,
                  "router --stream-interval 3: tokens per event %r" % per)
            served.append(s.headers.get("x-tandem-decode"))
        else:
            st, hdr, got = post(cl.router_port, "/v1/completions", body)
            check(st == 200, "request %d answered %d %r" % (i, st, got))
            served.append(hdr.get("x-tandem-decode"))
    check(all(x == free.name for x in served), "served by %r, want all %s" % (served, free.name))
    m = metrics(cl.router_port)
    retries = sum(v for k, v in m.items() if k.startswith("tandem:router_retries_total{") and
                  full.name in k)
    check(retries >= 1, "no retry away from the busy worker counted: %r" %
          {k: v for k, v in m.items() if "retries" in k})
    st, _, view = request(cl.router_port, "GET", "/v1/router/config", timeout=10)
    e = [e for e in view["endpoints_state"] if e["name"] == full.name][0]
    check(e["healthy"], "the busy worker was marked unhealthy: %r" % e)
    a.close()
    b.close()
    cl.stop()
    print("PASS: a worker's full queue sends its requests to the other worker "
          "(%d retries, the busy one stays healthy)" % retries)


def main():
    args = parse_args()
    # A context long enough that the queue stays full while the test runs.
    model = os.path.join(args.workdir, "pd-errors-tiny")
    if not os.path.exists(os.path.join(model, "model.safetensors")):
        subprocess.run([args.mkmodel, "--preset", "tiny", "--max-pos", "32768", "--out", model], check=True,
                       stdout=subprocess.DEVNULL)
    busy_elsewhere(args, model)
    cl = Cluster(args, n_prefill=1, n_decode=1, pd_mode="never", model=model,
                 worker_args=["--max-num-seqs", "1", "--max-waiting", "1"]).start()
    d = cl.decode[0].http_port
    a, b = fill_queue(d)

    answers = {}
    for where, port in (("direct", d), ("routed", cl.router_port)):
        for stream in (False, True):
            answers["%s stream=%s" % (where, stream)] = refused(port, stream)
    want = answers["direct stream=False"]
    check(want[0] == 503 and want[1] == "1", "direct: %r" % (want,))
    e = want[2]["error"]
    check(e["code"] == 503 and e["type"] == "ServiceUnavailableError" and
          e["message"].startswith("The server is overloaded: the waiting queue is full"),
          "direct body %r" % want[2])
    for what, got in answers.items():
        check(got == want, "%s answered %r, direct %r" % (what, got, want))
    a.close()
    b.close()

    # The prefill worker's HTTP port serves the OpenAI API too (documented in
    # docs/configuration.md): a request sent to it directly runs there and is
    # counted in its own vllm:* metrics, like any worker's.
    pf = cl.prefill[0].http_port
    before = sum(v for k, v in metrics(pf).items() if k.startswith("vllm:request_success_total{"))
    s, _, body = post(pf, "/v1/completions", {"prompt": "straight to prefill", "max_tokens": 3})
    check(s == 200 and body["usage"]["completion_tokens"] == 3, "prefill direct: %d %r" % (s, body))
    wait_metric(pf, "vllm:request_success_total", lambda v: v == before + 1,
                "the prefill worker did not count its direct request")

    # A priority other than 0 on an fcfs worker: vLLM's 400, the same directly
    # and through the router (which passes the priority on), streamed or not.
    wait_metric(d, "vllm:num_requests_running", lambda v: v == 0, "requests still running")
    wait_metric(d, "vllm:num_requests_waiting", lambda v: v == 0, "requests still waiting")
    prio = {"prompt": "urgent", "max_tokens": 3, "priority": 2}
    for port in (d, cl.router_port):
        for stream in (False, True):
            st, _, b = post(port, "/v1/completions", dict(prio, stream=stream))
            check(st == 400 and b["error"]["message"] ==
                  "Got priority 2 but Priority scheduling is not enabled.",
                  "priority on fcfs (port %d, stream %s): %d %r" % (port, stream, st, b))
    cl.stop()

    # --scheduling-policy priority on the decode worker, fcfs on the prefill
    # worker: a routed request's priority reaches the decode worker, whose
    # prefill worker (fcfs) ignores it; the tokens are the direct run's.
    cl = Cluster(args, n_prefill=1, n_decode=1, pd_mode="always", model=model,
                 decode_args=["--scheduling-policy", "priority"]).start()
    greedy = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
              "ignore_eos": True, "return_token_ids": True, "priority": 3}
    s1, _, direct = post(cl.decode[0].http_port, "/v1/completions", greedy)
    s2, _, routed = post(cl.router_port, "/v1/completions", greedy)
    check(s1 == 200 and s2 == 200 and
          routed["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"],
          "priority through P/D: %d %r / %d %r" % (s1, direct, s2, routed))
    cl.stop()
    print("PASS: a full queue is 503, Retry-After 1 and the same body on all 4 paths: %s; the "
          "prefill worker serves and counts a direct request; priority: 400 on fcfs on all 4 "
          "paths, served through P/D to a priority decode worker" % e["message"])


if __name__ == "__main__":
    main()
