#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Write a bf16 GGUF of a Qwen2 model in Hugging Face layout, for llama.cpp.

bench/peer/llamacpp.sh runs llama.cpp on the model Tandem benchmarks. llama.cpp's
own convert_hf_to_gguf.py imports torch and transformers, which this project's
machines do not have (Debian's python3 and python3-numpy only), so this script does
the part of it a Qwen2ForCausalLM needs with numpy alone. It writes through
llama.cpp's gguf-py package, loaded at run time from the llama.cpp source folder
given with --llama-src (never copied here), and it follows what that converter
writes for Qwen2: arch qwen2, gguf-py's tensor name map, the hparams of
TextModel.set_gguf_parameters, a gpt2-style BPE vocabulary (tokens, token types,
pre-tokenizer "qwen2") and gguf-py's SpecialVocab for merges, bos/eos/padding ids
and the chat template. Matrices stay bf16 (or f16/f32 as stored); 1-D tensors
(norms, biases) are written f32, as the converter does. Q8_0 is llama-quantize's
job (llamacpp.sh).

Usage: hf_to_gguf.py --llama-src DIR MODEL_DIR OUT.gguf
Exit status: 0 written, 1 on any error (one line on stderr).
"""

import argparse
import json
import struct
import sys
from pathlib import Path

# safetensors dtype -> (numpy dtype of the stored bits, GGML type name)
SAFETENSORS_DTYPES = {
    "BF16": ("<u2", "BF16"),
    "F16": ("<f2", "F16"),
    "F32": ("<f4", "F32"),
}


def fail(msg):
    print(f"hf_to_gguf.py: {msg}", file=sys.stderr)
    sys.exit(1)


def load_gguf_py(llama_src):
    """Imports llama.cpp's gguf-py from the source folder; returns the module."""
    pkg = Path(llama_src) / "gguf-py"
    if not (pkg / "gguf" / "__init__.py").is_file():
        fail(f"{pkg}/gguf not found: --llama-src must be a llama.cpp source folder")
    sys.path.insert(0, str(pkg))
    import gguf  # noqa: E402  (only importable once the path is set)

    return gguf


def safetensors_files(model_dir):
    """The checkpoint's files: model.safetensors or the shards its index names."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if not single.is_file():
        fail(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    return [single]


def read_safetensors(path, np):
    """Yields (name, array) for each tensor of one file, memory-mapped, in file order.

    A bf16 tensor comes back as its uint16 bits; f16 and f32 as themselves."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data_start = 8 + header_len
    entries = [(k, v) for k, v in header.items() if k != "__metadata__"]
    entries.sort(key=lambda kv: kv[1]["data_offsets"][0])
    for name, info in entries:
        if info["dtype"] not in SAFETENSORS_DTYPES:
            fail(f"{path}: {name}: dtype {info['dtype']} not handled (BF16, F16, F32)")
        np_dtype, _ = SAFETENSORS_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        count = (end - begin) // np.dtype(np_dtype).itemsize
        arr = np.memmap(path, dtype=np_dtype, mode="r", offset=data_start + begin, shape=(count,))
        yield name, info["dtype"], arr.reshape(info["shape"])


def to_f32(arr, st_dtype, np):
    """A tensor's values as float32 (bf16 bits widened by 16 zero bits)."""
    if st_dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def write_hparams(gguf, w, cfg, name):
    """The keys TextModel.set_gguf_parameters writes for a Qwen2 without rope scaling."""
    w.add_name(name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    if cfg.get("rope_scaling"):
        fail("config.json: rope_scaling is set; this converter writes unscaled RoPE only")


def write_vocab(gguf, w, model_dir, vocab_size):
    """gpt2-style BPE vocabulary from tokenizer.json, as _set_vocab_gpt2 writes it."""
    with open(model_dir / "tokenizer.json", encoding="utf-8") as f:
        tok = json.load(f)
    if tok["model"]["type"] != "BPE":
        fail(f"tokenizer.json: model type {tok['model']['type']}, expected BPE")
    reverse = {i: t for t, i in tok["model"]["vocab"].items()}
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    for i, a in added.items():
        reverse[i] = a["content"]
    if max(reverse) >= vocab_size:
        fail(f"tokenizer.json: token id {max(reverse)} >= config.json vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(reverse[i])
            types.append(
                gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED
            )
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    # merges, bos/eos/pad ids (tokenizer_config.json, then config.json), add_bos_token and
    # the chat template: llama.cpp's own reader of those files.
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size).add_to_gguf(w, quiet=True)


def write_tensors(gguf, w, model_dir, cfg, np):
    """Every checkpoint tensor under its GGUF name; returns how many were written."""
    n_layers = cfg["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, n_layers)
    tied = cfg.get("tie_word_embeddings", False)
    written = 0
    for path in safetensors_files(model_dir):
        for hf_name, st_dtype, arr in read_safetensors(path, np):
            if hf_name.endswith(".rotary_emb.inv_freq"):
                continue
            if tied and hf_name == "lm_head.weight":
                continue  # llama.cpp reads the output matrix from token_embd when absent
            name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is None:
                fail(f"{path.name}: {hf_name}: no qwen2 GGUF name for this tensor")
            if arr.ndim <= 1:
                w.add_tensor(name, np.ascontiguousarray(to_f32(arr, st_dtype, np)))
            else:
                _, ggml_type = SAFETENSORS_DTYPES[st_dtype]
                w.add_tensor(name, arr, raw_dtype=gguf.GGMLQuantizationType[ggml_type])
            written += 1
    return written


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-src", required=True, help="llama.cpp source folder (its gguf-py)")
    ap.add_argument("model_dir", type=Path, help="Qwen2 model in Hugging Face layout")
    ap.add_argument("out", type=Path, help="GGUF file written")
    args = ap.parse_args()

    import numpy as np

    gguf = load_gguf_py(args.llama_src)
    try:
        with open(args.model_dir / "config.json", encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{args.model_dir}/config.json: {e}")
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch != "Qwen2ForCausalLM":
        fail(f"config.json: architectures {arch}; this converter writes Qwen2ForCausalLM only")

    w = gguf.GGUFWriter(args.out, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2])
    write_hparams(gguf, w, cfg, args.model_dir.name)
    write_vocab(gguf, w, args.model_dir, cfg["vocab_size"])
    n = write_tensors(gguf, w, args.model_dir, cfg, np)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"hf_to_gguf.py: wrote {args.out} ({n} tensors, bf16 matrices)")


if __name__ == "__main__":
    main()
