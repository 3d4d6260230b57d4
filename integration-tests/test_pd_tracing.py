# SPDX-License-Identifier: Apache-2.0
"""Per-request traces through router -> decode -> prefill (issue 11, part 7).

An OTLP/HTTP receiver of the test's own (http.server in this process) collects
what the services export. The router finds it through OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
(the environment), the workers through --otlp-traces-endpoint (the flag).
  - a disaggregated request with the client's traceparent/tracestate: every
    span carries the client's trace id; the router's llm_request is a child of
    the client's span, the decode worker's llm_request a child of the router's
    attempt span, the prefill worker's prefill_request a child of the decode
    worker's remote_prefill span; the required spans are there, with times
    inside their parents' and inside the request's wall-clock window, and the
    usage attributes equal the response's usage;
  - the decode worker's own OpenAI route continues a client's trace too;
  - a malformed traceparent is ignored: a new trace, rooted at the router;
  - a refused request (400) has its router span, with its status code;
  - a router without tracing passes the client's traceparent on unchanged;
  - a router stopped right after a request loses none of its spans;
  - a traceparent with the sampled flag off exports nothing;
  - hung prefill workers: the decode worker's remote_prefill spans end failed
    and its local prefill (the fallback) has its span;
  - a hung decode worker: the router's attempt span to it ends failed and a
    second attempt serves the request;
  - with the collector dead, requests still succeed, no slower, and the
    dropped spans are counted in tandem:otlp_spans_dropped_total.
"""
import json
import os
import signal
import statistics
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pd_harness import (Cluster, check, fail, free_port, metric_sum, metrics, parse_args, register,
                        request)


class Receiver:
    """OTLP/HTTP JSON receiver: keeps every span with its service.name."""

    def __init__(self):
        self.spans = []
        self.posts = []  # (path, content-type)
        self.lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(n)
                with outer.lock:
                    outer.posts.append((self.path, self.headers.get("Content-Type")))
                try:
                    doc = json.loads(body)
                    for rs in doc["resourceSpans"]:
                        svc = next(a["value"]["stringValue"] for a in rs["resource"]["attributes"]
                                   if a["key"] == "service.name")
                        for ss in rs["scopeSpans"]:
                            for sp in ss["spans"]:
                                sp["service"] = svc
                                with outer.lock:
                                    outer.spans.append(sp)
                except (ValueError, KeyError, StopIteration) as e:
                    with outer.lock:
                        outer.posts.append(("BAD BODY", str(e)))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *a):
                pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), H)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def trace(self, trace_id):
        with self.lock:
            return [s for s in self.spans if s["traceId"] == trace_id]


def attrs(span):
    out = {}
    for a in span.get("attributes", []):
        v = a["value"]
        out[a["key"]] = (v.get("stringValue") if "stringValue" in v else
                         int(v["intValue"]) if "intValue" in v else v.get("doubleValue"))
    return out


def times(span):
    return int(span["startTimeUnixNano"]) / 1e9, int(span["endTimeUnixNano"]) / 1e9


def one(spans, service, name, parent=None):
    found = [s for s in spans if s["service"] == service and s["name"] == name and
             (parent is None or s.get("parentSpanId") == parent["spanId"])]
    check(len(found) >= 1, "no %s span %s%s in %s" % (
        service, name, " under %s" % parent["name"] if parent else "",
        sorted((s["service"], s["name"]) for s in spans)))
    return found[0]


def inside(child, parent, slack):
    cs, ce = times(child)
    ps, pe = times(parent)
    check(cs <= ce, "%s ends before it starts" % child["name"])
    check(cs >= ps - slack and ce <= pe + slack,
          "%s/%s [%.6f, %.6f] not inside %s/%s [%.6f, %.6f]" % (
              child["service"], child["name"], cs, ce, parent["service"], parent["name"], ps, pe))


