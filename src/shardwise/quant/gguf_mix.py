"""How llama.cpp stores each tensor of a GGUF file type (``Q4_K_M``, ``Q3_K_M``, ...), and the bytes that makes.

A GGUF "file type" is not one format: llama.cpp's quantizer (``llama_tensor_get_type`` in
``src/llama-quant.cpp``) picks a ggml type per tensor from its role, its layer and the model. For
``Q4_K_M`` most matrices are ``Q4_K`` (4.5 bits), but ``attn_v`` and ``ffn_down`` of the first and
last eighth of the layers and every third layer between are ``Q6_K`` (6.5625 bits), the LM head
(``output``) is ``Q6_K``, a tied embedding takes the LM head's type, the router (``ffn_gate_inp``),
the norms and every other vector stay ``F32``, and a matrix whose rows are not whole blocks
falls back to a 32-wide type. ``tensor_types`` applies those rules to a ``ModelSpec``'s tensors
and ``group_bits`` turns them into the bits per weight per tensor group the planner prices, so a
GGUF's bytes come out as llama.cpp writes them (``tests/test_gguf_mix.py`` holds them equal,
tensor for tensor, to files written by llama.cpp's own quantizer).

Source of the rules: ggml-org/llama.cpp ``src/llama-quant.cpp`` (``llama_tensor_get_type_impl``,
``tensor_type_fallback``, ``llama_ftype_get_default_type``, ``tensor_allows_quantization``), read at
commit 007dbbf3 (2026); block sizes: ``ggml/src/ggml-common.h``. What this module leaves out:
importance-matrix-only types (IQ*), Falcon's own rules, and the MLA ``attn_kv_b`` tensor, which
current converters split into ``attn_k_b`` / ``attn_v_b`` (neither is ``attn_v``-like, so both take
the default type; older files with one ``attn_kv_b`` quantize it as ``attn_v``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from shardwise.errors import unknown_name
from shardwise.spec.tensors import NORM, ROUTER, TENSOR_GROUPS, TensorSpec, unpacked_key

if TYPE_CHECKING:
    from shardwise.spec.model import ModelSpec

GGML_TYPES: dict[str, tuple[int, int]] = {
    # type: (weights per block, bytes per block) — ggml/src/ggml-common.h (block_q4_0 ... block_q6_K),
    # the same table as the gguf package's GGML_QUANT_SIZES
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "IQ4_NL": (32, 18), "MXFP4": (32, 17),
}
"""Storage of each ggml tensor type llama.cpp's mixes use."""

FTYPE_DEFAULT = {
    # file type: the type every quantizable tensor starts from (llama_ftype_get_default_type)
    "F16": "F16", "BF16": "BF16", "Q4_0": "Q4_0", "Q8_0": "Q8_0",
    "Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K",
    "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
    "MXFP4_MOE": "MXFP4",
}
"""The GGUF file types (llama-quantize's names) this module prices."""

_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
"""A K-quant for a matrix whose rows are not whole 256-weight blocks becomes this 32-wide type
(tensor_type_fallback; older llama.cpp used IQ4_NL for Q2_K / Q3_K: the same 18 bytes per 32)."""

_CATEGORY = {  # checkpoint projection name -> llama.cpp's tensor category (its GGUF name's role)
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
    "qkv_proj": "attn_qkv", "gate_proj": "ffn_gate", "w1": "ffn_gate", "up_proj": "ffn_up", "w3": "ffn_up",
    "gate_up_proj": "ffn_up", "down_proj": "ffn_down", "w2": "ffn_down",
}
_SEVENTY_B = ("llama", "mistral", "qwen2")
"""Families whose 80-layer models llama.cpp types LLM_TYPE_70B (attn_v gets Q5_K for Q3_K / Q4_K)."""


def bits(ggml_type: str) -> float:
    """Stored bits per weight of a ggml type, block scales included."""
    per_block, nbytes = GGML_TYPES[ggml_type]
    return nbytes * 8 / per_block


def check_ftype(ftype: str) -> str:
    """``ftype`` upper-cased, or ShardwiseError naming the known file types."""
    key = ftype.upper()
    if key not in FTYPE_DEFAULT:
        raise unknown_name("GGUF file type", ftype, FTYPE_DEFAULT)
    return key


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _category(t: TensorSpec, tied: bool) -> str | None:
    """llama.cpp's category of a quantizable tensor, or None for one it keeps in F32 (vectors,
    biases, the router, convolutions)."""
    if not t.is_matmul or t.keep_float32 or t.group in (ROUTER, NORM) or "conv1d" in t.name:
        return None
    if t.name.endswith("embed_tokens.weight"):
        return "output" if tied else "token_embd"
    if t.name.startswith("lm_head"):
        return "output"
    proj = t.name.removesuffix(".weight").rsplit(".", 1)[-1]
    return _CATEGORY.get(proj, "other")


