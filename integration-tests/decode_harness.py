# SPDX-License-Identifier: Apache-2.0
"""Shared helpers for the tandem-decode integration tests (Python 3 stdlib only).

Every test script takes the same arguments (see parse_args), generates its
tiny model with tandem-mkmodel into the build folder, starts tandem-decode on
127.0.0.1 with --port 0 (the real port is read from the startup line), talks to
it with http.client like a user would, and kills every process it started when
it ends (atexit and a hard deadline per test). Exit status: 0 pass, 1 fail,
77 skipped (ctest SKIP_RETURN_CODE).
"""
import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time

from proc_harness import (arm_deadline, check, fail, kill_all, register,  # noqa: F401 (re-exported)
                          watch_log, watch_sanitizers)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", required=True, help="tandem-decode binary")
    ap.add_argument("--mkmodel", required=True, help="tandem-mkmodel binary")
    ap.add_argument("--generate", help="tandem-generate binary")
    ap.add_argument("--workdir", required=True, help="scratch folder in the build tree")
    ap.add_argument("--promtool", default="promtool")
    ap.add_argument("--deadline", type=float, default=240.0, help="seconds before the test fails")
    ap.add_argument("--server-flags", default="",
                    help="extra tandem-decode flags for every server, e.g. '--device cuda'")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    arm_deadline(args.deadline)
    watch_sanitizers(args.workdir)
    if "cuda" in args.server_flags:
        skip_without_gpu(args)
    return args


def skip_without_gpu(args):
    """Exits 77 (skipped) when tandem-decode sees no CUDA GPU: it refuses
    --device cuda at startup, naming how many are visible."""
    r = subprocess.run([args.decode, "--model", "/nonexistent", "--device", "cuda"],
                       capture_output=True, text=True, timeout=60)
    if "0 CUDA GPUs visible" in r.stderr or "no CUDA backend" in r.stderr:
        print("skipped: %s" % r.stderr.strip())
        raise SystemExit(77)


def make_model(args, name="tiny", extra=()):
    """Writes a tandem-mkmodel folder (once per workdir) and returns its path."""
    out = os.path.join(args.workdir, name)
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        cmd = [args.mkmodel, "--preset", "tiny", "--out", out] + list(extra)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        check(r.returncode == 0, "tandem-mkmodel failed: %s" % r.stderr)
    return out


class Server:
    """A running tandem-decode; stderr is collected in self.log."""

    def __init__(self, args, model, *flags, ready_timeout=60.0):
        cmd = [args.decode, "--model", model, "--host", "127.0.0.1", "--port", "0"] + list(flags)
        cmd += args.server_flags.split()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        register(self.proc)
        self.log = []
        self.port = None
        self.ready_line = None
        got = threading.Event()

        def reader():
            for line in self.proc.stderr:
                self.log.append(line.rstrip("\n"))
                m = re.search(r"listening=http://[^ ]*:(\d+)", line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    self.ready_line = line.strip()
                    got.set()
            got.set()

        self.reader = threading.Thread(target=reader, daemon=True)
        self.reader.start()
        # A sanitizer report in its stderr fails the test (read once it is killed).
        watch_log("tandem-decode pid %d" % self.proc.pid,
                  lambda: (self.reader.join(2), "\n".join(self.log))[1])
        if not got.wait(ready_timeout) or self.port is None:
            fail("tandem-decode did not start: %s" % "\n".join(self.log))

    def conn(self, timeout=60.0):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method, path, body=None, headers=None, timeout=60.0):
        """Returns (status, headers dict lower-case, body bytes)."""
        c = self.conn(timeout)
        try:
            h = {"Content-Type": "application/json"}
            h.update(headers or {})
            if body is not None and not isinstance(body, (bytes, str)):
                body = json.dumps(body)
            c.request(method, path, body=body, headers=h)
            r = c.getresponse()
            data = r.read()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, data
        finally:
            c.close()

    def post_json(self, path, body, **kw):
        status, hdrs, data = self.request("POST", path, body, **kw)
        try:
            return status, hdrs, json.loads(data) if data else None
        except ValueError:
            fail("%s answered non-JSON (%d): %r" % (path, status, data[:200]))

    def metrics(self):
        status, _, data = self.request("GET", "/metrics")
        check(status == 200, "/metrics status %d" % status)
        return data.decode()

    def gauge(self, name, text=None):
        return metric_value(text if text is not None else self.metrics(), name)

    def wait(self, timeout=60.0):
        """Waits for an exit already under way (a signal was sent)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            fail("tandem-decode did not exit within %.0f s" % timeout)

    def stop(self, sig=signal.SIGTERM, timeout=60.0):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            fail("tandem-decode did not exit within %.0f s of signal %d" % (timeout, sig))


def metric_value(text, name, labels=None):
    """The value of the first sample of `name` whose labels include `labels`."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        if labels:
            lab = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if any(lab.get(k) != v for k, v in labels.items()):
                continue
        return float(m.group(3))
    fail("metric %s%s not found" % (name, labels or ""))


