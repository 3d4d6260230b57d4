#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
# render_ref.py: the independent reference for common/text/chat. Renders the REAL chat
# template texts with Jinja2, set up the way HF transformers' apply_chat_template
# compiles them (sandboxed, trim_blocks, lstrip_blocks, loopcontrols, a
# raise_exception and strftime_now globals, HF's tojson filter, the tokenizer's
# special tokens as variables), turns OpenAI messages into the conversation vLLM
# hands the template (text parts joined with "\n", null content -> ""), and checks
# that chat_render_driver (tdm_chat: tdm_chat_msgs_parse + tdm_chat_render) produces
# the same bytes, or fails where Jinja fails. The "near_misses" of cases.json (once
# templates the old recogniser had to refuse) are rendered like any other template.
#
#   render_ref.py --driver PATH --cases cases.json --shared /work/shared
#
# Exit 0: all equal; 1: a mismatch; 77: skipped (no jinja2, or no template to test).
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile


def hf_environment(jinja2):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def vllm_conversation(messages):
    """OpenAI messages -> what vLLM passes to the template (string content format)."""
    conv = []
    for m in messages:
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            content = "\n".join(p["text"] for p in content)
        conv.append({"role": m["role"], "content": content})
    return conv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--driver", required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--shared", required=True)
    args = ap.parse_args()
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox  # noqa: F401
    except ImportError:
        print("SKIPPED: python3-jinja2 is not installed")
        return 77
    env = hf_environment(jinja2)
    with open(args.cases, encoding="utf-8") as f:
        spec = json.load(f)

    # name -> (template text, special tokens, driver arguments)
    templates = {}
    cfg_path = os.path.join(args.shared, "models", "qwen2-tokenizer", "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        specials = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                    if cfg.get(k) is not None}
        templates["qwen2.5"] = (cfg["chat_template"], specials, ["--config", cfg_path])
        # A re-indented copy (tabs, no indentation, trailing spaces): Jinja renders it
        # from its own text, so a whitespace rule applied wrongly would show here.
        lines = cfg["chat_template"].split("\n")
        last = len(lines) - 2
        variant = "\n".join([("\t" * (i % 3)) + ln.strip() + (" " if i % 2 and i < last else "")
                             for i, ln in enumerate(lines[:-1])] + lines[-1:])
        vpath = os.path.join(tempfile.mkdtemp(prefix="tdm_chat_ref_"), "qwen_variant.jinja")
        with open(vpath, "w", encoding="utf-8") as f:
            f.write(variant)
        templates["qwen2.5_reindented"] = (variant, specials, ["--template", vpath])
    else:
        print(f"note: {cfg_path} absent; the Qwen2.5 template is not checked")
    tmpdir = tempfile.mkdtemp(prefix="tdm_chat_ref_")
    for name, t in spec["templates"].items():
        path = os.path.join(tmpdir, name + ".jinja")
        with open(path, "w", encoding="utf-8") as f:
            f.write(t["text"])
        specials = t.get("special_tokens", {})
        templates[name] = (t["text"], specials,
                           ["--template", path] + [a for k, v in specials.items()
                                                   for a in ("--var", f"{k}={v}")])
    for k, miss in enumerate(spec.get("near_misses", [])):
        path = os.path.join(tmpdir, f"miss{k}.jinja")
        with open(path, "w", encoding="utf-8") as f:
            f.write(miss["text"])
        specials = spec["templates"][miss["like"]].get("special_tokens", {})
        templates[f"near miss {k}"] = (miss["text"], specials,
                                       ["--template", path] + [a for kk, v in specials.items()
                                                               for a in ("--var", f"{kk}={v}")])
    if not templates:
        print("SKIPPED: no templates")
        return 77

    failures = 0
    checked = 0
    for case in spec["cases"]:
        msg_path = os.path.join(tmpdir, "messages.json")
        with open(msg_path, "w", encoding="utf-8") as f:
            json.dump(case["messages"], f, ensure_ascii=False)
        gen = case.get("add_generation_prompt", False)
        for tname, (text, specials, targs) in templates.items():
            label = f"{case['name']} / {tname}"
            cmd = [args.driver] + targs + [msg_path] + (["--gen"] if gen else [])
            run = subprocess.run(cmd, capture_output=True)
            checked += 1
            if case.get("tandem_rejects"):
                # Inputs Tandem refuses on purpose (see docs/chat-templates.md).
                if run.returncode != 1:
                    print(f"FAIL {label}: expected tdm_chat to reject this input")
                    failures += 1
                continue
            try:
                want = env.from_string(text).render(
                    messages=vllm_conversation(case["messages"]), tools=None, documents=None,
                    add_generation_prompt=gen, **specials)
                want_err = None
            except Exception as e:  # Jinja raised: Tandem must fail too
                want, want_err = None, f"{type(e).__name__}: {e}"
            if want_err is not None:
                if run.returncode != 1:
                    print(f"FAIL {label}: Jinja2 raised ({want_err}) but tdm_chat rendered "
                          f"{run.stdout!r}")
                    failures += 1
                continue
            if run.returncode != 0:
                print(f"FAIL {label}: tdm_chat failed: {run.stderr.decode(errors='replace')}")
                failures += 1
                continue
            got = run.stdout.decode("utf-8", errors="surrogateescape")
            if got != want:
                print(f"FAIL {label}:\n  jinja2 : {want!r}\n  tandem : {got!r}")
                failures += 1
    print(f"{checked} renderings checked, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
