#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
# pd_vs_colocated.py: the recorded experiment of docs/experiments.md (issue 6).
# Disaggregated serving (1 prefill + 1 decode worker) against colocated
# serving (2 decode workers) on the same two cores, one core per worker, under
# a mixed workload: (A) short prompts with long streamed outputs at a fixed
# concurrency and (B) long prompts arriving at a low Poisson rate while A
# streams. For each configuration and run it starts the stack with
# `tandem up`, pins every worker (all its threads) to its own core, warms it
# up, runs the two tandem-bench clients side by side, reads the router's P/D
# counters, stops the stack, and finally prints (and writes) a markdown table
# of A's ITL/TPOT, B's TTFT and goodput under the stated SLO.
#
# Standard library only (Debian's /usr/bin/python3). Run by hand, not by CI:
#   /usr/bin/python3 bench/experiments/pd_vs_colocated.py --build build-exp
# Every number in the table comes from the tandem-bench JSON files it writes
# into --out; nothing is computed from assumptions.
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# The model's shapes: Qwen2.5-0.5B's architecture and tokenizer but 8 layers of
# hidden 512, so that a 2048-token prefill takes about two seconds on one core
# rather than tens of seconds (the real 0.5B shapes do not finish a run of a
# few minutes on a shared two-core machine). Random weights: text is gibberish,
# lengths are exact because the bench sends ignore_eos.
MODEL_FLAGS = ["--preset", "qwen2.5-0.5b", "--layers", "8", "--hidden", "512",
               "--intermediate", "2048", "--heads", "8", "--kv-heads", "2"]

# name -> `tandem up` flags; "{thr}" is replaced by --pd-threshold.
CONFIGS = {
    # Every prompt, A's short ones too, is prefilled on the prefill worker.
    "disaggregated": ["--prefill", "1", "--decode", "1", "--pd-mode", "always"],
    # Only prompts with more than --pd-threshold uncached tokens (B's) are
    # prefilled remotely; A's 64-token prompts are prefilled by the decode
    # worker itself, as llm-d's threshold decider does.
    "disaggregated-prefix": ["--prefill", "1", "--decode", "1", "--pd-mode", "prefix",
                             "--pd-threshold", "{thr}"],
    # No prefill worker: each decode worker prefills its own prompts, B's long
    # ones in chunks between the decode steps of A's streams.
    "colocated": ["--prefill", "0", "--decode", "2"],
}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def find_bin(build, rel):
    p = os.path.join(build, rel)
    if not os.access(p, os.X_OK):
        sys.exit(f"pd_vs_colocated: {p} not found: build it first (see docs/experiments.md)")
    return p


def ensure_model(mkmodel, model_dir, tokenizer):
    if os.path.exists(os.path.join(model_dir, "config.json")):
        log(f"model: reusing {model_dir}")
        return
    if not os.path.exists(os.path.join(tokenizer, "tokenizer.json")):
        sys.exit(f"pd_vs_colocated: no tokenizer.json in {tokenizer} (--tokenizer-from)")
    log(f"model: generating {model_dir}")
    subprocess.run([mkmodel, *MODEL_FLAGS, "--tokenizer-from", tokenizer, "--out", model_dir],
                   check=True)


def pin_process(pid, cpu):
    # Every thread of the worker (engine, HTTP, nng) goes to the one core; a
    # thread created later inherits its creator's mask.
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
            n += 1
        except (ProcessLookupError, PermissionError):
            pass
    return n


class Stack:
    """One `tandem up` child, its log, and the pids of its workers."""

    def __init__(self, tandem, model, flags, port, threads, logpath):
        self.logf = open(logpath, "w")
        cmd = [tandem, "up", "--model", model, *flags, "--threads-per-worker", str(threads),
               "--port", str(port), "--log-level", "warn"]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self.workers = {}  # name -> pid
        self.ports = {}  # name -> HTTP port
        self.served = None
        deadline = time.time() + 300
        for line in self.proc.stdout:
            self.logf.write(line)
            m = re.search(r"^tandem\s+\|\s+((?:decode|prefill)-\d+)\s+http://[^:\s]+:(\d+).*pid (\d+)",
                          line)
            if m:
                self.workers[m.group(1)] = int(m.group(3))
                self.ports[m.group(1)] = int(m.group(2))
            m = re.search(r"model (\S+) \(", line)
            if "ready in" in line and m:
                self.served = m.group(1)
            if "try it" in line:
                break
            if time.time() > deadline:
                break
        if self.proc.poll() is not None or not self.workers or not self.served:
            self.stop()
            sys.exit(f"pd_vs_colocated: the stack did not start, see {logpath}")
        # Keep draining the launcher's output into the log so its pipe never fills.
        import threading

        def pump():
            for rest in self.proc.stdout:
                self.logf.write(rest)
        self.pump = threading.Thread(target=pump, daemon=True)
        self.pump.start()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if hasattr(self, "pump"):
            self.pump.join(timeout=5)
        self.logf.close()


