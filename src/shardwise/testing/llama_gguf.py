"""A Hugging Face llama checkpoint (``LlamaForCausalLM``, byte-level BPE ``tokenizer.json``) written
as a GGUF file that llama.cpp loads, for tests that run llama.cpp's server on a tiny checkpoint.

It writes what llama.cpp's own converter (``convert_hf_to_gguf.py``, llama-cpp-python 0.3.36's
``vendor/llama.cpp``) writes for such a checkpoint, through the ``gguf`` package's ``GGUFWriter``:

- ``llama.*`` hyper-parameters (context, widths, heads, RMS epsilon, rope base and dimension, vocab);
- tensors under llama.cpp's names (``token_embd``, ``blk.N.attn_q`` ..., ``output_norm``, ``output``;
  no ``output`` for tied embeddings, as the converter, which writes only the tensors the checkpoint has),
  with the rows of ``q_proj`` / ``k_proj`` permuted from Hugging Face's half-split rotary layout to
  llama.cpp's interleaved pairs (the converter's ``LlamaModel.permute``), and for ``rope_type``
  "llama3" the ``rope_freqs`` factors tensor it computes;
- the tokenizer as ``tokenizer.ggml.model`` "gpt2": every id's token string (``[PADn]`` for ids the
  tokenizer lacks), its type (special added tokens CONTROL), the merges, BOS/EOS/PAD ids,
  ``add_bos_token`` / ``add_eos_token`` and the chat template. ``tokenizer.ggml.pre`` is "gpt-2":
  the converter picks the pre-tokenizer by hashing the tokenizer's output on a check text, and a
  tokenizer trained here is in none of its lists, but a ``ByteLevel`` pre-tokenizer with
  ``use_regex`` splits with GPT-2's regex, which is llama.cpp's "gpt-2".

Checked against that converter on ``make_checkpoint("llama-3.1-8b", "tiny", ...)``: the same
tensors bit for bit and the same metadata (the converter run with only the pre-tokenizer name
given, as above); ``tests/test_bench_url_llama_cpp.py`` holds llama.cpp's logits against
transformers' on the same checkpoint.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from shardwise.errors import ShardwiseError

OUTTYPES = ("f32", "f16")

_NAMES = {  # Hugging Face name (layer part after "model.layers.N.") -> llama.cpp name (after "blk.N.")
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q/k projection from Hugging Face's rotary layout (each head's first half, then its
    second) to llama.cpp's (pairs interleaved): llama.cpp's ``LlamaModel.permute``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict, theta: float, dim: int) -> np.ndarray:
    """The per-frequency divisors of llama3 rope scaling, as the converter writes ``rope_freqs``."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _vocab(folder: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE ``tokenizer.json``."""
    from gguf import TokenType

    tok = json.loads((folder / "tokenizer.json").read_text())
    model = tok.get("model") or {}
    pre = tok.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise ShardwiseError(f"{folder}/tokenizer.json is not a byte-level BPE tokenizer with GPT-2's regex")
    by_id = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    by_id.update({i: a["content"] for i, a in added.items()})
    if max(by_id) >= vocab_size:
        raise ShardwiseError(f"{folder}: token id {max(by_id)} is past vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(TokenType.NORMAL if i not in added else
                         TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, [int(t) for t in types], merges


def write_llama_gguf(checkpoint: str | Path, out: str | Path, outtype: str = "f32") -> Path:
    """Write ``checkpoint`` (a folder: config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json) as the GGUF file ``out``; ``outtype`` "f16" stores matrices in half
    precision (vectors stay F32, as the converter keeps them). Returns ``out``."""
    import gguf
    from safetensors.numpy import load_file

    folder, out = Path(checkpoint), Path(out)
    if outtype not in OUTTYPES:
        raise ShardwiseError(f"outtype '{outtype}' is unknown: use {' or '.join(OUTTYPES)}")
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("architectures") != ["LlamaForCausalLM"]:
        raise ShardwiseError(f"{folder} is not a LlamaForCausalLM checkpoint: {cfg.get('architectures')}")
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    theta = float(cfg.get("rope_theta", 10000.0))
    rope = cfg.get("rope_scaling") or {}

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_type("model")
    w.add_name(folder.name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if outtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(head_dim)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tokens, types, merges = _vocab(folder, cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("pad_token_id", w.add_pad_token_id)):
        if isinstance(cfg.get(key), int):
            add(cfg[key])
    for key, add in (("add_bos_token", w.add_add_bos_token), ("add_eos_token", w.add_add_eos_token)):
        if isinstance(tok_cfg.get(key), bool):
            add(tok_cfg[key])
    if tok_cfg.get("chat_template"):
        w.add_chat_template(tok_cfg["chat_template"])

    def put(name: str, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data, dtype=np.float16 if outtype == "f16" and data.ndim > 1 else np.float32)
        w.add_tensor(name, data)

    if rope.get("rope_type", "").lower() == "llama3":
        put("rope_freqs.weight", llama3_rope_factors(rope, theta, head_dim))
    elif rope:
        raise ShardwiseError(f"{folder}: rope_scaling {rope.get('rope_type')!r} is not written by this helper")
    tensors = load_file(str(folder / "model.safetensors"))  # tied: no lm_head, no ``output`` (llama.cpp reuses token_embd)
    for name, data in tensors.items():
        if name in _TOP:
            put(_TOP[name], data)
            continue
        parts = name.split(".", 3)
        if parts[:2] != ["model", "layers"] or parts[3] not in _NAMES:
            raise ShardwiseError(f"{folder}: tensor {name} has no llama.cpp name here")
        if parts[3] == "self_attn.q_proj.weight":
            data = permute(data, n_head)
        elif parts[3] == "self_attn.k_proj.weight":
            data = permute(data, n_kv)
        put(f"blk.{parts[2]}.{_NAMES[parts[3]]}", data)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
