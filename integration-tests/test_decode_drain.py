# SPDX-License-Identifier: Apache-2.0
"""SIGTERM drains tandem-decode.

1. A running stream keeps going after SIGTERM and completes (finish_reason
   length, [DONE]); meanwhile /health is 503 and a new request gets 503; then
   the process exits 0.
2. With --drain-timeout 0.5 a stream that cannot finish in time is cut: its
   last chunk says finish_reason "abort", [DONE] follows, and the exit is 0.
"""
import signal
import time

import decode_harness as h


def main():
    args = h.parse_args()
    model = h.make_model(args, "tiny-long", ["--max-pos", "32768"])

    srv = h.Server(args, model, "--drain-timeout", "200")
    st = h.Stream(srv, "/v1/completions", {"prompt": "Go on.", "max_tokens": 5000,
                                           "ignore_eos": True, "stream": True,
                                           "stream_options": {"include_usage": True}})
    events = st.events()
    next(events)
    srv.proc.send_signal(signal.SIGTERM)
    # Draining: health and new work are refused while the stream continues.
    deadline = time.time() + 10
    while True:
        status, _, _ = srv.request("GET", "/health")
        if status == 503:
            break
        h.check(time.time() < deadline, "/health stayed %d after SIGTERM" % status)
        time.sleep(0.01)
    status, hdrs, err = srv.post_json("/v1/completions", {"prompt": "late", "max_tokens": 2})
    h.check(status == 503 and err["error"]["code"] == 503, "new request while draining: %d %r" %
            (status, err))
    finish, usage, done = None, None, False
    for ev in events:
        if ev == "[DONE]":
            done = True
        elif ev["choices"]:
            finish = ev["choices"][0]["finish_reason"] or finish
        else:
            usage = ev["usage"]
    st.close()
    h.check(done and finish == "length", "drained stream: finish %r done %r" % (finish, done))
    h.check(usage["completion_tokens"] == 5000, "drained stream usage %r" % usage)
    rc = srv.wait(timeout=30)
    h.check(rc == 0, "exit status %r after the drain" % rc)
    h.check(any("draining" in l for l in srv.log), "no drain log line")

    srv = h.Server(args, model, "--drain-timeout", "0.5")
    st = h.Stream(srv, "/v1/completions", {"prompt": "Go on.", "max_tokens": 30000,
                                           "ignore_eos": True, "stream": True})
    events = st.events()
    next(events)
    t0 = time.time()
    srv.proc.send_signal(signal.SIGTERM)
    finish, done = None, False
    for ev in events:
        if ev == "[DONE]":
            done = True
        elif ev["choices"]:
            finish = ev["choices"][0]["finish_reason"] or finish
    st.close()
    h.check(done and finish == "abort", "cut stream: finish %r done %r" % (finish, done))
    rc = srv.wait(timeout=30)
    exit_s = time.time() - t0
    h.check(rc == 0, "exit status %r after the drain timeout" % rc)
    print("PASS: drain completed a stream; a 0.5 s drain cut one and exited after %.2f s" %
          exit_s)


if __name__ == "__main__":
    main()