def _pick(ftype: str, cat: str, layer: int, n_layers: int, i_wv: int, n_wv: int, model: ModelSpec) -> str:
    """llama_tensor_get_type_impl for the K-quant / legacy file types, before the shape fallback."""
    default = FTYPE_DEFAULT[ftype]
    n_expert = model.moe.num_experts if model.moe is not None else 0
    gqa = model.num_heads // max(model.num_kv_heads, 1)
    if cat == "output":
        return "Q8_0" if ftype == "MXFP4_MOE" or default == "Q8_0" else "Q6_K"
    if ftype == "MXFP4_MOE":
        return default if cat.startswith("ffn") and "experts" in cat else "Q8_0"
    if cat in ("attn_v", "attn_qkv"):
        new = default
        if ftype == "Q2_K":
            new = "Q4_K" if gqa >= 4 else "Q3_K"
        elif ftype == "Q3_K_M":
            new = "Q5_K" if i_wv < 2 else "Q4_K"
        elif ftype == "Q3_K_L":
            new = "Q5_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i_wv, n_wv):
            new = "Q6_K"
        elif ftype == "Q4_K_S" and i_wv < 4:
            new = "Q5_K"
        if model.family in _SEVENTY_B and n_layers == 80 and new in ("Q3_K", "Q4_K"):
            new = "Q5_K"
        return "Q8_0" if n_expert == 8 else new
    if cat == "attn_k":
        return "Q8_0" if n_expert == 8 else default
    if cat.startswith("ffn_down"):
        if ftype == "Q2_K":
            return "Q3_K"
        if ftype == "Q3_K_M":
            return "Q5_K" if layer < n_layers // 16 else "Q4_K"
        if ftype == "Q3_K_L":
            return "Q5_K"
        if ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(layer, n_layers):
            return "Q6_K"
        if ftype == "Q4_K_S" and layer < n_layers // 8:
            return "Q5_K"
        return default
    if cat == "attn_output":
        if n_expert == 8:
            return "Q5_K" if ftype in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M") else default
        return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(ftype, default)
    return default


def _fallback(ggml_type: str, ncols: int) -> str:
    """tensor_type_fallback: a type whose blocks do not tile a row becomes a 32-wide one, else F16."""
    if ncols % GGML_TYPES[ggml_type][0] == 0:
        return ggml_type
    new = _FALLBACK.get(ggml_type, ggml_type)
    return new if ncols % GGML_TYPES[new][0] == 0 else "F16"


def tensor_types(model: ModelSpec, ftype: str) -> Iterator[tuple[TensorSpec, int | None, str]]:
    """(tensor, layer index or None for a global, ggml type) for every tensor of ``model`` in a GGUF
    of file type ``ftype``, as llama.cpp's quantizer types them from an F16 / BF16 conversion
    (the converter keeps vectors, routers and convolutions in F32)."""
    ftype = check_ftype(ftype)
    default = FTYPE_DEFAULT[ftype]
    tied = not any(t.name.startswith("lm_head") for t in model.globals)
    quantized = default not in ("F16", "BF16")
    n_wv = sum(1 for layer in model.layers for t in layer.tensors if _category(t, tied) in ("attn_v", "attn_qkv"))
    i_wv = 0
    placed = [(t, None) for t in model.globals if t.name.endswith("embed_tokens.weight")]
    placed += [(t, layer.index) for layer in model.layers for t in layer.tensors]
    placed += [(t, None) for t in model.globals if not t.name.endswith("embed_tokens.weight")]
    for t, layer in placed:
        cat = _category(t, tied)
        if cat is None:
            yield t, layer, "F32"
            continue
        if not quantized:
            yield t, layer, default
            continue
        if t.is_routed and ftype == "MXFP4_MOE":
            cat = cat + "_experts"
        if cat == "output" and t.shape[-1] % GGML_TYPES[default][0]:
            new = "Q8_0"
        else:
            new = _pick(ftype, cat, layer or 0, model.num_layers, i_wv, n_wv, model)
        if cat in ("attn_v", "attn_qkv"):
            i_wv += 1
        yield t, layer, _fallback(new, t.shape[-1])


def group_bits(model: ModelSpec, ftype: str) -> dict[str, float]:
    """Bits per weight per tensor group (and per group's vectors, ``unpacked_key``) of ``model`` in a
    GGUF of file type ``ftype``: each group's stored bits over its elements, so
    ``model.weight_bytes(group_bits(model, ftype))`` is the file's tensor bytes."""
    stored = dict.fromkeys(TENSOR_GROUPS, 0.0)
    count = dict.fromkeys(TENSOR_GROUPS, 0)
    for t, _, ggml_type in tensor_types(model, ftype):
        if t.is_matmul and not t.keep_float32:
            stored[t.group] += t.total_numel * bits(ggml_type)
            count[t.group] += t.total_numel
    out = {g: stored[g] / count[g] if count[g] else bits("F32") for g in TENSOR_GROUPS}
    out.update({unpacked_key(g): bits("F32") for g in TENSOR_GROUPS})
    return out


_CACHE: dict[tuple[int, str], tuple[ModelSpec, dict[str, float]]] = {}


def cached_group_bits(model: ModelSpec, ftype: str) -> dict[str, float]:
    """``group_bits`` computed once per model object and file type (the planner prices a model's
    layouts many times over)."""
    key = (id(model), check_ftype(ftype))
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not model:
        hit = _CACHE[key] = (model, group_bits(model, ftype))
    return dict(hit[1])