def wait_spans(rx, trace_id, want, timeout=8):
    """Waits until the trace has spans of every (service, name) in want."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        have = {(s["service"], s["name"]) for s in rx.trace(trace_id)}
        if all(w in have for w in want):
            return rx.trace(trace_id)
        time.sleep(0.1)
    fail("trace %s incomplete after %.0f s: have %s, want %s" % (
        trace_id, timeout, sorted({(s["service"], s["name"]) for s in rx.trace(trace_id)}), want))


def complete(port, tp=None, ts=None, max_tokens=4, prompt_len=48):
    h = {}
    if tp is not None:
        h["traceparent"] = tp
    if ts is not None:
        h["tracestate"] = ts
    body = {"prompt": [5 + (i * 7) % 400 for i in range(prompt_len)], "max_tokens": max_tokens,
            "temperature": 0}
    t0 = time.time()
    st, hdr, r = request(port, "POST", "/v1/completions", body, headers=h, timeout=60)
    return st, r, time.time() - t0, t0


def main():
    args = parse_args()
    rx = Receiver()
    ep = "http://127.0.0.1:%d" % rx.port
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = ep  # the router (and a fallback)
    os.environ.pop("OTEL_SERVICE_NAME", None)
    cl = Cluster(args, n_prefill=2, n_decode=2, pd_mode="always",
                 worker_args=["--otlp-traces-endpoint", ep + "/v1/traces"]).start()

    # 1. A disaggregated request in the client's trace.
    trace_id = os.urandom(16).hex()
    client_span = os.urandom(8).hex()
    st, r, _, t_sent = complete(cl.router_port, "00-%s-%s-01" % (trace_id, client_span),
                                "tandem=test,other=1")
    t_done = time.time()
    check(st == 200, "traced request: %d %s" % (st, r))
    want = [("tandem-router", "llm_request"), ("tandem-router", "attempt"),
            ("tandem-decode", "llm_request"), ("tandem-decode", "remote_prefill"),
            ("tandem-prefill", "prefill_request"), ("tandem-prefill", "kv_push")]
    spans = wait_spans(rx, trace_id, want)
    with rx.lock:
        posts = list(rx.posts)
    check(all(p == "/v1/traces" and (ct or "").startswith("application/json") for p, ct in posts),
          "OTLP POSTs: %s" % posts)
    check(all(s["traceId"] == trace_id for s in spans), "one trace id everywhere")
    check(all(s.get("traceState") == "tandem=test,other=1" for s in spans),
          "tracestate carried: %s" % {s.get("traceState") for s in spans})

    r_req = one(spans, "tandem-router", "llm_request")
    check(r_req.get("parentSpanId") == client_span, "router llm_request parent = client span")
    check(r_req["kind"] == 2, "llm_request is a SERVER span")
    for name in ("preprocess", "route", "attempt"):
        inside(one(spans, "tandem-router", name, r_req), r_req, 0.002)
    att = one(spans, "tandem-router", "attempt", r_req)
    check(att["kind"] == 3, "attempt is a CLIENT span")
    d_req = one(spans, "tandem-decode", "llm_request", att)
    inside(d_req, att, 0.05)  # another process: its clock conversion may differ by a little
    for name in ("queue", "remote_prefill", "kv_transfer_wait", "decode"):
        inside(one(spans, "tandem-decode", name, d_req), d_req, 0.002)
    check(any(e["name"] == "first_token" for e in d_req.get("events", [])),
          "decode llm_request has a first_token event")
    rp = one(spans, "tandem-decode", "remote_prefill", d_req)
    p_req = one(spans, "tandem-prefill", "prefill_request", rp)
    check(p_req["kind"] == 2, "prefill_request is a SERVER span")
    for name in ("queue", "prefill", "kv_push"):
        inside(one(spans, "tandem-prefill", name, p_req), p_req, 0.002)
    # The prefill worker releases the KV as soon as its last frame is out.
    held = times(p_req)[1] - times(one(spans, "tandem-prefill", "kv_push", p_req))[1]
    check(held < 0.05, "prefill worker held the KV %.3f s after its last frame" % held)
    # Sane times: everything inside the client's window (ms of clock slack).
    for s in spans:
        a, b = times(s)
        check(t_sent - 0.05 <= a <= b <= t_done + 0.05,
              "%s/%s [%.3f, %.3f] outside the request [%.3f, %.3f]" % (
                  s["service"], s["name"], a, b, t_sent, t_done))
    usage = r["usage"]
    ra, da = attrs(r_req), attrs(d_req)
    check(ra["gen_ai.request.id"] == r["id"], "router gen_ai.request.id %s" % ra)
    check(ra["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"] and
          ra["gen_ai.usage.completion_tokens"] == usage["completion_tokens"],
          "router usage attributes %s vs %s" % (ra, usage))
    check(da["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] and
          da["tandem.prefill"] == "remote" and
          da["tandem.finish_reason"] == ra["tandem.finish_reason"] ==
          r["choices"][0]["finish_reason"],
          "decode attributes %s" % da)
    check(ra["gen_ai.request.max_tokens"] == 4 and "gen_ai.latency.time_to_first_token" in ra and
          ra["http.response.status_code"] == 200, "router request attributes %s" % ra)
    print("trace ok: %d spans, router e2e %.1f ms, decode ttft %.1f ms" % (
        len(spans), 1e3 * ra["gen_ai.latency.e2e"], 1e3 * da["gen_ai.latency.time_to_first_token"]))

    # 1b. The decode worker's own OpenAI route (direct mode) continues a trace too.
    direct = os.urandom(16).hex()
    parent = os.urandom(8).hex()
    st, r, _, _ = complete(cl.decode[0].http_port, "00-%s-%s-01" % (direct, parent))
    check(st == 200, "direct request: %d %s" % (st, r))
    spans = wait_spans(rx, direct, [("tandem-decode", "llm_request"), ("tandem-decode", "decode")])
    d_req = one(spans, "tandem-decode", "llm_request")
    check(d_req.get("parentSpanId") == parent, "direct llm_request parent = client span")
    for name in ("queue", "prefill", "decode"):
        inside(one(spans, "tandem-decode", name, d_req), d_req, 0.002)
    da = attrs(d_req)
    check(da["gen_ai.request.id"] == r["id"] and
          da["gen_ai.usage.completion_tokens"] == r["usage"]["completion_tokens"],
          "direct attributes %s" % da)

    # 2. A malformed traceparent is ignored: a new trace rooted at the router.
    bad_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    st, r, _, _ = complete(cl.router_port, "00-%s-00f067aa0ba902b7-0x" % bad_trace, "a=b")
    check(st == 200, "malformed traceparent request: %d" % st)
    rid = r["id"]
    t0 = time.time()
    root = None
    while time.time() - t0 < 8 and root is None:
        with rx.lock:
            root = next((s for s in rx.spans if s["service"] == "tandem-router" and
                         s["name"] == "llm_request" and
                         attrs(s).get("gen_ai.request.id") == rid), None)
        time.sleep(0.1)
    check(root is not None, "no span for the request with a malformed traceparent")
    check(root["traceId"] != bad_trace and "parentSpanId" not in root and
          "traceState" not in root, "malformed traceparent was not ignored: %s" % root)
    wait_spans(rx, root["traceId"], [("tandem-decode", "llm_request"),
                                     ("tandem-prefill", "prefill_request")])

    # 2a. A request the router refuses (400) is traced with its status, and
    # is not an error span (OpenTelemetry: 4xx is the client's).
    refused = os.urandom(16).hex()
    st, _, _ = request(cl.router_port, "POST", "/v1/completions",
                       {"prompt": "hello", "max_tokens": -1},
                       headers={"traceparent": "00-%s-%s-01" % (refused, os.urandom(8).hex())})
    check(st == 400, "refused request: %d" % st)
    spans = wait_spans(rx, refused, [("tandem-router", "llm_request"),
                                     ("tandem-router", "preprocess")])
    rr = one(spans, "tandem-router", "llm_request")
    check(attrs(rr).get("http.response.status_code") == 400 and rr["status"]["code"] != 2 and
          not [s for s in spans if s["service"] != "tandem-router"],
          "refused request span: %s" % rr)

    # 2b. A router that does not trace passes the client's context on: a second
    # router on the same config without an endpoint; the decode worker's span
    # is a child of the client's span.
    env = {k: v for k, v in os.environ.items() if k != "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"}
    port2 = free_port()
    r2 = subprocess.Popen([args.router, "--config", cl.config, "--model", cl.model, "--host",
                           "127.0.0.1", "--port", str(port2), "--nng-url",
                           "tcp://127.0.0.1:%d" % free_port()], env=env,
                          stdout=cl._log("router2"), stderr=subprocess.STDOUT)
    register(r2)
    cl.wait_health(port2, r2)
    time.sleep(0.6)  # first load reports
    passed = os.urandom(16).hex()
    parent = os.urandom(8).hex()
    st, _, _, _ = complete(port2, "00-%s-%s-01" % (passed, parent), "k=v")
    check(st == 200, "request through the untraced router: %d" % st)
    spans = wait_spans(rx, passed, [("tandem-decode", "llm_request"),
                                    ("tandem-prefill", "prefill_request")])
    d_req = one(spans, "tandem-decode", "llm_request")
    check(d_req.get("parentSpanId") == parent and d_req.get("traceState") == "k=v",
          "untraced router did not pass the client's context on: %s" % d_req)
    check(not [s for s in spans if s["service"] == "tandem-router"], "untraced router traced")
    r2.terminate()
    r2.wait(timeout=20)

    # 2c. Nothing is lost at shutdown: a traced router gets SIGTERM right
    # after a request; once it exited, its spans are at the collector. (The
    # router takes ~2 s to stop, longer than the export interval, so this does
    # not tell the final flush from the timer; trace_test's
    # test_export_to_receiver, with a 30 s interval, does.)
    port3 = free_port()
    r3 = subprocess.Popen([args.router, "--config", cl.config, "--model", cl.model, "--host",
                           "127.0.0.1", "--port", str(port3), "--nng-url",
                           "tcp://127.0.0.1:%d" % free_port(), "--otlp-traces-endpoint", ep],
                          stdout=cl._log("router3"), stderr=subprocess.STDOUT)
    register(r3)
    cl.wait_health(port3, r3)
    time.sleep(0.6)
    flushed = os.urandom(16).hex()
    st, _, _, _ = complete(port3, "00-%s-%s-01" % (flushed, os.urandom(8).hex()))
    check(st == 200, "request before SIGTERM: %d" % st)
    t_term = time.time()
    r3.terminate()
    r3.wait(timeout=20)
    exited = time.time() - t_term
    got = {s["name"] for s in rx.trace(flushed) if s["service"] == "tandem-router"}
    check({"llm_request", "attempt", "route", "preprocess"} <= got,
          "router spans not flushed at shutdown (exit after %.2f s): %s" % (exited, got))

    # 3. Not sampled: propagated, nothing recorded.
    unsampled = os.urandom(16).hex()
    st, _, _, _ = complete(cl.router_port, "00-%s-%s-00" % (unsampled, os.urandom(8).hex()))
    check(st == 200, "unsampled request: %d" % st)

    # Overhead, roughly: sampled vs unsampled requests (the same path otherwise).
    lat_on, lat_off = [], []
    for i in range(10):
        lat_on.append(complete(cl.router_port, "00-%s-%s-01" % (os.urandom(16).hex(),
                                                                  os.urandom(8).hex()))[2])
        lat_off.append(complete(cl.router_port, "00-%s-%s-00" % (os.urandom(16).hex(),
                                                                   os.urandom(8).hex()))[2])
    on, off = statistics.median(lat_on), statistics.median(lat_off)
    print("latency median traced %.1f ms, not sampled %.1f ms" % (1e3 * on, 1e3 * off))
    time.sleep(1.5)  # a flush interval
    check(rx.trace(unsampled) == [], "spans exported for an unsampled trace")

    # 3b. Prefill workers that hang (SIGSTOP, both, so whichever the router
    # lists first fails): the decode worker's remote_prefill spans end failed,
    # it falls back to local prefill, and its llm_request shows a local
    # prefill span; all children of the one llm_request.
    for w in cl.prefill:
        os.kill(w.proc.pid, signal.SIGSTOP)
    try:
        tid = os.urandom(16).hex()
        st, r, _, _ = complete(cl.router_port, "00-%s-%s-01" % (tid, os.urandom(8).hex()))
        check(st == 200, "request with hung prefill workers: %d %s" % (st, r))
        failed = wait_spans(rx, tid, [("tandem-decode", "llm_request"),
                                      ("tandem-decode", "remote_prefill"),
                                      ("tandem-decode", "prefill")])
    finally:
        for w in cl.prefill:
            os.kill(w.proc.pid, signal.SIGCONT)
    d_req = one(failed, "tandem-decode", "llm_request")
    rps = [s for s in failed if s["name"] == "remote_prefill"]
    urls = ["tcp://127.0.0.1:%d" % w.nng_port for w in cl.prefill]
    check(rps and all(s.get("parentSpanId") == d_req["spanId"] and s["status"]["code"] == 2 and
                      s["status"].get("message") and attrs(s)["tandem.prefill.endpoint"] in urls
                      for s in rps), "failed remote_prefill spans: %s" % rps)
    inside(one(failed, "tandem-decode", "prefill", d_req), d_req, 0.002)
    check(attrs(d_req)["tandem.prefill"] == "local", "fallback not local: %s" % attrs(d_req))
    print("hung prefill workers: %d remote_prefill failed (\"%s\"), then local prefill" % (
        len(rps), rps[0]["status"]["message"]))

    # 3c. A decode worker that hangs before the first token: the router's
    # attempt span to it ends failed ("lost"), a second attempt serves the
    # request, both children of the one llm_request.
    hung = cl.decode[0]
    os.kill(hung.proc.pid, signal.SIGSTOP)
    retried = None
    try:
        for _ in range(3):  # round robin: within two requests it is picked
            tid = os.urandom(16).hex()
            st, r, _, _ = complete(cl.router_port, "00-%s-%s-01" % (tid, os.urandom(8).hex()))
            check(st == 200, "request with a hung decode worker: %d %s" % (st, r))
            spans = wait_spans(rx, tid, [("tandem-router", "llm_request")])
            if len([s for s in spans if s["name"] == "attempt"]) >= 2:
                retried = spans
                break
    finally:
        os.kill(hung.proc.pid, signal.SIGCONT)
    check(retried is not None, "no retried attempt with a hung decode worker")
    r_req = one(retried, "tandem-router", "llm_request")
    atts = sorted((s for s in retried if s["name"] == "attempt"), key=lambda s: times(s)[0])
    check(all(s.get("parentSpanId") == r_req["spanId"] for s in atts), "attempt parents")
    check(atts[0]["status"]["code"] == 2 and atts[-1]["status"]["code"] != 2 and
          [attrs(s)["tandem.attempt"] for s in atts] == list(range(1, len(atts) + 1)) and
          attrs(r_req)["tandem.attempts"] == len(atts),
          "attempt spans: %s" % [(attrs(s), s["status"]) for s in atts])
    wait_spans(rx, r_req["traceId"], [("tandem-decode", "llm_request")])
    print("hung decode worker: attempt 1 failed with \"%s\"" % atts[0]["status"]["message"])

    # 4. The collector dies: requests succeed, no slower; drops are counted.
    rx.stop()
    lat_dead = []
    for i in range(10):
        st, r, dt, _ = complete(cl.router_port, "00-%s-%s-01" % (os.urandom(16).hex(),
                                                                  os.urandom(8).hex()))
        check(st == 200, "request with the collector down: %d %s" % (st, r))
        lat_dead.append(dt)
    dead = statistics.median(lat_dead)
    print("latency median with the collector down %.1f ms" % (1e3 * dead))
    check(dead < 2 * on + 0.25, "collector down slowed requests: %.3f s vs %.3f s" % (dead, on))
    t0 = time.time()
    dropped = {}
    while time.time() - t0 < 8:
        dropped = {name: sum(metric_sum(metrics(port), "tandem:otlp_spans_dropped_total")
                             for port in ports)
                   for name, ports in (("router", [cl.router_port]),
                                       ("decode", [w.http_port for w in cl.decode]),
                                       ("prefill", [w.http_port for w in cl.prefill]))}
        if all(v > 0 for v in dropped.values()):
            break
        time.sleep(0.2)
    check(all(v > 0 for v in dropped.values()), "dropped spans not counted: %s" % dropped)
    print("dropped spans counted: %s" % dropped)
    print("PASS")


if __name__ == "__main__":
    main()
