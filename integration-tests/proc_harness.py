# SPDX-License-Identifier: Apache-2.0
"""Process and port helpers shared by decode_harness, pd_harness and stack_harness (Python 3
stdlib only): every process a test starts is registered here and killed when
the test ends (atexit, fail, or the hard deadline), so a failing or hanging
test never leaves servers behind. Exit status convention: 0 pass, 1 fail.

Slower builds and machines: measure_slowness(port) times a fixed load on a
running service and says how many times slower than a release build on the
development machine it ran; tests multiply their time bounds by that factor
(an ASan + UBSan build is 3-20 times slower, a loaded machine more).

Sanitizer builds: watch_sanitizers(workdir) (each harness's parse_args calls
it) sends the AddressSanitizer / UndefinedBehaviorSanitizer / LeakSanitizer
reports of every process the test starts to files in a folder of its own, and
a test that leaves any report there fails, printing it, whatever it asserted.
The services' own output is searched too (watch_log: the harnesses register
each log file or collected stderr), since gcc's UBSan in an ASan build prints
its reports to stderr whatever log_path says.
"""
import atexit
import glob
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

PROCS = []  # Popen objects the test started
CHILD_PIDS = []  # pids of processes started by those (e.g. the launcher's workers)


def kill_all():
    for p in PROCS:
        if p.poll() is None:
            p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
    for pid in CHILD_PIDS:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


atexit.register(kill_all)


def register(proc):
    """Kills proc with the rest when the test ends; returns it."""
    PROCS.append(proc)
    return proc


def arm_deadline(seconds):
    """A hard bound: whatever hangs, after `seconds` the test fails and its
    processes die."""
    def on_alarm(signum, frame):
        kill_all()
        print("FAIL: test deadline of %.0f s passed" % seconds, flush=True)
        _print_sanitizer_reports()
        os._exit(1)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(seconds))


# ---- slowness factor ---------------------------------------------------------------------
# The reference load: SLOW_STREAMS concurrent greedy completions of SLOW_TOKENS
# tokens each (ignore_eos, a 40-token prompt) on the tiny model. A release
# build on the 2-core development machine took 0.4-1.5 s per completion at
# load average 10-100: SLOW_REFERENCE_S is the slow end, so a release build
# there gets factor 1 and only a slower build or machine stretches bounds.
SLOW_STREAMS = 8
SLOW_TOKENS = 1000
SLOW_REFERENCE_S = 1.5


