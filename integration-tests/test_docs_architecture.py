# SPDX-License-Identifier: Apache-2.0
"""docs/architecture.md matches the code (issue 27, part D).

Two checks over the source tree, no build needed:
1. Every name the page writes in backticks that looks like code is in the
   code: a path (`worker/worker.c`, `common/engine/kv`), a function or type name
   (`tdm_worker_new`, `load_text_side`, `struct tdm_strbuf`), a file name
   (`router_stream.c`). A renamed or removed function shows up here.
2. The layers' rule holds: a file in one layer of common/ (a folder of the
   "Layers" table) includes only headers of its own layer and of the layers
   its row may call.
3. The module map's "may call" column holds: each folder's sources include
   only headers of the folders it may call (and its own, the standard and
   third-party libraries, generated protobuf headers where `proto` is
   allowed). Tests, benches and fuzzers are not held to it.
4. Core's `sanitizer.h` is the one place that asks the compiler which
   sanitizer is on (GCC's __SANITIZE_* macros, clang's __has_feature): code
   elsewhere that asked only GCC missed clang's builds (the fuzzers').
"""
import os
import re
import subprocess
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
doc_path = os.path.join(root, "docs", "architecture.md")
doc = open(doc_path, encoding="utf-8").read()
files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                       check=True).stdout.split()
src = [f for f in files if f.endswith((".c", ".h", ".cu", ".cuh", ".proto", ".txt", ".sh",
                                       ".py", ".mjs", ".yaml"))]
code = {}
for f in src:
    try:
        code[f] = open(os.path.join(root, f), encoding="utf-8", errors="replace").read()
    except OSError:
        pass
alltext = "\n".join(code.values())
basenames = {os.path.basename(f) for f in files}
dirs = {os.path.dirname(f) for f in files}
dirs |= {d.rsplit("/", i)[0] for d in list(dirs) for i in range(1, d.count("/") + 1)}

failures = []

# ---- 1. names in backticks ---------------------------------------------------------------
IDENT = re.compile(r"^(?:struct |enum )?([A-Za-z_][A-Za-z0-9_]*)(?:\(\))?$")
for m in re.finditer(r"`([^`\n]+)`", doc):
    t = m.group(1).strip()
    line = doc.count("\n", 0, m.start()) + 1
    if "/" in t and " " not in t and not t.startswith(("-", "/v1", "/health", "/metrics")):
        p = t.rstrip("/")
        if p.startswith(("common/", "worker/", "decode/", "prefill/", "router/", "tools/",
                         "bench/", "fuzz/", "deploy/", "proto/", "integration-tests/", "docs/")):
            if p not in files and p not in dirs:
                failures.append("line %d: path `%s` does not exist" % (line, t))
        continue
    if re.match(r"^[\w.-]+\.(c|h|cu|proto|md|py|sh)$", t):
        if t not in basenames:
            failures.append("line %d: file `%s` does not exist" % (line, t))
        continue
    mm = IDENT.match(t)
    if not mm:
        continue
    name = mm.group(1)
    # Code-like names only: with an underscore, or a tdm_/TDM_ prefix; plain
    # words (`ready`, `auth`) are values or prose.
    if "_" not in name or name.isupper() and not name.startswith("TDM_"):
        continue
    if not re.search(r"\b%s\b" % re.escape(name), alltext):
        failures.append("line %d: `%s` is not in the code" % (line, t))

# header basename -> file that owns it (the first in git's order: header names are unique)
owner = {}
for f in files:
    if f.endswith(".h") and not f.startswith(("integration-tests/", "bench/", "fuzz/")):
        owner.setdefault(os.path.basename(f), f)


def held(f):
    """Files held to the include rules: sources, not tests, benches, fuzzers."""
    return f.endswith((".c", ".h")) and not re.search(r"(_test|_bench|_dump)\.c$|/test_|fuzz", f)


def includes(f):
    """(include as written, owning file) for each project header f includes."""
    for inc in re.findall(r'^#include "([^"]+)"', code.get(f, ""), re.M):
        base = os.path.basename(inc)
        if base.endswith(".pb-c.h"):
            yield inc, "proto/" + base
        elif base in owner:
            yield inc, owner[base]


# ---- 2. the layers -----------------------------------------------------------------------
layer_table = next(b for b in doc.split("## Layers", 1)[1].split("\n\n") if b.startswith("| layer"))
layers = {}  # layer folder -> the layer folders it may call
for row in layer_table.splitlines()[2:]:
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    if len(cells) != 3:
        continue
    name = cells[0].strip("`")
    may = re.sub(r"\([^)]*\)", "", cells[2]).replace("`", "")
    layers[name] = {name} | {"common/" + w.strip() for w in may.split(",")
                             if w.strip() not in ("", "—", "-")}
