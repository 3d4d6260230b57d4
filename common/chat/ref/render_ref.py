#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
# render_ref.py: the independent reference for common/chat. Renders the REAL chat
# template texts with Jinja2, set up the way HF transformers' apply_chat_template
# compiles them (sandboxed, trim_blocks, lstrip_blocks, loopcontrols, a
# raise_exception global, HF's tojson filter, the tokenizer's special tokens as
# variables), turns OpenAI messages into the conversation vLLM hands the template
# (text parts joined with "\n", null content -> ""), and checks that
# chat_render_driver (tdm_chat) produces the same bytes, or fails where Jinja fails.
#
#   render_ref.py --driver PATH --cases cases.json --shared /work/shared
#
# Exit 0: all equal; 1: a mismatch; 77: skipped (no jinja2, or no template to test).
import argparse
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

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
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
        # A re-indented copy (tabs, no indentation, trailing spaces) that tdm_chat must
        # still recognise; Jinja renders it from its own text, so a canonicalisation
        # that equated templates Jinja treats differently would show here.
        # Every line of this template starts with a "{%-" or "{{-" tag, which eats the
        # whitespace before it; the last line's end must stay as it is (a space there
        # would be output, and tdm_chat rightly refuses that variant).
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
        templates[name] = (t["text"], t.get("special_tokens", {}), ["--template", path])
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
    # Near misses: tdm_chat must refuse them, and Jinja must show they really render
    # differently from the template they resemble (so refusing them is right).
    for k, miss in enumerate(spec.get("near_misses", [])):
        path = os.path.join(tmpdir, f"miss{k}.jinja")
        with open(path, "w", encoding="utf-8") as f:
            f.write(miss["text"])
        run = subprocess.run([args.driver, "--template", path, msg_path], capture_output=True)
        if run.returncode != 1 or b"not recognised" not in run.stderr:
            print(f"FAIL near miss {k}: tdm_chat did not refuse it")
            failures += 1
        base = spec["templates"][miss["like"]]["text"]
        differs = False
        for case in spec["cases"]:
            if case.get("tandem_rejects"):
                continue
            kw = dict(messages=vllm_conversation(case["messages"]), tools=None, documents=None,
                      add_generation_prompt=case.get("add_generation_prompt", False),
                      **spec["templates"][miss["like"]].get("special_tokens", {}))
            try:
                differs |= env.from_string(miss["text"]).render(**kw) != \
                    env.from_string(base).render(**kw)
            except Exception:
                differs = True
        if not differs:
            print(f"FAIL near miss {k}: Jinja renders it like {miss['like']}; it should be accepted")
            failures += 1
        checked += 1
    print(f"{checked} renderings checked, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
