# SPDX-License-Identifier: Apache-2.0
"""Request features through tandem-decode, checked against greedy references.

- stop strings: the text ends just before the stop string (or through it with
  include_stop_str_in_output), finish_reason stop, stop_reason the string; a
  stream never sends any part of it; usage counts tokens up to the match;
- stop_token_ids: the choice ends at that id, stop_reason the id, its text
  not included, completion_tokens includes it;
- n > 1 with a seed: n distinct indexes, usage sums, same seed -> same choices;
- several prompts in one request: one choice group each, prompt_tokens summed;
- echo; logprobs (completions and chat); max_tokens default 16;
- priority: refused under fcfs (vLLM's 400); --scheduling-policy priority
  starts a waiting request of lower priority value first;
- cache_salt: prefix hits only between requests of the same salt, same output;
- return_tokens_as_token_ids ("token_id:<id>" in logprobs); truncate_prompt_tokens
  (the prompt's last N tokens: the continuation of those alone);
- allowed_token_ids: every token from the set, the reference's where it is in
  the set; bad_words: a one-token word never comes, a two-token word's last
  token never follows its first (the reference up to there, then another);
- logprob_token_ids: each token's top logprobs are the chosen token, then the
  ids once each, with the values the top-N list gives the same ids
  (completions dict, chat list, chat stream);
- chat stream: role chunk first, content deltas, finish, [DONE];
- chat continue_final_message (the prompt ends with the final message), echo
  (its content first, in the body and the stream), chat_template_kwargs, the
  answer's role without add_generation_prompt;
- --stream-interval 4: tokens go out at least 4 per event after the first;
- generation_config.json defaults apply when the request is silent (top_k 1
  makes sampling greedy) and the request's own values win.
"""
import json
import os
import shutil
import threading
import time

import decode_harness as h

PROMPT_IDS = [72, 101, 108, 108, 111, 32, 119, 111]


def comp(srv, **body):
    status, _, r = srv.post_json("/v1/completions", body)
    h.check(status == 200, "status %d: %r (request %r)" % (status, r, body))
    return r


def stream_text(srv, path, body):
    st = h.Stream(srv, path, dict(body, stream=True))
    h.check(st.status == 200, "stream status %d" % st.status)
    evs = list(st.events())
    st.close()
    h.check(evs and evs[-1] == "[DONE]", "no [DONE]")
    return evs[:-1]


def one_token_word(srv, tid):
    """A bad word that bans the single token tid by vLLM's tokenization (the
    word lstripped; after a space too, where that is one other token as the
    word alone is), or None."""
    _, _, dt = srv.post_json("/detokenize", {"tokens": [tid]})
    word = dt["prompt"].lstrip()
    if not word:
        return None
    forms = []
    for form in (word, " " + word):
        _, _, t = srv.post_json("/tokenize", {"prompt": form, "add_special_tokens": False})
        forms.append(t["tokens"])
    if forms[0] == [tid] or (forms[1] == [tid] and len(forms[0]) == 1):
        return word
    return None


