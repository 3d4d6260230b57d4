# SPDX-License-Identifier: Apache-2.0
"""generate_constraints: tandem-generate's structured-output flags, offline.

On tandem-mkmodel's tiny random model (its own tokenizer), runs --json-schema
FILE, --json-object, --regex, --choice (comma list and JSON array) and
--grammar FILE with seeded temperature-1 sampling, and checks every output
that finished "stop" against the constraint here, independently of the
grammar engine (a small validator for the schema's keywords, re.fullmatch,
json.loads), that it ends on a generated EOS (as the engine and vLLM do), and
that the bad cases are one-line errors with a non-zero exit: two constraint
flags, an unsupported schema keyword (the grammar engine's message, as the
HTTP 400 carries it), a missing file. Also the GEMM-mode flags (the
workers'): --batch-invariant / --no-batch-invariant change nothing on the
CPU backend (the same ids), and a value that is not a boolean is an error.
  test_generate_constraints.py MKMODEL GENERATE WORKDIR
"""
import json
import os
import re
import subprocess
import sys

MKMODEL, GENERATE, WORK = sys.argv[1:4]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"enum": ["small", "large", 3]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
        "where": {"type": "object", "properties": {"x": {"enum": [1, 20, 300]},
                                                   "ok": {"type": "boolean"}},
                  "required": ["x", "ok"]},
    },
    "required": ["name", "size", "flags"],
}


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def validate(v):
    """True when v matches SCHEMA (property order as the schema's, optional where)."""
    if not isinstance(v, dict):
        return False
    keys = list(v)
    if keys not in (["name", "size", "flags"], ["name", "size", "flags", "where"]):
        return False
    if not isinstance(v["name"], str) or len(v["name"]) > 8:
        return False
    if v["size"] not in ("small", "large", 3) or isinstance(v["size"], bool):
        return False
    f = v["flags"]
    if not isinstance(f, list) or not 1 <= len(f) <= 3 or not all(isinstance(b, bool) for b in f):
        return False
    if "where" in v:
        w = v["where"]
        if not isinstance(w, dict) or list(w) != ["x", "ok"] or w["x"] not in (1, 20, 300) or \
                isinstance(w["x"], bool) or not isinstance(w["ok"], bool):
            return False
    return True


def run(*flags, seed=1, max_tokens=160):
    cmd = [GENERATE, "--model", MODEL, "--prompt", "Describe the sky:", "--max-tokens",
           str(max_tokens), "--temperature", "1", "--seed", str(seed), "--threads", "1",
           "--json"] + list(flags)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def generate(*flags, seed=1, max_tokens=160):
    r = run(*flags, seed=seed, max_tokens=max_tokens)
    check(r.returncode == 0, "%s: exit %d: %s" % (flags, r.returncode, r.stderr))
    out = json.loads(r.stdout)
    return out


def sweep(name, flags, validator, kind, seeds=range(1, 7), need=2):
    stops = 0
    for seed in seeds:
        out = generate(*flags, seed=seed)
        check(out["constraint"] == kind, "%s: constraint %r" % (name, out["constraint"]))
        check(out["timings"]["num_masks"] == len(out["ids"]),
              "%s: %d masks for %d tokens" % (name, out["timings"]["num_masks"], len(out["ids"])))
        if out["finish_reason"] == "stop":
            stops += 1
            check(validator(out["text"]), "%s seed %d: invalid output %r" % (name, seed,
                                                                             out["text"]))
            check(out["ids"][-1] in END_IDS, "%s seed %d: stop without an EOS: %s" % (
                name, seed, out["ids"]))
        else:
            check(len(out["ids"]) == 160, "%s: length with %d ids" % (name, len(out["ids"])))
    print("%s: %d of %d finished stop, all valid" % (name, stops, len(seeds)), flush=True)
    check(stops >= need, "%s: only %d stop outputs" % (name, stops))


def json_ok(check_fn):
    def f(t):
        try:
            return check_fn(json.loads(t))
        except ValueError:
            return False
    return f


def error_case(name, flags, pattern):
    r = run(*flags)
    lines = r.stderr.strip().splitlines()
    check(r.returncode != 0 and len(lines) == 1 and re.search(pattern, lines[0]),
          "%s: exit %d, stderr %r" % (name, r.returncode, r.stderr))
    print("%s: %s" % (name, lines[0]), flush=True)


os.makedirs(WORK, exist_ok=True)
MODEL = os.path.join(WORK, "tiny")
if not os.path.exists(os.path.join(MODEL, "config.json")):
    subprocess.run([MKMODEL, "--preset", "tiny", "--out", MODEL], check=True,
                   capture_output=True)
with open(os.path.join(MODEL, "config.json")) as f:
    eos = json.load(f)["eos_token_id"]
END_IDS = eos if isinstance(eos, list) else [eos]
schema_file = os.path.join(WORK, "schema.json")
with open(schema_file, "w") as f:
    json.dump(SCHEMA, f, indent=2)
gbnf_file = os.path.join(WORK, "list.gbnf")
with open(gbnf_file, "w") as f:
    f.write('root ::= "[" num ("," num)* "]"\nnum ::= [1-9] [0-9]?\n')
bad_schema = os.path.join(WORK, "bad.json")
with open(bad_schema, "w") as f:
    json.dump({"type": "integer", "allOf": []}, f)

sweep("json-schema", ["--json-schema", schema_file], json_ok(validate), "json_schema")
sweep("json-object", ["--json-object"], json_ok(lambda v: isinstance(v, dict)), "json_object",
      need=0)
sweep("regex", ["--regex", "(cat|dog)-[0-9]{2,4}"],
      lambda t: re.fullmatch("(cat|dog)-[0-9]{2,4}", t) is not None, "regex")
sweep("choice", ["--choice", "alpha,beta,gamma delta"],
      lambda t: t in ("alpha", "beta", "gamma delta"), "choice", need=6)
sweep("choice-json", ["--choice", '["a,b", "c d"]'], lambda t: t in ("a,b", "c d"), "choice",
      need=6)
sweep("grammar", ["--grammar", gbnf_file],
      lambda t: re.fullmatch(r"\[[1-9][0-9]?(,[1-9][0-9]?)*\]", t) is not None, "grammar")

# Unconstrained: no masks, no constraint.
out = generate()
check(out["constraint"] is None and out["timings"]["num_masks"] == 0, "unconstrained: %s" % out)

error_case("two flags", ["--regex", "a", "--choice", "a,b"], r"at most one of --json-schema")
error_case("unsupported keyword", ["--json-schema", bad_schema],
           r'^tandem-generate: --json-schema: .*"allOf" is not supported')
error_case("missing file", ["--grammar", os.path.join(WORK, "absent.gbnf")],
           r"^tandem-generate: --grammar: .*absent\.gbnf")
error_case("bad regex", ["--regex", "(a)\\1"], r"^tandem-generate: --regex: .*backreference")

ids = out["ids"]
for flags in (["--no-batch-invariant"], ["--batch-invariant"], ["--batch-invariant=false"]):
    check(generate(*flags)["ids"] == ids, "%s: other ids than the default on the CPU" % flags)
error_case("bad batch-invariant", ["--no-batch-invariant=maybe"],
           r'^tandem-generate: --no-batch-invariant: expected true or false, got "maybe"')
print("PASS")
