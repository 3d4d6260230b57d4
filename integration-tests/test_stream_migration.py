# SPDX-License-Identifier: Apache-2.0
"""A stream survives its decode worker (issue 11, part 6, B3).

Router + 1 prefill + 3 decode workers, every prompt prefilled remotely
(pd_harness's slow model, --threads 1). Six streams, greedy and
seeded (temperature 1, seed 7), ignore_eos, 160 tokens each, are run once
undisturbed for the reference; then again, and once the first of them has 25
tokens its decode worker is killed with SIGKILL. The router moves every
stream of that worker to another one with the tokens already sent (the new
worker computes prompt + those locally and its sampler replays them), so each stream
completes with finish_reason "length" and equals its reference token for
token (token_ids and logprobs). tandem:router_stream_migrations_total counts
the moves. With --no-stream-migration the same kill ends the streams with an
error event (the old behaviour, the opt-out).
"""
import threading
import time

from pd_harness import (Cluster, Stream, check, make_slow_model, metric_sum, metrics,
                        parse_args)

N_TOKENS = 160


def body(i, seeded):
    b = {"prompt": "stream %d says" % i, "max_tokens": N_TOKENS, "ignore_eos": True,
         "stream": True, "return_token_ids": True, "logprobs": 1}
    if seeded:
        b.update({"temperature": 1.0, "seed": 7 + i})
    else:
        b.update({"temperature": 0})
    return b


def run(cl, bodies, kill=None):
    """Runs the streams concurrently; returns [(ids, logprobs, finish, error, decode)].
    kill(name): called with stream 0's decode worker once it has 25 tokens."""
    out = [None] * len(bodies)
    first = threading.Event()
    decode0 = []

    def one(i):
        s = Stream(cl.router_port, "/v1/completions", bodies[i], timeout=120)
        if i == 0:
            decode0.append(s.headers.get("x-tandem-decode"))
        ids, lps, finish, err = [], [], None, None
        for ev in s.events():
            if ev == "[DONE]":
                break
            if "error" in ev:
                err = ev["error"]
                continue
            for ch in ev.get("choices", []):
                ids += ch.get("token_ids") or []
                lp = ch.get("logprobs") or {}
                lps += lp.get("token_logprobs") or []
                finish = ch.get("finish_reason") or finish
            if i == 0 and len(ids) >= 25:
                first.set()
        s.close()
        out[i] = (ids, lps, finish, err, s.headers.get("x-tandem-decode"))

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in ts:
        t.start()
    if kill:
        check(first.wait(60), "stream 0 never reached 25 tokens")
        kill(decode0[0])
    for t in ts:
        t.join()
    return out


def main():
    args = parse_args()
    cl = Cluster(args, n_prefill=1, n_decode=3, pd_mode="always",
                 model=make_slow_model(args)).start()
    by_name = {w.name: w for w in cl.decode}
    for seeded in (False, True):
        kind = "seeded" if seeded else "greedy"
        bodies = [body(i, seeded) for i in range(6)]
        ref = run(cl, bodies)
        for i, (ids, _, finish, err, _) in enumerate(ref):
            check(err is None and finish == "length" and len(ids) == N_TOKENS,
                  "reference stream %d: %s %s %d" % (i, err, finish, len(ids)))
        before = metric_sum(metrics(cl.router_port), "tandem:router_stream_migrations_total")
        victim = []

        def kill(name):
            victim.append(by_name[name])
            cl.kill(by_name[name])
        got = run(cl, bodies, kill=kill)
        moved = [i for i in range(6) if got[i][4] == victim[0].name]
        check(0 in moved, "stream 0 was not on the killed worker: %s" % moved)
        for i, (ids, lps, finish, err, dec) in enumerate(got):
            check(err is None, "%s stream %d (on %s) ended with an error: %s" % (kind, i, dec, err))
            check(finish == "length" and len(ids) == N_TOKENS,
                  "stream %d: finish %s, %d tokens" % (i, finish, len(ids)))
            check(ids == ref[i][0], "%s stream %d differs from the undisturbed run at token %s" %
                  (kind, i, next((j for j, (a, b) in enumerate(zip(ids, ref[i][0])) if a != b),
                                 None)))
            check(len(lps) == len(ref[i][1]) and
                  all(abs(a - b) < 1e-4 for a, b in zip(lps, ref[i][1])),
                  "%s stream %d: logprobs differ" % (kind, i))
        after = metric_sum(metrics(cl.router_port), "tandem:router_stream_migrations_total")
        check(after - before == len(moved), "migrations counter %s -> %s for %d moved streams" %
              (before, after, len(moved)))
        print("stream_migration: %s: %d streams on the killed worker continued, all 6 equal "
              "the undisturbed run" % (kind, len(moved)))
        cl.restart(victim[0])
        time.sleep(1.5)  # the router sees it healthy again
    # The opt-out: the router restarted with --no-stream-migration.
    cl.router_proc.kill()
    cl.router_proc.wait()
    cl.router_args = ["--no-stream-migration"]
    cl.start_router()
    time.sleep(1.0)
    got = run(cl, [body(i, False) for i in range(3)], kill=lambda name: cl.kill(by_name[name]))
    check(got[0][3] is not None, "without migration stream 0 should end with an error event")
    print("stream_migration: --no-stream-migration: the lost stream ended with an error event")


if __name__ == "__main__":
    main()
