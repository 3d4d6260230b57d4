# SPDX-License-Identifier: Apache-2.0
"""bench/pd: latency and CPU the router adds to a streamed completion.

Starts one tandem-decode and tandem-router (pd_mode never: decode-only, so the
difference is the router's HTTP parse, tokenization, routing, nng relay and SSE
re-encoding) on the tiny model. For each concurrency in --streams it runs N
concurrent streaming clients that alternate request by request between the
decode worker's HTTP port and the router (each path once per round, in a
random order), --requests requests of --max-tokens tokens per path in all:
both paths share every moment of the machine's load, so a busy shared machine
adds noise to both alike instead of to whichever path ran while it was busy.
With --base-router an older router runs beside the new one on the same decode
worker and the clients rotate over three paths: before and after in one run.
--base-extra-yaml appends YAML to the base router's config (the same binary
with a feature on or off: e.g. "featureGates: [flowControl]" measures what
flow control adds to a request while the pool has room).
Prints, per concurrency and path, p50/p99 of TTFT (request sent -> first data
event) and of inter-token latency (ITL: the gap between consecutive data
events of one stream), the differences router - direct (goal: <= 0.5 ms p50
and <= 2 ms p99 added), and the router's CPU time per 1000 tokens it streamed
(utime + stime of /proc/PID/stat, read before and after each run). The
clients are Python threads: their own overhead is the same on both paths but
adds noise, most at 100 streams on a small machine.

  /usr/bin/python3 bench/pd/bench_router_overhead.py --build build
  /usr/bin/python3 bench/pd/bench_router_overhead.py --build build \\
      --base-router /tmp/old/tandem-router   # before/after: a third path, same run
  /usr/bin/python3 bench/pd/bench_router_overhead.py --build build \\
      --base-router build/router/tandem-router --base-extra-yaml "featureGates: [flowControl]"
"""
import argparse
import os
import random
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "integration-tests"))
import pd_harness as h  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))] if xs else float("nan")


