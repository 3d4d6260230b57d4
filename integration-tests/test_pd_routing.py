# SPDX-License-Identifier: Apache-2.0
"""Routing through tandem-router with 2 prefill + 2 decode workers, asserted
from the workers' own metrics and the router's response headers:
  - round_robin with the P/D decider (pd_threshold_tokens): short prompts are
    decode-only, alternating over the decode workers; long ones are prefilled
    remotely, alternating over the prefill workers;
  - a hot reload (atomic rename of the config file) switches the policy under
    traffic with zero failed requests, and GET /v1/router/config shows it;
  - session_affinity: the same session header lands on the same worker, and the
    returned x-session-token brings the client back to it;
  - prefix_cache: a repeated long prompt goes back to the worker that caches it
    (its prefix cache hits rise); a prompt a decode worker served directly (the
    router never saw it) is routed to that worker from its KV events alone;
  - least_loaded: with one decode worker busy, new requests go to the other.
"""
import random
import threading
import time

from pd_harness import (Cluster, Stream, check, metric_sum, metrics, parse_args, post, request)


def served_counts(cl, name="tandem:pd_requests_total"):
    return {w.name: metric_sum(metrics(w.http_port), name) for w in cl.decode + cl.prefill}


def delta(after, before):
    return {k: after[k] - before.get(k, 0) for k in after}


def phases(hdr):
    return dict(p.strip().split("=", 1) for p in hdr.get("x-tandem-phases", "").split(";") if p)


def wait_policy(cl, policy, timeout=10):
    t0 = time.time()
    while time.time() - t0 < timeout:
        st, _, cfg = request(cl.router_port, "GET", "/v1/router/config")
        if st == 200 and cfg.get("policy") == policy:
            return
        time.sleep(0.1)
    fail_cfg = request(cl.router_port, "GET", "/v1/router/config")[2]
    check(False, "policy %s not active: %s" % (policy, fail_cfg))


def router_view_settled(cl, busy_name, timeout=10):
    """Waits until the router's view of the load is current: the busy worker
    reported running its stream, every other decode worker reported nothing
    running (a short request that just ended is still in a report up to one
    load interval old, and two such reports would tie with the busy worker)
    and has nothing in flight from the router (the client can read a
    response's end before the router releases it; until then its queue
    estimate counts it, and the busy worker's empty queue outscores it)."""
    end = time.time() + timeout
    while time.time() < end:
        st, _, cfg = request(cl.router_port, "GET", "/v1/router/config")
        eps = {e["name"]: e for e in cfg.get("endpoints_state", [])} if st == 200 else {}
        ok = bool(eps)
        for w in cl.decode:
            ep = eps.get(w.name) or {}
            load = ep.get("load") or {}
            running = load.get("running", -1)
            idle = ep.get("inflight", -1) == 0 and ep.get("unreported", -1) == 0
            ok = ok and (running >= 1 if w.name == busy_name else running == 0 and idle)
        if ok:
            return
        time.sleep(0.05)
    check(False, "the router's load view did not settle: %s" %
          request(cl.router_port, "GET", "/v1/router/config")[2])


def prefix_blocks(cl, name):
    st, _, cfg = request(cl.router_port, "GET", "/v1/router/config")
    eps = {e["name"]: e for e in cfg.get("endpoints_state", [])} if st == 200 else {}
    return (eps.get(name) or {}).get("prefix_blocks", 0)


def wait_prefix_blocks(cl, name, at_least, timeout=15):
    """Waits until the router's index holds at least at_least block hashes
    for worker name (its load reports carry the KV events every 0.2 s; a
    loaded machine delays them, so a fixed sleep was a race)."""
    end = time.time() + timeout
    while time.time() < end:
        if prefix_blocks(cl, name) >= at_least:
            return
        time.sleep(0.05)
    check(False, "the router indexed %d blocks of %s, expected %d" %
          (prefix_blocks(cl, name), name, at_least))


