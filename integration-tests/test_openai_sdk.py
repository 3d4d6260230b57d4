# SPDX-License-Identifier: Apache-2.0
"""openai_sdk: the official OpenAI SDK for Node.js against the router and a decode worker.

Installs the pinned npm `openai` and `zod` (package-lock.json; zod for the
SDK's zodResponseFormat helper) with `npm ci` into
integration-tests/node_modules when it is missing or older than the lock file
(under a lock, so parallel tests install once), starts `tandem up --prefill 1
--decode 1`, and runs test_openai_sdk.mjs against the router's /v1 and then
decode-0's own /v1. Skips (exit 77) when node or npm is absent, or when the
packages are missing and the npm registry cannot be reached.
"""
import fcntl
import os
import shutil
import subprocess

from stack_harness import Stack, check, make_model, parse_args, skip

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "tandem-sdk-test"


def installed():
    stamp = os.path.join(HERE, "node_modules", ".package-lock.json")
    lock = os.path.join(HERE, "package-lock.json")
    return os.path.exists(stamp) and os.path.getmtime(stamp) >= os.path.getmtime(lock)


def ensure_packages(args):
    if installed():
        return
    npm = shutil.which(args.npm)
    if not npm:
        skip("node_modules missing and npm not found (Debian: apt-get install npm)")
    with open(os.path.join(args.workdir, "npm-ci.lock"), "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        if installed():
            return
        print("npm ci in %s" % HERE, flush=True)
        r = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=HERE,
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            ping = subprocess.run([npm, "ping"], cwd=HERE, capture_output=True, text=True,
                                  timeout=60)
            if ping.returncode != 0:
                skip("npm registry unreachable, cannot install the pinned openai and zod packages: %s"
                     % (ping.stderr.strip().splitlines() or ["?"])[-1])
            check(False, "npm ci failed: %s" % r.stderr)


def main():
    args = parse_args()
    node = shutil.which(args.node)
    if not node:
        skip("node not found (Debian: apt-get install nodejs)")
    ensure_packages(args)
    model = make_model(args)
    st = Stack(args, "--model", model, "--prefill", "1", "--decode", "1", "--pd-mode", "always",
               "--served-model-name", MODEL)
    for name in ("router", "decode-0"):
        r = subprocess.run([node, os.path.join(HERE, "test_openai_sdk.mjs"),
                            "--base-url", "http://127.0.0.1:%d/v1" % st.port(name),
                            "--model", MODEL, "--label", name],
                           capture_output=True, text=True, timeout=180, cwd=HERE)
        print(r.stdout, end="", flush=True)
        check(r.returncode == 0, "the OpenAI SDK against %s:\n%s%s" % (name, r.stderr,
                                                                       st.log()[-4000:]))
    rc = st.stop()
    check(rc == 0, "tandem up exited %d:\n%s" % (rc, st.log()))
    st.check_children_gone()
    print("PASS")


if __name__ == "__main__":
    main()
