# SPDX-License-Identifier: Apache-2.0
"""Fault suite (issue 11, labels faults and integration): router + 2 prefill +
2 decode workers on loopback with the shared secret, 8 concurrent streams
through the router, and one fault per case:

  - kill -9 of a decode worker, of a prefill worker and of the router, each
    restarted on the same ports afterwards;
  - a graceful restart of each role: SIGTERM (the process drains: every
    stream completes), exit, start again on the same ports;
  - SIGSTOP for 10 s then SIGCONT of a decode worker, a prefill worker and the
    router (alive, connected, silent; the router's streams must all complete:
    its own stall is not the workers' silence), and three 1.1 s stops of the
    router, under its stall detector: no stream may move;
  - a network partition of a decode worker and a prefill worker for 10 s. The
    test cannot rely on iptables/nft (not installed by .ci/run) or on network
    namespaces (a container may refuse them), so the partition is a TCP proxy
    the test puts in front of both workers' HTTP and nng ports (the router's
    config names the proxy; the decode workers reach the prefill worker through
    it too): cut, it accepts connections and holds every byte without
    forwarding it (no FIN, no RST: the classic partition); healed, it forwards
    again what it held.

Every case asserts: no stream is silent past its deadline (each ends within the
router's request deadline plus a small slack, never by the client's timeout);
a stream a decode fault interrupted moves to the other decode worker and
completes (stream migration, the router's default; the router counts each),
and a stream the fault did not touch completes (finish_reason "length", no
error); requests sent during a prefill
fault succeed; a new request succeeds within 2 s of the recovery (restart,
SIGCONT or heal) and the recovered worker takes traffic again; the requests
the router gave up on a stopped or cut-off worker end as soon as it hears
again, and a killed router's within 5 s on the workers; and at the end
of the case vllm:kv_cache_usage_perc, vllm:num_requests_running and
vllm:num_requests_waiting are 0 on every worker. test_pd_failures.py covers
the single-stream versions (one kill of each worker kind, a hung prefill
worker, drain); this suite runs each fault under concurrent load and adds the
router's faults and the partition.
"""
import http.client
import random
import signal
import socket
import subprocess
import threading
import time

from pd_harness import (Cluster, Stream, check, fail, free_port, metric_sum, metrics,
                        parse_args, post)
from proc_harness import SLOW_STREAMS, SLOW_TOKENS, measure_slowness, tokens_for

N_STREAMS = SLOW_STREAMS  # as in the calibration, whose timing sizes the streams
DEADLINE = 40.0  # the router's request.deadline_seconds in this suite
SLACK = 5.0  # a stream ends within its deadline plus this
# Time bounds for a release build; main() stretches them on a slower machine or
# build (a sanitizer build is 3-20 times slower), as calibrate() measures it.
RECOVER = 2.0  # a new request succeeds within this after the recovery
PAUSE = 10.0  # SIGSTOP and partition length
NOTICE = 5.0  # an interrupted stream's error event comes within this of the fault
BACK = 10.0  # a recovered worker takes traffic again within this
ORPHANS = 5.0  # a dead router's requests end on the workers within this (send timeout 2 s)


