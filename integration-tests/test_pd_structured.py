# SPDX-License-Identifier: Apache-2.0
"""Structured outputs through the router (disaggregated: the prefill worker
samples the first token under the grammar's mask, the decode worker continues
the grammar from it) and directly on a decode worker, streamed and not, on
completions and chat: a nested JSON Schema (arrays, enum, nested object), a
regex, a choice list, any JSON object and a GBNF grammar, in each of the
request shapes (response_format, structured_outputs, guided_*). Every output
that finished "stop" parses and validates (a small validator here, independent
of the grammar engine); the same seeded request gives the same token ids
routed and direct, streamed and not; n > 1 gives one valid output per choice;
the services stay healthy."""
import json
import os
import re

from pd_harness import Cluster, Stream, check, parse_args, post, stream_text

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                 "minItems": 1, "maxItems": 3},
        "pos": {"type": "object",
                "properties": {"x": {"enum": [1, 20, 300]}, "ok": {"type": "boolean"}},
                "required": ["x", "ok"]},
        "kind": {"enum": ["a", "b", None, 3]},
    },
    "required": ["name", "tags", "pos", "kind"],
}
TYPES = {"string": str, "boolean": bool, "object": dict, "array": list}


def validate(v, s, path="$"):
    """The keywords SCHEMA uses; raises AssertionError naming the place."""
    if "enum" in s:
        assert any(v == e and type(v) is type(e) for e in s["enum"]), "%s: %r not in enum" % (
            path, v)
    if "type" in s:
        assert type(v) is TYPES[s["type"]], "%s: %r is not %s" % (path, v, s["type"])
    if isinstance(v, str) and "maxLength" in s:
        assert len(v) <= s["maxLength"], "%s: longer than %d" % (path, s["maxLength"])
    if isinstance(v, list):
        assert s.get("minItems", 0) <= len(v) <= s.get("maxItems", 1 << 30), "%s: items" % path
        for i, e in enumerate(v):
            validate(e, s["items"], "%s[%d]" % (path, i))
    if isinstance(v, dict) and "properties" in s:
        order = list(s["properties"])
        keys = list(v)
        assert all(k in order for k in keys), "%s: unknown keys %s" % (path, keys)
        assert keys == sorted(keys, key=order.index), "%s: keys out of schema order" % path
        for k in s.get("required", []):
            assert k in v, "%s: %s missing" % (path, k)
        for k, e in v.items():
            validate(e, s["properties"][k], path + "." + k)


def check_schema(text, where):
    try:
        validate(json.loads(text), SCHEMA)
    except (ValueError, AssertionError) as e:
        check(False, "%s: output %r does not validate: %s" % (where, text, e))


def chat_stream(port, body):
    s = Stream(port, "/v1/chat/completions", dict(body, stream=True))
    check(s.status == 200, "chat stream status %d" % s.status)
    text, finish = "", None
    for ev in s.events():
        if ev == "[DONE]":
            break
        check("error" not in ev, "stream error event: %s" % ev)
        for ch in ev.get("choices", []):
            text += ch.get("delta", {}).get("content") or ""
            finish = ch.get("finish_reason") or finish
    s.close()
    return text, finish


