# SPDX-License-Identifier: Apache-2.0
"""Helpers for the whole-stack integration tests (Python 3 stdlib only).

A Stack runs `tandem up` exactly as an operator would (router + prefill +
decode workers as the launcher's children, free ports with --port 0), reads
the launcher's output to learn each process's address and pid, and stops it
with SIGTERM like Ctrl-C would. Whatever happens, every process is killed when
the test ends (atexit and a hard deadline per test: the launcher first, then
any child pid it printed). Exit status: 0 pass, 1 fail, 77 skipped (ctest
SKIP_RETURN_CODE).
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time

# The process registry (killed at exit, on fail and at the deadline), fail/check
# and free_port come from proc_harness; _PROCS/_CHILD_PIDS are its lists.
from proc_harness import CHILD_PIDS as _CHILD_PIDS  # noqa: E402
from proc_harness import PROCS as _PROCS  # noqa: E402,F401 (re-exported)
from proc_harness import (arm_deadline, check, fail, free_port, kill_all,  # noqa: E402,F401
                          watch_log, watch_sanitizers)
# The HTTP helpers are shared with the other harnesses (re-exported).
from proc_harness import Stream, metric_sum, metrics, post, request  # noqa: E402,F401


def parse_args(extra=None):
    """The common arguments (extra(ap) may add more); arms the test's hard deadline."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tandem", required=True, help="the tandem launcher binary")
    ap.add_argument("--mkmodel", required=True, help="tandem-mkmodel binary")
    ap.add_argument("--workdir", required=True, help="scratch folder in the build tree")
    ap.add_argument("--deadline", type=float, default=240.0, help="seconds before the test fails")
    # The real clients (only the tests that use them read these).
    ap.add_argument("--node", default="node", help="Node.js, for the OpenAI SDK test")
    ap.add_argument("--npm", default="npm", help="npm, to install the pinned openai package")
    ap.add_argument("--prometheus", default="prometheus", help="the Prometheus server binary")
    if extra:
        extra(ap)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    arm_deadline(args.deadline)
    watch_sanitizers(args.workdir)
    return args


def skip(msg):
    print("SKIPPED: " + msg, flush=True)
    kill_all()
    sys.exit(77)


def make_model(args, name="stack-tiny"):
    """A tandem-mkmodel tiny folder (once per workdir; 8k context for long streams)."""
    out = os.path.join(args.workdir, name)
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        r = subprocess.run([args.mkmodel, "--preset", "tiny", "--max-pos", "8192", "--out", out],
                           capture_output=True, text=True, timeout=120)
        check(r.returncode == 0, "tandem-mkmodel failed: %s" % r.stderr)
    return out


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it has exited for our purposes.
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


# ---- the stack ----------------------------------------------------------------------------
_ENDPOINT = re.compile(r"^tandem\s+\|\s+(router|decode-\d+|prefill-\d+)\s+http://([^ ]+):(\d+)"
                       r"(?:\s+nng tcp://[^ ]+:(\d+))?.*\bpid (\d+)")


class Stack:
    """`tandem up` with its output collected in self.lines."""

    def __init__(self, args, *flags, env=None, wait_ready=True, ready_timeout=120.0):
        self.cmd = [args.tandem, "up", "--port", "0", "--threads-per-worker", "1"] + list(flags)
        e = dict(os.environ)
        e.update(env or {})
        e["NO_COLOR"] = "1"
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, env=e)
        _PROCS.append(self.proc)
        self.lines = []
        self.endpoints = {}  # name -> {"port", "nng_port", "pid"}
        self.curl = None
        self.curls = []
        self.ready = threading.Event()
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        # Its children's output comes through it: a sanitizer report there
        # fails the test (read once every process is killed).
        watch_log("tandem up pid %d" % self.proc.pid,
                  lambda: (self.reader.join(2), self.log())[1])
        if wait_ready:
            if not self.ready.wait(ready_timeout) or not self.endpoints:
                fail("tandem up did not become ready within %.0f s:\n%s"
                     % (ready_timeout, self.log()))

    def _read(self):
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            with self.lock:
                self.lines.append(line)
            m = _ENDPOINT.match(line)
            if m:
                pid = int(m.group(5))
                self.endpoints[m.group(1)] = {
                    "host": m.group(2), "port": int(m.group(3)),
                    "nng_port": int(m.group(4)) if m.group(4) else None, "pid": pid}
                _CHILD_PIDS.append(pid)
            elif line.startswith("curl "):
                self.curls.append(line)  # the first is the short one; P/D stacks add a long one
                if self.curl is None:
                    self.curl = line
                self.ready.set()
        self.ready.set()

    def log(self):
        with self.lock:
            return "\n".join(self.lines)

    def port(self, name="router"):
        check(name in self.endpoints, "no %s in tandem up's output:\n%s" % (name, self.log()))
        return self.endpoints[name]["port"]

    def pids(self):
        return [e["pid"] for e in self.endpoints.values()]

    def wait_line(self, pattern, timeout=30.0):
        """Waits until a line matching pattern appeared; returns it."""
        rx = re.compile(pattern)
        end = time.time() + timeout
        while time.time() < end:
            with self.lock:
                for line in self.lines:
                    if rx.search(line):
                        return line
            time.sleep(0.05)
        fail("no line matching %r within %.0f s:\n%s" % (pattern, timeout, self.log()))

    def wait_exit(self, timeout=60.0):
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            fail("tandem up did not exit within %.0f s:\n%s" % (timeout, self.log()))
        self.reader.join(10)
        return rc

    def stop(self, sig=signal.SIGTERM, timeout=90.0):
        """Signals the launcher (as Ctrl-C would) and returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait_exit(timeout)

    def check_children_gone(self, timeout=10.0):
        end = time.time() + timeout
        while time.time() < end and any(pid_alive(p) for p in self.pids()):
            time.sleep(0.1)
        left = [n for n, e in self.endpoints.items() if pid_alive(e["pid"])]
        check(not left, "still running after tandem up exited: %s" % left)