def check_token_masks(srv, greedy, greedy_ids):
    """allowed_token_ids and bad_words against a greedy and a seeded
    reference (the tiny model's greedy output may repeat one token)."""
    sampled = dict(greedy, temperature=1.0, seed=123, max_tokens=24)
    ref_ids = comp(srv, **sampled)["choices"][0]["token_ids"]
    # allowed_token_ids without the greedy first token: every token from the
    # set, and the first one another; with the greedy tokens' own set, the
    # greedy output.
    allowed = sorted(set(ref_ids[:8]) - {greedy_ids[0]})
    for body in (greedy, sampled):
        ids = comp(srv, **dict(body, allowed_token_ids=allowed))["choices"][0]["token_ids"]
        h.check(len(ids) == body["max_tokens"] and set(ids) <= set(allowed) and
                (body is sampled or ids[0] != greedy_ids[0]),
                "allowed_token_ids %s gave %s" % (allowed, ids))
    r = comp(srv, **dict(greedy, allowed_token_ids=sorted(set(greedy_ids))))
    h.check(r["choices"][0]["token_ids"] == greedy_ids, "allowed_token_ids of the greedy's own")
    # The bad words against a seeded draw over a few word tokens (the tiny
    # model's own choices repeat one token for long).
    words = []
    for w in ("is", "he", "in", "on", "it", "re", "a", "e"):
        _, _, t = srv.post_json("/tokenize", {"prompt": w, "add_special_tokens": False})
        if len(t["tokens"]) == 1:
            words.append(t["tokens"][0])
    h.check(len(words) >= 3, "fewer than 3 one-token words: %s" % words)
    masked = dict(sampled, temperature=2.0, allowed_token_ids=words[:3])
    ref_ids = comp(srv, **masked)["choices"][0]["token_ids"]
    # A one-token bad word: never drawn; the reference up to its first place.
    cands = [(i, t) for i, t in enumerate(ref_ids) if one_token_word(srv, t)]
    h.check(cands, "no reference token is a word of its own: %s" % ref_ids)
    i, tid = cands[0]
    ids = comp(srv, **dict(masked, bad_words=[one_token_word(srv, tid)]))["choices"][0]["token_ids"]
    h.check(tid not in ids and ids[:i] == ref_ids[:i] and len(ids) == len(ref_ids),
            "bad word %d (first at %d): %s vs reference %s" % (tid, i, ids, ref_ids))
    # A two-token bad word: its last token never follows its first; the
    # reference up to the first place it did.
    for i in range(len(ref_ids) - 1):
        a, b = ref_ids[i], ref_ids[i + 1]
        _, _, dt = srv.post_json("/detokenize", {"tokens": [a, b]})
        word = dt["prompt"]
        _, _, t = srv.post_json("/tokenize", {"prompt": word.lstrip(),
                                              "add_special_tokens": False})
        if word == word.lstrip() and t["tokens"] == [a, b]:
            break
    else:
        h.check(False, "no two reference tokens make a word: %s" % ref_ids)
    for stream in (False, True):
        body = dict(masked, bad_words=[word])
        if stream:
            evs = stream_text(srv, "/v1/completions", body)
            ids = [t for e in evs if e["choices"] for t in e["choices"][0].get("token_ids") or []]
        else:
            ids = comp(srv, **body)["choices"][0]["token_ids"]
        h.check(ids[:i + 1] == ref_ids[:i + 1] and ids[i + 1] != b and
                not any(x == a and y == b for x, y in zip(ids, ids[1:])),
                "bad word %r = [%d, %d] at %d (stream %s): %s vs reference %s"
                % (word, a, b, i, stream, ids, ref_ids))
    print("allowed_token_ids %s; bad words: %d, then %r = [%d, %d] at %d"
          % (allowed, tid, word, a, b, i))


