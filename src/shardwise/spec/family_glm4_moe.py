"""Zhipu / Z.ai GLM-4.5, GLM-4.5-Air, GLM-4.6 and GLM-4.7 (``model_type`` glm4_moe,
``Glm4MoeForCausalLM``): a GQA decoder whose first ``first_k_dense_replace`` layers have a dense
SwiGLU MLP and whose other layers have a DeepSeek-V3-style MoE.

Shapes follow transformers' ``modeling_glm4_moe.py`` (all sizes in elements; a weight is
[out, in]):

- attention: q_proj [heads·head_dim, hidden], k_proj and v_proj [kv_heads·head_dim, hidden], each
  with a bias of its output width when ``attention_bias`` is true (GLM-4.5 sets it); o_proj
  [hidden, heads·head_dim], never a bias. With ``use_qk_norm`` an RMSNorm of ``head_dim`` on q and
  on k (GLM-4.5 / 4.6: false). ``head_dim`` defaults to hidden / heads. ``partial_rotary_factor``
  (default 0.5; transformers 5 writes it inside ``rope_parameters``) only chooses how many of a
  head's ``head_dim`` dimensions rotate: no tensor and no KV-cache size depends on it (the cache
  holds whole keys of ``head_dim``);
- dense layers (index < ``first_k_dense_replace``, default 1): gate/up [intermediate_size, hidden],
  down [hidden, intermediate_size];
- MoE layers: the router ``mlp.gate.weight`` [n_routed_experts, hidden] and its
  ``mlp.gate.e_score_correction_bias`` [n_routed_experts] (transformers keeps both in float32 in
  any run dtype, ``_keep_in_fp32_modules_strict``; the bias is a buffer there, but a stored tensor of
  the checkpoint, so it is counted), ``n_routed_experts`` SwiGLU experts of
  ``moe_intermediate_size`` stored one by one (``mlp.experts.{e}.gate_proj.weight``...), and one
  shared SwiGLU of ``moe_intermediate_size · n_shared_experts`` (none when that is 0);
- two RMSNorms of ``hidden`` per layer; the model's embedding, final norm and (unless
  ``tie_word_embeddings``) LM head come from the parser.

Routing (MoESpec "sigmoid_grouped"): sigmoid scores plus the correction bias choose the
``num_experts_per_tok`` experts within the ``topk_group`` best of ``n_group`` groups; the chosen
weights are renormalised when ``norm_topk_prob`` (default true) and scaled by
``routed_scaling_factor`` (default 1.0; GLM-4.5 2.5). Only shapes and the k chosen experts matter
to the planner; the other fields are kept for the record.

Multi-token prediction: the checkpoint stores ``num_nextn_predict_layers`` extra decoder layers
after the last one (GLM-4.5's ``model.layers.92.*``, with its own ``eh_proj`` / ``enorm`` /
``hnorm`` / ``shared_head``). transformers does not build them (``_keys_to_ignore_on_load_unexpected``)
and neither does the planner: as for DeepSeek-V3 (``_build_deepseek`` ignores the field), their
bytes are not counted as resident (``runtime.loader``'s rule for those layers would skip them too;
the runtime does not run glm4_moe). A plan that serves the MTP layer as a speculative drafter
needs about one more MoE layer's bytes than this spec counts.
"""

from __future__ import annotations

from typing import Any

from shardwise.errors import ShardwiseError, shown
from shardwise.spec.config_fields import Config
from shardwise.spec.mixers import gqa_tensors
from shardwise.spec.model import LayerSpec, MoESpec
from shardwise.spec.tensors import (
    DENSE_MLP,
    ROUTER,
    SHARED_EXPERTS,
    TensorSpec,
    experts,
    layer_norms,
    rep,
    swiglu,
)

FAMILY = "glm4_moe"

# transformers' Glm4MoeConfig defaults for the fields this builder reads and a config may leave out
DEFAULTS = dict(
    first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=1.0, attention_bias=False, use_qk_norm=False, num_nextn_predict_layers=1,
)


def attention_tensors(prefix: str, hidden: int, heads: int, kv: int, hd: int, bias: bool,
                      qk_norm: bool) -> list[TensorSpec]:
    """One GLM-4.5 attention block's tensors (elements): the shared GQA set with q/k/v biases of
    their output widths when ``bias`` (o_proj has none in GLM) and RMSNorms of ``hd`` on q and k
    when ``qk_norm``."""
    tensors = gqa_tensors(prefix, hidden, heads, kv, hd, bias, "head" if qk_norm else None)
    return [t for t in tensors if t.name != f"{prefix}o_proj.bias"]


