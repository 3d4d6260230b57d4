# SPDX-License-Identifier: Apache-2.0
"""The harness's sanitizer check (proc_harness.watch_sanitizers) fails a test
whose processes left a report, and passes one whose processes did not.

A "test" here is a small script run as a child: it calls watch_sanitizers,
starts a process with its stderr in a watched log, and exits 0. That process
writes a report where a sanitizer would: at ASAN_OPTIONS' log_path + ".<pid>"
as it inherited it (ASan does exactly this), or a UBSan line on its stderr
(gcc's UBSan in an ASan build); the control writes nothing. Expected: the
first two scripts exit 1 and print the report, the third exits 0. Python 3
stdlib only.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# The child "service": writes a report at the log_path it was given, or not.
SERVICE = r'''
import os, sys
opts = dict(kv.split("=", 1) for kv in os.environ["ASAN_OPTIONS"].split(":") if "=" in kv)
if sys.argv[1] == "report":
    with open("%s.%d" % (opts["log_path"], os.getpid()), "w") as f:
        f.write("==1==ERROR: AddressSanitizer: heap-buffer-overflow (written by the test)\n")
if sys.argv[1] == "log":  # gcc's UBSan in an ASan build: stderr, whatever log_path says
    sys.stderr.write("x.c:1:1: runtime error: store to misaligned address (written by the test)\n")
'''

# The "test": what every integration test does through its harness.
TEST = r'''
import os, subprocess, sys
sys.path.insert(0, %r)
from proc_harness import read_file, watch_log, watch_sanitizers
watch_sanitizers(sys.argv[1])
log = os.path.join(sys.argv[1], "service-%%d.log" %% os.getpid())
watch_log(log, read_file(log))
with open(log, "w") as f:
    subprocess.run([sys.executable, "-c", %r, sys.argv[2]], check=True, stderr=f)
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
    os.makedirs(args.workdir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="harness-sanitizer-", dir=args.workdir)
    rc, out = run(workdir, "report")
    if rc != 1 or "heap-buffer-overflow (written by the test)" not in out \
            or "FAIL: 1 sanitizer report" not in out:
        print("FAIL: a report did not fail the test (exit %d):\n%s" % (rc, out))
        sys.exit(1)
    rc, out = run(workdir, "log")
    if rc != 1 or "store to misaligned address (written by the test)" not in out:
        print("FAIL: a report in a service's log did not fail the test (exit %d):\n%s"
              % (rc, out))
        sys.exit(1)
    rc, out = run(workdir, "clean")
    if rc != 0 or "PASS" not in out:
        print("FAIL: a clean run failed (exit %d):\n%s" % (rc, out))
        sys.exit(1)
    print("harness sanitizer check: a report file or a report in a log fails the test (exit 1), "
          "a clean run passes")
    shutil.rmtree(workdir)  # the reports above were this test's own
    print("PASS")


if __name__ == "__main__":
    main()
