# SPDX-License-Identifier: Apache-2.0
"""openai_tools: tool calling through the official OpenAI SDK for Node.js.

Starts `tandem up --prefill 1 --decode 1 --pd-mode always --enable-auto-tool-choice
--tool-call-parser hermes` on a tiny random model whose tokenizer_config.json
carries the real Qwen2.5 chat template (from shared/chat-templates; without it
the model's ChatML template is kept and the "tools are rendered" check is left
out), and runs test_openai_tools.mjs against the router's /v1 and decode-0's
own /v1. --forced runs the forced calls too (tool_choice named / "required"),
which need the sampler's constraints. Skips (exit 77) like openai_sdk when node
or the pinned npm packages are missing.
"""
import json
import os
import shutil
import subprocess

from stack_harness import Stack, check, make_model, parse_args, skip
from test_openai_sdk import ensure_packages

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "tandem-tools-test"


def extra(ap):
    ap.add_argument("--shared", default=os.path.join(HERE, "..", "..", "shared"),
                    help="the shared/ folder (chat-templates/)")
    ap.add_argument("--forced", action="store_true", help="check forced tool calls too")


def tools_model(args):
    """The tiny model with Qwen2.5's own chat template, if the shared folder has it."""
    src = make_model(args)
    tmpl = os.path.join(args.shared, "chat-templates", "Qwen-Qwen2.5-7B-Instruct.jinja")
    if not os.path.exists(tmpl):
        return src, False
    out = os.path.join(args.workdir, "stack-tiny-tools")
    if os.path.exists(out):
        shutil.rmtree(out)
    shutil.copytree(src, out)
    cfg_path = os.path.join(out, "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    with open(tmpl, encoding="utf-8") as f:
        cfg["chat_template"] = f.read()
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=2)
    return out, True


def main():
    args = parse_args(extra)
    node = shutil.which(args.node)
    if not node:
        skip("node not found (Debian: apt-get install nodejs)")
    ensure_packages(args)
    model, rendered = tools_model(args)
    st = Stack(args, "--model", model, "--prefill", "1", "--decode", "1", "--pd-mode", "always",
               "--served-model-name", MODEL, "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes")
    flags = (["--rendered"] if rendered else []) + (["--forced"] if args.forced else [])
    for name in ("router", "decode-0"):
        r = subprocess.run([node, os.path.join(HERE, "test_openai_tools.mjs"),
                            "--base-url", "http://127.0.0.1:%d/v1" % st.port(name),
                            "--model", MODEL, "--label", name] + flags,
                           capture_output=True, text=True, timeout=240, cwd=HERE)
        print(r.stdout, end="", flush=True)
        check(r.returncode == 0, "tool calling through the OpenAI SDK against %s:\n%s%s"
              % (name, r.stderr, st.log()[-4000:]))
    rc = st.stop()
    check(rc == 0, "tandem up exited %d:\n%s" % (rc, st.log()))
    st.check_children_gone()
    print("PASS")


if __name__ == "__main__":
    main()
