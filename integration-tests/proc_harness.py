# SPDX-License-Identifier: Apache-2.0
"""Process and port helpers shared by decode_harness, pd_harness and stack_harness (Python 3
stdlib only): every process a test starts is registered here and killed when
the test ends (atexit, fail, or the hard deadline), so a failing or hanging
test never leaves servers behind. Exit status convention: 0 pass, 1 fail.
"""
import atexit
import os
import signal
import socket
import subprocess
import sys

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


def free_port():
    """A TCP port free on 127.0.0.1 right now."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