def cpu_s(pid):
    """utime + stime of the process, in seconds."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat(5)


def switches(pid):
    """Context switches (voluntary + not) summed over the process's threads: each
    futex hand-off between threads costs at least one."""
    n = 0
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/status" % (pid, tid)) as f:
                for line in f:
                    if "ctxt_switches:" in line:  # voluntary_ and nonvoluntary_
                        n += int(line.split()[-1])
        except OSError:
            pass  # a thread that ended meanwhile
    return n


def run(ports, streams, rounds, max_tokens):
    """One run: streams clients, each sending rounds requests to every path in
    ports ({name: port}), one to each path per round in a random order (a fixed
    order would give each path the same predecessor), so the paths share the
    same moments of the machine's load. Returns
    {name: (ttft, itl, tokens)} and the errors."""
    names = sorted(ports)
    res = {n: ([], [], [0]) for n in names}
    errors = []
    lock = threading.Lock()
    start = threading.Barrier(streams)

    def client(i):
        rng = random.Random(i)
        order = []
        for _ in range(rounds):  # each path once per round, in a random order
            order += rng.sample(names, len(names))
        start.wait()
        for r, name in enumerate(order):
            body = {"prompt": [3 + (i * 7 + r) % 400, 5, 7, 11, 13], "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0, "stream": True}
            t0 = time.perf_counter()
            try:
                s = h.Stream(ports[name], "/v1/completions", body, timeout=120)
                first, prev, gaps, n = None, None, [], 0
                for ev in s.events():
                    now = time.perf_counter()
                    if ev == "[DONE]":
                        break
                    if "error" in ev:
                        raise OSError("error event: %s" % ev)
                    n += 1
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - prev)
                    prev = now
                s.close()
                with lock:
                    ttft, itl, tokens = res[name]
                    if first is not None:
                        ttft.append(first - t0)
                    itl.extend(gaps)
                    tokens[0] += max_tokens if n else 0
            except OSError as e:
                with lock:
                    errors.append("%s: %s" % (name, e))

    ths = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return res, errors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--streams", default="1,10,100", help="comma-separated concurrencies")
    ap.add_argument("--requests", type=int, default=300, help="requests per path and concurrency")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--router", help="tandem-router binary (default BUILD/router/tandem-router)")
    ap.add_argument("--base-router", help="a second tandem-router (an older build) run beside the "
                    "first on the same decode worker, as a third path: before/after in one run")
    ap.add_argument("--base-extra-yaml", default="",
                    help="YAML appended to the base router's config (e.g. a feature gate)")
    ap.add_argument("--decode", help="tandem-decode binary (default BUILD/decode/tandem-decode)")
    ap.add_argument("--slow-model", action="store_true",
                    help="the harness's ~30x slower model (a decode step of milliseconds, so each "
                    "token is its own event and ITL times the path, not a burst of tokens)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="--stream-interval of the router and the decode worker (tokens per "
                    "event after the first; default 1)")
    ap.add_argument("--pin-decode", help="CPU list for the decode worker (taskset), e.g. 1")
    ap.add_argument("--pin-router", help="CPU list for the router(s), e.g. 0: apart from the "
                    "decode worker's, as on separate pods, so the router does not wait for cores "
                    "the engine holds")
    ap.add_argument("--pin-clients", help="CPU list for this script's client threads")
    args = ap.parse_args()
    b = args.build
    ns = argparse.Namespace(router=args.router or b + "/router/tandem-router",
                            prefill=b + "/prefill/tandem-prefill",
                            decode=args.decode or b + "/decode/tandem-decode",
                            mkmodel=b + "/tools/mkmodel/tandem-mkmodel",
                            workdir="/tmp/tandem-bench-pd", deadline=1800)
    os.makedirs(ns.workdir, exist_ok=True)
    cl = h.Cluster(ns, n_prefill=0, n_decode=1, policy="round_robin", pd_mode="never",
                   model=h.make_slow_model(ns) if args.slow_model else None,
                   worker_args=["--max-num-seqs", "128", "--http-threads", "256",
                                "--stream-interval", str(args.stream_interval)],
                   router_args=["--stream-interval", str(args.stream_interval)]).start()
    ports = {"direct": cl.decode[0].http_port, "router": cl.router_port}
    pids = {"router": cl.router_proc.pid}
    base = None
    if args.base_router:
        port, nng = h.free_port(), h.free_port()
        base_config = cl.config
        if args.base_extra_yaml:
            base_config = cl.config + ".base.yaml"
            with open(cl.config) as f, open(base_config, "w") as g:
                g.write(f.read() + args.base_extra_yaml.replace("\\n", "\n") + "\n")
        base = subprocess.Popen(
            [args.base_router, "--config", base_config, "--model", cl.model, "--host", "127.0.0.1",
             "--port", str(port), "--liveness-timeout", "1.0", "--debug-headers", "--nng-url",
             "tcp://127.0.0.1:%d" % nng], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        h.register(base)
        cl.wait_health(port, base)
        time.sleep(0.6)  # the worker's first load report
        ports["base"] = port
        pids["base"] = base.pid
    routers = sorted(pids, reverse=True)  # router, base

    def pin(cpus, pid):
        subprocess.run(["taskset", "-a", "-c", "-p", cpus, str(pid)], check=True,
                       stdout=subprocess.DEVNULL)
    if args.pin_decode:
        pin(args.pin_decode, cl.decode[0].proc.pid)
    for r in routers if args.pin_router else []:
        pin(args.pin_router, pids[r])
    if args.pin_clients:
        os.sched_setaffinity(0, [int(c) for c in args.pin_clients.split(",")])
    if args.pin_decode or args.pin_router or args.pin_clients:
        print("pinned: decode %s, router %s, clients %s" % (
            args.pin_decode or "-", args.pin_router or "-", args.pin_clients or "-"))
    run(ports, 10, 1, args.max_tokens)  # warm up
    print("streams path   requests  ttft p50/p99 ms   itl p50/p99 ms", flush=True)
    for streams in [int(x) for x in args.streams.split(",")]:
        rounds = max(1, args.requests // streams)
        c0 = {r: cpu_s(pids[r]) for r in routers}
        s0 = {r: switches(pids[r]) for r in routers}
        res, errors = run(ports, streams, rounds, args.max_tokens)
        cpu = {r: cpu_s(pids[r]) - c0[r] for r in routers}
        sw = {r: switches(pids[r]) - s0[r] for r in routers}
        h.check(not errors, "%d errors: %s" % (len(errors), errors[:2]))
        for name in ["direct"] + routers:
            ttft, itl, _ = res[name]
            print("%7d %-6s %8d  %6.2f / %6.2f   %6.2f / %6.2f" % (
                streams, name, len(ttft), 1e3 * pct(ttft, 50), 1e3 * pct(ttft, 99),
                1e3 * pct(itl, 50), 1e3 * pct(itl, 99)), flush=True)
        for r in routers:
            d = {m: [1e3 * (pct(res[r][i], p) - pct(res["direct"][i], p)) for p in (50, 99)]
                 for i, m in enumerate(("ttft", "itl"))}
            toks = res[r][2][0]
            print("%7d %-6s adds: ttft p50 %+.2f ms p99 %+.2f ms, itl p50 %+.2f ms p99 %+.2f ms "
                  "(goal <= 0.5 / 2 ms); cpu %.4f s and %.0f context switches per 1000 tokens "
                  "(%d tokens)" % (
                      streams, r, d["ttft"][0], d["ttft"][1], d["itl"][0], d["itl"][1],
                      1e3 * cpu[r] / toks if toks else float("nan"),
                      1e3 * sw[r] / toks if toks else float("nan"), toks), flush=True)
    if base:
        base.terminate()
        base.wait()
    cl.stop()


if __name__ == "__main__":
    main()
