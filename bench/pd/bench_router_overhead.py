# SPDX-License-Identifier: Apache-2.0
"""bench/pd: latency the router adds, at 100 concurrent streams.

Starts one tandem-decode and tandem-router (pd_mode never: decode-only, so the
difference is the router's HTTP parse, tokenization, routing, nng relay and SSE
re-encoding) on the tiny model, then runs --streams concurrent streaming
clients, each sending --rounds requests of --max-tokens tokens, first directly
to the decode worker and then through the router. Prints p50/p99 of TTFT and
end-to-end latency for both paths and their differences (goal: <= 1 ms added
at p99). The clients are Python threads: their own overhead is the same on
both paths but adds noise.

  /usr/bin/python3 bench/pd/bench_router_overhead.py --build build
"""
import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "integration-tests"))
import pd_harness as h  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))]


def run(port, streams, rounds, max_tokens):
    ttft, e2e, errors = [], [], []
    lock = threading.Lock()
    start = threading.Barrier(streams)

    def client(i):
        start.wait()
        for r in range(rounds):
            body = {"prompt": [3 + (i * 7 + r) % 400, 5, 7, 11, 13], "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0}
            t0 = time.perf_counter()
            try:
                s = h.Stream(port, "/v1/completions", dict(body, stream=True), timeout=120)
                first = None
                for ev in s.events():
                    if first is None and ev != "[DONE]":
                        first = time.perf_counter()
                s.close()
                t1 = time.perf_counter()
                with lock:
                    ttft.append((first or t1) - t0)
                    e2e.append(t1 - t0)
            except OSError as e:
                with lock:
                    errors.append(str(e))

    ths = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return ttft, e2e, errors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    b = args.build
    ns = argparse.Namespace(router=b + "/router/tandem-router", prefill=b + "/prefill/tandem-prefill",
                            decode=b + "/decode/tandem-decode",
                            mkmodel=b + "/tools/mkmodel/tandem-mkmodel",
                            workdir="/tmp/tandem-bench-pd", deadline=1800)
    os.makedirs(ns.workdir, exist_ok=True)
    cl = h.Cluster(ns, n_prefill=0, n_decode=1, policy="round_robin", pd_mode="never",
                   worker_args=["--max-num-seqs", "128", "--http-threads", "256"]).start()
    res = {}
    for name, port in (("direct", cl.decode[0].http_port), ("router", cl.router_port)):
        run(port, 10, 1, args.max_tokens)  # warm up
        ttft, e2e, errors = run(port, args.streams, args.rounds, args.max_tokens)
        h.check(not errors, "%s: %d errors: %s" % (name, len(errors), errors[:2]))
        res[name] = (ttft, e2e)
        print("%-6s requests=%d ttft p50=%.2f ms p99=%.2f ms  e2e p50=%.2f ms p99=%.2f ms" % (
            name, len(e2e), 1e3 * pct(ttft, 50), 1e3 * pct(ttft, 99), 1e3 * pct(e2e, 50),
            1e3 * pct(e2e, 99)), flush=True)
    for metric, idx in (("ttft", 0), ("e2e", 1)):
        d50 = pct(res["router"][idx], 50) - pct(res["direct"][idx], 50)
        d99 = pct(res["router"][idx], 99) - pct(res["direct"][idx], 99)
        print("router added %s: p50 %+.2f ms  p99 %+.2f ms (goal p99 <= 1 ms)"
              % (metric, 1e3 * d50, 1e3 * d99))


if __name__ == "__main__":
    main()
