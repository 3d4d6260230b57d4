#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
# tools_render_ref.py: chat requests carrying tools, assistant tool_calls (with
# arguments as JSON strings, as OpenAI clients send them) and tool results,
# rendered two ways and compared byte for byte on every template in
# shared/chat-templates/ and the real Qwen2.5 tokenizer_config.json:
#   - the reference: vLLM's preprocessing written out here (chat_utils: content
#     parts joined with "\n", None content -> "", tool_calls copied with
#     function.arguments json.loads'ed by _postprocess_messages ("" or missing
#     -> {}), tool_call_id and a string name kept; tools as tool.model_dump())
#     and Jinja2 set up as transformers' apply_chat_template sets it;
#   - Tandem: openai_prompt_driver (tdm_oai_request_parse + tdm_oai_chat_prompt).
# Where Jinja2 raises (Llama 3.1 refuses two calls in one message), Tandem must
# fail too.
#
#   tools_render_ref.py --driver PATH --shared DIR --chat-ref DIR
#
# Exit 0: all equal; 1: a mismatch; 77: skipped (no jinja2, or no shared folder).
import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web", "strict": True,
    "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 10.5}},
        "required": ["q"], "additionalProperties": False}}}

CALL_W = {"id": "call_abc", "type": "function",
          "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}
CALL_T = {"id": "call_def", "type": "function", "function": {"name": "get_time", "arguments": ""}}
CALL_S = {"id": "call_ghi", "type": "function",
          "function": {"name": "search", "arguments": "{\"q\": \"日本 \\u00e9 \\\"x\\\"\", \"limit\": 3}"}}

REQUESTS = [
    ("tools offered", {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER, TIME]}),
    ("tools, no system", {"messages": [{"role": "user", "content": "Time?"}],
                          "tools": [TIME, SEARCH], "tool_choice": "auto"}),
    ("round trip", {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL_W]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "{\"temp\": 21}"}],
        "tools": [WEATHER, TIME]}),
    ("parallel calls", {"messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather"},
                                     {"type": "text", "text": "and time?"}]},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [CALL_W, CALL_T]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_def", "content": "12:00"},
        {"role": "assistant", "content": "Sunny, noon."},
        {"role": "user", "content": "Thanks"}],
        "tools": [WEATHER, TIME], "parallel_tool_calls": True}),
    ("tool_choice none still renders", {"messages": [{"role": "user", "content": "hi"}],
                                        "tools": [SEARCH], "tool_choice": "none"}),
    ("history without tools", {"messages": [
        {"role": "user", "content": "Find sushi"},
        {"role": "assistant", "tool_calls": [CALL_S]},
        {"role": "tool", "tool_call_id": "call_ghi", "content": "3 results", "name": "search"},
        {"role": "user", "content": "ok"}]}),
    ("named and required", {"messages": [
        {"role": "user", "content": "Weather?", "name": "ann"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": "{\"city\":\"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": ""}],
        "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "add_generation_prompt": True}),
]


def vllm_conversation(body):
    conv = []
    for m in body["messages"]:
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            text = "\n".join(p["text"] for p in content)
        out = {"role": m["role"], "content": text}
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            calls = copy.deepcopy(m["tool_calls"])
            for c in calls:
                a = c["function"].get("arguments")
                if a:
                    if not isinstance(a, (dict, list)):
                        c["function"]["arguments"] = json.loads(a)
                else:
                    c["function"]["arguments"] = {}
            out["tool_calls"] = calls
        elif m["role"] == "tool" and "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        conv.append(out)
    return conv


def vllm_tools(body):
    if body.get("tools") is None:
        return None
    out = []
    for t in body["tools"]:
        f = t["function"]
        fn = {"name": f["name"], "description": f.get("description"),
              "parameters": f.get("parameters")}
        fn.update({k: v for k, v in f.items() if k not in fn})
        d = {"type": "function", "function": fn}
        d.update({k: v for k, v in t.items() if k not in ("type", "function")})
        out.append(d)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--driver", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--chat-ref", required=True, help="common/text/chat/ref (Jinja2 setup, tokens)")
    ap.add_argument("-v", action="store_true")
    args = ap.parse_args()
    try:
        import jinja2
        import jinja2.ext  # noqa: F401
        import jinja2.sandbox  # noqa: F401
    except ImportError:
        print("SKIPPED: python3-jinja2 is not installed")
        return 77
    tdir = os.path.join(args.shared, "chat-templates")
    if not os.path.isdir(tdir):
        print(f"SKIPPED: {tdir} is absent")
        return 77
    sys.path.insert(0, args.chat_ref)
    from template_corpus import hf_environment
    env = hf_environment(jinja2)
    with open(os.path.join(args.chat_ref, "corpus.json"), encoding="utf-8") as f:
        corpus = json.load(f)
    templates = []  # (name, path, specials)
    for name in sorted(os.listdir(tdir)):
        if name.endswith(".jinja"):
            specials = dict(corpus["special_tokens"].get(name, {}))
            specials.update(corpus.get("template_vars", {}).get(name, {}))
            templates.append((name, os.path.join(tdir, name), specials))
    tmpdir = tempfile.mkdtemp(prefix="tdm_tools_ref_")
    cfg_path = os.path.join(args.shared, "models", "qwen2-tokenizer", "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        qpath = os.path.join(tmpdir, "qwen2-tokenizer.jinja")
        with open(qpath, "w", encoding="utf-8") as f:
            f.write(cfg["chat_template"])
        templates.append(("qwen2-tokenizer/tokenizer_config.json", qpath,
                          {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token")
                           if isinstance(cfg.get(k), str)}))
    failures = checked = raised = 0
    for label, body in REQUESTS:
        body_path = os.path.join(tmpdir, "body.json")
        with open(body_path, "w", encoding="utf-8") as f:
            json.dump(body, f, ensure_ascii=False)
        gen = body.get("add_generation_prompt", True)
        for tname, path, specials in templates:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            checked += 1
            try:
                want = env.from_string(text).render(
                    messages=vllm_conversation(body), tools=vllm_tools(body), documents=None,
                    add_generation_prompt=gen, **specials)
                want_err = None
            except Exception as e:
                want, want_err = None, f"{type(e).__name__}: {e}"
            cmd = [args.driver, "--template", path]
            for k, v in specials.items():
                cmd += ["--var", f"{k}={v}"]
            run = subprocess.run(cmd + [body_path], capture_output=True)
            name = f"{label} / {tname}"
            if want_err is not None:
                raised += 1
                if run.returncode != 1:
                    print(f"FAIL {name}: Jinja2 raised ({want_err}) but Tandem rendered")
                    failures += 1
                continue
            if run.returncode != 0:
                print(f"FAIL {name}: Tandem failed: {run.stderr.decode(errors='replace')}")
                failures += 1
                continue
            got = run.stdout.decode("utf-8", errors="surrogateescape")
            if got != want:
                i = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]),
                         min(len(got), len(want)))
                print(f"FAIL {name}: first difference at char {i}\n"
                      f"  vLLM+jinja2: {want[max(0, i - 80):i + 80]!r}\n"
                      f"  tandem     : {got[max(0, i - 80):i + 80]!r}")
                failures += 1
            elif args.v:
                print(f"ok {name}")
    print(f"{checked} renderings checked ({len(REQUESTS)} requests x {len(templates)} templates; "
          f"{raised} where Jinja2 raises), {failures} mismatched")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
