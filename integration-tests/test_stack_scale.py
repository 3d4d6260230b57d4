# SPDX-License-Identifier: Apache-2.0
"""stack_scale: workers added to a running `tandem up` (issue 28, item 1).

A decode worker started by hand with another control-plane secret and added
to the router's config is not counted healthy: the router shows it unhealthy
with reason `auth` (/v1/router/config, tandem:router_endpoint_unhealthy_reason),
logs one ERROR for it naming TANDEM_INTERNAL_SECRET, never counts a pick for
it, and every request is served by the stack's own worker. Stopped, it is not
up (never heard from, control link down: no candidate). Started again with
the secret file `tandem up` printed (mode 0600 in a 0700 folder), it is healthy
and serves within seconds, with no failure charged to it. One listed with a
wrong nng port (its /health answers) is healthy but not up: never routed to.
`tandem scale --prefill N --decode M` adds workers (awaited, then the router
takes them) and removes them (they leave the router's config, then drain:
streams running there finish whole); bad requests fail with a line saying
why, and so does a scaling while the router's /metrics does not answer (within
seconds); one whose router config cannot be written changes nothing (its new
workers stop, the ones it would take away stay and serve); the socket and the
secret file are gone after the stack stops.
"""
import http.server
import json
import os
import re
import signal
import stat
import subprocess
import threading
import time

from proc_harness import PROCS, free_port
from stack_harness import (Stack, Stream, check, make_model, metric_sum, metrics, parse_args,
                           pid_alive, post, request)


def endpoint_state(port):
    s, _, body = request(port, "GET", "/v1/router/config")
    check(s == 200, "/v1/router/config: %d" % s)
    return {e["name"]: e for e in body["endpoints_state"]}


def health(port):
    """GET /health's status, 0 when nothing answers."""
    try:
        return request(port, "GET", "/health", timeout=5)[0]
    except OSError:
        return 0


def wait_for(what, cond, timeout=30.0):
    end = time.time() + timeout
    while time.time() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    check(False, "timed out waiting for %s" % what)


def start_hand_worker(args, model, http_port, nng_port, env_secret):
    env = dict(os.environ)
    env.pop("TANDEM_INTERNAL_SECRET", None)
    env.pop("TANDEM_INTERNAL_SECRET_FILE", None)
    env.update(env_secret)
    log = open(os.path.join(args.workdir, "hand-%d.log" % http_port), "w")
    p = subprocess.Popen([args.decode_bin, model, "--port", str(http_port), "--nng-url",
                          "tcp://127.0.0.1:%d" % nng_port, "--threads", "1"],
                         stdout=log, stderr=subprocess.STDOUT, env=env)
    PROCS.append(p)
    wait_for("the hand-started worker's /health",
             lambda: health(http_port) == 200 if p.poll() is None
             else check(False, "hand worker exited: %s" % p.returncode), timeout=60)
    return p


def scale(args, env, *flags):
    r = subprocess.run([args.tandem, "scale"] + list(flags), capture_output=True, text=True,
                       timeout=240, env=env)
    return r.returncode, r.stdout, r.stderr


def add_to_config(cfg_path, http_port, nng_port):
    with open(cfg_path) as f:
        text = f.read()
    line = '    - {host: "127.0.0.1", http_port: %d, nng_port: %d}\n' % (http_port, nng_port)
    text = re.sub(r"(  decode:\n)", r"\1" + line.replace("\\", "\\\\"), text, count=1)
    with open(cfg_path, "w") as f:
        f.write(text)