def main():
    args = parse_args()
    cl = Cluster(args, policy="round_robin", pd_mode="prefix",
                 extra_yaml="pd_threshold_tokens: 64\n").start()
    rnd = random.Random(3)
    dec = [w.name for w in cl.decode]
    pre = [w.name for w in cl.prefill]

    # 1. round robin + P/D decider.
    before = served_counts(cl)
    for i in range(4):
        st, hdr, r = post(cl.router_port, "/v1/completions",
                          {"prompt": [rnd.randrange(3, 500) for _ in range(10)], "max_tokens": 3})
        check(st == 200, "short request status %d" % st)
        ph = phases(hdr)
        check(ph.get("decision") == "decode-only" and ph.get("prefill") == "local",
              "short prompt not decode-only: %s" % ph)
    d = delta(served_counts(cl), before)
    check(d[dec[0]] == 2 and d[dec[1]] == 2, "round robin over decode workers: %s" % d)
    before_p = served_counts(cl, "tandem:pd_prefill_requests_total")
    for i in range(4):
        st, hdr, r = post(cl.router_port, "/v1/completions",
                          {"prompt": [rnd.randrange(3, 500) for _ in range(200)], "max_tokens": 3})
        check(st == 200, "long request status %d" % st)
        check(phases(hdr).get("decision") == "prefill-decode", "long prompt not P/D: %s" % hdr)
    dp = delta(served_counts(cl, "tandem:pd_prefill_requests_total"), before_p)
    check(dp[pre[0]] == 2 and dp[pre[1]] == 2, "round robin over prefill workers: %s" % dp)
    print("round_robin + decider ok", flush=True)

    # 2. Hot reload under traffic: zero failed requests.
    failures, done, sent = [], threading.Event(), [0]

    def traffic():
        while not done.is_set():
            try:
                st, _, r = post(cl.router_port, "/v1/completions",
                                {"prompt": [5, 6, 7, 8] * 30, "max_tokens": 4}, timeout=30)
                if st != 200:
                    failures.append((st, r))
            except OSError as e:
                failures.append(str(e))
            sent[0] += 1

    ths = [threading.Thread(target=traffic) for _ in range(4)]
    for t in ths:
        t.start()
    time.sleep(0.5)
    cl.write_config("session_affinity", "prefix", "pd_threshold_tokens: 64\n")
    wait_policy(cl, "session_affinity")
    time.sleep(0.5)
    done.set()
    for t in ths:
        t.join()
    check(not failures, "failed requests during the reload: %s" % failures[:3])
    check(sent[0] >= 8, "too little traffic during the reload (%d)" % sent[0])
    print("hot reload under traffic: %d requests, 0 failed" % sent[0], flush=True)

    # 3. Session affinity.
    for user in ("user-1", "user-2", "user-3"):
        where = set()
        token = None
        for i in range(4):
            st, hdr, _ = request(cl.router_port, "POST", "/v1/completions",
                                 {"prompt": [rnd.randrange(3, 500) for _ in range(12)],
                                  "max_tokens": 2}, headers={"x-session-token": user})
            check(st == 200, "session request status %d" % st)
            where.add(hdr.get("x-tandem-decode"))
            token = hdr.get("x-session-token")
        check(len(where) == 1, "session %s spread over %s" % (user, where))
        check(token, "no x-session-token returned")
        st, hdr, _ = request(cl.router_port, "POST", "/v1/completions",
                             {"prompt": [9, 9, 9], "max_tokens": 2},
                             headers={"x-session-token": token})
        check(hdr.get("x-tandem-decode") in where, "token %s did not stick" % token)
    print("session_affinity ok", flush=True)

    # 4. Prefix cache.
    cl.write_config("prefix_cache", "prefix", "pd_threshold_tokens: 64\n")
    wait_policy(cl, "prefix_cache")
    prompt = [rnd.randrange(3, 500) for _ in range(320)]
    first = None
    hits0 = {w.name: metric_sum(metrics(w.http_port), "vllm:prefix_cache_hits_total")
             for w in cl.decode}
    for i in range(4):
        st, hdr, _ = post(cl.router_port, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        check(st == 200, "prefix request status %d" % st)
        first = first or hdr.get("x-tandem-decode")
        check(hdr.get("x-tandem-decode") == first, "repeated prompt moved to %s" % hdr)
        if i > 0:
            check(phases(hdr).get("decision") == "decode-only",
                  "cached prompt still prefilled remotely: %s" % hdr.get("x-tandem-phases"))
    w = [x for x in cl.decode if x.name == first][0]
    hits = metric_sum(metrics(w.http_port), "vllm:prefix_cache_hits_total") - hits0[first]
    check(hits >= 3 * 304, "prefix cache hits on %s rose by %d only" % (first, hits))
    print("prefix_cache ok (%d cached tokens served)" % hits, flush=True)

    # 4b. KV events: prompts served directly by one decode worker (bypassing the
    # router, so its approximate index knows nothing of them) are routed to that
    # worker once its load reports carried the stored block hashes. Two prompts
    # per worker, both workers: a tie-break could not pick right 4 times.
    for rnd_i in range(2):
        for w in cl.decode:
            p = [rnd.randrange(3, 500) for _ in range(320)]
            indexed = prefix_blocks(cl, w.name)
            st, _, _ = post(w.http_port, "/v1/completions", {"prompt": p, "max_tokens": 2})
            check(st == 200, "direct request to %s status %d" % (w.name, st))
            # The load reports carry the KV events of its 20 full blocks.
            wait_prefix_blocks(cl, w.name, indexed + 320 // 16)
            st, hdr, _ = post(cl.router_port, "/v1/completions", {"prompt": p, "max_tokens": 2})
            check(st == 200, "kv-events request status %d" % st)
            check(hdr.get("x-tandem-decode") == w.name,
                  "prompt cached on %s (KV events) routed to %s" % (w.name, hdr.get("x-tandem-decode")))
            check(phases(hdr).get("decision") == "decode-only",
                  "prompt cached on %s still prefilled remotely: %s"
                  % (w.name, hdr.get("x-tandem-phases")))
    print("prefix_cache from KV events ok", flush=True)

    # 5. Least loaded: one decode worker busy with a long stream.
    cl.write_config("least_loaded", "never")
    wait_policy(cl, "least_loaded")
    busy = Stream(cl.router_port, "/v1/completions",
                  {"prompt": [1, 2, 3], "max_tokens": 7000, "ignore_eos": True, "stream": True})
    busy_name = busy.headers.get("x-tandem-decode")
    ev = busy.events()
    next(ev)
    time.sleep(0.6)  # load reports show it running
    others = []
    for i in range(4):
        router_view_settled(cl, busy_name)
        st, hdr, _ = post(cl.router_port, "/v1/completions",
                          {"prompt": [rnd.randrange(3, 500) for _ in range(8)], "max_tokens": 2})
        check(st == 200, "least_loaded status %d" % st)
        others.append(hdr.get("x-tandem-decode"))
    busy.close()
    check(all(o != busy_name for o in others), "sent to the busy worker %s: %s"
          % (busy_name, others))
    cl.wait_kv_free()
    print("PASS", flush=True)


if __name__ == "__main__":
    main()