class Stream:
    """A streaming request read event by event (http.client undoes the chunking)."""

    def __init__(self, server, path, body, timeout=120.0):
        self.c = server.conn(timeout)
        self.c.request("POST", path, body=json.dumps(body),
                       headers={"Content-Type": "application/json"})
        self.r = self.c.getresponse()
        self.status = self.r.status
        self.headers = {k.lower(): v for k, v in self.r.getheaders()}

    def events(self):
        """Yields the data of each SSE event: a dict, or the string "[DONE]"."""
        buf = b""
        while True:
            line = self.r.readline()
            if not line:
                return
            line = line.rstrip(b"\r\n")
            if line == b"":
                if buf:
                    data = buf.decode()
                    buf = b""
                    yield data if data == "[DONE]" else json.loads(data)
                continue
            if line.startswith(b":"):
                continue  # an SSE comment
            check(line.startswith(b"data: "), "not an SSE data line: %r" % line[:100])
            buf += line[6:]

    def close(self):
        # Closing the socket is what a client that goes away does.
        try:
            self.c.sock.shutdown(2)
        except OSError:
            pass
        self.c.close()


def check_completion_chunk(ev, rid, created, model, index=0):
    """Field-by-field check of one completions stream chunk with one choice."""
    check(isinstance(ev, dict), "chunk is not an object: %r" % (ev,))
    check(ev.get("id") == rid, "id changed: %r != %r" % (ev.get("id"), rid))
    check(ev.get("object") == "text_completion", "object %r" % ev.get("object"))
    check(ev.get("created") == created, "created changed")
    check(ev.get("model") == model, "model %r" % ev.get("model"))
    ch = ev.get("choices")
    check(isinstance(ch, list) and len(ch) == 1, "choices %r" % ch)
    c = ch[0]
    check(c.get("index") == index, "index %r" % c.get("index"))
    check(isinstance(c.get("text"), str), "text %r" % c.get("text"))
    check("logprobs" in c and c["logprobs"] is None, "logprobs %r" % c.get("logprobs"))
    check(c.get("finish_reason") in (None, "stop", "length"),
          "finish_reason %r" % c.get("finish_reason"))
    return c


def promtool_check(promtool, text):
    """Runs promtool check metrics; returns (ok, output); None when promtool is absent.
    promtool's lint objects to two things vLLM itself does and Tandem copies
    (':' in names, the vllm:iteration_tokens_total histogram); those are accepted."""
    try:
        r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=60)
    except FileNotFoundError:
        return None
    out = (r.stdout + r.stderr).strip()
    if r.returncode == 0:
        return True, out
    bad = [l for l in out.splitlines() if l.strip() and
           not l.endswith("metric names should not contain ':'") and
           l != 'vllm:iteration_tokens_total non-counter metrics should not have "_total" suffix']
    return not bad, out