def main():
    args = parse_args(lambda ap: ap.add_argument("--decode-bin", required=True))
    model = make_model(args)
    run_dir = os.path.join(args.workdir, "run-scale")
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    os.chmod(run_dir, 0o700)
    env = dict(os.environ, XDG_RUNTIME_DIR=run_dir)
    env.pop("TANDEM_INTERNAL_SECRET", None)
    env.pop("TANDEM_INTERNAL_SECRET_FILE", None)
    st = Stack(args, "--model", model, "--decode", "1", "--served-model-name", "tandem-test",
               env={"XDG_RUNTIME_DIR": run_dir, "TANDEM_INTERNAL_SECRET": "",
                    "TANDEM_INTERNAL_SECRET_FILE": ""})
    api = st.port()

    # The secret file: printed, the user's alone, in a folder only the user opens.
    line = st.wait_line(r"^tandem\s+\| control-plane secret: ")
    secret_file = line.split("control-plane secret: ", 1)[1].split(" ", 1)[0]
    check(os.path.dirname(secret_file) == os.path.join(run_dir, "tandem"),
          "secret file %s not under %s/tandem" % (secret_file, run_dir))
    mode = stat.S_IMODE(os.stat(secret_file).st_mode)
    check(mode == 0o600, "secret file mode %o, want 600" % mode)
    dmode = stat.S_IMODE(os.stat(os.path.dirname(secret_file)).st_mode)
    check(dmode == 0o700, "run folder mode %o, want 700" % dmode)
    with open(secret_file) as f:
        check(len(f.read().strip()) >= 16, "secret too short")
    scale_line = st.wait_line(r"^tandem\s+\| more or fewer workers: tandem scale --port %d" % api)
    sock = scale_line.rsplit("control socket ", 1)[1].rstrip(")")
    check(stat.S_ISSOCK(os.stat(sock).st_mode), "no control socket at %s" % sock)
    cfg_path = st.wait_line(r"^tandem\s+\| router config: ").split("router config: ", 1)[1].strip()

    # 1. A worker added by hand with another secret: unhealthy, reason auth, never picked.
    hp, hn = free_port(), free_port()
    hand = start_hand_worker(args, model, hp, hn,
                             {"TANDEM_INTERNAL_SECRET": "not-the-stack-secret-0123456789"})
    add_to_config(cfg_path, hp, hn)
    st.proc.send_signal(signal.SIGHUP)  # the launcher passes it to the router
    name = "127.0.0.1:%d" % hp
    wait_for("reason auth for %s" % name,
             lambda: endpoint_state(api).get(name, {}).get("unhealthy_reason") == "auth")
    ep = endpoint_state(api)[name]
    check(ep["healthy"] is False, "auth-failed endpoint counted healthy: %s" % ep)
    m = metrics(api)
    check(m.get('tandem:router_endpoint_unhealthy_reason{endpoint="%s",reason="auth",'
                'role="decode"}' % name) == 1.0, "no auth reason series for %s" % name)
    check(m.get('tandem:router_endpoint_healthy{endpoint="%s",role="decode"}' % name) == 0.0,
          "endpoint_healthy not 0 for %s" % name)
    picks_before = metric_sum(m, "tandem:router_endpoint_picks_total")
    for i in range(8):
        s, _, body = post(api, "/v1/completions",
                          {"model": "tandem-test", "prompt": "hello %d" % i, "max_tokens": 4})
        check(s == 200, "request %d: %d %s" % (i, s, body))
    m = metrics(api)
    check(m.get('tandem:router_endpoint_picks_total{endpoint="%s",role="decode"}' % name, 0) == 0,
          "a pick was counted for the auth-failed worker")
    check(metric_sum(m, "tandem:router_endpoint_picks_total") - picks_before == 8,
          "picks do not match the requests served: %s" %
          {k: v for k, v in m.items() if "picks" in k})
    check(metric_sum(metrics(hp), "vllm:request_success_total") == 0,
          "the auth-failed worker served requests")
    errors = [ln for ln in st.log().splitlines()
              if ln.startswith("router") and " ERROR " in ln and name in ln]
    check(len(errors) == 1 and "TANDEM_INTERNAL_SECRET" in errors[0],
          "want one ERROR naming TANDEM_INTERNAL_SECRET for %s, got %s" % (name, errors))
    check(health(api) == 200, "router /health not 200 with one good worker")

    # 2. Stopped, it is not up (never heard from, its control link down): no
    # candidate, and /v1/router/config says so. Started again with the stack's
    # secret file: healthy, and it serves.
    hand.terminate()
    hand.wait(30)
    wait_for("%s not up" % name, lambda: endpoint_state(api).get(name, {}).get("not_up"))
    hand = start_hand_worker(args, model, hp, hn, {"TANDEM_INTERNAL_SECRET_FILE": secret_file})
    wait_for("%s healthy" % name, lambda: endpoint_state(api).get(name, {}).get("healthy"))
    check(endpoint_state(api)[name]["unhealthy_reason"] is None, "reason left after recovery")
    # Requests until it serves one, for up to 5 s and at least 20 requests.
    # One at a time they never overlap, so the router's in-flight count cannot
    # tell the workers apart (ties go at random: a slow machine, which fits
    # only a few requests in 5 s, would miss it 1 time in 2^n). Until its
    # control link is up or it reports, it is no candidate, so nothing is sent
    # there to fail over: no failure counts against it (before, such routes
    # failed over, made it unhealthy until its next health check and kept it
    # out for seconds: this loop ran up to 20 s; `charged` below catches that).
    served, i, t0 = 0, 0, time.time()
    while not served and (time.time() < t0 + 5 or i < 20):
        post(api, "/v1/completions", {"model": "tandem-test", "prompt": "again %d" % i,
                                      "max_tokens": 2})
        served = metric_sum(metrics(hp), "vllm:request_success_total")
        i += 1
    check(served > 0, "the worker with the right secret never served (%d requests in %.1f s)"
          % (i, time.time() - t0))
    print("recovered worker served after %d request(s), %.2f s" % (i, time.time() - t0))
    charged = {k: v for k, v in metrics(api).items()
               if v and 'endpoint="%s"' % name in k and k.split("{")[0] in (
                   "tandem:router_upstream_errors_total", "tandem:router_endpoint_fallbacks_total",
                   "tandem:router_retries_total")}
    check(not charged, "failures charged to the recovered worker: %s" % charged)
    hand.terminate()
    hand.wait(30)

    # 2b. A worker whose nng port is wrong: its /health answers (healthy), but
    # the router's control link to it never comes up and it never reports: not
    # up, so never a candidate and nothing charged to it (before, least_loaded
    # preferred it, unreported and idle; each route there was refused, failed
    # over and counted as its failure: unhealthy after 3).
    class HealthOnly(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    hs = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HealthOnly)
    threading.Thread(target=hs.serve_forever, daemon=True).start()
    wrong = "127.0.0.1:%d" % hs.server_address[1]
    add_to_config(cfg_path, hs.server_address[1], free_port())
    st.proc.send_signal(signal.SIGHUP)
    wait_for("%s healthy" % wrong, lambda: endpoint_state(api).get(wrong, {}).get("healthy"))
    wait_for("%s not up" % wrong, lambda: endpoint_state(api).get(wrong, {}).get("not_up"))
    for i in range(8):
        s, _, body = post(api, "/v1/completions",
                          {"model": "tandem-test", "prompt": "wrong port %d" % i, "max_tokens": 2})
        check(s == 200, "request %d with a wrong-port worker listed: %d %s" % (i, s, body))
    m = metrics(api)
    charged = {k: v for k, v in m.items()
               if v and 'endpoint="%s"' % wrong in k and k.split("{")[0] in (
                   "tandem:router_endpoint_picks_total", "tandem:router_upstream_errors_total",
                   "tandem:router_endpoint_fallbacks_total", "tandem:router_retries_total")}
    check(not charged, "the wrong-port worker was routed to: %s" % charged)
    ep = endpoint_state(api)[wrong]
    check(ep["healthy"] is True and ep["not_up"] is True, "wrong-port worker: %s" % ep)
    hs.shutdown()

    # 3. tandem scale: up to 1 prefill + 2 decode workers.
    rc, out, err = scale(args, env, "--port", str(api), "--prefill", "1", "--decode", "2")
    check(rc == 0 and out.strip().splitlines()[-1] == "ok: 1 prefill + 2 decode workers",
          "scale up: rc %d\n%s%s" % (rc, out, err))
    check("decode-1 healthy" in out and "prefill-0 healthy" in out, "scale up output:\n%s" % out)
    m = metrics(api)
    # The hand-added worker is gone from the config scale wrote: decode-0 and decode-1.
    check(m.get('tandem:router_ready_endpoints{role="decode"}') == 2.0,
          "router counts %s decode ready" % m.get('tandem:router_ready_endpoints{role="decode"}'))
    check(m.get('tandem:router_ready_endpoints{role="prefill"}') == 1.0, "prefill not ready")
    rc, out, _ = scale(args, env, "--port", str(api))
    check(rc == 0 and "ok: 1 prefill + 2 decode workers" in out, "status: %d %s" % (rc, out))
    # 3b. To the counts that run: the config's bytes are already the file's,
    # and a reload of them would count nothing; the scaling only checks that
    # the router sees every worker (before: a 60 s wait, then rc 1).
    t0 = time.time()
    rc, out, err = scale(args, env, "--port", str(api), "--prefill", "1", "--decode", "2")
    took = time.time() - t0
    check(rc == 0 and out.strip().splitlines()[-1] == "ok: 1 prefill + 2 decode workers" and
          "router already has" in out, "same counts: rc %d\n%s%s" % (rc, out, err))
    check(took < 20, "same counts: scale took %.1f s" % took)
    new = re.search(r"decode-1 started: http://[^:]+:(\d+), nng port \d+, pid (\d+)",
                    st.log())
    check(new is not None, "no decode-1 start line:\n%s" % st.log())
    d1_port, d1_pid = int(new.group(1)), int(new.group(2))
    with open(cfg_path) as f:
        check("http_port: %d" % d1_port in f.read(), "decode-1 not in the router config")

    # 4. Down to 1 decode, 0 prefill while streams run on both decode workers:
    # decode-1 leaves the config, drains, and its streams finish whole.
    streams, results = [], {}

    def run(i):
        s = Stream(api, "/v1/completions",
                   {"model": "tandem-test", "prompt": "stream %d" % i, "max_tokens": 1500,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}, timeout=120)
        fin, usage = None, None
        for ev in s.events():
            if ev == "[DONE]":
                break
            if ev.get("choices") and ev["choices"][0].get("finish_reason"):
                fin = ev["choices"][0]["finish_reason"]
            if ev.get("usage"):
                usage = ev["usage"]["completion_tokens"]
        results[i] = (s.status, fin, usage)

    # 4 streams at once split 2 and 2: least_loaded counts the requests the
    # router sent each worker since its last report in its queue, so streams
    # routed within one report interval do not all see the same loads (on
    # reported load alone all 4 went to one worker 1 time in 8). decode-1 is
    # first heard from (a load report), as a route to a worker never heard
    # from whose control link is down fails over whatever the policy says.
    d1_name = [n for n in endpoint_state(api) if n.endswith(":%d" % d1_port)]
    check(len(d1_name) == 1, "decode-1 not in endpoints_state: %s" % endpoint_state(api))
    d1_name = d1_name[0]
    wait_for("a load report from decode-1",
             lambda: endpoint_state(api)[d1_name].get("load") is not None)

    def picks():
        return {k: v for k, v in metrics(api).items()
                if k.startswith("tandem:router_endpoint_picks_total{") and 'role="decode"' in k}

    before = picks()
    for i in range(4):
        t = threading.Thread(target=run, args=(i,))
        t.start()
        streams.append(t)
    wait_for("4 streams routed",
             lambda: sum(picks().values()) - sum(before.values()) == 4)
    after = picks()
    d1_key = 'tandem:router_endpoint_picks_total{endpoint="%s",role="decode"}' % d1_name
    check(after.get(d1_key, 0) - before.get(d1_key, 0) == 2,
          "4 streams at once did not split 2 and 2: picks before %s, after %s" % (before, after))
    wait_for("decode-1 running its streams",
             lambda: metric_sum(metrics(d1_port), "vllm:num_requests_running") >= 1)
    rc, out, err = scale(args, env, "--port", str(api), "--prefill", "0", "--decode", "1")
    check(rc == 0 and out.strip().splitlines()[-1] == "ok: 0 prefill + 1 decode workers",
          "scale down: rc %d\n%s%s" % (rc, out, err))
    check("decode-1 leaves the router's config and drains" in out and "decode-1 stopped" in out,
          "scale down output:\n%s" % out)
    for t in streams:
        t.join(120)
    for i in range(len(streams)):
        check(results.get(i) == (200, "length", 1500), "stream %d: %s" % (i, results.get(i)))
    check(not pid_alive(d1_pid), "decode-1 (pid %d) still runs" % d1_pid)
    with open(cfg_path) as f:
        check("http_port: %d" % d1_port not in f.read(), "decode-1 left in the router config")
    s, _, body = post(api, "/v1/completions", {"model": "tandem-test", "prompt": "after",
                                               "max_tokens": 3})
    check(s == 200, "after scaling down: %d %s" % (s, body))
    # A retired worker is not restarted by the supervisor.
    time.sleep(1.5)
    check("decode-1 restarted" not in st.log(), "decode-1 was restarted:\n%s" % st.log())

    # 5. Bad requests: a line saying why, no change.
    rc, _, err = scale(args, env, "--port", str(free_port()), "--decode", "2")
    check(rc == 1 and "no `tandem up` of yours" in err, "unknown port: %d %r" % (rc, err))
    rc, _, err = scale(args, env, "--port", str(api), "--decode", "0")
    check(rc == 2 and "--decode" in err, "decode 0: %d %r" % (rc, err))
    rc, _, err = scale(args, env, "--port", str(api), "--bogus")
    check(rc == 2, "unknown flag: %d %r" % (rc, err))

    # 5b. A router whose /metrics does not answer (stopped): the reload count
    # read before the config changes is retried for a few seconds, then the
    # scaling fails with one line saying so (before, that read was given up
    # after 2 s, any state was accepted as the reload, and a stopped router
    # was waited on for 60 s). Running again, the router takes the next scaling.
    router_pid = re.search(r"OpenAI API, policy \S+\s+pid (\d+)", st.log())
    check(router_pid is not None, "no router pid line:\n%s" % st.log())
    router_pid = int(router_pid.group(1))
    os.kill(router_pid, signal.SIGSTOP)
    try:
        t0 = time.time()
        rc, out, err = scale(args, env, "--port", str(api), "--decode", "1")
        took = time.time() - t0
    finally:
        os.kill(router_pid, signal.SIGCONT)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    check(rc == 1 and last.startswith("error: the router's /metrics") and
          "did not answer within" in last, "router stopped: rc %d\n%s%s" % (rc, out, err))
    check(took < 30, "router stopped: scale took %.1f s" % took)
    # (A config with other bytes: a reload of the active bytes counts nothing.)
    rc, out, err = scale(args, env, "--port", str(api), "--prefill", "1", "--decode", "1")
    check(rc == 0 and out.strip().splitlines()[-1] == "ok: 1 prefill + 1 decode workers",
          "router running again: rc %d\n%s%s" % (rc, out, err))
    print("router stopped: scale failed in %.1f s: %s" % (took, last))

    # 5c. The router's config cannot be written (a folder where the new file
    # goes): nothing changes. The decode worker started for the scaling up
    # stops (the router was never told of it); the prefill worker of the
    # scaling down stays, in the config, and serves (before, it was drained
    # and stopped while the router still routed to it).
    with open(cfg_path) as f:
        cfg_before = f.read()
    pre = re.findall(r"prefill-(\d+) started: http://[^:]+:(\d+), nng port \d+, pid (\d+)",
                     st.log())
    check(pre, "no prefill start line:\n%s" % st.log())
    pre_port, pre_pid = int(pre[-1][1]), int(pre[-1][2])
    os.mkdir(cfg_path + ".new")
    try:
        rc, out, err = scale(args, env, "--port", str(api), "--prefill", "0", "--decode", "2")
    finally:
        os.rmdir(cfg_path + ".new")
    lines = out.strip().splitlines()
    check(rc == 1 and lines and lines[-1] == "error: nothing changed: 1 prefill + 1 decode "
          "workers, as before" and any(x.startswith("error: cannot write") for x in lines),
          "config not writable: rc %d\n%s%s" % (rc, out, err))
    started = re.search(r"(decode-\d+) started: http://[^:]+:\d+, nng port \d+, pid (\d+)", out)
    check(started is not None and "%s stopped: the router was not told of it" % started.group(1)
          in out, "config not writable, the new worker:\n%s" % out)
    check(not pid_alive(int(started.group(2))), "%s still runs" % started.group(1))
    check(pid_alive(pre_pid) and health(pre_port) == 200, "the prefill worker was stopped")
    with open(cfg_path) as f:
        check(f.read() == cfg_before, "the router config changed")
    m = metrics(api)
    check(m.get('tandem:router_ready_endpoints{role="prefill"}') == 1.0 and
          m.get('tandem:router_ready_endpoints{role="decode"}') == 1.0,
          "router endpoints after a failed scaling: %s" % {
              k: v for k, v in m.items() if k.startswith("tandem:router_ready_endpoints")})
    s, _, body = post(api, "/v1/completions", {"model": "tandem-test", "prompt": "unchanged",
                                               "max_tokens": 3})
    check(s == 200, "after a failed scaling: %d %s" % (s, body))
    rc, out, _ = scale(args, env, "--port", str(api))
    check(rc == 0 and "ok: 1 prefill + 1 decode workers" in out, "status: %d %s" % (rc, out))

    # 6. Stopped: the socket and the secret file are gone.
    check(st.stop() == 0, "tandem up exit status:\n%s" % st.log())
    check(not os.path.exists(sock) and not os.path.exists(secret_file),
          "control socket or secret file left behind")
    print("stack_scale: auth-failed worker kept out (1 ERROR, 0 picks), recovered with the "
          "secret file, scaled 1 -> 1+2 -> 1 with 4 streams whole")


if __name__ == "__main__":
    main()
