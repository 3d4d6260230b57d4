# SPDX-License-Identifier: Apache-2.0
"""bench/gpu/gpu_steps.py: two of bench/gpu/check.sh's steps that drive
processes and read /proc, kept out of bash (Python 3 stdlib only: the GPU
machine's Python runs it as it is).

  gpu_steps.py serve --decode BIN --bench BIN --model DIR --workdir DIR --json FILE
      [--concurrency 1,64,256] [--input-len 128] [--output-len 128]
      [--worker-args "--device cuda ..."]
    One decode worker (--device cuda unless --worker-args says otherwise) and
    tandem-bench against it: random prompts of --input-len tokens, --output-len
    output tokens, once per concurrency (2 x C prompts, at least 16). Per run:
    output tok/s, TTFT and ITL p50/p99 (tandem-bench's --json, vLLM's key
    names), and the engine thread's share of one core during the run: the
    utime + stime of the worker's thread named tdm-engine
    (/proc/PID/task/TID/stat, fields 14 and 15) read before and after the run,
    over the run's wall time (1.0 = one core busy all the time); and where the
    worker exports tandem:engine_thread_seconds_total{phase} (/metrics, read
    before and after the run), that thread's wall time by phase over the
    run's: the host's share of a step (schedule, prepare, forward: the
    launches on a GPU, finish) beside its waits for the device (wait).
  gpu_steps.py ids --generate BIN --model DIR --json FILE
      [--lengths 1000,2048,2049,3000,3500] [--chunks 256,2048] [--max-tokens 16]
    Greedy ids of tandem-generate --device cuda equal --device cpu for random
    prompts of each length, at each prefill chunk (compared at the same chunk:
    the GPU kernels are not chunking-invariant, docs/gpu-backend.md).

Each writes its JSON (the figures, or the lengths that differ) and prints one
table; exit 0 when every run passed, 1 otherwise.
"""
import argparse
import json
import os
import random
import re
import shlex
import subprocess
import sys
import threading
import time
import urllib.request

ENGINE_THREAD = "tdm-engine"  # common/engine/engine.c names its thread so


def engine_ticks(pid):
    """utime + stime (clock ticks) of the process's tdm-engine thread, or None."""
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return None
    for tid in tids:
        try:
            with open("/proc/%d/task/%s/comm" % (pid, tid)) as f:
                if f.read().strip() != ENGINE_THREAD:
                    continue
            with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                stat = f.read()
        except OSError:
            continue
        # The name (field 2) may hold spaces: count fields after its ')'.
        fields = stat[stat.rindex(")") + 2:].split()
        return int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5)
    return None


PHASE_RE = re.compile(
    r'^tandem:engine_thread_seconds_total\{[^}]*phase="([a-z]+)"[^}]*\} (\S+)$', re.M)


def engine_phases(port):
    """The worker's tandem:engine_thread_seconds_total by phase (seconds), or
    None when its /metrics has no such series."""
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
            text = r.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    got = {}
    for m in PHASE_RE.finditer(text):
        try:
            got[m.group(1)] = float(m.group(2))
        except ValueError:
            pass
    return got or None


class Worker:
    """A tandem-decode on 127.0.0.1 --port 0; the port (and the model name it
    answers to) is read from its 'ready ... served_model_name=NAME ...
    listening=http://HOST:PORT' line, its stderr kept in self.log."""

    def __init__(self, decode, model, flags, ready_s):
        cmd = [decode, "--model", model, "--host", "127.0.0.1", "--port", "0"] + flags
        print("worker: %s" % " ".join(shlex.quote(c) for c in cmd), flush=True)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.log, self.port, self.served_name = [], None, None
        got = threading.Event()

        def reader():
            for line in self.proc.stderr:
                self.log.append(line.rstrip("\n"))
                m = re.search(r"listening=http://[^ ]*:(\d+)", line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    n = re.search(r"served_model_name=(\S+)", line)
                    self.served_name = n.group(1) if n else None
                    got.set()
            got.set()

        threading.Thread(target=reader, daemon=True).start()
        if not got.wait(ready_s) or self.port is None:
            self.stop()
            raise RuntimeError("tandem-decode did not start:\n" + "\n".join(self.log[-20:]))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve(args):
    flags = ["--max-num-seqs", str(max(args.concurrency))] + shlex.split(args.worker_args)
    w = Worker(args.decode, args.model, flags, args.ready_timeout)
    hz = os.sysconf("SC_CLK_TCK")
    runs, ok = [], True
    try:
        if engine_ticks(w.proc.pid) is None:
            print("note: no thread named %s in pid %d: engine share not measured"
                  % (ENGINE_THREAD, w.proc.pid), flush=True)
        for c in args.concurrency:
            out = os.path.join(args.workdir, "serve-c%d.json" % c)
            if os.path.exists(out):
                os.unlink(out)
            cmd = [args.bench, "--base-url", "http://127.0.0.1:%d" % w.port,
                   "--model", args.model, "--dataset", "random",
                   "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                   "--num-prompts", str(max(16, 2 * c)), "--max-concurrency", str(c),
                   "--percentiles", "50,99", "--seed", str(c), "--json", out]
            if w.served_name:
                cmd += ["--served-model-name", w.served_name]
            p0 = engine_phases(w.port)
            t0, e0 = time.monotonic(), engine_ticks(w.proc.pid)
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            wall, e1 = time.monotonic() - t0, engine_ticks(w.proc.pid)
            p1 = engine_phases(w.port)
            sys.stdout.write(r.stdout)
            share = None
            if e0 is not None and e1 is not None and wall > 0:
                share = (e1 - e0) / hz / wall
            phases = None
            if p0 is not None and p1 is not None and wall > 0:
                phases = {k: (v - p0.get(k, 0.0)) / wall for k, v in p1.items()}
            row = {"concurrency": c, "exit": r.returncode, "wall_s": wall,
                   "engine_core_share": share, "engine_phases": phases}
            try:
                with open(out) as f:
                    res = json.load(f)
                for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms",
                          "median_itl_ms", "p99_itl_ms", "completed"):
                    row[k] = res.get(k)
            except (OSError, ValueError) as e:
                row["error"] = "no --json results: %s" % e
            if r.returncode != 0 or "error" in row or row.get("output_throughput") is None:
                ok = False
            runs.append(row)
    finally:
        w.stop()
    doc = {"input_len": args.input_len, "output_len": args.output_len,
           "worker_args": args.worker_args, "runs": runs}
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(serve_table(doc), end="")
    return 0 if ok else 1