def check_logprob_token_ids(srv, greedy, greedy_ids):
    """logprob_token_ids: the ids come back for every token, after the chosen
    one, each once, with the logprobs the top-20 list gives them."""
    body = dict(greedy, max_tokens=4, return_tokens_as_token_ids=True)
    ref = comp(srv, **dict(body, logprobs=20))["choices"][0]["logprobs"]["top_logprobs"]
    # Two ids from the first token's top 20 other than the chosen one, one
    # twice, and the chosen one itself: each listed once.
    alts = [int(k.split(":")[1]) for k in ref[0] if k != "token_id:%d" % greedy_ids[0]][:2]
    ids = [alts[0], alts[1], alts[0], greedy_ids[0]]
    r = comp(srv, **dict(body, logprobs=1, logprob_token_ids=ids))
    lp = r["choices"][0]["logprobs"]
    for i, top in enumerate(lp["top_logprobs"]):
        keys = list(top)
        want = ["token_id:%d" % greedy_ids[i]] + ["token_id:%d" % t for t in
                                                  (alts[0], alts[1], greedy_ids[0])
                                                  if t != greedy_ids[i]]
        h.check(keys == want, "token %d: keys %s, want %s" % (i, keys, want))
        h.check(abs(top[keys[0]] - lp["token_logprobs"][i]) < 1e-6, "chosen logprob %r" % top)
        for k in keys:  # the top-20 list's value where it lists the id
            if k in ref[i]:
                h.check(abs(top[k] - ref[i][k]) < 1e-4, "%s: %g vs top-20 %g"
                        % (k, top[k], ref[i][k]))
    # Chat, whole and streamed: the list is the chosen token, then the ids.
    chat = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 3,
            "temperature": 0, "ignore_eos": True, "logprobs": True,
            "return_tokens_as_token_ids": True, "logprob_token_ids": [alts[1], alts[0]]}
    st, _, r = srv.post_json("/v1/chat/completions", chat)
    h.check(st == 200, "chat %r" % r)
    content = r["choices"][0]["logprobs"]["content"]
    evs = stream_text(srv, "/v1/chat/completions", chat)
    streamed = [c for e in evs if e["choices"] and e["choices"][0].get("logprobs")
                for c in e["choices"][0]["logprobs"]["content"]]
    for entries in (content, streamed):
        h.check(len(entries) == 3, "chat entries %r" % entries)
        for c in entries:
            toks = [t["token"] for t in c["top_logprobs"]]
            rest = [x for x in ("token_id:%d" % alts[1], "token_id:%d" % alts[0])
                    if x != c["token"]]
            h.check(toks == [c["token"]] + rest, "chat top %s (token %s)" % (toks, c["token"]))
            h.check(c["top_logprobs"][0]["logprob"] == c["logprob"], "chat chosen %r" % c)
    h.check([c["top_logprobs"] for c in content] == [c["top_logprobs"] for c in streamed],
            "chat stream != whole")
    st, _, r = srv.post_json("/v1/chat/completions", dict(chat, logprobs=False))
    h.check(st == 400 and "`logprobs` must be set to true" in r["error"]["message"],
            "without logprobs: %r" % r)
    print("logprob_token_ids %s: completions and chat" % ids)


def check_chat_continue(srv):
    """continue_final_message (the prompt ends with the final message's
    content), echo (that content before the answer, non-stream and as the
    stream's first content delta), chat_template_kwargs accepted, and the
    answer's role continuing the final message without add_generation_prompt."""
    msgs = [{"role": "user", "content": "Say something."},
            {"role": "assistant", "content": "Once upon"}]
    cont = dict(messages=msgs, add_generation_prompt=False, continue_final_message=True)
    _, _, whole = srv.post_json("/tokenize", dict(messages=msgs, add_generation_prompt=False))
    _, _, cut = srv.post_json("/tokenize", cont)
    _, _, tail = srv.post_json("/tokenize", {"prompt": "Once upon", "add_special_tokens": False})
    h.check(cut["count"] < whole["count"] and
            cut["tokens"][-len(tail["tokens"]):] == tail["tokens"],
            "continue_final_message: %s vs %s" % (cut["tokens"], whole["tokens"]))
    body = dict(cont, max_tokens=5, temperature=0, ignore_eos=True, echo=True,
                chat_template_kwargs={"enable_thinking": False})
    st, _, r = srv.post_json("/v1/chat/completions", body)
    h.check(st == 200, "continue+echo: %d %r" % (st, r))
    m = r["choices"][0]["message"]
    h.check(m["role"] == "assistant" and m["content"].startswith("Once upon") and
            r["usage"]["prompt_tokens"] == cut["count"], "continue+echo %r" % r)
    evs = stream_text(srv, "/v1/chat/completions", body)
    h.check(evs[1]["choices"][0]["delta"] == {"content": "Once upon"},
            "echo's stream delta %r" % evs[1])
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in evs[1:] if e["choices"])
    h.check(content == m["content"], "echo stream %r != %r" % (content, m["content"]))
    st, _, r = srv.post_json("/v1/chat/completions", dict(
        messages=msgs[:1], add_generation_prompt=False, max_tokens=2))
    h.check(st == 200 and r["choices"][0]["message"]["role"] == "user", "role %r" % r)
    st, _, r = srv.post_json("/v1/chat/completions", dict(
        messages=msgs, chat_template_kwargs={"tokenize": True}, max_tokens=2))
    h.check(st == 400 and "tokenize" in r["error"]["message"], "kwargs tokenize %d %r" % (st, r))
    st, _, r = srv.post_json("/v1/chat/completions", dict(
        messages=msgs, chat_template="{{ 1 }}", max_tokens=2))
    h.check(st == 400 and r["error"]["message"].startswith(
        "Chat template is passed with request, but --trust-request-chat-template is not set."),
        "untrusted chat_template: %d %r" % (st, r))


