#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
# template_corpus.py: renders every chat template in shared/chat-templates/ (real
# Hugging Face templates: Qwen2.5, Llama 3.1/3.2/3.3, DeepSeek-R1, Hermes,
# Functionary, Command-R, Firefunction) and the real Qwen2.5 tokenizer_config.json
# over the conversations in corpus.json (tools, assistant tool calls, tool results,
# empty content, unicode) with Jinja2 set up as HF's apply_chat_template sets it,
# and checks that chat_render_driver --raw (tdm_chat_render_json) prints the same
# bytes, or fails where Jinja2 fails. --extra DIR adds the templates there
# (ref/templates: Tandem's own templates exercising Jinja2/Python semantics).
#
#   template_corpus.py --driver PATH --corpus corpus.json --shared DIR [--extra DIR]
#
# Exit 0: all equal; 1: a mismatch; 77: skipped (no jinja2, or no shared folder).
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile


def hf_environment(jinja2):
    """jinja2 configured as transformers' _compile_jinja_template does."""
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class AssistantTracker(Extension):
        """HF's {% generation %} block, without the mask bookkeeping: renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(
                lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--driver", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--extra", help="a folder of more .jinja templates")
    ap.add_argument("-v", action="store_true", help="print every comparison")
    args = ap.parse_args()
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox  # noqa: F401
    except ImportError:
        print("SKIPPED: python3-jinja2 is not installed")
        return 77
    tdir = os.path.join(args.shared, "chat-templates")
    if not os.path.isdir(tdir):
        print(f"SKIPPED: {tdir} is absent")
        return 77
    env = hf_environment(jinja2)
    with open(args.corpus, encoding="utf-8") as f:
        corpus = json.load(f)

    # name -> (template text, special tokens, driver arguments)
    templates = {}
    paths = [os.path.join(tdir, n) for n in sorted(os.listdir(tdir))]
    if args.extra:
        paths += [os.path.join(args.extra, n) for n in sorted(os.listdir(args.extra))]
    for path in paths:
        name = os.path.basename(path)
        if not name.endswith(".jinja"):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        specials = dict(corpus["special_tokens"].get(name, {}))
        specials.update(corpus.get("template_vars", {}).get(name, {}))
        targs = ["--template", path]
        for k, v in specials.items():
            targs += ["--var", f"{k}={v}"]
        templates[name] = (text, specials, targs)
    cfg_path = os.path.join(args.shared, "models", "qwen2-tokenizer", "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        specials = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                    if isinstance(cfg.get(k), str)}
        templates["qwen2-tokenizer/tokenizer_config.json"] = (cfg["chat_template"], specials,
                                                              ["--config", cfg_path])
    tmpdir = tempfile.mkdtemp(prefix="tdm_chat_corpus_")
    failures = checked = jinja_errors = 0
    for conv in corpus["conversations"]:
        msg_path = os.path.join(tmpdir, "messages.json")
        with open(msg_path, "w", encoding="utf-8") as f:
            json.dump(conv["messages"], f, ensure_ascii=False)
        extra = ["--raw"]
        if conv.get("tools") is not None:
            tools_path = os.path.join(tmpdir, "tools.json")
            with open(tools_path, "w", encoding="utf-8") as f:
                json.dump(conv["tools"], f, ensure_ascii=False)
            extra += ["--tools", tools_path]
        gen = conv.get("add_generation_prompt", False)
        if gen:
            extra.append("--gen")
        for tname, (text, specials, targs) in templates.items():
            label = f"{conv['name']} / {tname}"
            checked += 1
            try:
                want = env.from_string(text).render(
                    messages=json.loads(json.dumps(conv["messages"])), tools=conv.get("tools"),
                    documents=None, add_generation_prompt=gen, **specials)
                want_err = None
            except Exception as e:  # Jinja raised: Tandem must fail too
                want, want_err = None, f"{type(e).__name__}: {e}"
            run = subprocess.run([args.driver] + targs + [msg_path] + extra, capture_output=True)
            if want_err is not None:
                jinja_errors += 1
                if run.returncode != 1:
                    print(f"FAIL {label}: Jinja2 raised ({want_err}) but tdm_chat rendered "
                          f"{run.stdout[:200]!r}")
                    failures += 1
                elif args.v:
                    print(f"ok (both fail) {label}: {want_err} | {run.stderr.decode().strip()}")
                continue
            if run.returncode != 0:
                print(f"FAIL {label}: tdm_chat failed: {run.stderr.decode(errors='replace')}")
                failures += 1
                continue
            got = run.stdout.decode("utf-8", errors="surrogateescape")
            if got != want:
                i = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]),
                         min(len(got), len(want)))
                print(f"FAIL {label}: first difference at char {i}\n"
                      f"  jinja2 : {want[max(0, i - 60):i + 60]!r}\n"
                      f"  tandem : {got[max(0, i - 60):i + 60]!r}")
                failures += 1
            elif args.v:
                print(f"ok {label}")
    print(f"{checked} renderings checked ({len(templates)} templates x "
          f"{len(corpus['conversations'])} conversations; {jinja_errors} where Jinja2 raises), "
          f"{failures} mismatched")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