class Proxy:
    """TCP proxy 127.0.0.1:port -> 127.0.0.1:back that can be cut. Cut, it still
    accepts connections but forwards nothing in either direction (held bytes
    and new connections wait); healed, it forwards again. Thread per direction."""

    def __init__(self, back):
        self.back = back
        self.open = threading.Event()
        self.open.set()
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.port = free_port()
        self.lsock.bind(("127.0.0.1", self.port))
        self.lsock.listen(128)
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self):
        self.open.clear()

    def heal(self):
        self.open.set()

    def _accept(self):
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c):
        self.open.wait()  # a connection made during the partition goes nowhere
        try:
            b = socket.create_connection(("127.0.0.1", self.back), timeout=5)
        except OSError:
            c.close()
            return
        b.settimeout(None)
        t = threading.Thread(target=self._pump, args=(b, c), daemon=True)
        t.start()
        self._pump(c, b)
        t.join()
        c.close()
        b.close()

    def _pump(self, src, dst):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self.open.wait()
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Load:
    """n streams through the router, each in its own thread; records how each
    one ended: "done" ([DONE] after finish_reason, no error), "error" (an SSE
    error event), "http N", "closed" (connection closed or reset without
    either), "silent" (the client's socket timeout: nothing for
    DEADLINE + SLACK)."""

    def __init__(self, cl, n, max_tokens, rnd):
        self.cl = cl
        self.res = []
        self.threads = []
        for i in range(n):
            body = {"prompt": [rnd.randrange(3, 500) for _ in range(40)],
                    "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                    "stream": True}
            r = {"i": i, "start": time.time(), "first": None, "end": None, "tokens": 0,
                 "how": None, "error": None, "finish": None, "decode": None}
            self.res.append(r)
            t = threading.Thread(target=self._one, args=(r, body), daemon=True)
            t.start()
            self.threads.append(t)

    def _one(self, r, body):
        try:
            s = Stream(self.cl.router_port, "/v1/completions", body, timeout=DEADLINE + SLACK)
            r["decode"] = s.headers.get("x-tandem-decode")
            if s.status != 200:
                r["how"] = "http %d" % s.status
                r["error"] = s.resp.read()[:300]
            else:
                done = False
                for ev in s.events():
                    if ev == "[DONE]":
                        done = True
                        break
                    if "error" in ev:
                        r["error"] = ev["error"]
                        continue
                    for ch in ev.get("choices", []):
                        if r["first"] is None:
                            r["first"] = time.time()
                        r["tokens"] += 1
                        r["finish"] = ch.get("finish_reason") or r["finish"]
                r["how"] = "error" if r["error"] else ("done" if done and r["finish"]
                                                        else "closed")
            s.close()
        except socket.timeout:
            r["how"] = "silent"
        except (OSError, http.client.HTTPException) as e:
            r["how"] = "error" if r["error"] else "closed"
            r["error"] = r["error"] or repr(e)
        r["end"] = time.time()

    def wait_started(self, timeout=30):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if all(r["first"] is not None or r["how"] for r in self.res):
                bad = [r for r in self.res if r["first"] is None]
                check(not bad, "streams ended before their first token: %s" % bad)
                return
            time.sleep(0.02)
        fail("not every stream had its first token within %.0f s" % timeout)

    def join(self, what):
        """Waits for every stream; none may outlive its deadline plus slack."""
        for r, t in zip(self.res, self.threads):
            t.join(timeout=max(0.0, r["start"] + DEADLINE + SLACK + 2 - time.time()))
            check(not t.is_alive(), "%s: stream %d silent past its deadline" % (what, r["i"]))
            check(r["how"] != "silent", "%s: stream %d got nothing for %.0f s (decode %s)"
                  % (what, r["i"], DEADLINE + SLACK, r["decode"]))
            took = r["end"] - r["start"]
            check(took <= DEADLINE + SLACK, "%s: stream %d ended after %.1f s (deadline %.0f)"
                  % (what, r["i"], took, DEADLINE))
        return self.res


def small_body(rnd):
    return {"prompt": [rnd.randrange(3, 500) for _ in range(40)], "max_tokens": 4,
            "temperature": 0}


def recovered(cl, t_recover, rnd, what):
    """A new request through the router succeeds within RECOVER s of t_recover
    (failures before then are retried at once); returns the seconds it took."""
    while True:
        try:
            st, _, r = post(cl.router_port, "/v1/completions", small_body(rnd), timeout=RECOVER)
            if st == 200:
                break
            why = "status %d: %s" % (st, r)
        except (OSError, http.client.HTTPException) as e:
            why = repr(e)
        check(time.time() - t_recover <= RECOVER,
              "%s: no request succeeded within %.0f s of the recovery (last: %s)"
              % (what, RECOVER, why))
        time.sleep(0.05)
    took = time.time() - t_recover
    check(took <= RECOVER, "%s: first request after the recovery ended after %.2f s"
          % (what, took))
    return took


def decode_serves_again(cl, w, rnd, what):
    t0 = time.time()
    while time.time() - t0 < BACK:
        st, hdr, r = post(cl.router_port, "/v1/completions", small_body(rnd), timeout=30)
        check(st == 200, "%s: request status %d: %s" % (what, st, r))
        if hdr.get("x-tandem-decode") == w.name:
            return
        time.sleep(0.05)
    fail("%s: decode worker %s served nothing within %.0f s" % (what, w.name, BACK))


def prefill_serves_again(cl, w, rnd, what):
    before = metric_sum(metrics(w.http_port), "tandem:pd_prefill_requests_total")
    t0 = time.time()
    while time.time() - t0 < BACK:
        st, _, r = post(cl.router_port, "/v1/completions", small_body(rnd), timeout=30)
        check(st == 200, "%s: request status %d: %s" % (what, st, r))
        if metric_sum(metrics(w.http_port), "tandem:pd_prefill_requests_total") > before:
            return
    fail("%s: prefill worker %s prefilled nothing within %.0f s" % (what, w.name, BACK))


def orphans_freed(w, t_back, what):
    """The requests the router gave up on a worker that was stopped or cut off
    (not dead) are cancelled as soon as it hears again, not generated for
    nobody until max_tokens: running and KV 0 on it within RECOVER s."""
    last = None
    while time.time() - t_back <= RECOVER:
        m = metrics(w.http_port)
        last = (metric_sum(m, "vllm:num_requests_running"),
                metric_sum(m, "vllm:kv_cache_usage_perc"))
        if last == (0, 0):
            return time.time() - t_back
        time.sleep(0.05)
    fail("%s: %s still runs the abandoned requests %.0f s after it came back "
         "(running, KV usage: %s)" % (what, w.name, RECOVER, last))


def migrations(cl):
    return metric_sum(metrics(cl.router_port), "tandem:router_stream_migrations_total")


def check_split(cl, res, victim, t_fault, what, m0, moved_all=True):
    """Streams on the victim decode worker move to the other one (stream
    migration, the router's default: issue 11 part 6) and complete like the
    others; the router counts one migration each. (--no-stream-migration, where
    they end with an error event instead, is pd_failures' and
    stream_migration's.) Returns when the last interrupted stream ended,
    seconds after the fault. moved_all=False: the fault may leave the streams
    where they are (a partition that cuts the router's requests and load
    queries but not the worker's own connection: its tokens keep arriving, so
    the router rightly keeps them), but they must complete all the same."""
    hit = [r for r in res if r["decode"] == victim.name]
    check(hit, "%s: no stream ran on %s (%s)" % (what, victim.name, [r["decode"] for r in res]))
    for r in res:
        check(r["how"] == "done" and r["finish"] == "length",
              "%s: stream %d on %s%s ended %s, finish_reason %s, after %d chunks (%s)"
              % (what, r["i"], r["decode"], " (interrupted)" if r in hit else "", r["how"],
                 r["finish"], r["tokens"], r["error"]))
    moved = migrations(cl) - m0
    check(moved >= len(hit) or not moved_all, "%s: %d streams interrupted, the router counts %d migrations"
          % (what, len(hit), moved))
    return max(r["end"] - t_fault for r in hit)


def all_done(res, what):
    for r in res:
        check(r["how"] == "done" and r["finish"] == "length",
              "%s: stream %d ended %s, finish_reason %s, after %d chunks (%s)"
              % (what, r["i"], r["how"], r["finish"], r["tokens"], r["error"]))


def settle(cl, what, timeout=30, router=True):
    """Every process alive (the router too unless told) and every worker's KV,
    running and waiting gauges 0 within timeout; returns the seconds it took."""
    for w in cl.workers():
        check(w.proc.poll() is None, "%s: %s %s died (%s)" % (what, w.kind, w.name,
                                                             w.proc.returncode))
    check(not router or cl.router_proc.poll() is None, "%s: the router died" % what)
    t0 = time.time()
    cl.wait_kv_free(timeout=timeout)
    return time.time() - t0


def calibrate(cl):
    """max_tokens for streams of about 8 s at N_STREAMS on this machine, and how
    much slower than a release build on the development machine it is
    (proc_harness.measure_slowness: N_STREAMS completions of 1 000 tokens)."""
    took, slow = measure_slowness(cl.router_port)
    return tokens_for(8.0, took), took, slow


def case_decode_kill(cl, rnd, mt):
    victim = cl.decode[0]
    load = Load(cl, N_STREAMS, mt, rnd)
    load.wait_started()
    m0 = migrations(cl)
    cl.kill(victim)
    t_fault = time.time()
    notice = check_split(cl, load.join("decode kill -9"), victim, t_fault, "decode kill -9", m0)
    cl.restart(victim)
    rec = recovered(cl, time.time(), rnd, "decode restart")
    decode_serves_again(cl, victim, rnd, "decode restart")
    return "interrupted streams migrated, complete %.2f s after the kill; restarted, first " \
           "request %.2f s" % (notice, rec)


def case_decode_stop(cl, rnd, mt):
    victim = cl.decode[0]
    load = Load(cl, N_STREAMS, mt, rnd)
    load.wait_started()
    m0 = migrations(cl)
    victim.proc.send_signal(signal.SIGSTOP)
    t_fault = time.time()
    try:
        time.sleep(PAUSE)
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    t_cont = time.time()
    freed = orphans_freed(victim, t_cont, "decode SIGCONT")
    # Probed before the migrated streams are joined (as the prefill and router
    # cases do): joining first counted their remaining seconds as recovery
    # time (7.5 s against a 6.1 s bound under ASan).
    rec = recovered(cl, t_cont, rnd, "decode SIGCONT")
    notice = check_split(cl, load.join("decode SIGSTOP"), victim, t_fault, "decode SIGSTOP", m0)
    decode_serves_again(cl, victim, rnd, "decode SIGCONT")
    return "interrupted streams migrated, complete %.2f s after SIGSTOP; after SIGCONT abandoned requests freed in " \
           "%.2f s, first request %.2f s" % (notice, freed, rec)


def prefill_fault(cl, rnd, mt, victim, what, during):
    """8 streams running, the fault, 8 more streams started during it: all 16 complete."""
    load = Load(cl, N_STREAMS, mt, rnd)
    load.wait_started()
    during_fault = during()
    fresh = Load(cl, N_STREAMS, 16, rnd)
    res2 = fresh.join(what + " (sent during)")
    all_done(res2, what + " (sent during)")
    worst = max(r["first"] - r["start"] for r in res2)
    t_rec = during_fault()
    rec = recovered(cl, t_rec, rnd, what + " recovery")
    all_done(load.join(what), what)
    prefill_serves_again(cl, victim, rnd, what + " recovery")
    return "8 requests during the fault ok (worst TTFT %.2f s); first after recovery %.2f s" % (
        worst, rec)


def case_prefill_kill(cl, rnd, mt):
    victim = cl.prefill[0]

    def during():
        cl.kill(victim)

        def recover():
            cl.restart(victim)
            return time.time()
        return recover
    return prefill_fault(cl, rnd, mt, victim, "prefill kill -9", during)


def case_prefill_stop(cl, rnd, mt):
    victim = cl.prefill[0]

    def during():
        victim.proc.send_signal(signal.SIGSTOP)
        t_stop = time.time()

        def recover():
            time.sleep(max(0.0, t_stop + PAUSE - time.time()))
            victim.proc.send_signal(signal.SIGCONT)
            return time.time()
        return recover
    try:
        return prefill_fault(cl, rnd, mt, victim, "prefill SIGSTOP", during)
    finally:
        victim.proc.send_signal(signal.SIGCONT)


def case_router_kill(cl, rnd, mt):
    load = Load(cl, N_STREAMS, mt, rnd)
    load.wait_started()
    cl.router_proc.kill()
    cl.router_proc.wait(timeout=20)
    t_fault = time.time()
    res = load.join("router kill -9")
    for r in res:
        # Nobody is left to write an error event: the connection closes.
        check(r["how"] in ("closed", "error"), "router kill -9: stream %d ended %s"
              % (r["i"], r["how"]))
        check(r["end"] - t_fault <= NOTICE, "router kill -9: stream %d ended %.1f s after"
              % (r["i"], r["end"] - t_fault))
    # The decode workers' orphaned requests: a chunk the router cannot take
    # within the decode worker's 2 s send timeout aborts the request, well
    # before the ~7 s of generation left.
    settle(cl, "router kill -9 (orphans)", router=False)
    freed = time.time() - t_fault
    check(freed <= ORPHANS, "router kill -9: the workers ran the orphans for %.1f s (> %.0f s)"
          % (freed, ORPHANS))
    cl.start_router(settle=0)
    rec = recovered(cl, time.time(), rnd, "router restart")
    return "streams closed; orphans freed on the workers %.2f s after the kill; restarted " \
           "router's first request %.2f s" % (freed, rec)


def case_router_stop(cl, rnd, mt):
    load = Load(cl, N_STREAMS, mt, rnd)
    load.wait_started()
    cl.router_proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(PAUSE)
    finally:
        cl.router_proc.send_signal(signal.SIGCONT)
    t_cont = time.time()
    rec = recovered(cl, t_cont, rnd, "router SIGCONT")
    # The workers were fine all along: a stall of the router is not their
    # silence, and every stream goes on to complete (they all failed once).
    all_done(load.join("router SIGSTOP"), "router SIGSTOP")
    return "every stream completed after SIGCONT; first request %.2f s" % rec


def case_router_short_stops(cl, rnd, mt):
    """Stops of the router shorter than its own stall detector (load interval
    0.2 s + liveness timeout 1.0 s): 1.1 s, three times, under load. The last
    report it read is older than the timeout when it comes back, but it did
    not ask the workers anything meanwhile: no worker is condemned, no stream
    moves, every one completes (issue 29 part 6: a live worker's stream was
    migrated after the router stalled)."""
    load = Load(cl, N_STREAMS, mt, rnd)
    load.wait_started()
    m0 = migrations(cl)
    for _ in range(3):
        cl.router_proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(1.1)
        finally:
            cl.router_proc.send_signal(signal.SIGCONT)
        time.sleep(0.6)
    all_done(load.join("router short stops"), "router short stops")
    moved = migrations(cl) - m0
    check(moved == 0, "router short stops: %d streams migrated off live workers" % moved)
    return "every stream completed where it was (0 migrations)"


def graceful_restart(cl, rnd, mt, proc, restart, what):
    """SIGTERM under 8 streams: the process drains (its streams and every other
    complete, new requests go elsewhere while a worker drains), exits, and comes
    back on its ports; a new request succeeds within RECOVER s of its return."""
    load = Load(cl, N_STREAMS, mt, rnd)
    load.wait_started()
    proc.send_signal(signal.SIGTERM)
    t0 = time.time()
    try:
        proc.wait(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        fail("%s: still running %.0f s after SIGTERM" % (what, DEADLINE))
    drained = time.time() - t0
    all_done(load.join(what), what)
    restart()
    rec = recovered(cl, time.time(), rnd, what)
    return "drained and exited in %.2f s, every stream complete; back, first request %.2f s" % (
        drained, rec)


def case_decode_term(cl, rnd, mt):
    w = cl.decode[0]
    what = graceful_restart(cl, rnd, mt, w.proc, lambda: cl.restart(w), "decode SIGTERM")
    decode_serves_again(cl, w, rnd, "decode SIGTERM")
    return what


def case_prefill_term(cl, rnd, mt):
    w = cl.prefill[0]
    what = graceful_restart(cl, rnd, mt, w.proc, lambda: cl.restart(w), "prefill SIGTERM")
    prefill_serves_again(cl, w, rnd, "prefill SIGTERM")
    return what


def case_router_term(cl, rnd, mt):
    return graceful_restart(cl, rnd, mt, cl.router_proc, lambda: cl.start_router(settle=0),
                            "router SIGTERM")


def case_partition(cl, rnd, mt, proxies):
    victim = cl.decode[1]
    load = Load(cl, N_STREAMS, mt, rnd)
    load.wait_started()
    m0 = migrations(cl)
    for p in proxies:
        p.cut()
    t_fault = time.time()
    try:
        # Requests sent during the partition succeed elsewhere.
        fresh = Load(cl, 4, 16, rnd)
        res2 = fresh.join("partition (sent during)")
        all_done(res2, "partition (sent during)")
        check(all(r["decode"] != victim.name for r in res2),
              "partition: a request was routed to the partitioned decode worker")
        time.sleep(max(0.0, t_fault + PAUSE - time.time()))
    finally:
        for p in proxies:
            p.heal()
    t_heal = time.time()
    freed = orphans_freed(victim, t_heal, "partition healed")
    rec = recovered(cl, t_heal, rnd, "partition healed")  # before the join, as above
    notice = check_split(cl, load.join("partition"), victim, t_fault, "partition", m0,
                         moved_all=False)
    moved = migrations(cl) - m0
    decode_serves_again(cl, victim, rnd, "partition healed")
    prefill_serves_again(cl, cl.prefill[1], rnd, "partition healed")
    return "its streams complete %.2f s after the cut (%d migrated); healed, abandoned requests " \
           "freed in %.2f s, first request %.2f s" % (notice, moved, freed, rec)


def main():
    args = parse_args()
    rnd = random.Random(11)
    cl = Cluster(args, n_prefill=2, n_decode=2, policy="round_robin", pd_mode="always",
                 deadline_s=DEADLINE)
    # decode[1] and prefill[1] are reached through proxies (HTTP and nng).
    proxies = []
    for w in (cl.decode[1], cl.prefill[1]):
        ph, pn = Proxy(w.http_port), Proxy(w.nng_port)
        w.route_http_port, w.route_nng_port = ph.port, pn.port
        proxies += [ph, pn]
    cl.write_config("round_robin", "always")
    cl.start()
    t_all = time.time()
    mt, took, slow = calibrate(cl)
    global RECOVER, NOTICE, BACK, ORPHANS
    RECOVER, NOTICE, BACK, ORPHANS = (x * slow for x in (RECOVER, NOTICE, BACK, ORPHANS))
    print("calibration: %d tokens in %.2f s per stream at %d streams -> max_tokens %d; "
          "time bounds x%.1f (recovery %.1f s)"
          % (SLOW_TOKENS, took, N_STREAMS, mt, slow, RECOVER), flush=True)
    cases = [("decode kill -9 + restart", case_decode_kill),
             ("decode SIGSTOP 10 s", case_decode_stop),
             ("prefill kill -9 + restart", case_prefill_kill),
             ("prefill SIGSTOP 10 s", case_prefill_stop),
             ("partition of decode + prefill 10 s", lambda c, r, m: case_partition(c, r, m,
                                                                                   proxies)),
             ("router SIGSTOP 10 s", case_router_stop),
             ("router SIGSTOP 1.1 s x 3", case_router_short_stops),
             ("router kill -9 + restart", case_router_kill),
             ("decode SIGTERM + restart", case_decode_term),
             ("prefill SIGTERM + restart", case_prefill_term),
             ("router SIGTERM + restart", case_router_term)]
    for name, fn in cases:
        t0 = time.time()
        what = fn(cl, rnd, mt)
        freed = settle(cl, name)
        print("%-36s ok in %5.1f s: %s; KV and running 0 everywhere after %.2f s"
              % (name, time.time() - t0, what, freed), flush=True)
    print("all cases in %.0f s" % (time.time() - t_all), flush=True)
    print("PASS", flush=True)


if __name__ == "__main__":
    main()