def fmt(v, spec):
    return "-" if v is None else spec % v


def serve_table(doc):
    lines = ["serving, one decode worker (%s), %d-token random prompts, %d output tokens:"
             % (doc["worker_args"] or "default device", doc["input_len"], doc["output_len"]),
             "  conc  out tok/s  TTFT p50 ms  TTFT p99 ms  ITL p50 ms  ITL p99 ms"
             "  engine thread, share of a core"]
    for r in doc["runs"]:
        lines.append("  %4d  %9s  %11s  %11s  %10s  %10s  %s" % (
            r["concurrency"], fmt(r.get("output_throughput"), "%.0f"),
            fmt(r.get("median_ttft_ms"), "%.1f"), fmt(r.get("p99_ttft_ms"), "%.1f"),
            fmt(r.get("median_itl_ms"), "%.2f"), fmt(r.get("p99_itl_ms"), "%.2f"),
            fmt(r.get("engine_core_share"), "%.2f") + ("  (%s)" % r["error"] if "error" in r
                                                       else "")))
        ph = r.get("engine_phases")
        if ph:
            lines.append("        engine thread's wall by phase: " + "  ".join(
                "%s %.2f" % (k, v) for k, v in sorted(ph.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines) + "\n"


def generate_ids(args, device, chunk, prompt):
    cmd = [args.generate, "--model", args.model, "--prompt-ids", ",".join(map(str, prompt)),
           "--max-tokens", str(args.max_tokens), "--ignore-eos", "--temperature", "0",
           "--chunk", str(chunk), "--device", device, "--json"]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        return None, "exit %d: %s" % (r.returncode, r.stderr.strip()[-300:])
    try:
        return json.loads(r.stdout)["ids"], None
    except (ValueError, KeyError, TypeError):
        return None, "no ids in: %r" % r.stdout[:200]


def ids(args):
    with open(os.path.join(args.model, "config.json")) as f:
        top = min(500, json.load(f)["vocab_size"])
    rnd = random.Random(25)
    rows, ok = [], True
    print("ids, --device cuda vs cpu, greedy, %d tokens out:" % args.max_tokens)
    for n in args.lengths:
        prompt = [rnd.randrange(3, top) for _ in range(n)]
        for chunk in args.chunks:
            cpu, e1 = generate_ids(args, "cpu", chunk, prompt)
            gpu, e2 = generate_ids(args, "cuda", chunk, prompt)
            same = cpu is not None and cpu == gpu
            ok = ok and same
            row = {"tokens": n, "chunk": chunk, "equal": same, "cpu": cpu, "cuda": gpu}
            if e1 or e2:
                row["error"] = "; ".join(e for e in (e1 and "cpu " + e, e2 and "cuda " + e) if e)
            rows.append(row)
            print("  %5d tokens, chunk %4d: %s%s" % (
                n, chunk, "equal" if same else "DIFFER",
                "" if same else "  cpu %s cuda %s %s" % (cpu and cpu[:6], gpu and gpu[:6],
                                                        row.get("error", ""))), flush=True)
    with open(args.json, "w") as f:
        json.dump({"max_tokens": args.max_tokens, "runs": rows}, f, indent=1)
    return 0 if ok else 1


def ints(s):
    return [int(x) for x in s.split(",") if x]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--decode", required=True)
    s.add_argument("--bench", required=True)
    s.add_argument("--model", required=True)
    s.add_argument("--workdir", required=True)
    s.add_argument("--json", required=True)
    s.add_argument("--concurrency", type=ints, default=[1, 64, 256])
    s.add_argument("--input-len", type=int, default=128)
    s.add_argument("--output-len", type=int, default=128)
    s.add_argument("--worker-args", default="--device cuda")
    s.add_argument("--ready-timeout", type=float, default=120.0)
    i = sub.add_parser("ids")
    i.add_argument("--generate", required=True)
    i.add_argument("--model", required=True)
    i.add_argument("--json", required=True)
    i.add_argument("--lengths", type=ints, default=[1000, 2048, 2049, 3000, 3500])
    i.add_argument("--chunks", type=ints, default=[256, 2048])
    i.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    if args.step == "serve":
        os.makedirs(args.workdir, exist_ok=True)
        return serve(args)
    return ids(args)


if __name__ == "__main__":
    sys.exit(main())
