# SPDX-License-Identifier: Apache-2.0
"""stack_up: the whole stack started by `tandem up` (1 prefill + 1 decode + router).

Checks: the launcher prints every endpoint and a curl line that works as
printed; every child's log lines carry its role prefix; requests through the
router are disaggregated (the prefill worker counts them); Ctrl-C's SIGTERM
stops the router before the workers, exits 0, leaves no process and removes
the router config; SIGHUP reaches the router (config reload). Then the failure paths: a worker killed outright is
restarted while the other serves (--restart on-failure, the default), or with
--restart never stops the stack with a non-zero exit and a line naming it; a model the workers cannot
load fails the startup naming the worker, and so does one that never gets
healthy (killed after the grace period, as it ignores SIGTERM); a port in use and a bad flag fail
before anything starts. `--device cuda-emu` puts every worker on the CUDA backend's emulator
with its share of the one GPU (--gpu-memory-utilization 0.9 / workers) and serves.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from proc_harness import measure_slowness, tokens_for
from stack_harness import (Stack, Stream, check, make_model, metric_sum, metrics, parse_args,
                           pid_alive, post, request)


def main():
    args = parse_args()
    # tandem --help lists its commands and up's options, exit 0; no command is exit 2.
    r = subprocess.run([args.tandem, "--help"], capture_output=True, text=True)
    check(r.returncode == 0 and "  up " in r.stdout and "--prefill" in r.stdout and
          "--restart" in r.stdout, "tandem --help: %d %r" % (r.returncode, r.stdout[:300]))
    r = subprocess.run([args.tandem], capture_output=True, text=True)
    check(r.returncode == 2 and "tandem --help" in r.stderr, "bare tandem: %d %r" %
          (r.returncode, r.stderr))
    model = make_model(args)
    t0 = time.time()
    st = Stack(args, "--model", model, "--prefill", "1", "--decode", "1", "--pd-mode", "always",
               "--served-model-name", "tandem-test")
    print("stack ready in %.1f s" % (time.time() - t0))

    # Endpoints: router, decode-0, prefill-0 on distinct ports, workers with nng inboxes.
    for name in ("router", "decode-0", "prefill-0"):
        check(name in st.endpoints, "%s missing from the endpoint list:\n%s" % (name, st.log()))
    ports = [e["port"] for e in st.endpoints.values()]
    ports += [e["nng_port"] for e in st.endpoints.values() if e["nng_port"]]
    check(len(set(ports)) == len(ports) == 5, "ports not distinct: %s" % st.endpoints)
    for name in ("router", "decode-0", "prefill-0"):
        s, _, _ = request(st.port(name), "GET", "/health")
        check(s == 200, "%s /health %d after ready" % (name, s))

    # Every child's startup line arrives behind its name.
    st.wait_line(r"^router\s+\| .* ready config=")
    st.wait_line(r"^decode-0\s+\| .* ready model=")
    st.wait_line(r"^prefill-0\s+\| .* ready model=")
    cfg_line = st.wait_line(r"^tandem\s+\| router config: ")
    cfg_path = cfg_line.split("router config: ", 1)[1].strip()
    check(os.path.isfile(cfg_path), "router config %s does not exist" % cfg_path)
    with open(cfg_path) as f:
        cfg = f.read()
    check("policy: least_loaded" in cfg and "pd_mode: always" in cfg,
          "unexpected router config:\n%s" % cfg)
    check("nng_port: %d" % st.endpoints["decode-0"]["nng_port"] in cfg, "decode nng port missing")

    # The printed curl works as printed (through a shell, like a paste).
    check(st.curl and "/v1/completions" in st.curl, "no curl line: %r" % st.curl)
    if shutil.which("curl"):
        r = subprocess.run(["sh", "-c", st.curl], capture_output=True, text=True, timeout=60)
        check(r.returncode == 0, "the printed curl failed: %s" % r.stderr)
        body = json.loads(r.stdout)
    else:
        # No curl here: send what it would send.
        data = st.curl.split("-d '", 1)[1].rsplit("'", 1)[0]
        s, _, body = post(st.port(), "/v1/completions", json.loads(data))
        check(s == 200, "the curl's request: %d %s" % (s, body))
    check(body.get("object") == "text_completion" and body["model"] == "tandem-test",
          "curl answer: %s" % body)
    check(body["usage"]["completion_tokens"] >= 1, "curl usage: %s" % body)

    # Through the router, non-stream and stream; the prefill worker did the prefills.
    # Internals are not told to clients by default (issue 11): no worker
    # address or phase times in the router's answer without --debug-headers.
    s, hdr, _ = post(st.port(), "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    check(s == 200 and "x-tandem-decode" not in hdr and "x-tandem-phases" not in hdr,
          "router answer headers leak internals: %s" % hdr)
    s, _, body = post(st.port(), "/v1/completions",
                      {"model": "tandem-test", "prompt": "The launcher starts", "max_tokens": 12,
                       "temperature": 0, "ignore_eos": True})
    check(s == 200 and body["usage"]["completion_tokens"] == 12, "router completion: %s" % body)
    # Tools work out of the box (issue 28, item 3): the model's chat template
    # writes Hermes <tool_call> tags, so tandem up turned on tool choice "auto"
    # (the SDKs' default whenever tools are sent) with the hermes parser.
    check('tool_choice "auto" is on: --enable-auto-tool-choice --tool-call-parser hermes'
          in st.log(), "tandem up did not turn on tool choice auto:\n" + st.log())
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object",
                                              "properties": {"city": {"type": "string"}}}}}]
    s, _, tbody = post(st.port(), "/v1/chat/completions",
                       {"model": "tandem-test", "max_tokens": 8, "tools": tools,
                        "messages": [{"role": "user", "content": "Weather in Paris?"}]})
    check(s == 200 and tbody["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"),
          "chat with tools, tool_choice auto by default: %d %s" % (s, tbody))
    stream = Stream(st.port(), "/v1/completions",
                    {"model": "tandem-test", "prompt": "The launcher starts", "max_tokens": 12,
                     "temperature": 0, "ignore_eos": True, "stream": True})
    check(stream.status == 200, "stream status %d" % stream.status)
    text, done = "", False
    for ev in stream.events():
        if ev == "[DONE]":
            done = True
            break
        text += "".join(c.get("text", "") for c in ev.get("choices", []))
    stream.close()
    check(done and text == body["choices"][0]["text"],
          "stream text %r != non-stream %r (done=%s)" % (text, body["choices"][0]["text"], done))
    pf = metric_sum(metrics(st.port("prefill-0")), "tandem:pd_prefill_requests_total")
    check(pf >= 3, "prefill-0 counted %g prefills for 3 disaggregated requests" % pf)

    # SIGHUP to the launcher reaches the router, which reloads its config.
    st.proc.send_signal(signal.SIGHUP)
    st.wait_line(r"^tandem\s+\| SIGHUP: the router reloads ")
    st.wait_line(r"^router\s+\| .*SIGHUP: config reloaded")
    check(st.proc.poll() is None, "tandem up exited on SIGHUP")

    # Ctrl-C during two long streams through the router (issue 14: the router
    # used to cut them): it drains like the workers, /health turns 503, and
    # both streams finish with every token, finish_reason and [DONE]. The
    # streams are sized to last about 8 s on this build and machine, well
    # inside the 30 s drain (a fixed 8 000 tokens outlasted it under ASan).
    took, slow = measure_slowness(st.port())
    n_tokens = tokens_for(8.0, took)
    print("slowness x%.1f: streams of %d tokens" % (slow, n_tokens))
    streams = [Stream(st.port(), "/v1/completions",
                      {"prompt": "stream %d" % i, "max_tokens": n_tokens, "ignore_eos": True,
                       "stream": True}) for i in range(2)]
    results = [None, None]
    started = [threading.Event(), threading.Event()]

    def consume(i):
        n, finish, done = 0, None, False
        for ev in streams[i].events():
            started[i].set()
            if ev == "[DONE]":
                done = True
                break
            for ch in ev.get("choices", []):
                n += 1 if ch.get("text") is not None else 0
                finish = ch.get("finish_reason") or finish
        results[i] = (n, finish, done)

    readers = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for r in readers:
        r.start()
    for ev in started:
        ev.wait(30)
    st.proc.send_signal(signal.SIGINT)
    st.wait_line(r"^router\s+\| .*signal=\d+ draining")
    code = None
    try:
        code = request(st.port(), "GET", "/health", timeout=2)[0]
    except OSError:
        pass
    check(code in (None, 503), "router /health during the drain: %s" % code)
    for r in readers:
        r.join(120)
    for i, res in enumerate(results):
        check(res is not None and res[1] == "length" and res[2],
              "stream %d through the router did not finish during the drain: %r" % (i, res))
    # Both ended after the drain began (else this checked nothing).
    t_end = time.time() + 20
    while True:  # the router logs a request after its last chunk went out
        lines = list(st.lines)
        i_drain = next(i for i, l in enumerate(lines) if re.search(r"^router .*draining", l))
        late = [l for l in lines[i_drain:]
                if re.search(r"^router .*completion_tokens=%d " % n_tokens, l)]
        if len(late) == 2 or time.time() > t_end:
            break
        time.sleep(0.1)
    check(len(late) == 2, "the streams did not outlive the drain's start:\n" + st.log())
    print("router drain ok (streams: %s)" % results)

    # The launcher stopped the router first, then the workers drained; exit 0.
    rc = st.wait_exit(120)
    log = st.log()
    check(rc == 0, "tandem up exited %d after SIGINT:\n%s" % (rc, log))
    st.check_children_gone()
    lines = st.lines
    i_router = next((i for i, l in enumerate(lines) if l.startswith("router") and "signal=" in l),
                    None)
    i_decode = next((i for i, l in enumerate(lines) if l.startswith("decode-0") and "signal=" in l),
                    None)
    check(i_router is not None and i_decode is not None and i_router < i_decode,
          "router was not stopped before decode-0:\n%s" % log)
    check(any(l.startswith("tandem") and l.endswith("| stopped") for l in lines),
          "no 'stopped' line:\n%s" % log)
    check(not os.path.exists(cfg_path), "router config %s left behind" % cfg_path)
    print("graceful stop ok")

    # Supervision (the default, --restart on-failure): a worker killed outright
    # is started again while the other serves, and the stack keeps running.
    st = Stack(args, "--model", model, "--prefill", "0", "--decode", "2")
    os.kill(st.endpoints["decode-0"]["pid"], signal.SIGKILL)
    for i in range(4):
        code, _, body = post(st.port(), "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        check(code == 200, "request %d while decode-0 is down: %d %r" % (i, code, body))
    st.wait_line(r"decode-0 exited unexpectedly \(signal 9.*restarting it in 1 s")
    line = st.wait_line(r"decode-0 restarted \(restart 1, pid \d+\)")
    new_pid = int(line.rsplit("pid ", 1)[1].rstrip(")"))
    st.endpoints["decode-0-restarted"] = dict(st.endpoints["decode-0"], pid=new_pid)
    t0 = time.time()
    while time.time() - t0 < 60:
        try:
            if request(st.port("decode-0"), "GET", "/health", timeout=2)[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.2)
    check(request(st.port("decode-0"), "GET", "/health")[0] == 200, "decode-0 not back:\n" + st.log())
    check(st.proc.poll() is None, "tandem up stopped after a worker died:\n" + st.log())
    rc = st.stop()
    check(rc == 0, "tandem up exited %d after a supervised restart" % rc)
    st.check_children_gone()
    print("supervised restart ok (decode-0 back in %.1f s)" % (time.time() - t0))

    # With --restart never, a worker that dies stops the stack, named, with a non-zero exit.
    st = Stack(args, "--model", model, "--prefill", "0", "--decode", "1", "--restart", "never")
    check("prefill-0" not in st.endpoints, "--prefill 0 started a prefill worker")
    os.kill(st.endpoints["decode-0"]["pid"], signal.SIGKILL)
    rc = st.wait_exit(60)
    check(rc != 0, "tandem up exited 0 after decode-0 was killed")
    st.wait_line(r"decode-0 exited unexpectedly \(signal 9")
    st.check_children_gone()
    print("worker death ok (exit %d)" % rc)

    # A model the workers cannot load: the startup fails naming the worker.
    empty = os.path.join(args.workdir, "empty-model")
    os.makedirs(empty, exist_ok=True)
    st = Stack(args, "--model", empty, "--decode", "1", wait_ready=False)
    rc = st.wait_exit(120)
    check(rc == 1, "tandem up with an empty model folder exited %d:\n%s" % (rc, st.log()))
    st.wait_line(r"(decode-0|router) exited \(exit status 1\) before it became healthy")
    st.wait_line(r"startup failed")
    check(not any(pid_alive(p) for p in st.pids()), "children left after a failed startup")
    print("startup failure ok")

    # A worker that never answers /health and ignores SIGTERM (a stand-in
    # binary through --bin-dir): the startup deadline names it, and it is
    # killed once the drain timeout and the grace period have passed.
    fake_dir = os.path.join(args.workdir, "fake-bin")
    os.makedirs(fake_dir, exist_ok=True)
    fake = os.path.join(fake_dir, "tandem-decode")
    with open(fake, "w") as f:
        f.write("#!/bin/sh\necho fake decode starting\nexec %s -c 'import signal, time; "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'\n"
                % sys.executable)
    os.chmod(fake, 0o755)
    t0 = time.time()
    st = Stack(args, "--model", model, "--no-router", "--bin-dir", fake_dir, "--startup-timeout",
               "1", "--drain-timeout", "0", wait_ready=False)
    rc = st.wait_exit(60)
    check(rc == 1, "unhealthy worker: exit %d:\n%s" % (rc, st.log()))
    st.wait_line(r"^decode-0\s+\| fake decode starting")
    st.wait_line(r"decode-0 \(port \d+\) did not become healthy within 1 s \(last /health: ")
    st.wait_line(r"still running 15 s after SIGTERM: killing")
    st.wait_line(r"decode-0 ended with signal 9")
    check(14 < time.time() - t0 < 40, "the kill came after %.1f s" % (time.time() - t0))
    print("startup timeout and SIGKILL escalation ok")

    # --device: every worker on one (emulated) GPU, each with its share of it;
    # the CUDA backend's module over its CPU emulator stands in for a GPU here.
    # --scheduling-policy goes to every worker likewise (a request's priority
    # is then served, not refused), and --default-chat-template-kwargs to
    # every process.
    kwargs = '{"enable_thinking": false}'
    st = Stack(args, "--model", model, "--prefill", "1", "--decode", "1", "--pd-mode", "always",
               "--device", "cuda-emu", "--scheduling-policy", "priority",
               "--default-chat-template-kwargs", kwargs)
    st.wait_line(r"^tandem\s+\| workers on --device cuda-emu; on a GPU each gets "
                 r"--gpu-memory-utilization 0\.45 of it")
    for w in ("decode-0", "prefill-0"):
        st.wait_line(r"^%s\s+\| .* ready model=.* device=cuda-emu:0$" % w)
        with open("/proc/%d/cmdline" % st.endpoints[w]["pid"], "rb") as f:
            argv = f.read().split(b"\0")
        i = argv.index(b"--gpu-memory-utilization")
        check(argv[argv.index(b"--device") + 1] == b"cuda-emu" and argv[i + 1] == b"0.45" and
              argv[argv.index(b"--scheduling-policy") + 1] == b"priority" and
              argv[argv.index(b"--default-chat-template-kwargs") + 1] == kwargs.encode(),
              "%s started with %r" % (w, argv))
    s, _, body = post(st.port(), "/v1/completions",
                      {"prompt": "one GPU for all", "max_tokens": 3, "temperature": 0,
                       "priority": 4})
    check(s == 200 and body["usage"]["completion_tokens"] == 3,
          "completion on cuda-emu workers: %d %r" % (s, body))
    check(st.stop() == 0, "tandem up --device cuda-emu did not exit 0:\n" + st.log())
    st.check_children_gone()
    for bad, why in ((["--device", "tpu"], "--device: expected cpu, auto, cuda, cuda:N"),
                     (["--scheduling-policy", "lifo"],
                      "--scheduling-policy: unknown policy \"lifo\" (fcfs or priority)"),
                     (["--default-chat-template-kwargs", '{"tokenize": true}'],
                      "--default-chat-template-kwargs: Found unexpected chat template kwargs"),
                     (["--device", "cpu", "--gpu-memory-utilization", "0.5"],
                      "does not apply to --device cpu"),
                     (["--prefill", "1", "--gpu-memory-utilization", "0.6"],
                      "0.60 x 2 workers is more than the one GPU they share (at most 0.50 each)")):
        r = subprocess.run([args.tandem, "up", "--model", model] + bad, capture_output=True,
                           text=True, timeout=30)
        check(r.returncode == 2 and why in r.stderr, "%s: %d %r" % (bad, r.returncode, r.stderr))
    print("--device cuda-emu stack ok")

    # A port in use and a bad flag fail before anything starts.
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    r = subprocess.run([args.tandem, "up", "--model", model, "--port", str(port)],
                       capture_output=True, text=True, timeout=60)
    busy.close()
    check(r.returncode == 1 and ("port %d" % port) in r.stdout and "not free" in r.stdout,
          "busy port: exit %d, output %r" % (r.returncode, r.stdout + r.stderr))
    r = subprocess.run([args.tandem, "up", "--decode", "0"], capture_output=True, text=True,
                       timeout=30)
    check(r.returncode == 2 and "--decode" in r.stderr, "--decode 0: %d %r" % (r.returncode,
                                                                             r.stderr))
    r = subprocess.run([args.tandem, "up", "--policy", "fastest", "--model", model, "--port", "0"],
                       capture_output=True, text=True, timeout=30)
    check(r.returncode == 1 and "unknown policy 'fastest'" in r.stdout,
          "--policy fastest: %d %r" % (r.returncode, r.stdout + r.stderr))
    r = subprocess.run([args.tandem, "up", "--help"], capture_output=True, text=True, timeout=30)
    check(r.returncode == 0 and "--prefill N" in r.stdout, "--help: %d" % r.returncode)
    print("PASS")


if __name__ == "__main__":
    main()
