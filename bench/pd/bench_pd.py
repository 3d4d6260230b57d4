# SPDX-License-Identifier: Apache-2.0
"""bench/pd: KV transfer time / prefill time on the Qwen2.5-0.5B-shaped model.

Starts one tandem-prefill, one tandem-decode and tandem-router (pd_mode always)
on loopback, sends prompts of random token ids of each size through the router
with max_tokens 2 and reads the x-tandem-phases header the router returns:
prefill_s (PrefillRequest sent -> PrefillResult received, as the decode worker
sees it) and transfer: the KV transfer the request waited for after the
PrefillResult (the push sends KV layer group by layer group while the prefill's
final chunk computes, so this is the part compute did not hide; with the
earlier pull protocol it was the whole transfer). kv_window_s is the decode
worker's tandem:kv_receive_seconds for the request (first KvData frame
imported -> last layer installed; under the pull protocol, KvPull sent -> last
layer installed). Prints one line per size with medians over --reps prompts
(goal for transfer/prefill <= 0.02), and TTFT through the router vs the decode
worker alone (local prefill) for the same prompt length (max_tokens 2: TTFT
plus one decode step).

  /usr/bin/python3 bench/pd/bench_pd.py --build build [--sizes 256,1024,4096]
      [--worker-args "--device cuda --kv-transfer cuda-ipc"] [--json FILE]

--worker-args adds flags to both workers (bench/gpu/check.sh runs the GPU
workers this way); --json writes the medians per size, with the KV bytes one
request moved, for tandem-gpu-report (bench/gpu/gpu_report.h).
"""
import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "integration-tests"))
import pd_harness as h  # noqa: E402


def phases(hdr):
    out = {}
    for part in hdr.get("x-tandem-phases", "").split(";"):
        k, _, v = part.strip().partition("=")
        out[k] = v
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--model", default="/tmp/tandem-bench-pd/qwen2.5-0.5b")
    ap.add_argument("--sizes", default="256,1024,4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--worker-args", default="", help="extra flags for both workers")
    ap.add_argument("--json", help="write the medians per size to this file")
    args = ap.parse_args()
    extra = shlex.split(args.worker_args)
    transport = "nng"
    for i, a in enumerate(extra):
        if a == "--kv-transfer" and i + 1 < len(extra):
            transport = extra[i + 1]
        elif a.startswith("--kv-transfer="):
            transport = a.split("=", 1)[1]
    b = args.build
    ns = argparse.Namespace(router=b + "/router/tandem-router", prefill=b + "/prefill/tandem-prefill",
                            decode=b + "/decode/tandem-decode",
                            mkmodel=b + "/tools/mkmodel/tandem-mkmodel",
                            workdir=os.path.dirname(args.model), deadline=3600)
    os.makedirs(ns.workdir, exist_ok=True)
    if not os.path.exists(os.path.join(args.model, "model.safetensors")):
        subprocess.run([ns.mkmodel, "--preset", "qwen2.5-0.5b", "--max-pos", "8192", "--out",
                        args.model], check=True, stdout=subprocess.DEVNULL)
    cl = h.Cluster(ns, n_prefill=1, n_decode=1, policy="round_robin", pd_mode="always",
                   model=args.model,
                   worker_args=["--threads", str(args.threads), "--kv-cache-memory", "2GiB",
                                "--max-num-batched-tokens", "4096",
                                "--no-enable-prefix-caching"] + extra)
    cl.start()
    rnd = random.Random(1)
    with open(os.path.join(args.model, "config.json")) as f:  # ids stay inside a small vocab
        top_id = min(150000, json.load(f)["vocab_size"] - 3)
    print("tokens  prefill_s  transfer_s  transfer/prefill  kv_window_s  ttft_direct_s  ttft_pd_s"
          "  kv_bytes", flush=True)
    window_name = "tandem:kv_receive_seconds_sum"
    bytes_name = "tandem:kv_transfer_bytes_total"
    # Over CUDA IPC the receive window is paced by the prefill's compute (each
    # group is copied as soon as it is final), so the copy bandwidth is taken
    # from the prefill worker's summed device copy time instead.
    copy_name = "tandem:kv_copy_seconds_total"
    points = []
    for n in [int(x) for x in args.sizes.split(",")]:
        b0 = h.metric_sum(h.metrics(cl.prefill[0].http_port), bytes_name)
        ratios, pre, tra, win, td, tp = [], [], [], [], [], []
        for r in range(args.reps):
            body = {"prompt": [rnd.randrange(3, top_id) for _ in range(n)], "max_tokens": 2,
                    "temperature": 0, "ignore_eos": True}
            w0 = h.metric_sum(h.metrics(cl.decode[0].http_port), window_name)
            c0 = h.metric_sum(h.metrics(cl.prefill[0].http_port), copy_name)
            t0 = time.time()
            st, hdr, _ = h.post(cl.router_port, "/v1/completions", body, timeout=3600)
            tp.append(time.time() - t0)
            if transport == "cuda-ipc":
                win.append(h.metric_sum(h.metrics(cl.prefill[0].http_port), copy_name) - c0)
            else:
                win.append(h.metric_sum(h.metrics(cl.decode[0].http_port), window_name) - w0)
            h.check(st == 200, "router status %d" % st)
            ph = phases(hdr)
            p, t = float(ph["prefill_s"]), float(ph["transfer_exposed"])
            pre.append(p)
            tra.append(t)
            ratios.append(t / p)
            body["prompt"] = [rnd.randrange(3, top_id) for _ in range(n)]
            t0 = time.time()
            st, _, _ = h.post(cl.decode[0].http_port, "/v1/completions", body, timeout=3600)
            td.append(time.time() - t0)
        m = h.metrics(cl.prefill[0].http_port)
        print("%6d  %9.3f  %10.4f  %16.4f  %11.4f  %13.3f  %9.3f  %d" % (
            n, statistics.median(pre), statistics.median(tra), statistics.median(ratios),
            statistics.median(win), statistics.median(td), statistics.median(tp),
            h.metric_sum(m, bytes_name)), flush=True)
        points.append({"tokens": n, "ttft_direct_s": statistics.median(td),
                       "ttft_pd_s": statistics.median(tp), "transfer_s": statistics.median(tra),
                       "prefill_s": statistics.median(pre),
                       "kv_window_s": statistics.median(win),
                       "kv_bytes": (h.metric_sum(m, bytes_name) - b0) / args.reps})
    print("goal: transfer/prefill <= 0.02")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"transport": transport, "reps": args.reps, "sizes": points}, f, indent=1)


if __name__ == "__main__":
    main()
