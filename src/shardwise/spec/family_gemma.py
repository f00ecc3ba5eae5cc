"""Google Gemma 2 and Gemma 3 (``model_type`` gemma2, gemma3_text, and gemma3: the vision-language
wrapper, read through its ``text_config``; the vision tower is not counted).

Shapes follow transformers' ``modeling_gemma2.py`` / ``modeling_gemma3.py``: every layer is GQA
attention (q/k/v/o, biases only with ``attention_bias``; Gemma 3 adds an RMSNorm over ``head_dim``
on q and on k) and a gated GELU MLP (gate/up/down, the SwiGLU shapes), with four norms of the
hidden width: pre- and post-attention, pre- and post-feedforward. The input embedding is tied to
the LM head unless ``tie_word_embeddings`` is false.

Layers alternate sliding-window and full attention: ``layer_types`` ("sliding_attention" /
"full_attention") when the config gives it, else transformers' default: Gemma 2 slides every
even layer; Gemma 3 makes every ``sliding_window_pattern``-th layer (default 6) full. Sliding
layers are the planner's "sliding" mixer, whose KV cache is capped at ``sliding_window`` tokens.

Fields a config leaves out take the defaults of transformers' ``Gemma2Config`` /
``Gemma3TextConfig`` (gemma-3-4b-it's ``text_config`` gives only the hidden and MLP widths, the
layer count and the window), written into the config the ModelSpec keeps, as transformers reads
them. Checkpoint names: ``model.`` for the text-only models, ``language_model.model.`` for the
gemma3 wrapper (its published safetensors).
"""

from __future__ import annotations

from typing import Any

from shardwise.errors import ShardwiseError, shown
from shardwise.spec.config_fields import Config, check_fields
from shardwise.spec.mixers import gqa_tensors
from shardwise.spec.model import LayerSpec
from shardwise.spec.tensors import DENSE_MLP, norm, swiglu

# transformers' config-class defaults for the fields the builder and the parser read
_COMMON = dict(head_dim=256, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
               num_key_value_heads=4, rms_norm_eps=1e-6, sliding_window=4096, tie_word_embeddings=True)
DEFAULTS = {
    "gemma2": dict(_COMMON, vocab_size=256000, max_position_embeddings=8192),
    "gemma3": dict(_COMMON, vocab_size=262208, max_position_embeddings=131072),
}
LAYER_KINDS = {"sliding_attention": "sliding", "full_attention": "gqa"}


def _layer_kinds(cfg: Config, version: str, n_layers: int) -> list[str]:
    """The mixer kind ("sliding" or "gqa") of each layer, from ``layer_types`` or the version's
    default pattern; one-line errors for an unknown layer type, a list of the wrong length or a
    pattern below 1."""
    types = cfg.get("layer_types")
    if types is not None:
        unknown = sorted(set(types) - set(LAYER_KINDS))
        if unknown:
            raise ShardwiseError(f"config.json field 'layer_types' has {shown(unknown[0])}: use "
                                 f"{' or '.join(LAYER_KINDS)}")
        if len(types) != n_layers:
            raise ShardwiseError(f"config.json field 'layer_types' has {len(types)} entries, expected "
                                 f"num_hidden_layers = {n_layers}")
        return [LAYER_KINDS[t] for t in types]
    every = 2 if version == "gemma2" else cfg.get("sliding_window_pattern", 6)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ShardwiseError(f"config.json field 'sliding_window_pattern' must be a whole number >= 1, "
                             f"got {shown(every)}")
    return ["sliding" if (i + 1) % every else "gqa" for i in range(n_layers)]


def build_gemma(cfg: Config) -> dict[str, Any]:
    """ModelSpec keyword arguments of a Gemma 2 or Gemma 3 config (see the module docstring)."""
    version = "gemma2" if cfg.model_type == "gemma2" else "gemma3"
    for key, value in DEFAULTS[version].items():
        if cfg.data.get(key) is None:
            cfg.data[key] = value
    check_fields(cfg.data)
    if cfg.get("use_bidirectional_attention", False):
        raise ShardwiseError("config.json field 'use_bidirectional_attention' true (an encoder such as EmbeddingGemma) "
                             "is not supported: shardwise plans causal decoders")
    hidden, heads, n_layers = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_hidden_layers")
    kv, hd, inter = cfg.int("num_key_value_heads"), cfg.int("head_dim"), cfg.int("intermediate_size")
    window = cfg.int("sliding_window")
    kinds = _layer_kinds(cfg, version, n_layers)
    if "sliding" in kinds and window == 0:
        raise ShardwiseError("config.json field 'sliding_window' must be at least 1 when layers slide: give the window")
    prefix = "language_model.model." if cfg.model_type == "gemma3" else "model."
    bias = bool(cfg.get("attention_bias", False))
    layers = []
    for i, kind in enumerate(kinds):
        p = f"{prefix}layers.{i}."
        tensors = gqa_tensors(p + "self_attn.", hidden, heads, kv, hd, bias, "head" if version == "gemma3" else None)
        tensors += swiglu(p + "mlp.", hidden, inter, DENSE_MLP)
        tensors += [norm(f"{p}{name}.weight", hidden) for name in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")]
        layers.append(LayerSpec(i, kind, "dense", tuple(tensors), window if kind == "sliding" else None))
    return dict(
        family=version, prefix=prefix, num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=hd,
        intermediate_size=inter, layers=tuple(layers), sliding_window=window if "sliding" in kinds else None,
    )
