#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Independent NumPy reference for Qwen2 / Llama decoder-only models.

Written from the architecture as Hugging Face transformers defines it
(Qwen2ForCausalLM, LlamaForCausalLM), not from Tandem's C code:

  h = embed_tokens[ids]
  per layer:  a = RMSNorm(h) ; q, k, v = a Wq^T (+bq), a Wk^T (+bk), a Wv^T (+bv)
              q, k = RoPE(q), RoPE(k)       (rotate-half form, HF's apply_rotary_pos_emb)
              o = softmax(q k^T / sqrt(d) + causal mask) v   (GQA: head h uses kv head
                                                             h // (n_heads / n_kv_heads))
              h = h + o Wo^T
              m = RMSNorm(h) ; h = h + (silu(m Wg^T) * (m Wu^T)) Wd^T
  logits = RMSNorm(h) W_head^T   (W_head = embed_tokens when tie_word_embeddings)

RMSNorm(x) = w * x / sqrt(mean(x^2) + eps). RoPE inverse frequencies are
theta^(-2i/d), with rope_scaling {"rope_type": "llama3"} applied as in
transformers' _compute_llama3_parameters (long wavelengths divided by factor,
a smooth interpolation between low_freq_wavelen and high_freq_wavelen).

It reads config.json and the safetensors file(s) itself: an 8-byte
little-endian header length, a JSON header, then raw tensors; BF16 becomes
F32 by shifting the 16 bits into the top half of a uint32.

Precision: everything is computed in float32 from the checkpoint's exact
values. With --bf16-acts the inputs of every matmul (activations) are rounded
to bf16 first (round to nearest even), to mirror an engine whose dot products
take bf16 inputs; with --bf16-kv the keys (after RoPE) and values are rounded
to bf16 (nearest even) before attention, as a bf16 KV cache stores them; the
default (both off) is plain float32, which is what Tandem's
CPU engine does (bf16 weights widened to f32, f32 activations and f32
accumulation), see docs/engine.md.

Usage as a tool:
  qwen2_ref.py --model DIR --prompt-ids 1,2,3 --max-tokens 16 [--json]
prints the greedy continuation (full recompute every step: slow but simple).
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np


# ---- files -------------------------------------------------------------------------------

def _decode(raw, dtype, shape):
    if dtype == "F32":
        a = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    elif dtype == "F16":
        a = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    elif dtype == "BF16":
        u16 = np.frombuffer(raw, dtype="<u2").astype(np.uint32)
        a = (u16 << 16).view(np.float32)
    else:
        raise ValueError("unsupported safetensors dtype %s" % dtype)
    return a.reshape(shape)


def load_safetensors_file(path):
    with open(path, "rb") as f:
        data = f.read()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + hlen].decode("utf-8"))
    base = 8 + hlen
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = _decode(data[base + start:base + end], info["dtype"], info["shape"])
    return out


def load_weights(model_dir):
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return load_safetensors_file(single)
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_safetensors_file(os.path.join(model_dir, shard)))
    return tensors


# ---- math --------------------------------------------------------------------------------