common_dirs = {f.split("/")[1] for f in files if f.startswith("common/") and f.count("/") > 1}
for d in sorted(common_dirs):
    if "common/" + d not in layers:
        failures.append("layers: folder common/%s is in no layer of the Layers table" % d)
for name, may in layers.items():
    for m in may:
        if m not in layers:
            failures.append("layers: %s may call %s, which is no layer" % (name, m))


def layer_of(path):
    parts = path.split("/")
    return "/".join(parts[:2]) if parts[0] == "common" and len(parts) > 2 else None


for f in files:
    lf = layer_of(f)
    if lf is None or lf not in layers or not held(f):
        continue
    for inc, hf in includes(f):
        lh = layer_of(hf)
        if lh is not None and lh not in layers[lf]:
            failures.append("%s includes %s (layer %s), which layer %s may not call" %
                            (f, inc, lh, lf))

# ---- 3. the module map's include rules ---------------------------------------------------
table = doc.split("## Module map", 1)[1].split("\n\n", 2)[1]
rules = []  # (folders, allowed folders or None for "not checked")
for row in table.splitlines()[2:]:
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    if len(cells) != 3:
        continue
    folders = [f.strip("/") for f in re.findall(r"`([^`]+)`", cells[0])]
    rules.append((folders, cells[2]))

def folder_of(path):
    best = None
    for folders, _ in rules:
        for d in folders:
            if path == d or path.startswith(d + "/"):
                if best is None or len(d) > len(best):
                    best = d
    return best


def allowed_set(spec, own):
    """The folders a "may call" cell names: a comma-separated list of folders
    (`kv` is common/engine/kv, `worker` is worker/, `common/*` every common
    folder), optionally "except" some, then notes in parentheses; "—" for
    none. Every module may call common/core."""
    spec = re.sub(r"\([^)]*\)", "", spec).replace("`", "")
    base, _, excluded = spec.partition(" except ")
    known = {d for fs, _ in rules for d in fs}

    def resolve(word):
        w = word.strip().strip("/")
        if w == "common/*":
            return {d for d in known if d.startswith("common/")}
        # A bare module name (`kv`) is the common/ folder of that name in
        # whichever layer holds it (common/engine/kv).
        hits = {d for d in known
                if d == w or d == "common/" + w or d.startswith("common/") and d.endswith("/" + w)}
        if not hits and w not in ("—", "-", ""):
            failures.append("module map: \"%s\" in a may-call cell names no folder" % w)
        return hits

    out = {own, "common/core"}
    for w in base.split(","):
        out |= resolve(w)
    for w in excluded.split(","):
        out -= resolve(w)
    return out


own_rules = {}
for folders, spec in rules:
    for d in folders:
        own_rules[d] = spec
for f in files:
    if not held(f):
        continue
    d = folder_of(f)
    if d is None:
        continue
    allowed = allowed_set(own_rules[d], d)
    # Folders in one row share their rules (e.g. common/engine/model, common/engine/kv, common/engine/sampling).
    for folders, spec in rules:
        if d in folders:
            allowed |= set(folders)
    for inc, hf in includes(f):
        hdir = "proto" if hf.startswith("proto/") else folder_of(hf)
        if hdir is None or hdir == d:
            continue
        if hdir not in allowed:
            failures.append("%s includes %s (%s), which %s may not call (may call: %s)" %
                            (f, inc, hdir, d, own_rules[d]))

# ---- 4. sanitizer.h asks the compiler -----------------------------------------------------
SANITIZER_ASK = re.compile(r"__SANITIZE_[A-Z]+__|__has_feature\s*\(\s*\w*sanitizer")
for f in files:
    if f.endswith((".c", ".h", ".cu", ".cuh")) and f != "common/core/sanitizer.h":
        for i, text in enumerate(code.get(f, "").splitlines(), 1):
            if SANITIZER_ASK.search(text):
                failures.append("%s:%d asks the compiler for its sanitizer: include sanitizer.h "
                                "and use TDM_SANITIZE_*" % (f, i))

for line in failures:
    print("FAIL: docs/architecture.md: " + line)
if failures:
    sys.exit(1)
print("docs/architecture.md: every code name exists; every include follows the layers and the "
      "module map; only sanitizer.h asks the compiler for its sanitizer")