def moe_tensors(prefix: str, hidden: int, n_exp: int, moe_inter: int, n_shared: int) -> list[TensorSpec]:
    """One MoE MLP's tensors under ``prefix`` (``model.layers.{i}.mlp.``): the router [n_exp, hidden]
    and its correction bias [n_exp] (group ROUTER, which transformers keeps in float32), ``n_exp``
    routed SwiGLU experts of ``moe_inter``, and the shared SwiGLU of ``moe_inter · n_shared`` when
    ``n_shared`` > 0."""
    tensors = [rep(prefix + "gate.weight", (n_exp, hidden), ROUTER),
               rep(prefix + "gate.e_score_correction_bias", (n_exp,), ROUTER)]
    tensors += experts(prefix + "experts.", hidden, moe_inter, n_exp)
    if n_shared:
        tensors += swiglu(prefix + "shared_experts.", hidden, moe_inter * n_shared, SHARED_EXPERTS)
    return tensors


def _checked(cfg: Config) -> tuple[int, int, float]:
    """The dense-layer count, top-k and routed scaling factor, after one-line errors for values
    transformers' router cannot use: more dense layers than layers, experts the groups do not
    divide, more groups kept than groups, a rotary fraction outside (0, 1], an MTP layer count
    that is not a whole number."""
    n_layers, n_exp = cfg.int("num_hidden_layers"), cfg.int("n_routed_experts")
    first_dense = cfg.int("first_k_dense_replace")
    if first_dense > n_layers:
        raise ShardwiseError(f"config.json field 'first_k_dense_replace' ({first_dense}) is above num_hidden_layers "
                             f"({n_layers}): give at most the layer count")
    n_group, topk_group = cfg.int("n_group"), cfg.int("topk_group")
    if n_exp % n_group:
        raise ShardwiseError(f"config.json field 'n_group' ({n_group}) must divide n_routed_experts ({n_exp})")
    if topk_group > n_group:
        raise ShardwiseError(f"config.json field 'topk_group' ({topk_group}) must be at most n_group ({n_group})")
    top_k = cfg.int("num_experts_per_tok")
    if top_k > n_exp:
        raise ShardwiseError(f"config.json field 'num_experts_per_tok' ({top_k}) is above n_routed_experts ({n_exp})")
    rope = cfg.get("rope_parameters")  # transformers 5 writes the factor here
    rotary = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5) if isinstance(rope, dict) else 0.5)
    if not isinstance(rotary, (int, float)) or isinstance(rotary, bool) or not 0 < rotary <= 1:
        raise ShardwiseError(f"config.json field 'partial_rotary_factor' must be a number in (0, 1], "
                             f"got {shown(rotary)}")
    cfg.int("num_nextn_predict_layers")  # a whole number >= 0 (not counted: see the module docstring)
    scale = cfg.get("routed_scaling_factor")
    return first_dense, top_k, float(scale)


def build_glm4_moe(cfg: Config) -> dict[str, Any]:
    """ModelSpec keyword arguments of a GLM-4.5 config (see the module docstring)."""
    for key, value in DEFAULTS.items():
        if cfg.data.get(key) is None:
            cfg.data[key] = value
    hidden, heads, n_layers = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_hidden_layers")
    kv = cfg.int("num_key_value_heads", heads)
    hd = cfg.int("head_dim", hidden // heads)
    inter, moe_inter = cfg.int("intermediate_size"), cfg.int("moe_intermediate_size")
    n_exp, n_shared = cfg.int("n_routed_experts"), cfg.int("n_shared_experts")
    first_dense, top_k, scale = _checked(cfg)
    bias, qk_norm = bool(cfg.get("attention_bias")), bool(cfg.get("use_qk_norm"))
    layers = []
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors = attention_tensors(p + "self_attn.", hidden, heads, kv, hd, bias, qk_norm)
        moe = i >= first_dense
        tensors += moe_tensors(p + "mlp.", hidden, n_exp, moe_inter, n_shared) if moe else swiglu(
            p + "mlp.", hidden, inter, DENSE_MLP)
        tensors += layer_norms(p, hidden)
        layers.append(LayerSpec(i, "gqa", "moe" if moe else "dense", tuple(tensors)))
    moe_spec = MoESpec(
        num_experts=n_exp, top_k=top_k, shared_experts=n_shared, intermediate_size=moe_inter,
        shared_intermediate_size=moe_inter * n_shared, routing="sigmoid_grouped",
        n_group=cfg.int("n_group"), topk_group=cfg.int("topk_group"),
        norm_topk_prob=bool(cfg.get("norm_topk_prob")), routed_scaling_factor=scale,
    )
    return dict(
        family=FAMILY, float32_groups=(ROUTER,), num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=hd,
        intermediate_size=inter, layers=tuple(layers), moe=moe_spec,
    )
