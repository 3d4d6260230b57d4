# SPDX-License-Identifier: Apache-2.0
"""stack_demo: `tandem up` with no model: the built-in demo model, router + one decode worker.

With XDG_CACHE_HOME pointing into the build folder: the first run generates
the demo model into $XDG_CACHE_HOME/tandem/models/demo-v2 and serves it as
`tandem-demo` with the router talking to the decode worker only (--prefill 0:
no prefill section, pd_mode never); the second run reuses the folder without
writing it again. A Hub id found in the Hugging Face cache is served offline
under the id (--no-router: the decode worker alone). A bad preset fails with a
clear line.
"""
import os
import shutil
import subprocess
import time

from stack_harness import Stack, check, make_model, metric_sum, metrics, parse_args, post, request


def main():
    args = parse_args()
    xdg = os.path.abspath(os.path.join(args.workdir, "xdg-cache"))
    shutil.rmtree(xdg, ignore_errors=True)
    env = {"XDG_CACHE_HOME": xdg}
    folder = os.path.join(xdg, "tandem", "models", "demo-v2")

    st = Stack(args, env=env)
    st.wait_line(r"^tandem\s+\| generating the demo model \(preset demo")
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        check(os.path.isfile(os.path.join(folder, f)), "demo model lacks %s" % f)
    check(set(st.endpoints) == {"router", "decode-0"}, "endpoints: %s" % st.endpoints)
    cfg_path = st.wait_line(r"router config: ").split("router config: ", 1)[1].strip()
    with open(cfg_path) as f:
        cfg = f.read()
    check("pd_mode: never" in cfg and "prefill:" not in cfg, "router config:\n%s" % cfg)
    check('"model": "tandem-demo"' in st.curl, "curl line: %s" % st.curl)
    s, _, body = post(st.port(), "/v1/chat/completions",
                      {"model": "tandem-demo", "max_tokens": 8,
                       "messages": [{"role": "user", "content": "Hello"}]})
    check(s == 200 and body["object"] == "chat.completion" and
          body["usage"]["completion_tokens"] >= 1, "demo chat: %d %s" % (s, body))
    rc = st.stop()
    check(rc == 0, "first run exited %d:\n%s" % (rc, st.log()))
    st.check_children_gone()
    mtime = os.path.getmtime(os.path.join(folder, "model.safetensors"))

    st = Stack(args, "--prefill", "1", env=env)
    check(not any("generating the demo model" in l for l in st.lines),
          "the second run generated the model again:\n%s" % st.log())
    s, _, body = post(st.port(), "/v1/completions",
                      {"model": "tandem-demo", "prompt": "Hello", "max_tokens": 4})
    check(s == 200, "second run completion: %d %s" % (s, body))
    # With a prefill worker the launcher also prints a command that is
    # disaggregated as printed (a prompt over the P/D threshold): run it.
    st.wait_line(r"^tandem\s+\| disaggregated: a prompt over --pd-threshold 256 tokens")
    t_end = time.time() + 10
    while len(st.curls) < 2 and time.time() < t_end:
        time.sleep(0.05)
    check(len(st.curls) == 2, "no second curl line:\n%s" % st.log())
    before = metric_sum(metrics(st.port("prefill-0")), "tandem:pd_prefill_requests_total")
    r = subprocess.run(["sh", "-c", st.curls[1]], capture_output=True, text=True, timeout=60)
    check(r.returncode == 0 and '"text_completion"' in r.stdout,
          "the disaggregated curl as printed: %d %r %r" % (r.returncode, r.stdout[:200], r.stderr))
    after = metric_sum(metrics(st.port("prefill-0")), "tandem:pd_prefill_requests_total")
    check(after == before + 1, "the printed disaggregated curl was not prefilled remotely (%s -> %s)"
          % (before, after))
    rc = st.stop()
    check(rc == 0, "second run exited %d" % rc)
    check(os.path.getmtime(os.path.join(folder, "model.safetensors")) == mtime,
          "the cached demo model was rewritten")
    check(not any(n.startswith("demo-v2.tmp") for n in os.listdir(os.path.dirname(folder))),
          "temporary folders left in the cache")

    # A Hub id already in the Hugging Face cache (as another tool would have
    # left it) is served offline, under the id.
    hf_home = os.path.abspath(os.path.join(args.workdir, "hf-home"))
    shutil.rmtree(hf_home, ignore_errors=True)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = os.path.join(hf_home, "hub", "models--tandem-test--tiny")
    snap = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "refs"))
    shutil.copytree(make_model(args), snap)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    st = Stack(args, "--model", "tandem-test/tiny", "--no-router", "--decode", "1",
               env={"HF_HOME": hf_home, "HF_HUB_OFFLINE": "1"})
    s, _, body = request(st.port("decode-0"), "GET", "/v1/models")
    # root is the served name, not the snapshot folder (issue 11: no local paths to clients).
    check(s == 200 and body["data"][0]["id"] == "tandem-test/tiny" and
          body["data"][0]["root"] == body["data"][0]["id"], "models of the Hub id: %s" % body)
    check('"model": "tandem-test/tiny"' in st.curl, "curl line: %s" % st.curl)
    rc = st.stop()
    check(rc == 0, "Hub id run exited %d:\n%s" % (rc, st.log()))
    st.check_children_gone()

    r = subprocess.run([args.tandem, "up", "--model-preset", "huge", "--port", "0"],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, **env))
    check(r.returncode == 1 and 'unknown --model-preset "huge"' in r.stdout,
          "bad preset: %d %r" % (r.returncode, r.stdout + r.stderr))
    r = subprocess.run([args.tandem, "up", "--model", make_model(args), "--model-preset", "tiny"],
                       capture_output=True, text=True, timeout=60)
    check(r.returncode == 2 and "--model-preset" in r.stderr, "--model with --model-preset: %d %r"
          % (r.returncode, r.stderr))
    print("PASS")


if __name__ == "__main__":
    main()