def router_pd_counters(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError as e:
        return f"(metrics unavailable: {e})"
    keep = [ln for ln in text.splitlines()
            if ln.startswith(("tandem:router_pd_decision_total",
                              "tandem:router_prefill_fallback_total"))]
    return "; ".join(keep)


def decode_prompt_tokens(stack):
    # Prompt tokens as the decode workers counted them (vllm:prompt_tokens_total,
    # summed): a check that the server saw the prompt lengths the bench meant.
    total = 0.0
    for name, port in stack.ports.items():
        if not name.startswith("decode"):
            continue
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                for ln in r.read().decode().splitlines():
                    if ln.startswith("vllm:prompt_tokens_total"):
                        total += float(ln.rsplit(" ", 1)[1])
        except OSError:
            return None
    return total


def bench_cmd(bench, port, served, model, out_json, *, input_len, output_len, n, seed,
              concurrency=None, rate=None, goodput):
    cmd = [bench, "--base-url", f"http://127.0.0.1:{port}", "--model", served,
           "--tokenizer", model, "--dataset", "random", "--input-len", str(input_len),
           "--output-len", str(output_len), "--num-prompts", str(n), "--seed", str(seed),
           "--goodput", *goodput, "--percentiles", "50,90,99", "--json", out_json]
    if concurrency is not None:
        cmd += ["--max-concurrency", str(concurrency)]
    if rate is not None:
        cmd += ["--request-rate", str(rate)]
    return cmd


def run_one(a, tandem, bench, name, run, outdir, cpus):
    tag = f"{name}-run{run}"
    port = a.port
    flags = [f.replace("{thr}", str(a.pd_threshold)) for f in CONFIGS[name]]
    stack = Stack(tandem, a.model, flags, port, 1,
                  os.path.join(outdir, f"{tag}.stack.log"))
    try:
        order = sorted(stack.workers)  # decode-0, decode-1 | decode-0, prefill-0
        pins = []
        for i, w in enumerate(order):
            cpu = cpus[i % len(cpus)]
            pin_process(stack.workers[w], cpu)
            pins.append(f"{w}->cpu{cpu}")
        log(f"{tag}: stack up ({' '.join(stack.cmd[1:])}); pinned {', '.join(pins)}")
        # Warm-up: touch the weights and the code paths of both request kinds.
        for (il, ol) in ((a.a_input, 8), (a.b_input, 2)):
            subprocess.run(bench_cmd(bench, port, stack.served, a.model,
                                     os.path.join(outdir, f"{tag}.warmup.json"),
                                     input_len=il, output_len=ol, n=2, seed=999,
                                     concurrency=2, goodput=["ttft:1000000"]),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        before = router_pd_counters(port)
        ptok0 = decode_prompt_tokens(stack)
        ja = os.path.join(outdir, f"{tag}.A.json")
        jb = os.path.join(outdir, f"{tag}.B.json")
        fa = open(os.path.join(outdir, f"{tag}.A.txt"), "w")
        fb = open(os.path.join(outdir, f"{tag}.B.txt"), "w")
        t0 = time.time()
        pa = subprocess.Popen(bench_cmd(bench, port, stack.served, a.model, ja,
                                        input_len=a.a_input, output_len=a.a_output,
                                        n=a.a_prompts, seed=run, concurrency=a.a_concurrency,
                                        goodput=a.slo_a), stdout=fa, stderr=subprocess.STDOUT)
        time.sleep(a.b_delay)  # let A's streams be running when the first long prompt lands
        pb = subprocess.Popen(bench_cmd(bench, port, stack.served, a.model, jb,
                                        input_len=a.b_input, output_len=a.b_output,
                                        n=a.b_prompts, seed=a.b_seed + run, rate=a.b_rate,
                                        goodput=a.slo_b), stdout=fb, stderr=subprocess.STDOUT)
        rb = pb.wait()
        ra = pa.wait()
        wall = time.time() - t0
        fa.close()
        fb.close()
        after = router_pd_counters(port)
        ptok1 = decode_prompt_tokens(stack)
        sent = load(ja)["total_input_tokens"] + load(jb)["total_input_tokens"]
        seen = None if ptok0 is None or ptok1 is None else ptok1 - ptok0
        log(f"{tag}: prompt tokens sent (bench count) {sent}, counted by the decode workers {seen}")
        if ra != 0 or rb != 0:
            log(f"{tag}: a bench exited {ra}/{rb}; see {outdir}/{tag}.[AB].txt")
        log(f"{tag}: done in {wall:.1f} s")
        return {"tag": tag, "config": name, "run": run, "wall_s": wall, "A": ja, "B": jb,
                "pd_before": before, "pd_after": after, "pins": pins,
                "prompt_tokens_sent": sent, "prompt_tokens_seen_by_decode": seen}
    finally:
        stack.stop()


def load(p):
    with open(p) as f:
        return json.load(f)


def percentile(xs, q):
    # numpy's default (linear interpolation), as tandem-bench computes them.
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results, a):
    rows = []
    for r in results:
        A, B = load(r["A"]), load(r["B"])
        good = 0
        for J in (A, B):
            if J.get("request_goodput") is not None:
                good += J["request_goodput"] * J["duration"]
        ok = A["completed"] + B["completed"]
        rows.append({
            "tag": r["tag"], "config": r["config"], "run": r["run"], "wall": r["wall_s"],
            "itl50": A["median_itl_ms"], "itl99": A["p99_itl_ms"],
            # The stalls a long prefill causes are a few gaps per long prompt
            # among thousands: p99.9 and the maximum show them, p99 barely.
            "itl999": 1000 * percentile([g for r_ in A["itls"] for g in r_], 99.9),
            "itlmax": 1000 * max((g for r_ in A["itls"] for g in r_), default=0.0),
            "slow_gaps": sum(1 for r_ in A["itls"] for g in r_ if g > a.stall_ms / 1000),
            "stall_s": sum(g for r_ in A["itls"] for g in r_ if g > a.stall_ms / 1000),
            "tpot50": A["median_tpot_ms"], "tpot99": A["p99_tpot_ms"],
            "a_ttft99": A["p99_ttft_ms"],
            "b_ttft50": B["median_ttft_ms"], "b_ttft99": B["p99_ttft_ms"],
            "b_tpot50": B["median_tpot_ms"],
            "a_good": A.get("request_goodput") and A["request_goodput"] * A["duration"],
            "b_good": B.get("request_goodput") and B["request_goodput"] * B["duration"],
            "a_n": A["completed"], "b_n": B["completed"],
            "failed": A["failed"] + B["failed"],
            "goodput": good / r["wall_s"], "good": good, "ok": ok,
            "tok_s": (A["total_output_tokens"] + B["total_output_tokens"]) / r["wall_s"],
            "pd": r["pd_after"], "sent": r["prompt_tokens_sent"],
            "seen": r["prompt_tokens_seen_by_decode"],
        })
    hdr = ("| config | run | A ITL p50 / p99 / p99.9 / max (ms) | A gaps > "
           f"{a.stall_ms:g} ms: count, seconds | A TPOT p50 / p99 (ms) | A TTFT p99 (ms) "
           "| B TTFT p50 / p99 (ms) | B TPOT p50 (ms) | good A / B (of done) "
           "| goodput (req/s) | output tok/s | wall (s) |")
    lines = [hdr, "|" + "---|" * 12]
    for x in rows:
        lines.append(
            f"| {x['config']} | {x['run']} | {x['itl50']:.1f} / {x['itl99']:.1f} / "
            f"{x['itl999']:.0f} / {x['itlmax']:.0f} | {x['slow_gaps']}, {x['stall_s']:.1f} "
            f"| {x['tpot50']:.1f} / {x['tpot99']:.1f} | {x['a_ttft99']:.0f} "
            f"| {x['b_ttft50']:.0f} / {x['b_ttft99']:.0f} | {x['b_tpot50']:.1f} "
            f"| {round(x['a_good'] or 0)}/{x['a_n']} , {round(x['b_good'] or 0)}/{x['b_n']} "
            f"| {x['goodput']:.3f} | {x['tok_s']:.1f} | {x['wall']:.1f} |")
    slo = (f"SLO: A (streams) {' '.join(a.slo_a)}; B (long prompts) {' '.join(a.slo_b)}. "
           "Goodput = requests of A and B meeting their SLO / wall time of the run "
           "(first send of A to the end of the last request).")
    pd = "\n".join(f"- {x['tag']}: {x['pd'] or '(no P/D counters)'}; prompt tokens sent "
                   f"{x['sent']}, counted by the decode workers {x['seen']}" for x in rows)
    return "\n".join(lines) + "\n\n" + slo + "\n\nRouter P/D counters after each run:\n" + pd + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--build", default=os.path.join(REPO, "build"),
                    help="CMake build folder holding tandem, the services and tandem-bench")
    ap.add_argument("--model", default="/tmp/tandem-exp-m8",
                    help="model folder; generated with tandem-mkmodel if it has no config.json")
    ap.add_argument("--tokenizer-from", default="/work/shared/models/qwen2-tokenizer")
    ap.add_argument("--out", default="/tmp/tandem-exp-pd")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--configs", default="disaggregated,disaggregated-prefix,colocated")
    ap.add_argument("--port", type=int, default=18700)
    ap.add_argument("--pd-threshold", type=int, default=1024,
                    help="disaggregated-prefix: uncached prompt tokens above which to "
                    "prefill remotely")
    ap.add_argument("--a-input", type=int, default=64)
    ap.add_argument("--a-output", type=int, default=256)
    ap.add_argument("--a-concurrency", type=int, default=4)
    ap.add_argument("--a-prompts", type=int, default=72)
    ap.add_argument("--b-input", type=int, default=2048)
    ap.add_argument("--b-output", type=int, default=16)
    ap.add_argument("--b-rate", type=float, default=0.15)
    ap.add_argument("--b-prompts", type=int, default=8)
    ap.add_argument("--b-delay", type=float, default=2.0)
    ap.add_argument("--b-seed", type=int, default=10,
                    help="B's seed is this + the run number (A's is the run number)")
    ap.add_argument("--stall-ms", type=float, default=100,
                    help="an A inter-token gap above this counts as a stall in the table")
    ap.add_argument("--summarize-only", action="store_true",
                    help="rebuild the table from --out/results.json without running anything")
    ap.add_argument("--slo-a", default="ttft:1000,tpot:25")
    ap.add_argument("--slo-b", default="ttft:3000,tpot:25")
    a = ap.parse_args()
    a.slo_a = a.slo_a.split(",")
    a.slo_b = a.slo_b.split(",")
    tandem = find_bin(a.build, "tools/tandem/tandem")
    bench = find_bin(a.build, "bench/serve/tandem-bench")
    mkmodel = find_bin(a.build, "tools/mkmodel/tandem-mkmodel")
    for s in ("router/tandem-router", "prefill/tandem-prefill", "decode/tandem-decode"):
        if not os.path.exists(os.path.join(a.build, s)):
            log(f"note: {s} not under {a.build}; tandem up will look on PATH")
    os.makedirs(a.out, exist_ok=True)
    if a.summarize_only:
        with open(os.path.join(a.out, "results.json")) as f:
            print(summarize(json.load(f), a))
        return
    ensure_model(mkmodel, a.model, a.tokenizer_from)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    log(f"cpus used for the workers: {cpus}; online {os.cpu_count()}; "
        f"load average {os.getloadavg()}")
    results = []
    # Interleave the configurations (D, C, D, C) so slow phases of a shared
    # machine hit both rather than one.
    for run in range(1, a.runs + 1):
        for name in a.configs.split(","):
            if name not in CONFIGS:
                sys.exit(f"pd_vs_colocated: unknown config {name}")
            results.append(run_one(a, tandem, bench, name, run, a.out, cpus))
            with open(os.path.join(a.out, "results.json"), "w") as f:
                json.dump(results, f, indent=1)
            log(f"load average {os.getloadavg()}")
    table = summarize(results, a)
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
