# SPDX-License-Identifier: Apache-2.0
"""The KV cache dtype on the P/D wire (--kv-cache-dtype, docs/pd-protocol.md).

For each pair (prefill worker's dtype, decode worker's dtype) a fresh cluster
(router + 1 prefill + 1 decode) serves one greedy request of a 100-token
prompt through the router and the same request straight to the decode worker:
  * the transfer moves exactly the prompt's 7 blocks of every layer in the
    decode worker's dtype (the dtype its kv header asks for; the prefill worker
    converts when its own pool differs): bytes sent == bytes received ==
    layers x 2 (K, V) x kv_heads x head_dim x 16 tokens x 7 blocks x 2 (bf16)
    or 4 (f32), so bf16 moves half of f32;
  * a pair of the same dtype gives exactly the decode worker's own tokens
    (disaggregated == direct, as pd_equivalence checks for the default);
  * a mixed pair serves the request (converted on the prefill side); its tokens
    are printed, not compared: the prompt's KV then went through the other
    dtype's rounding.
Also: the decode worker's metric vllm:cache_config_info names its cache_dtype."""
import json
import os

from pd_harness import Cluster, check, make_model, metric_sum, metrics, parse_args, post


def elem(dtype):
    return 2 if dtype == "bf16" else 4


def main():
    args = parse_args()
    model = make_model(args)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    layers = cfg["num_hidden_layers"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    prompt = [(i * 37) % 400 + 3 for i in range(100)]
    blocks = (len(prompt) + 15) // 16
    body = dict(prompt=prompt, max_tokens=8, ignore_eos=True, temperature=0,
                return_token_ids=True)
    moved = {}
    for pd, dd in (("bf16", "bf16"), ("f32", "f32"), ("f32", "bf16"), ("bf16", "f32")):
        cl = Cluster(args, n_prefill=1, n_decode=1, policy="round_robin", pd_mode="always",
                     model=model, prefill_args=["--kv-cache-dtype", pd],
                     decode_args=["--kv-cache-dtype", dd]).start()
        st, hdr, routed = post(cl.router_port, "/v1/completions", body)
        check(st == 200, "%s->%s: router status %d: %s" % (pd, dd, st, routed))
        check("prefill=tcp://" in hdr.get("x-tandem-phases", ""),
              "%s->%s: not prefilled remotely" % (pd, dd))
        st, _, direct = post(cl.decode[0].http_port, "/v1/completions", body)
        check(st == 200, "%s->%s: direct status %d" % (pd, dd, st))
        a, b = routed["choices"][0]["token_ids"], direct["choices"][0]["token_ids"]
        if pd == dd:
            check(a == b, "%s: disaggregated %s != direct %s" % (pd, a, b))
        else:
            print("%s->%s: disaggregated %s, direct %s (%s)"
                  % (pd, dd, a, b, "equal" if a == b else "differ"))
        sent = metric_sum(metrics(cl.prefill[0].http_port), "tandem:kv_transfer_bytes_total")
        dm = metrics(cl.decode[0].http_port)
        recv = metric_sum(dm, "tandem:kv_received_bytes_total")
        want = layers * 2 * kv_heads * head_dim * 16 * blocks * elem(dd)
        check(sent == want and recv == want,
              "%s->%s: bytes sent %s received %s, expected %d" % (pd, dd, sent, recv, want))
        check(any(k.startswith("vllm:cache_config_info") and 'cache_dtype="%s"' % dd in k
                  for k in dm),
              "%s->%s: vllm:cache_config_info lacks cache_dtype=\"%s\"" % (pd, dd, dd))
        moved[(pd, dd)] = sent
        cl.wait_kv_free()
        cl.stop()
    check(moved[("bf16", "bf16")] * 2 == moved[("f32", "f32")], "bf16 does not halve the bytes")
    print("PASS: KV bytes per pair %s" % {"%s->%s" % k: int(v) for k, v in moved.items()})


if __name__ == "__main__":
    main()
