# SPDX-License-Identifier: Apache-2.0
"""The harness's sanitizer check (proc_harness.watch_sanitizers) fails a test
whose processes left a report, and passes one whose processes did not.

A "test" here is a small script run as a child: it calls watch_sanitizers,
starts a process, and exits 0. That process writes a report where a
sanitizer would, i.e. at ASAN_OPTIONS' log_path + ".<pid>" as it inherited it
(a sanitized binary does exactly this on an error); the control writes
nothing. Expected: the first script exits 1 and prints the report, the second
exits 0. Python 3 stdlib only.
"""
import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# The child "service": writes a report at the log_path it was given, or not.
SERVICE = r'''
import os, sys
opts = dict(kv.split("=", 1) for kv in os.environ["ASAN_OPTIONS"].split(":") if "=" in kv)
if sys.argv[1] == "report":
    with open("%s.%d" % (opts["log_path"], os.getpid()), "w") as f:
        f.write("==1==ERROR: AddressSanitizer: heap-buffer-overflow (written by the test)\n")
'''

# The "test": what every integration test does through its harness.
TEST = r'''
import subprocess, sys
sys.path.insert(0, %r)
from proc_harness import watch_sanitizers
watch_sanitizers(sys.argv[1])
subprocess.run([sys.executable, "-c", %r, sys.argv[2]], check=True)
print("PASS", flush=True)
'''


def run(workdir, mode):
    r = subprocess.run([sys.executable, "-c", TEST % (HERE, SERVICE), workdir, mode],
                       capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout + r.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    workdir = os.path.join(args.workdir, "harness-sanitizer")
    os.makedirs(workdir, exist_ok=True)
    rc, out = run(workdir, "report")
    if rc != 1 or "heap-buffer-overflow (written by the test)" not in out \
            or "FAIL: 1 sanitizer report" not in out:
        print("FAIL: a report did not fail the test (exit %d):\n%s" % (rc, out))
        sys.exit(1)
    rc, out = run(workdir, "clean")
    if rc != 0 or "PASS" not in out:
        print("FAIL: a clean run failed (exit %d):\n%s" % (rc, out))
        sys.exit(1)
    print("harness sanitizer check: a report fails the test (exit 1), a clean run passes")
    print("PASS")


if __name__ == "__main__":
    main()
