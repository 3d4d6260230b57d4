# SPDX-License-Identifier: Apache-2.0
"""Process and port helpers shared by decode_harness, pd_harness and stack_harness (Python 3
stdlib only): every process a test starts is registered here and killed when
the test ends (atexit, fail, or the hard deadline), so a failing or hanging
test never leaves servers behind. Exit status convention: 0 pass, 1 fail.
"""
import atexit
import os
import random
import signal
import socket
import subprocess
import sys
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
        os._exit(1)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(seconds))


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
