# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding through the server changes speed, never output.

Two tandem-decode servers on the same model, one with
--speculative-config '{"method":"ngram",...}': for greedy and seeded sampled
requests (penalties, top-p, logprobs, a stop string and a stop id met inside
the output, n > 1), alone and several at once, the token ids, text, finish
reason, usage and logprobs are identical. The speculating server exports
vLLM's spec_decode counters and they moved (drafts were proposed and
accepted; promtool accepts the exposition); the plain server has none. A bad --speculative-config is a
one-line startup error.
"""
import random
import subprocess
import threading

import decode_harness as h

SPEC = '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":3,"prompt_lookup_min":1}'


def complete(srv, body):
    st, _, r = srv.post_json("/v1/completions", body)
    h.check(st == 200, "status %d %r" % (st, r))
    return r


def same(a, b, what):
    for ca, cb in zip(a["choices"], b["choices"]):
        h.check(ca["token_ids"] == cb["token_ids"],
                "%s: token ids differ\n spec  %s\n plain %s" % (what, ca["token_ids"],
                                                                 cb["token_ids"]))
        h.check(ca["text"] == cb["text"], "%s: text differs" % what)
        h.check(ca["finish_reason"] == cb["finish_reason"], "%s: finish differs" % what)
        la = (ca.get("logprobs") or {}).get("token_logprobs") or []
        lb = (cb.get("logprobs") or {}).get("token_logprobs") or []
        h.check(len(la) == len(lb) and all(abs(x - y) < 1e-4 for x, y in zip(la, lb)),
                "%s: logprobs differ" % what)
    h.check(len(a["choices"]) == len(b["choices"]), "%s: choices differ" % what)
    h.check(a["usage"] == b["usage"], "%s: usage differs %r %r" % (what, a["usage"], b["usage"]))


def main():
    args = h.parse_args()
    model = h.make_model(args)
    bad = subprocess.run([args.decode, "--model", model, "--speculative-config",
                          '{"method":"eagle","num_speculative_tokens":2}'],
                         capture_output=True, text=True, timeout=60)
    h.check(bad.returncode != 0 and "--speculative-config: method" in bad.stderr,
            "bad config accepted or unclear: rc %d %r" % (bad.returncode, bad.stderr))
    plain = h.Server(args, model)
    spec = h.Server(args, model, "--speculative-config", SPEC)
    rnd = random.Random(3)
    prompts = []
    for i in range(6):
        text = [rnd.randrange(3, 500) for _ in range(10 + 7 * i)]
        prompts.append(text + text[: len(text) // 2] if i % 2 == 0 else text)
    samplings = [
        {"temperature": 0, "logprobs": 2},
        {"temperature": 0, "presence_penalty": 1.0, "frequency_penalty": 0.3},
        {"temperature": 0.8, "seed": 11, "top_p": 0.9, "repetition_penalty": 1.1},
        {"temperature": 1.0, "seed": 5, "n": 2, "top_k": 20},
    ]
    bodies = []
    for i, p in enumerate(prompts):
        for s in samplings:
            bodies.append(dict(prompt=p, max_tokens=20 + 3 * i, ignore_eos=True,
                               return_token_ids=True, **s))
    want = [complete(plain, b) for b in bodies]
    for b, w in zip(bodies, want):
        same(complete(spec, b), w, "alone %s" % {k: b[k] for k in b if k != "prompt"})
    # Several at once: drafts of one request share steps with others' prefills.
    got = [None] * len(bodies)

    def run(i):
        got[i] = complete(spec, bodies[i])
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (g, w) in enumerate(zip(got, want)):
        same(g, w, "concurrent %d" % i)
    # A stop string and a stop id met inside the output end the request where
    # plain decoding ends it.
    base = want[0]["choices"][0]
    stop_id = base["token_ids"][len(base["token_ids"]) // 2]
    cut = base["text"][len(base["text"]) // 2:][:3]
    for extra in ({"stop_token_ids": [stop_id], "ignore_eos": False}, {"stop": [cut]} if cut.strip() else {}):
        b = dict(bodies[0], **extra)
        same(complete(spec, b), complete(plain, b), "stop %r" % extra)
    text = spec.metrics()
    drafts = h.metric_value(text, "vllm:spec_decode_num_drafts_total")
    drafted = h.metric_value(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = h.metric_value(text, "vllm:spec_decode_num_accepted_tokens_total")
    pos = [h.metric_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                          {"position": str(k)}) for k in range(4)]
    h.check(drafts > 0 and accepted > 0 and accepted <= drafted,
            "spec counters: drafts %s drafted %s accepted %s" % (drafts, drafted, accepted))
    h.check(sum(pos) == accepted and all(pos[k] >= pos[k + 1] for k in range(3)),
            "per-position counters %s vs accepted %s" % (pos, accepted))
    h.check("vllm:spec_decode" not in plain.metrics(), "plain server exports spec counters")
    pc = h.promtool_check(args.promtool, text)
    h.check(pc is None or pc[0], "promtool: %s" % (pc[1] if pc else ""))
    print("spec: %d drafts, %d draft tokens, %d accepted (%.0f%%), per position %s"
          % (drafts, drafted, accepted, 100 * accepted / drafted, pos))
    plain.stop()
    spec.stop()
    print("ok")


if __name__ == "__main__":
    main()
