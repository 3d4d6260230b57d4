#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
# template_fuzz.py: differential fuzzing of tdm_chat against python3-jinja2. Takes
# the real templates (shared/chat-templates) and ref/templates, damages them at
# random (inserted tag delimiters, operators and keywords, deleted or duplicated
# spans), renders each with both over a conversation of corpus.json, and requires:
# no crash (exit 0 or 1, no sanitizer report), the same bytes where both render,
# and failure where Jinja2 fails. One difference is allowed: Tandem refuses an
# unknown filter or test anywhere at load, Jinja2 only when its branch runs.
#
#   template_fuzz.py --driver PATH --corpus corpus.json --shared DIR --extra DIR
#                    [--iterations N] [--seed S]
#
# Exit 0: no divergence; 1: a divergence (the template is saved and named); 77:
# skipped (no jinja2).
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from template_corpus import hf_environment  # noqa: E402

PIECES = ["{%", "%}", "{{", "}}", "-", "+", "(", ")", "[", "]", "'", '"', "|", ".", " is ",
          " not ", " in ", "{#", "#}", "\n", "loop.", " if ", " else ", "~", "*", "/", "0", ":",
          ",", " and ", " or ", "ns.", "none", "[0]", "[1:]", "|length", "|tojson"]


def mutate(rng, t):
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(t) + 1)
        r = rng.random()
        if r < 0.4:
            t = t[:i] + rng.choice(PIECES) + t[i:]
        elif r < 0.8:
            t = t[:i] + t[i + rng.randint(1, 4):]
        else:
            j = rng.randrange(len(t) + 1)
            t = t[:i] + t[j:j + 8] + t[i:]
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--driver", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--extra", required=True)
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--seed", type=int, default=12)
    args = ap.parse_args()
    try:
        import jinja2
        import jinja2.ext  # noqa: F401
    except ImportError:
        print("SKIPPED: python3-jinja2 is not installed")
        return 77
    env = hf_environment(jinja2)
    shared_templates = os.path.join(args.shared, "chat-templates")
    if not os.path.isdir(shared_templates):
        # The damaged corpus is drawn from the real templates; without them the
        # seed would draw a different corpus than the one this test pins.
        print("SKIPPED: %s is absent (the real templates this fuzz test damages)"
              % shared_templates)
        return 77
    dirs = [shared_templates, args.extra]
    texts = []
    for d in dirs:
        if os.path.isdir(d):
            for name in sorted(os.listdir(d)):
                if name.endswith(".jinja"):
                    with open(os.path.join(d, name), encoding="utf-8") as f:
                        texts.append(f.read())
    with open(args.corpus, encoding="utf-8") as f:
        convs = json.load(f)["conversations"]
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="tdm_chat_fuzz_")
    stats = {"same output": 0, "both fail": 0, "stricter at load": 0, "divergent": 0}
    for it in range(args.iterations):
        text = mutate(rng, rng.choice(texts))
        conv = rng.choice(convs)
        tpath = os.path.join(tmp, f"t{it}.jinja")
        with open(tpath, "w", encoding="utf-8") as f:
            f.write(text)
        mpath = os.path.join(tmp, "messages.json")
        with open(mpath, "w", encoding="utf-8") as f:
            json.dump(conv["messages"], f, ensure_ascii=False)
        cmd = [args.driver, "--template", tpath, "--var", "bos_token=<s>", "--var",
               "eos_token=</s>", mpath, "--raw"]
        if conv.get("tools") is not None:
            tools = os.path.join(tmp, "tools.json")
            with open(tools, "w", encoding="utf-8") as f:
                json.dump(conv["tools"], f, ensure_ascii=False)
            cmd += ["--tools", tools]
        try:
            want = env.from_string(text).render(
                messages=conv["messages"], tools=conv.get("tools"), documents=None,
                add_generation_prompt=False, bos_token="<s>", eos_token="</s>")
            want_err = None
        except Exception as e:
            want, want_err = None, f"{type(e).__name__}: {e}"
        run = subprocess.run(cmd, capture_output=True, timeout=60)
        err = run.stderr.decode(errors="replace")
        got = run.stdout.decode("utf-8", errors="surrogateescape") if run.returncode == 0 else None
        problem = None
        if run.returncode not in (0, 1) or "Sanitizer" in err or "runtime error" in err:
            problem = f"crash (exit {run.returncode}): {err[:300]}"
        elif want is not None and got is not None:
            if want != got:
                problem = "different output"
            else:
                stats["same output"] += 1
        elif want is None and got is None:
            stats["both fail"] += 1
        elif want is None:
            problem = f"Tandem renders, Jinja2 raises {want_err[:200]}"
        elif "unknown filter" in err or "unknown test" in err:
            stats["stricter at load"] += 1
        else:
            problem = f"Jinja2 renders, Tandem fails: {err.strip()[:200]}"
        if problem:
            stats["divergent"] += 1
            print(f"FAIL iteration {it} ({tpath}): {problem}")
        else:
            os.unlink(tpath)
    print(f"{args.iterations} damaged templates (seed {args.seed}): {stats}")
    return 1 if stats["divergent"] else 0


if __name__ == "__main__":
    sys.exit(main())