def round_bf16(x):
    """float32 -> nearest bf16 (ties to even), returned as float32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    r = ((u + rounding) & np.uint32(0xFFFF0000)).astype(np.uint32)
    return r.view(np.float32)


def rms_norm(x, w, eps):
    var = np.mean(x.astype(np.float32) ** 2, axis=-1, keepdims=True)
    return (x / np.sqrt(var + eps)).astype(np.float32) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


def inv_freq(cfg, head_dim):
    theta = float(cfg.get("rope_theta", 10000.0))
    f = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    rs = cfg.get("rope_scaling") or {}
    rtype = rs.get("rope_type", rs.get("type", "default"))
    if rtype == "llama3":
        factor = rs["factor"]
        low, high = rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        low_wavelen = old / low
        high_wavelen = old / high
        wavelen = 2 * math.pi / f
        scaled = np.where(wavelen > low_wavelen, f / factor, f)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        f = np.where(medium, smoothed, scaled)
    elif rtype not in ("default", None):
        raise ValueError("unsupported rope scaling %s" % rtype)
    return f.astype(np.float32)


def rope(x, pos, freqs):
    # x: [T, heads, d]; rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
    ang = pos[:, None].astype(np.float32) * freqs[None, :]          # [T, d/2]
    cos = np.cos(np.concatenate([ang, ang], axis=-1))[:, None, :]   # [T, 1, d]
    sin = np.sin(np.concatenate([ang, ang], axis=-1))[:, None, :]
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rot * sin).astype(np.float32)


# ---- model -------------------------------------------------------------------------------

class Model:
    def __init__(self, model_dir, bf16_acts=False, bf16_kv=False):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = cfg = json.load(f)
        arch = cfg["architectures"][0]
        if arch not in ("Qwen2ForCausalLM", "LlamaForCausalLM"):
            raise ValueError("unsupported architecture %s" % arch)
        self.w = load_weights(model_dir)
        self.hidden = cfg["hidden_size"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg.get("num_key_value_heads") or self.n_heads
        self.head_dim = cfg.get("head_dim") or self.hidden // self.n_heads
        self.n_layers = cfg["num_hidden_layers"]
        self.eps = float(cfg["rms_norm_eps"])
        self.bias = arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
        self.freqs = inv_freq(cfg, self.head_dim)
        self.bf16_acts = bf16_acts
        self.bf16_kv = bf16_kv  # K (after RoPE) and V rounded to bf16, as a bf16 KV cache holds
        if cfg.get("tie_word_embeddings", False):
            self.head = self.w["model.embed_tokens.weight"]
        else:
            self.head = self.w["lm_head.weight"]

    def _mm(self, x, name_or_w, bias=None):
        w = self.w[name_or_w] if isinstance(name_or_w, str) else name_or_w
        if self.bf16_acts:
            x = round_bf16(x)
        y = x @ w.T
        if bias is not None:
            y = y + bias
        return y.astype(np.float32)

    def forward(self, ids):
        """Logits [T, vocab] for every position of ids (causal, no cache)."""
        ids = np.asarray(ids, dtype=np.int64)
        T = len(ids)
        pos = np.arange(T)
        h = self.w["model.embed_tokens.weight"][ids].astype(np.float32)
        mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), k=1)
        group = self.n_heads // self.n_kv
        d = self.head_dim
        for l in range(self.n_layers):
            p = "model.layers.%d." % l
            a = rms_norm(h, self.w[p + "input_layernorm.weight"], self.eps)
            bq = self.w[p + "self_attn.q_proj.bias"] if self.bias else None
            bk = self.w[p + "self_attn.k_proj.bias"] if self.bias else None
            bv = self.w[p + "self_attn.v_proj.bias"] if self.bias else None
            q = self._mm(a, p + "self_attn.q_proj.weight", bq).reshape(T, self.n_heads, d)
            k = self._mm(a, p + "self_attn.k_proj.weight", bk).reshape(T, self.n_kv, d)
            v = self._mm(a, p + "self_attn.v_proj.weight", bv).reshape(T, self.n_kv, d)
            q = rope(q, pos, self.freqs)
            k = rope(k, pos, self.freqs)
            if self.bf16_kv:
                k, v = round_bf16(k), round_bf16(v)
            o = np.empty((T, self.n_heads, d), dtype=np.float32)
            for hh in range(self.n_heads):
                kv = hh // group
                s = (q[:, hh, :] @ k[:, kv, :].T) / np.float32(math.sqrt(d)) + mask
                s = s - s.max(axis=-1, keepdims=True)
                e = np.exp(s)
                o[:, hh, :] = (e / e.sum(axis=-1, keepdims=True)) @ v[:, kv, :]
            h = h + self._mm(o.reshape(T, self.n_heads * d), p + "self_attn.o_proj.weight")
            m = rms_norm(h, self.w[p + "post_attention_layernorm.weight"], self.eps)
            g = self._mm(m, p + "mlp.gate_proj.weight")
            u = self._mm(m, p + "mlp.up_proj.weight")
            h = h + self._mm((silu(g) * u).astype(np.float32), p + "mlp.down_proj.weight")
        h = rms_norm(h, self.w["model.norm.weight"], self.eps)
        return self._mm(h, self.head)

    def greedy(self, prompt, n):
        ids = list(prompt)
        out, logits = [], []
        for _ in range(n):
            row = self.forward(ids)[-1]
            t = int(np.argmax(row))
            out.append(t)
            logits.append(row)
            ids.append(t)
        return out, np.stack(logits)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--bf16-acts", action="store_true")
    ap.add_argument("--bf16-kv", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = Model(args.model, bf16_acts=args.bf16_acts, bf16_kv=args.bf16_kv)
    prompt = [int(x) for x in args.prompt_ids.split(",") if x]
    ids, _ = m.greedy(prompt, args.max_tokens)
    if args.json:
        print(json.dumps({"prompt_ids": prompt, "ids": ids}))
    else:
        print(",".join(str(i) for i in ids))


if __name__ == "__main__":
    sys.exit(main())
