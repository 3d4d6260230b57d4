# SPDX-License-Identifier: Apache-2.0
"""Greedy output through the server equals tandem-generate's.

For several prompts given as token ids, temperature 0 and ignore_eos, the
server's token ids (return_token_ids) and text - non-stream, stream, and with
other requests running in the same batches - equal what tandem-generate (the
shared runner, no server) produces for the same ids. Structured outputs too:
seeded temperature-1 requests under a JSON Schema, a regex and a choice list
give the server's ids (ending on the EOS sampled once the grammar is complete)
equal to tandem-generate's --json-schema / --regex / --choice for the same seed.
"""
import json
import os
import subprocess
import threading

import decode_harness as h

PROMPTS = [[1], [72, 101, 108, 108, 111], list(range(3, 40)), [200 + (i * 7) % 250 for i in range(70)]]
MAX_TOKENS = 24


def generate(args, model, ids):
    r = subprocess.run([args.generate, "--model", model, "--prompt-ids",
                        ",".join(map(str, ids)), "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
                        "--json"], capture_output=True, text=True, timeout=120)
    h.check(r.returncode == 0, "tandem-generate: %s" % r.stderr)
    j = json.loads(r.stdout)
    return j["ids"], j["text"]


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1, "maxItems": 2},
    "ok": {"type": "boolean"}}, "required": ["name", "tags", "ok"]}


def constrained(args, model, srv):
    """Seeded constrained requests: server ids == tandem-generate ids."""
    schema_file = os.path.join(args.workdir, "greedy-schema.json")
    with open(schema_file, "w") as f:
        json.dump(SCHEMA, f)
    cases = [(["--json-schema", schema_file], {"guided_json": SCHEMA}),
             (["--regex", "(cat|dog)-[0-9]{2,3}"], {"guided_regex": "(cat|dog)-[0-9]{2,3}"}),
             (["--choice", "alpha,beta,gamma delta"],
              {"guided_choice": ["alpha", "beta", "gamma delta"]})]
    prompt = PROMPTS[2]
    stops = 0
    for flags, fields in cases:
        for seed in (1, 2):
            r = subprocess.run([args.generate, "--model", model, "--prompt-ids",
                                ",".join(map(str, prompt)), "--max-tokens", "120",
                                "--temperature", "1", "--seed", str(seed), "--json"] + flags,
                               capture_output=True, text=True, timeout=120)
            h.check(r.returncode == 0, "tandem-generate %s: %s" % (flags, r.stderr))
            want = json.loads(r.stdout)
            st, _, got = srv.post_json("/v1/completions", dict(
                fields, prompt=prompt, max_tokens=120, temperature=1, seed=seed,
                return_token_ids=True))
            h.check(st == 200, "%s: status %d %r" % (flags[0], st, got))
            c = got["choices"][0]
            h.check(c["token_ids"] == want["ids"], "%s seed %d: ids %r != tandem-generate %r" % (
                flags[0], seed, c["token_ids"], want["ids"]))
            h.check(c["text"] == want["text"] and c["finish_reason"] == want["finish_reason"],
                    "%s seed %d: %r %s != %r %s" % (flags[0], seed, c["text"], c["finish_reason"],
                                                    want["text"], want["finish_reason"]))
            h.check(got["usage"]["completion_tokens"] == len(want["ids"]), "completion_tokens")
            stops += c["finish_reason"] == "stop"
    h.check(stops >= 4, "only %d of 6 constrained requests finished stop" % stops)
    return stops


def main():
    args = h.parse_args()
    h.check(args.generate is not None, "--generate is required")
    model = h.make_model(args)
    srv = h.Server(args, model)
    want = [generate(args, model, p) for p in PROMPTS]
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}

    # Non-stream, one at a time.
    for p, (ids, text) in zip(PROMPTS, want):
        st, _, r = srv.post_json("/v1/completions", dict(body, prompt=p))
        h.check(st == 200, "status %d %r" % (st, r))
        c = r["choices"][0]
        h.check(c["token_ids"] == ids, "ids %r != tandem-generate %r" % (c["token_ids"], ids))
        h.check(c["text"] == text, "text %r != %r" % (c["text"], text))

    # All prompts at once, streamed, sharing engine steps.
    got = [None] * len(PROMPTS)

    def one(i):
        s = h.Stream(srv, "/v1/completions", dict(body, prompt=PROMPTS[i], stream=True))
        ids, text = [], ""
        for ev in s.events():
            if ev != "[DONE]" and ev["choices"]:
                c = ev["choices"][0]
                ids += c.get("token_ids") or []
                text += c["text"]
        s.close()
        got[i] = (ids, text)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    for i, (g, w) in enumerate(zip(got, want)):
        h.check(g is not None, "stream %d did not finish" % i)
        h.check(list(g[0]) == w[0], "stream %d ids %r != %r" % (i, g[0], w[0]))
        h.check(g[1] == w[1], "stream %d text %r != %r" % (i, g[1], w[1]))
    stops = constrained(args, model, srv)
    h.check(srv.stop() == 0, "exit status")
    print("PASS: %d prompts x %d greedy tokens equal tandem-generate (non-stream and batched "
          "stream); 6 seeded constrained requests too (%d finished stop)" % (
              len(PROMPTS), MAX_TOKENS, stops))


if __name__ == "__main__":
    main()
