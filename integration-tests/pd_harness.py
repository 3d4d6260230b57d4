# SPDX-License-Identifier: Apache-2.0
"""Helpers for the disaggregated-serving integration tests (Python 3 stdlib only).

A Cluster starts tandem-router, N tandem-prefill and M tandem-decode processes
on 127.0.0.1 with fixed ports picked at start (so a worker restarted by a test
comes back on the same addresses, as a Kubernetes pod behind the same Service
would), writes the router's config file, and kills every process it started
when the test ends (atexit and a hard deadline). Exit status: 0 pass, 1 fail.
"""
import argparse
import os
import signal
import subprocess
import time

from proc_harness import (arm_deadline, check, fail, free_port, kill_all,  # noqa: F401
                          read_file, register, watch_log, watch_sanitizers)
# The HTTP helpers are shared with the other harnesses (re-exported).
from proc_harness import Stream, metric_sum, metrics, post, request  # noqa: F401


def parse_args(extra=None):
    """The common flags; extra(parser), when given, adds a test's own."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--mkmodel", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--deadline", type=float, default=240.0)
    ap.add_argument("--decode-flags", default="",
                    help="extra flags for every decode worker (whitespace-separated), e.g. "
                         "a --speculative-config")
    if extra:
        extra(ap)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    arm_deadline(args.deadline)
    watch_sanitizers(args.workdir)
    return args


def make_model(args, name="pd-tiny"):
    """The tiny model with a context long enough for prompts of a few thousand tokens."""
    out = os.path.join(args.workdir, name)
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        subprocess.run([args.mkmodel, "--preset", "tiny", "--max-pos", "8192", "--out", out],
                       check=True, stdout=subprocess.DEVNULL)
    return out


def make_slow_model(args):
    """A model ~30x slower per token than the tiny one (hidden 512, 4 layers): a
    heavy request keeps its engine busy for seconds, a stream lasts long enough
    to kill its worker mid-way."""
    out = os.path.join(args.workdir, "pd-slow")
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        subprocess.run([args.mkmodel, "--preset", "tiny", "--hidden", "512", "--intermediate",
                        "2048", "--layers", "4", "--heads", "8", "--kv-heads", "2", "--max-pos",
                        "2048", "--out", out], check=True, stdout=subprocess.DEVNULL)
    return out


# ---- HTTP ---------------------------------------------------------------------------------
def stream_text(port, body):
    """Full streamed text, token ids and finish reason of choice 0."""
    s = Stream(port, "/v1/completions", dict(body, stream=True))
    check(s.status == 200, "stream status %d" % s.status)
    text, ids, finish = "", [], None
    for ev in s.events():
        if ev == "[DONE]":
            break
        check("error" not in ev, "stream error event: %s" % ev)
        for ch in ev.get("choices", []):
            text += ch.get("text", "")
            ids += ch.get("token_ids") or []
            finish = ch.get("finish_reason") or finish
    s.close()
    return text, ids, finish, s.headers


# ---- the cluster --------------------------------------------------------------------------
class Worker:
    def __init__(self, kind, idx, http_port, nng_port):
        self.kind, self.idx = kind, idx
        self.http_port, self.nng_port = http_port, nng_port
        # The ports the router's config names for this worker: its own, or a
        # proxy's in front of them (test_faults.py partitions a worker that way).
        self.route_http_port, self.route_nng_port = http_port, nng_port
        self.proc = None

    @property
    def name(self):
        """The worker as the router names it (x-tandem-decode, metric labels)."""
        return "127.0.0.1:%d" % self.route_http_port


class Cluster:
    def __init__(self, args, n_prefill=2, n_decode=2, policy="round_robin", pd_mode="always",
                 extra_yaml="", model=None, worker_args=(), deadline_s=120, router_args=(),
                 health=(0.5, 0.5, 2), prefill_args=(), decode_args=()):
        self.args = args
        # Active health checks: interval, timeout (s), failures -> unhealthy. The
        # tests' default is fast to notice a kill; the soak uses the router's own
        # defaults (2, 1, 3).
        self.health = health
        self.router_args = list(router_args)  # appended to the router's flags
        self.deadline_s = deadline_s  # the router's request.deadline_seconds
        # The control plane runs authenticated, as tandem up and the k8s
        # manifests run it: every process of the cluster inherits one secret.
        os.environ.setdefault("TANDEM_INTERNAL_SECRET", os.urandom(24).hex())
        self.model = model or make_model(args)
        self.worker_args = list(worker_args)  # appended to every worker's flags (override)
        # Run in each worker process before it starts (e.g. a lower resource
        # limit for one restart); None: nothing.
        self.worker_preexec = None
        self.kind_args = {"prefill": list(prefill_args),  # then these
                          "decode": list(decode_args) + getattr(args, "decode_flags", "").split()}
        self.prefill = [Worker("prefill", i, free_port(), free_port()) for i in range(n_prefill)]
        self.decode = [Worker("decode", i, free_port(), free_port()) for i in range(n_decode)]
        self.router_port = free_port()
        self.router_nng = free_port()
        self.router_proc = None
        self.config = os.path.join(args.workdir, "router-%d.yaml" % os.getpid())
        self.write_config(policy, pd_mode, extra_yaml)

    def write_config(self, policy, pd_mode, extra_yaml=""):
        lines = ["policy: %s" % policy, "pd_mode: %s" % pd_mode, "endpoints:", "  prefill:"]
        for w in self.prefill:
            lines.append("  - {host: 127.0.0.1, http_port: %d, nng_port: %d}"
                         % (w.route_http_port, w.route_nng_port))
        lines.append("  decode:")
        for w in self.decode:
            lines.append("  - {host: 127.0.0.1, http_port: %d, nng_port: %d}"
                         % (w.route_http_port, w.route_nng_port))
        lines += ["health:", "  interval_seconds: %g" % self.health[0],
                  "  timeout_seconds: %g" % self.health[1],
                  "  failure_threshold: %d" % self.health[2], "load_stale_seconds: 2", "request:",
                  "  deadline_seconds: %g" % self.deadline_s, "  prefill_retries: 1"]
        text = "\n".join(lines) + "\n" + extra_yaml
        tmp = self.config + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self.config)

    def _log(self, name):
        path = os.path.join(self.args.workdir, "%s-%d.log" % (name, os.getpid()))
        watch_log(path, read_file(path))  # a sanitizer report there fails the test
        return open(path, "ab")

    def start_worker(self, w):
        binary = self.args.prefill if w.kind == "prefill" else self.args.decode
        cmd = [binary, "--model", self.model, "--host", "127.0.0.1", "--port", str(w.http_port),
               "--nng-url", "tcp://127.0.0.1:%d" % w.nng_port, "--threads", "1",
               "--kv-cache-memory", "64MiB"] + self.worker_args + self.kind_args[w.kind]
        env = dict(os.environ)
        if w.route_nng_port != w.nng_port:
            # Peers reach this worker's inbox through a proxy (test_faults.py):
            # the handshake binds each connection to the inbox's own endpoint,
            # so the proxy's is declared (docs/pd-protocol.md, Authentication).
            env["TANDEM_INTERNAL_ALIASES"] = "127.0.0.1:%d" % w.route_nng_port
        w.proc = subprocess.Popen(cmd, stdout=self._log("%s%d" % (w.kind, w.idx)),
                                  stderr=subprocess.STDOUT, preexec_fn=self.worker_preexec,
                                  env=env)
        register(w.proc)

    def wait_health(self, port, proc, timeout=30):
        t0 = time.time()
        while time.time() - t0 < timeout:
            check(proc.poll() is None, "process on port %d exited (%s)" % (port, proc.returncode))
            try:
                st, _, _ = request(port, "GET", "/health", timeout=2)
                if st == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        fail("port %d not healthy within %.0f s" % (port, timeout))

    def start(self):
        for w in self.prefill + self.decode:
            self.start_worker(w)
        for w in self.prefill + self.decode:
            self.wait_health(w.http_port, w.proc)
        self.start_router()
        return self

    def start_router(self, settle=0.6, nng_url=None):
        """Starts (or, after a kill, restarts) the router on its ports and waits
        for it to be healthy, then `settle` s for the workers' first load reports.
        nng_url: its inbox instead of tcp://127.0.0.1:<router_nng>."""
        cmd = [self.args.router, "--config", self.config, "--model", self.model, "--host",
               "127.0.0.1", "--port", str(self.router_port), "--liveness-timeout", "1.0",
               "--debug-headers",
               "--nng-url", nng_url or "tcp://127.0.0.1:%d" % self.router_nng] + self.router_args
        self.router_proc = subprocess.Popen(cmd, stdout=self._log("router"),
                                            stderr=subprocess.STDOUT)
        register(self.router_proc)
        self.wait_health(self.router_port, self.router_proc)
        time.sleep(settle)

    def stop(self):
        """Ends the router and every worker (a test may then start another cluster)."""
        for p in [self.router_proc] + [w.proc for w in self.workers()]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=20)

    def kill(self, w, sig=signal.SIGKILL):
        w.proc.send_signal(sig)
        w.proc.wait(timeout=20)

    def restart(self, w):
        self.start_worker(w)
        self.wait_health(w.http_port, w.proc)

    def workers(self):
        return self.prefill + self.decode

    def wait_kv_free(self, timeout=10):
        """Every live worker reports KV usage 0 and nothing running or waiting."""
        t0 = time.time()
        last = None
        while time.time() - t0 < timeout:
            last = []
            for w in self.workers():
                if w.proc is None or w.proc.poll() is not None:
                    continue
                m = metrics(w.http_port)
                last.append((w.name, metric_sum(m, "vllm:kv_cache_usage_perc"),
                             metric_sum(m, "vllm:num_requests_running"),
                             metric_sum(m, "vllm:num_requests_waiting")))
            if all(u == 0 and r == 0 and q == 0 for _, u, r, q in last):
                return
            time.sleep(0.1)
        fail("KV not freed everywhere within %.0f s: %s" % (timeout, last))