def main():
    args = parse_args()
    cl = Cluster(args, n_prefill=1, n_decode=1, pd_mode="always").start()
    direct = cl.decode[0].http_port
    prompt = "Describe the sky as JSON:"
    with open(os.path.join(cl.model, "generation_config.json")) as f:
        end_ids = json.load(f)["eos_token_id"]
    end_ids = end_ids if isinstance(end_ids, list) else [end_ids]
    stops = 0
    # Completions, every request shape of a constraint, seeded sampling.
    cases = [
        ("guided_json", {"guided_json": SCHEMA}, check_schema),
        ("response_format", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "sky", "strict": True, "schema": SCHEMA}}}, check_schema),
        ("structured_outputs.json", {"structured_outputs": {"json": json.dumps(SCHEMA)}},
         check_schema),
        ("structured_outputs.regex", {"structured_outputs": {"regex": "(cat|dog)-[0-9]{2,4}"}},
         lambda t, w: check(re.fullmatch("(cat|dog)-[0-9]{2,4}", t), "%s: %r" % (w, t))),
        ("guided_choice", {"guided_choice": ["alpha", "beta", "gamma delta"]},
         lambda t, w: check(t in ("alpha", "beta", "gamma delta"), "%s: %r" % (w, t))),
        ("guided_grammar", {"guided_grammar": 'root ::= "[" num ("," num)* "]"\nnum ::= [1-9]'},
         lambda t, w: check(re.fullmatch(r"\[[1-9](,[1-9])*\]", t), "%s: %r" % (w, t))),
        ("json_object", {"response_format": {"type": "json_object"}},
         lambda t, w: check(isinstance(json.loads(t), dict), "%s: %r" % (w, t))),
    ]
    for name, extra, validator in cases:
        for seed in (1, 2):
            body = dict(prompt=prompt, max_tokens=120, temperature=1.0, seed=seed,
                        return_token_ids=True, **extra)
            st, hdr, routed = post(cl.router_port, "/v1/completions", body)
            check(st == 200, "%s router: %d %s" % (name, st, routed))
            check("prefill=tcp://" in hdr.get("x-tandem-phases", ""),
                  "%s: not prefilled remotely: %r" % (name, hdr.get("x-tandem-phases")))
            st, _, dir_ = post(direct, "/v1/completions", body)
            check(st == 200, "%s direct: %d %s" % (name, st, dir_))
            a, b = routed["choices"][0], dir_["choices"][0]
            check(a["token_ids"] == b["token_ids"], "%s seed %d: token ids differ\n router %s\n"
                  " direct %s" % (name, seed, a["token_ids"], b["token_ids"]))
            check(a["text"] == b["text"] and a["finish_reason"] == b["finish_reason"],
                  "%s: text/finish differ" % name)
            for port, where in ((cl.router_port, "router"), (direct, "direct")):
                text, ids, finish, _ = stream_text(port, body)
                check(ids == a["token_ids"] and text == a["text"] and finish == a["finish_reason"],
                      "%s %s streamed differs: %r %s" % (name, where, text, finish))
            check(a["finish_reason"] in ("stop", "length"), "%s: finish %s" % (
                name, a["finish_reason"]))
            if a["finish_reason"] == "stop":
                stops += 1
                validator(a["text"], "%s seed %d" % (name, seed))
                # As vLLM (xgrammar terminates on the stop token): once the grammar is
                # complete the ending token is sampled, the only one the mask leaves,
                # so it is the last id and completion_tokens counts it.
                check(a["token_ids"] and a["token_ids"][-1] in end_ids,
                      "%s seed %d: stop without an ending token: %s" % (name, seed,
                                                                        a["token_ids"]))
                check(routed["usage"]["completion_tokens"] == len(a["token_ids"]) and
                      dir_["usage"]["completion_tokens"] == len(a["token_ids"]),
                      "%s seed %d: completion_tokens %s/%s for %d ids" % (
                          name, seed, routed["usage"]["completion_tokens"],
                          dir_["usage"]["completion_tokens"], len(a["token_ids"])))
                check(a["stop_reason"] in (None, a["token_ids"][-1]),
                      "%s: stop_reason %r" % (name, a["stop_reason"]))
            else:
                check(name == "json_object", "%s seed %d ran to max_tokens: %r" % (
                    name, seed, a["text"]))
    # Chat, response_format json_schema, streamed and not, routed and direct.
    chat = {"messages": [{"role": "user", "content": "the sky as JSON"}], "max_tokens": 120,
            "temperature": 1.0, "seed": 9, "response_format": {
                "type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA}}}
    st, _, a = post(cl.router_port, "/v1/chat/completions", chat)
    st2, _, b = post(direct, "/v1/chat/completions", chat)
    check(st == 200 and st2 == 200, "chat status %d/%d" % (st, st2))
    check(a["choices"][0]["message"] == b["choices"][0]["message"], "chat differs")
    check(a["choices"][0]["finish_reason"] == "stop", "chat finish %s" % a["choices"][0])
    check_schema(a["choices"][0]["message"]["content"], "chat")
    for port in (cl.router_port, direct):
        text, finish = chat_stream(port, chat)
        check(text == a["choices"][0]["message"]["content"] and finish == "stop",
              "chat streamed differs: %r" % text)
    # n > 1: one matcher per choice, each output valid; same through the router.
    body = dict(prompt=prompt, max_tokens=120, temperature=1.0, seed=31, n=3, guided_json=SCHEMA)
    st, _, a = post(cl.router_port, "/v1/completions", body)
    st2, _, b = post(direct, "/v1/completions", body)
    check(st == 200 and st2 == 200, "n=3 status %d/%d" % (st, st2))
    check([c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]], "n=3 differs")
    for c in a["choices"]:
        check(c["finish_reason"] == "stop", "n=3 choice %d: %s" % (c["index"], c))
        check_schema(c["text"], "n=3 choice %d" % c["index"])
    # max_tokens mid-object: length.
    st, _, a = post(cl.router_port, "/v1/completions", dict(prompt=prompt, max_tokens=3,
                                                             guided_json=SCHEMA, seed=1))
    check(st == 200 and a["choices"][0]["finish_reason"] == "length", "mid-object: %s" % a)
    # Bad constraints: 400 from the router itself and from the decode worker.
    for port in (cl.router_port, direct):
        st, _, e = post(port, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "n", "schema": {"type": "object", "patternProperties": {}}}}})
        check(st == 400 and "patternProperties" in e["error"]["message"], "bad schema: %d %s" % (
            st, e))
    cl.wait_kv_free()
    print("PASS: %d constrained cases equal routed/direct/streamed, %d stop outputs validated"
          % (len(cases) * 2, stops))


if __name__ == "__main__":
    main()
