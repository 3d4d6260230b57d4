# SPDX-License-Identifier: Apache-2.0
"""One failure, one answer: a full waiting queue on the decode worker gets the
same status (503, vLLM's answer), Retry-After and OpenAI error body on every path:
the decode worker directly or through the router, streamed or not (before the
error table was shared the router said 429 streamed and 502 not). Router + 1
prefill + 1 decode worker with --max-num-seqs 1 --max-waiting 1, pd_mode never.
"""
import json
import os
import subprocess
import time

from pd_harness import Cluster, Stream, check, metrics, parse_args, post


def wait_metric(port, name, pred, what, timeout=30):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = sum(x for k, x in metrics(port).items() if k == name or k.startswith(name + "{"))
        if pred(v):
            return
        time.sleep(0.05)
    check(False, what)


def refused(port, stream):
    """A request the full queue refuses: (status, retry-after, body)."""
    body = {"prompt": "one too many", "max_tokens": 4, "stream": stream}
    if stream:
        s = Stream(port, "/v1/completions", body)
        raw = s.resp.read()
        s.close()
        return s.status, s.headers.get("retry-after"), json.loads(raw)
    st, hdr, b = post(port, "/v1/completions", body)
    return st, hdr.get("retry-after"), b


def main():
    args = parse_args()
    # A context long enough that the queue stays full while the test runs.
    model = os.path.join(args.workdir, "pd-errors-tiny")
    if not os.path.exists(os.path.join(model, "model.safetensors")):
        subprocess.run([args.mkmodel, "--preset", "tiny", "--max-pos", "32768", "--out", model], check=True,
                       stdout=subprocess.DEVNULL)
    cl = Cluster(args, n_prefill=1, n_decode=1, pd_mode="never", model=model,
                 worker_args=["--max-num-seqs", "1", "--max-waiting", "1"]).start()
    d = cl.decode[0].http_port
    # One running and one waiting, sent directly (its stream starts at once).
    long = {"prompt": "A long one.", "max_tokens": 30000, "ignore_eos": True, "stream": True}
    a = Stream(d, "/v1/completions", long)
    wait_metric(d, "vllm:num_requests_running", lambda v: v == 1, "first request not running")
    b = Stream(d, "/v1/completions", long)
    wait_metric(d, "vllm:num_requests_waiting", lambda v: v == 1, "second request not waiting")

    answers = {}
    for where, port in (("direct", d), ("routed", cl.router_port)):
        for stream in (False, True):
            answers["%s stream=%s" % (where, stream)] = refused(port, stream)
    want = answers["direct stream=False"]
    check(want[0] == 503 and want[1] == "1", "direct: %r" % (want,))
    e = want[2]["error"]
    check(e["code"] == 503 and e["type"] == "ServiceUnavailableError" and
          e["message"].startswith("The server is overloaded: the waiting queue is full"),
          "direct body %r" % want[2])
    for what, got in answers.items():
        check(got == want, "%s answered %r, direct %r" % (what, got, want))
    a.close()
    b.close()
    print("PASS: a full queue is 503, Retry-After 1 and the same body on all 4 paths: %s"
          % e["message"])


if __name__ == "__main__":
    main()
