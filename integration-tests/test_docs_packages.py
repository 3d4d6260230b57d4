# SPDX-License-Identifier: Apache-2.0
"""One list of Debian packages, in one place (issue 28, item 4).

.ci/run holds the list: `bash .ci/run --print-deps` prints it (and installs
nothing), `--deps-only` installs it. The README and the docs must not carry a
list of their own (the quickstart's once differed from both): every
`apt-get install` they show installs `$(bash .ci/run --print-deps)`, or names
packages outside the build's list (a container tool, say).
"""
import glob
import os
import re
import subprocess
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
r = subprocess.run(["bash", os.path.join(root, ".ci", "run"), "--print-deps"],
                   capture_output=True, text=True, timeout=60)
if r.returncode != 0:
    sys.exit("FAIL: .ci/run --print-deps exited %d: %s" % (r.returncode, r.stderr))
deps = set(r.stdout.split())
for lib in ("libnng-dev", "libprotobuf-c-dev", "libcivetweb-dev", "libcjson-dev", "libpcre2-dev",
            "libutf8proc-dev", "libcmocka-dev", "libcurl4-openssl-dev", "cmake"):
    if lib not in deps:
        sys.exit("FAIL: .ci/run --print-deps lacks %s: %s" % (lib, r.stdout))
bad = []
for path in [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md"))):
    text = open(path, encoding="utf-8").read().replace("\\\n", " ")
    for m in re.finditer(r"apt-get install([^\n`]*)", text):
        named = {w for w in m.group(1).split() if not w.startswith(("-", "$"))} & deps
        if named:
            bad.append("%s: its own list (%s)" % (os.path.relpath(path, root),
                                                 " ".join(sorted(named))))
if bad:
    sys.exit("FAIL: package lists outside .ci/run:\n  " + "\n  ".join(bad))
print("docs_packages: %d packages in .ci/run; README and docs point there" % len(deps))