def main():
    args = h.parse_args()
    model = h.make_model(args)
    srv = h.Server(args, model)
    greedy = dict(prompt=PROMPT_IDS, max_tokens=40, temperature=0, ignore_eos=True,
                  return_token_ids=True)
    ref = comp(srv, **greedy)["choices"][0]
    ref_text, ref_ids = ref["text"], ref["token_ids"]
    h.check(len(ref_ids) == 40 and len(ref_text) >= 10, "reference %r" % ref)

    # ---- stop strings
    stop = ref_text[len(ref_text) // 2:len(ref_text) // 2 + 3]
    cut = ref_text.index(stop)
    r = comp(srv, **dict(greedy, stop=[stop]))
    c = r["choices"][0]
    h.check(c["text"] == ref_text[:cut], "stop: %r != %r" % (c["text"], ref_text[:cut]))
    h.check(c["finish_reason"] == "stop" and c["stop_reason"] == stop, "stop finish %r" % c)
    h.check(r["usage"]["completion_tokens"] < 40, "stop: usage %r" % r["usage"])
    r = comp(srv, **dict(greedy, stop=[stop], include_stop_str_in_output=True))
    h.check(r["choices"][0]["text"] == ref_text[:cut + len(stop)], "include_stop_str_in_output")
    evs = stream_text(srv, "/v1/completions", dict(greedy, stop=["zzzz", stop]))
    texts = [e["choices"][0]["text"] for e in evs if e["choices"]]
    h.check("".join(texts) == ref_text[:cut], "stream stop text %r" % "".join(texts))
    h.check(evs[-1]["choices"][0]["finish_reason"] == "stop" and
            evs[-1]["choices"][0]["stop_reason"] == stop, "stream stop finish %r" % evs[-1])

    # ---- stop_token_ids
    k = 10
    tid = ref_ids[k]
    first = ref_ids.index(tid)
    r = comp(srv, **dict(greedy, stop_token_ids=[tid]))
    c = r["choices"][0]
    h.check(c["finish_reason"] == "stop" and c["stop_reason"] == tid, "stop token %r" % c)
    h.check(c["token_ids"] == ref_ids[:first + 1], "stop token ids %r" % c["token_ids"])
    h.check(r["usage"]["completion_tokens"] == first + 1, "stop token usage %r" % r["usage"])
    st, _, dt = srv.post_json("/detokenize", {"tokens": ref_ids[:first]})
    h.check(c["text"] == dt["prompt"], "stop token text %r != %r" % (c["text"], dt["prompt"]))

    # ---- n > 1 with a seed; several prompts
    body = dict(prompt="Once upon a time", max_tokens=12, n=3, seed=7, temperature=1.0,
                ignore_eos=True)
    r1, r2 = comp(srv, **body), comp(srv, **body)
    h.check([c["index"] for c in r1["choices"]] == [0, 1, 2], "n indexes %r" % r1["choices"])
    h.check(r1["usage"]["completion_tokens"] == 36, "n usage %r" % r1["usage"])
    h.check([c["text"] for c in r1["choices"]] == [c["text"] for c in r2["choices"]],
            "same seed gave different choices")
    h.check(len({c["text"] for c in r1["choices"]}) > 1, "n choices all equal (seed + i)")
    _, _, t1 = srv.post_json("/tokenize", {"prompt": "a b"})
    _, _, t2 = srv.post_json("/tokenize", {"prompt": "c d e"})
    r = comp(srv, prompt=["a b", "c d e"], max_tokens=3, n=2, temperature=0.5, seed=1,
             ignore_eos=True)
    h.check([c["index"] for c in r["choices"]] == [0, 1, 2, 3], "multi-prompt indexes")
    h.check(r["usage"]["prompt_tokens"] == t1["count"] + t2["count"] and
            r["usage"]["completion_tokens"] == 12, "multi-prompt usage %r" % r["usage"])

    # ---- echo, logprobs, default max_tokens
    r = comp(srv, prompt="Hello", echo=True, max_tokens=4, temperature=0, ignore_eos=True)
    h.check(r["choices"][0]["text"].startswith("Hello"), "echo %r" % r["choices"][0]["text"])
    r = comp(srv, prompt="Hello", echo=True, max_tokens=0)
    h.check(r["choices"][0]["text"] == "Hello" and r["usage"]["completion_tokens"] == 0,
            "echo only %r" % r)
    r = comp(srv, **dict(greedy, logprobs=3, max_tokens=5))
    lp = r["choices"][0]["logprobs"]
    h.check(len(lp["tokens"]) == 5 and len(lp["token_logprobs"]) == 5 and
            len(lp["top_logprobs"]) == 5 and all(1 <= len(t) <= 4 for t in lp["top_logprobs"]),
            "logprobs %r" % lp)
    h.check(all(x <= 0 for x in lp["token_logprobs"]), "logprob > 0")
    # Greedy: the chosen token is the most likely one.
    h.check(all(abs(max(t.values()) - x) < 1e-5 for t, x in
                zip(lp["top_logprobs"], lp["token_logprobs"])), "greedy token not the top one")
    r = comp(srv, prompt="Hello", ignore_eos=True)
    h.check(r["usage"]["completion_tokens"] == 16, "default max_tokens: %r" % r["usage"])
    # return_tokens_as_token_ids: the logprobs name the ids the choice has.
    r = comp(srv, **dict(greedy, logprobs=2, max_tokens=5, return_tokens_as_token_ids=True))
    lp = r["choices"][0]["logprobs"]
    want = ["token_id:%d" % i for i in ref_ids[:5]]
    h.check(lp["tokens"] == want, "tokens as ids %r != %r" % (lp["tokens"], want))
    h.check(all(k.startswith("token_id:") for t in lp["top_logprobs"] for k in t),
            "top_logprobs as ids %r" % lp["top_logprobs"])
    # truncate_prompt_tokens: the prompt's last tokens only, the same greedy
    # continuation as that prompt alone.
    r = comp(srv, **dict(greedy, prompt=[7, 8, 9] + PROMPT_IDS,
                         truncate_prompt_tokens=len(PROMPT_IDS)))
    h.check(r["choices"][0]["token_ids"] == ref_ids and
            r["usage"]["prompt_tokens"] == len(PROMPT_IDS) and
            r["choices"][0]["prompt_token_ids"] == PROMPT_IDS, "truncate_prompt_tokens %r" % r)
    check_token_masks(srv, greedy, ref_ids)
    check_logprob_token_ids(srv, greedy, ref_ids)

    # ---- chat, non-stream and stream
    msgs = [{"role": "user", "content": "Say something."}]
    st, _, r = srv.post_json("/v1/chat/completions", {"messages": msgs, "max_tokens": 6,
                                                      "temperature": 0, "ignore_eos": True,
                                                      "logprobs": True, "top_logprobs": 2})
    h.check(st == 200 and r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-"),
            "chat %r" % r)
    m = r["choices"][0]["message"]
    h.check(m["role"] == "assistant" and isinstance(m["content"], str), "chat message %r" % m)
    h.check(len(r["choices"][0]["logprobs"]["content"]) == 6, "chat logprobs")
    evs = stream_text(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 6,
                                                     "temperature": 0, "ignore_eos": True})
    h.check(evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""},
            "first chat chunk %r" % evs[0])
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in evs[1:])
    h.check(content == m["content"], "chat stream %r != %r" % (content, m["content"]))
    h.check(all(e["object"] == "chat.completion.chunk" and e["id"] == evs[0]["id"] for e in evs),
            "chat chunk ids/objects")
    h.check(evs[-1]["choices"][0]["finish_reason"] == "length", "chat finish %r" % evs[-1])
    check_chat_continue(srv)
    # cache_salt (vLLM's): prefix-cache hits only between requests of the same
    # salt; the output does not change. A prompt of 40 tokens: 32 can hit.
    long_ids = list(range(300, 340))

    def hits():
        return h.metric_value(srv.metrics(), "vllm:prefix_cache_hits_total") or 0

    base = dict(greedy, prompt=long_ids, max_tokens=4)
    want = comp(srv, **base)["choices"][0]["token_ids"]
    got = []
    for salt, gain in (("tenant-a", 0), ("tenant-b", 0), ("tenant-a", 32), (None, 32)):
        before = hits()
        body = dict(base, cache_salt=salt) if salt else base
        got.append(comp(srv, **body)["choices"][0]["token_ids"])
        h.check(hits() - before == gain, "cache_salt %r: %s prefix hits, want %d"
                % (salt, hits() - before, gain))
    h.check(all(g == want for g in got), "cache_salt changed the output")
    st, _, r = srv.post_json("/v1/completions", dict(base, cache_salt=""))
    h.check(st == 400 and "cache_salt" in r["error"]["message"], "empty cache_salt %d %r" % (st, r))
    # fcfs (the default) refuses a priority other than 0, in vLLM's words.
    st, _, r = srv.post_json("/v1/completions", dict(greedy, priority=2))
    h.check(st == 400 and r["error"]["message"] ==
            "Got priority 2 but Priority scheduling is not enabled.", "fcfs priority %d %r" % (st, r))
    h.check(comp(srv, **dict(greedy, priority=0))["choices"][0]["token_ids"] == ref_ids,
            "priority 0 under fcfs")
    h.check(srv.stop() == 0, "exit status")

    # ---- --stream-interval 4 (vLLM's flag): after the first token at least 4
    # per event (more when the writer lags), the rest with the finish. On a
    # model slow enough (~1 ms a token) that the writer keeps up, a worker
    # without the flag would send the tokens one per event.
    slow = h.make_model(args, "slow", ["--hidden", "512", "--intermediate", "2048", "--layers",
                                       "4", "--heads", "8", "--kv-heads", "2"])
    for flags, interval in (([], 1), (["--stream-interval", "4"], 4)):
        srv = h.Server(args, slow, *flags)
        want = comp(srv, **greedy)["choices"][0]["token_ids"]
        evs = stream_text(srv, "/v1/completions", greedy)
        per = [len(e["choices"][0]["token_ids"]) for e in evs if e["choices"]]
        ids = [t for e in evs if e["choices"] for t in e["choices"][0]["token_ids"]]
        h.check(ids == want, "stream-interval %d: tokens %r != %r" % (interval, ids, want))
        h.check(all(n >= interval for n in per[1:-1]) and len(per) <= 2 + 40 // interval,
                "stream-interval %d: tokens per event %r" % (interval, per))
        print("stream-interval %d: tokens per event %r" % (interval, per))
        h.check(srv.stop() == 0, "exit status")

    # ---- --scheduling-policy priority: one request runs at a time; while a
    # long one runs, a request of priority 10 arrives, then one of -1: the
    # later one starts (and so finishes) first.
    srv = h.Server(args, slow, "--scheduling-policy", "priority", "--max-num-seqs", "1")
    blocker = h.Stream(srv, "/v1/completions", dict(greedy, max_tokens=600, stream=True))
    h.check(blocker.status == 200, "blocker status %d" % blocker.status)
    evs = blocker.events()
    next(evs)  # the blocker runs
    done = {}

    def ask(name, prio):
        st, _, r = srv.post_json("/v1/completions", dict(greedy, max_tokens=8, priority=prio))
        done[name] = (time.monotonic(), st, r)

    low = threading.Thread(target=ask, args=("low", 10))
    low.start()
    time.sleep(0.05)
    high = threading.Thread(target=ask, args=("high", -1))
    high.start()
    rest = list(evs)
    blocker.close()
    low.join(60)
    high.join(60)
    h.check(rest and rest[-1] == "[DONE]", "blocker stream did not finish")
    h.check(done["low"][1] == 200 and done["high"][1] == 200, "priority requests %r" % done)
    h.check(done["high"][0] < done["low"][0], "priority -1 finished after priority 10")
    h.check(srv.stop() == 0, "exit status")

    # ---- generation_config.json defaults
    gdir = os.path.join(args.workdir, "tiny-topk1")
    if os.path.exists(gdir):
        shutil.rmtree(gdir)
    shutil.copytree(model, gdir)
    with open(os.path.join(gdir, "generation_config.json")) as f:
        gc = json.load(f)
    gc.update({"top_k": 1, "temperature": 0.9})
    with open(os.path.join(gdir, "generation_config.json"), "w") as f:
        json.dump(gc, f)
    srv = h.Server(args, gdir)
    silent = dict(prompt=PROMPT_IDS, max_tokens=40, ignore_eos=True, return_token_ids=True)
    a = comp(srv, **dict(silent, seed=1))["choices"][0]["token_ids"]
    b = comp(srv, **dict(silent, seed=2))["choices"][0]["token_ids"]
    h.check(a == ref_ids and b == ref_ids, "generation_config top_k 1 not applied")
    outs = {tuple(comp(srv, **dict(silent, seed=s, top_k=0, temperature=1.5))["choices"][0]
                  ["token_ids"]) for s in range(3)}
    h.check(len(outs) > 1, "the request's top_k did not override generation_config")
    h.check(srv.stop() == 0, "exit status")

    # ---- a request's own chat_template: vLLM's 400 unless trusted, then
    # rendered (its /tokenize equals the prompt it makes), with the server's
    # --default-chat-template-kwargs under the request's.
    own = dict(messages=[{"role": "user", "content": "hi"}],
               chat_template="[{{ who }}]{% for m in messages %}{{ m.content }}{% endfor %}")
    srv = h.Server(args, model, "--trust-request-chat-template",
                   "--default-chat-template-kwargs", '{"who": "server"}', "--max-logprobs", "1")
    for kw, who in ((None, "server"), ({"who": "me"}, "me")):
        body = dict(own, chat_template_kwargs=kw) if kw else own
        _, _, t = srv.post_json("/tokenize", body)
        _, _, want = srv.post_json("/tokenize", {"prompt": "[%s]hi" % who,
                                                 "add_special_tokens": False})
        h.check(t["tokens"] == want["tokens"], "own template %r: %r != %r" % (kw, t, want))
        st, _, r = srv.post_json("/v1/chat/completions", dict(body, max_tokens=2))
        h.check(st == 200 and r["usage"]["prompt_tokens"] == want["count"],
                "own template chat %d %r" % (st, r))
    # --max-logprobs 1: vLLM's 400 above it.
    h.check(comp(srv, prompt="x", max_tokens=1, logprobs=1)["choices"][0]["logprobs"],
            "logprobs 1 under --max-logprobs 1")
    st, _, r = srv.post_json("/v1/completions", dict(prompt="x", max_tokens=1, logprobs=2))
    h.check(st == 400 and r["error"]["message"] ==
            "Requested sample logprobs of 2, which is greater than max allowed: 1",
            "--max-logprobs 1: %d %r" % (st, r))
    h.check(srv.stop() == 0, "exit status")
    print("PASS: stop strings, stop ids, n/seed, multi-prompt, echo, logprobs, chat, "
          "generation_config defaults")


if __name__ == "__main__":
    main()
