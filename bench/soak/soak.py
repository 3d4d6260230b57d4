# SPDX-License-Identifier: Apache-2.0
"""bench/soak: N concurrent streams for T minutes through tandem-router on the
tiny model, with the memory of every process sampled over time (issue 11).

Starts tandem-router + P tandem-prefill + D tandem-decode on loopback (the
integration tests' pd_harness: fixed ports, the cluster's shared secret,
pd_mode always, so every request crosses router -> decode -> prefill -> KV
push), then runs tandem-bench with --duration (requests back to back at
--max-concurrency N, random prompts of --input-len tokens, --output-len
tokens each with ignore_eos) and samples VmRSS of each process from
/proc/PID/status every --sample seconds. At the end it waits for the workers'
gauges to settle and prints: RSS start / warm / peak / end per process (MiB;
start = before the load, warm = the sample half way through the run, end =
the last sample under load), the RSS series, requests completed and failed (with
reasons), throughput, and the final vllm:kv_cache_usage_perc,
vllm:num_requests_running, vllm:num_requests_waiting per worker and the
router's tandem:router_inflight_requests.

--check makes it a test (exit 1 on any breach): 0 failed requests, the
concurrency reached, every final gauge 0, and no process's RSS growing after
the warm-up by more than --rss-growth (fraction of the warm value) plus
--rss-slack MiB. The ctest bench_soak (label soak) runs 1 minute at 200 streams.

  /usr/bin/python3 bench/soak/soak.py --build build --streams 200 --minutes 3 [--json F]

Exit status: 0 done (with --check: passed), 1 a check failed or the stack
did not come up, 2 bad arguments.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "integration-tests"))
import pd_harness as h  # noqa: E402

MIB = 1024.0 * 1024.0


def rss_bytes(pid):
    """VmRSS of pid in bytes; None once the process is gone."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class Sampler:
    """Samples RSS of named processes every `period` seconds on a thread."""

    def __init__(self, procs, period):
        self.procs = procs  # name -> pid
        self.period = period
        self.samples = []  # (t, {name: bytes})
        self.t0 = time.time()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def take(self):
        self.samples.append((time.time() - self.t0,
                             {n: rss_bytes(p) for n, p in list(self.procs.items())}))

    def _run(self):
        while not self.stop.wait(self.period):
            self.take()

    def start(self):
        self.take()
        self.thread.start()

    def finish(self):
        self.stop.set()
        self.thread.join()
        self.take()


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", help="build folder (finds the binaries below in it)")
    for b in ("router", "prefill", "decode", "mkmodel", "bench"):
        ap.add_argument("--" + b, help="path of the %s binary (default: under --build)" % b)
    ap.add_argument("--workdir", default="/tmp/tandem-soak", help="model, logs, JSON")
    ap.add_argument("--streams", type=int, default=200, help="concurrent streams (default 200)")
    ap.add_argument("--minutes", type=float, default=3.0, help="load time (default 3)")
    ap.add_argument("--n-prefill", type=int, default=1)
    ap.add_argument("--n-decode", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--sample", type=float, default=5.0, help="RSS sample period, s")
    ap.add_argument("--worker-args", default="", help="extra flags for every worker")
    ap.add_argument("--json", help="write the summary and the RSS series here")
    ap.add_argument("--check", action="store_true", help="fail on errors, gauges, RSS growth")
    ap.add_argument("--rss-growth", type=float, default=0.10,
                    help="--check: allowed RSS growth after warm-up, fraction (default 0.10)")
    ap.add_argument("--rss-slack", type=float, default=8.0,
                    help="--check: allowed RSS growth after warm-up, MiB, added (default 8)")
    a = ap.parse_args()
    paths = {"router": "router/tandem-router", "prefill": "prefill/tandem-prefill",
             "decode": "decode/tandem-decode", "mkmodel": "tools/mkmodel/tandem-mkmodel",
             "bench": "bench/serve/tandem-bench"}
    for k, rel in paths.items():
        if getattr(a, k) is None:
            if not a.build:
                ap.error("--%s or --build is required" % k)
            setattr(a, k, os.path.join(a.build, rel))
        if not os.access(getattr(a, k), os.X_OK):
            ap.error("--%s: %s is not an executable (build it first)" % (k, getattr(a, k)))
    if a.streams < 1 or a.minutes <= 0 or a.sample <= 0 or a.n_prefill < 0 or a.n_decode < 1:
        ap.error("--streams, --minutes, --sample and --n-decode must be positive")
    os.makedirs(a.workdir, exist_ok=True)
    a.deadline = a.minutes * 60 + 600  # pd_harness's hard bound on the whole run
    return a


def gauges(cl):
    out = {}
    for w in cl.workers():
        m = h.metrics(w.http_port)
        out["%s%d" % (w.kind, w.idx)] = {
            "kv_cache_usage_perc": h.metric_sum(m, "vllm:kv_cache_usage_perc"),
            "num_requests_running": h.metric_sum(m, "vllm:num_requests_running"),
            "num_requests_waiting": h.metric_sum(m, "vllm:num_requests_waiting")}
    m = h.metrics(cl.router_port)
    out["router"] = {"inflight_requests": h.metric_sum(m, "tandem:router_inflight_requests")}
    return out


def wait_settled(cl, timeout=60):
    t0 = time.time()
    while True:
        g = gauges(cl)
        if all(v == 0 for d in g.values() for v in d.values()) or time.time() - t0 > timeout:
            return g, time.time() - t0
        time.sleep(0.2)


def main():
    a = parse_args()
    h.arm_deadline(a.deadline)
    # The KV pool sized for the load (tokens in flight on a decode worker, twice,
    # at the tiny model's 512 bytes a token; 16 MiB at least), so that the pool's
    # pages are all touched early in the run: its first touch grows RSS by the
    # pool's size and is not a leak. --worker-args overrides it.
    per_decode = -(-a.streams // a.n_decode) * (a.input_len + a.output_len) * 2 * 512
    kv_mib = max(16, -(-per_decode // int(MIB)))
    extra = ["--kv-cache-memory", "%dMiB" % kv_mib] + a.worker_args.split()
    # 200 streams on 2 decode workers: 100 each, 64 running (--max-num-seqs) and
    # the rest waiting (bounded by --max-waiting 1024); the router needs one
    # HTTP thread per open stream.
    cl = h.Cluster(a, n_prefill=a.n_prefill, n_decode=a.n_decode, policy="round_robin",
                   pd_mode="always" if a.n_prefill else "never", worker_args=extra,
                   router_args=["--http-threads", str(a.streams + 16)], deadline_s=600,
                   health=(2, 1, 3))  # the router's defaults, not the tests' fast ones
    cl.start()
    procs = {"router": cl.router_proc.pid}
    for w in cl.workers():
        procs["%s%d" % (w.kind, w.idx)] = w.proc.pid
    st, _, models = h.request(cl.router_port, "GET", "/v1/models")
    h.check(st == 200, "GET /v1/models: %d" % st)
    served = models["data"][0]["id"]

    sampler = Sampler(procs, a.sample)
    sampler.start()
    out_json = os.path.join(a.workdir, "bench-%d.json" % os.getpid())
    cmd = ["nice", "-n", "5", a.bench, "--base-url", "http://127.0.0.1:%d" % cl.router_port,
           "--model", cl.model, "--served-model-name", served, "--dataset", "random",
           "--input-len", str(a.input_len), "--output-len", str(a.output_len),
           "--num-prompts", "1000", "--max-concurrency", str(a.streams),
           "--duration", str(a.minutes * 60), "--timeout", "300", "--json", out_json]
    print("soak: %d streams for %g min through the router (%d prefill, %d decode, KV pool "
          "%d MiB each), %d+%d tokens per request" % (a.streams, a.minutes, a.n_prefill,
                                                     a.n_decode, kv_mib, a.input_len,
                                                     a.output_len), flush=True)
    t_load = time.time()
    bench = h.register(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    bench_out = bench.communicate()[0].decode("utf-8", "replace")
    load_s = time.time() - t_load
    sampler.take()  # the end of the load
    end_idx = len(sampler.samples) - 1
    if bench.returncode != 0:
        print(bench_out)
        h.fail("tandem-bench exited %d" % bench.returncode)
    final, settle_s = wait_settled(cl)
    sampler.finish()
    with open(out_json) as f:
        r = json.load(f)

    # RSS table: start (before the load), warm (half way), peak, end (last under load).
    samples = sampler.samples
    warm_t = samples[0][0] + (samples[end_idx][0] - samples[0][0]) / 2.0
    warm_idx = min(range(end_idx + 1), key=lambda i: abs(samples[i][0] - warm_t))
    names = list(samples[0][1].keys())
    table = {}
    for n in names:
        series = [s[1].get(n) for s in samples[:end_idx + 1]]
        series = [x for x in series if x is not None]
        table[n] = {"start": samples[0][1][n], "warm": samples[warm_idx][1][n],
                    "peak": max(series), "end": samples[end_idx][1][n]}
    print("\nRSS (MiB)     start    warm    peak     end", flush=True)
    for n in names:
        t = table[n]
        print("%-10s %8.1f %7.1f %7.1f %7.1f" % (n, t["start"] / MIB, t["warm"] / MIB,
                                                 t["peak"] / MIB, t["end"] / MIB))
    print("\nRSS over time (MiB)\n%8s " % "t (s)" + " ".join("%9s" % n for n in names))
    for t, row in samples:
        print("%8.0f " % t + " ".join("%9s" % ("%.1f" % (row[n] / MIB) if row.get(n) else "-")
                                      for n in names))
    reasons = r.get("failure_reasons") or {}
    print("\nrequests: %d completed, %d failed %s in %.0f s (%.1f req/s, %.0f output tok/s); "
          "peak concurrency %d; TTFT p50 %.0f ms p99 %.0f ms"
          % (r["completed"], r["failed"], json.dumps(reasons) if reasons else "", load_s,
             r["request_throughput"], r["output_throughput"], r["max_concurrent_requests"],
             r["median_ttft_ms"], r["p99_ttft_ms"]))
    print("final gauges (%.1f s after the load): %s" % (settle_s, json.dumps(final)), flush=True)

    problems = []
    if r["failed"]:
        problems.append("%d failed requests: %s" % (r["failed"], reasons))
    if r["completed"] < a.streams:
        problems.append("only %d requests completed" % r["completed"])
    if r["max_concurrent_requests"] < a.streams:
        problems.append("concurrency reached %d of %d" % (r["max_concurrent_requests"],
                                                         a.streams))
    for who, d in final.items():
        for k, v in d.items():
            if v != 0:
                problems.append("%s %s = %g after the load" % (who, k, v))
    for n, t in table.items():
        bound = t["warm"] * (1 + a.rss_growth) + a.rss_slack * MIB
        if t["end"] > bound:
            problems.append("%s RSS grew from %.1f MiB (warm) to %.1f MiB (bound %.1f)"
                            % (n, t["warm"] / MIB, t["end"] / MIB, bound / MIB))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"streams": a.streams, "minutes": a.minutes, "load_s": load_s,
                       "completed": r["completed"], "failed": r["failed"],
                       "failure_reasons": reasons,
                       "request_throughput": r["request_throughput"],
                       "output_throughput": r["output_throughput"],
                       "max_concurrent_requests": r["max_concurrent_requests"],
                       "rss": table, "rss_series": samples, "final_gauges": final,
                       "problems": problems}, f, indent=1)
    os.unlink(out_json)
    for p in problems:
        print(("FAIL: " if a.check else "note: ") + p, flush=True)
    if a.check and problems:
        h.fail("%d check(s) failed" % len(problems))
    print("PASS" if a.check else "done", flush=True)


if __name__ == "__main__":
    main()