def measure_slowness(port, timeout=300):
    """Runs the reference load against the OpenAI server on 127.0.0.1:port
    (a worker or the router); returns (mean seconds per completion, factor),
    factor = max(1, that / SLOW_REFERENCE_S). Fails the test if a completion
    does not succeed."""
    rnd = random.Random(11)
    took, errors = [], []

    def one(prompt):
        t0 = time.time()
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
            c.request("POST", "/v1/completions",
                      body=json.dumps({"prompt": prompt, "max_tokens": SLOW_TOKENS,
                                       "ignore_eos": True, "temperature": 0}),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            raw = r.read()
            c.close()
            if r.status != 200:
                errors.append("HTTP %d %s" % (r.status, raw[:200]))
                return
        except (OSError, http.client.HTTPException) as e:
            errors.append(repr(e))
            return
        took.append(time.time() - t0)

    threads = [threading.Thread(target=one, args=([rnd.randrange(3, 500) for _ in range(40)],),
                                daemon=True) for _ in range(SLOW_STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check(not errors, "slowness calibration on port %d failed: %s" % (port, errors))
    mean = sum(took) / len(took)
    return mean, max(1.0, mean / SLOW_REFERENCE_S)


def tokens_for(seconds, took, lo=200, hi=8000):
    """max_tokens for a stream of about `seconds` at the reference load's
    concurrency, given measure_slowness's seconds per SLOW_TOKENS (`took`). The
    tiny model's cost per token grows with the context, so a stream's time grows
    about as the square of its length: scale by the square root, within
    [lo, hi] (hi: within the tests' 8 192-token context)."""
    return max(lo, min(hi, int(SLOW_TOKENS * (seconds / max(took, 1e-3)) ** 0.5)))


# ---- sanitizer reports ------------------------------------------------------------------
_SAN_DIR = None  # this test's report folder, once watch_sanitizers ran


def _with_options(var, extra):
    """The environment's `var` options (e.g. .ci/run's detect_leaks=1) with
    `extra` appended: a later option wins in the sanitizers' parser."""
    old = os.environ.get(var, "")
    return (old + ":" if old else "") + extra


def watch_sanitizers(workdir):
    """Every process this test starts from now on (services, launchers, tools)
    writes its ASan / UBSan / LSan report, if it has one, to
    WORKDIR/sanitizer/<test>-<pid>/report.<its pid> instead of stderr, and stops
    at the first error (halt_on_error; the build also sets
    -fno-sanitize-recover). At exit, after every process is killed, a report
    there fails the test and is printed. Without a sanitizer build the
    variables are ignored and nothing is written. The logs given to watch_log
    are searched for report lines (SANITIZER_MARKERS) at the same time."""
    global _SAN_DIR
    test = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    _SAN_DIR = os.path.join(workdir, "sanitizer", "%s-%d" % (test, os.getpid()))
    os.makedirs(_SAN_DIR, exist_ok=True)
    # One log_path for the three: a process parses all of its sanitizers'
    # variables, the last log_path read wins.
    common = "halt_on_error=1:print_stacktrace=1:log_path=" + os.path.join(_SAN_DIR, "report")
    for var in ("ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS"):
        os.environ[var] = _with_options(var, common)
    atexit.register(_check_sanitizer_reports)  # runs before kill_all's (LIFO): kills itself


# Lines that start a sanitizer report in a process's own output. gcc's UBSan,
# built together with ASan, prints to stderr whatever log_path says, so the
# services' logs are read too.
SANITIZER_MARKERS = ("runtime error:", "ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
                     "WARNING: ThreadSanitizer", "SUMMARY: UndefinedBehaviorSanitizer")
# Lines a sanitizer writes to its report file that report nothing: ASan's note
# when a process switches stacks with swapcontext, which the CUDA emulator's
# fibers do (a worker on --device cuda-emu). A file of only these is no report.
SANITIZER_NOTICES = ("WARNING: ASan doesn't fully support makecontext/swapcontext functions",)
_LOGS = {}  # name -> callable returning a service's output so far


def watch_log(name, read):
    """Adds a service's output (read() returns its text; called after every
    process is killed) to what the exit check searches for reports."""
    _LOGS[name] = read


def read_file(path):
    """watch_log's reader for a log file."""
    def read():
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""
    return read


def sanitizer_reports():
    """(where, text) of each report written so far by this test's processes:
    the files under the report folder, and each watched log's lines from the
    first report marker on (at most 40)."""
    if _SAN_DIR is None:
        return []
    out = []
    for path in sorted(glob.glob(os.path.join(_SAN_DIR, "*"))):
        with open(path, errors="replace") as f:
            text = f.read()
        if all(any(b in line for b in SANITIZER_NOTICES) for line in text.splitlines()
               if line.strip()):
            continue  # only notices, no report
        out.append((path, text))
    for name, read in sorted(_LOGS.items()):
        lines = read().splitlines()
        at = [i for i, line in enumerate(lines) if any(m in line for m in SANITIZER_MARKERS)]
        if at:
            out.append((name, "\n".join(lines[at[0]:at[0] + 40])))
    return out


def _print_sanitizer_reports():
    reports = sanitizer_reports()
    for path, text in reports:
        print("---- sanitizer report %s ----\n%s" % (path, text), flush=True)
    return len(reports)


def _check_sanitizer_reports():
    kill_all()  # the processes' reports are complete once they are gone
    n = _print_sanitizer_reports()
    if n:
        print("FAIL: %d sanitizer report(s) from this test's processes (above)" % n, flush=True)
        os._exit(1)
    try:
        os.rmdir(_SAN_DIR)  # empty: nothing to keep
    except OSError:
        pass


def fail(msg):
    print("FAIL: " + msg, flush=True)
    kill_all()
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


_GIVEN_PORTS = set()
_PORT_RNG = random.Random(os.getpid() ^ time.time_ns())


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port():
    """A TCP port free on 127.0.0.1 right now, never one this process handed
    out before, and outside the kernel's ephemeral range: a port the kernel
    picks for "port 0" can be picked again by the next probe, or taken as the
    source port of an outgoing connection (the services dial each other)
    before the process it was meant for binds it."""
    lo, hi = _ephemeral_range()
    first, last = (10000, lo - 1) if lo - 1 - 10000 >= 2000 else (hi + 1, 65535)
    for _ in range(1000):
        port = _PORT_RNG.randint(first, last)
        if port in _GIVEN_PORTS:
            continue
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            s.close()
        _GIVEN_PORTS.add(port)
        return port
    fail("no free TCP port found in %d-%d" % (first, last))


# ---- HTTP (pd_harness and stack_harness re-export these) ---------------------------------
def request(port, method, path, body=None, timeout=60, headers=None):
    """Returns (status, headers lower-case, parsed JSON or text); a str body
    is sent as it is, anything else as JSON."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body) if body is not None and not isinstance(body, str) else body
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        raw = r.read()
    finally:
        c.close()
    try:
        parsed = json.loads(raw) if raw else None
    except ValueError:
        parsed = raw.decode("utf-8", "replace")
    return r.status, {k.lower(): v for k, v in r.getheaders()}, parsed


def post(port, path, body, timeout=60):
    return request(port, "POST", path, body, timeout)


class Stream:
    """An SSE stream read event by event (so a test can stop reading or disconnect)."""

    def __init__(self, port, path, body, timeout=60):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.conn.request("POST", path, body=json.dumps(body),
                          headers={"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        self.status = self.resp.status
        self.headers = {k.lower(): v for k, v in self.resp.getheaders()}

    def events(self):
        """Yields parsed data events; "[DONE]" as the string."""
        while True:
            line = self.resp.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                yield "[DONE]"
                return
            yield json.loads(data)

    def close(self):
        # Shutting the socket down is what a client that goes away does.
        try:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        except (OSError, AttributeError):
            pass
        self.conn.close()


def metrics(port):
    """Prometheus text -> {name{labels}: value}."""
    st, _, body = request(port, "GET", "/metrics")
    check(st == 200, "/metrics on port %d: status %d" % (port, st))
    out = {}
    for line in body.splitlines() if isinstance(body, str) else []:
        if not line or line.startswith("#"):
            continue
        k, _, v = line.rpartition(" ")
        try:
            out[k] = float(v)
        except ValueError:
            pass
    return out


def metric_sum(m, name):
    """Sum of every series of a family (name with or without labels)."""
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))
