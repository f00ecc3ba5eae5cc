"""NVIDIA Nemotron-H (``model_type`` nemotron_h: Nemotron-H, Nemotron 3 Nano / Super / Ultra): a
stack of single-mixer blocks, each one RMSNorm and one of a Mamba-2 mixer (``M``), GQA attention
(``*``), a non-gated relu² MLP (``-``) or a routed MoE (``E``), as ``hybrid_override_pattern``
(or the list ``layers_block_type``) gives them.

Every block is one ``LayerSpec``: Mamba and attention blocks have no MLP ("none"), MLP and MoE
blocks no mixer (the "none" mixer). Tensor names are the checkpoint's (``backbone.`` prefix,
per-expert ``experts.{e}.up_proj`` / ``down_proj``: the published safetensors; transformers 5's
``NemotronH*`` modules have the same shapes, experts fused). Shapes follow transformers'
``modeling_nemotron_h.py`` (NemotronHMamba2Mixer, NemotronHAttention, NemotronHMLP, NemotronHMoE,
NemotronHTopkRouter); the MoE as vLLM's ``models/nemotron_h.py`` (NemotronHMoE) runs it: a
sigmoid router with a float32 correction bias, group-limited top-k, routed experts that work in
``moe_latent_size`` when it is set, between ``fc1_latent_proj`` / ``fc2_latent_proj``, which are
whole on every rank (ReplicatedLinear), and a shared expert of
``moe_shared_expert_intermediate_size`` × ``n_shared_experts``. Multi-token-prediction layers
(``num_nextn_predict_layers``, ``mtp_*``) are not counted, as for DeepSeek.
"""

from __future__ import annotations

from typing import Any

from shardwise.errors import ShardwiseError, shown
from shardwise.spec.config_fields import MOST, Config, check_fields
from shardwise.spec.mixers import LinearAttentionSpec, gqa_tensors, mamba2_tensors
from shardwise.spec.model import LayerSpec, MoESpec
from shardwise.spec.tensors import (
    DENSE_MLP,
    LATENT_PROJ,
    ROUTED_EXPERTS,
    ROUTER,
    SHARED_EXPERTS,
    TensorSpec,
    col,
    norm,
    rep,
    row,
)

# Block letters of ``hybrid_override_pattern``; ``layers_block_type`` spells them out (transformers
# 5's names, and the legacy ones its ``remap_legacy_layer_types`` accepts).
BLOCK_NAMES = {
    "mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E",
}
POSITIVE = ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "moe_latent_size",
            "moe_shared_expert_intermediate_size", "attention_head_dim")


def block_pattern(cfg: Config) -> str:
    """The blocks as pattern letters (M, *, -, E), from ``hybrid_override_pattern`` or
    ``layers_block_type``; one-line errors for an unknown block or a length that disagrees with
    ``num_hidden_layers``."""
    types = cfg.get("layers_block_type")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) and t in BLOCK_NAMES for t in types):
            raise ShardwiseError(f"config.json field 'layers_block_type' must be a list of {', '.join(BLOCK_NAMES)}, "
                                 f"got {shown(types)}")
        pattern, field = "".join(BLOCK_NAMES[t] for t in types), "layers_block_type"
    else:
        pattern, field = cfg.req("hybrid_override_pattern"), "hybrid_override_pattern"
        if not isinstance(pattern, str) or not pattern or set(pattern) - set("M*-E"):
            raise ShardwiseError(f"config.json field 'hybrid_override_pattern' must be a string of M, *, - and E, "
                                 f"got {shown(pattern)}")
    layers = cfg.int("num_hidden_layers", len(pattern))
    if len(pattern) > MOST["num_hidden_layers"]:
        raise ShardwiseError(f"config.json field '{field}' has {len(pattern)} blocks: at most "
                             f"{MOST['num_hidden_layers']} are read")
    if len(pattern) != layers:
        raise ShardwiseError(f"config.json field '{field}' has {len(pattern)} blocks, expected num_hidden_layers = {layers}")
    return pattern


def _refuse_unpriced(cfg: Config) -> None:
    """Biases the tensor list does not declare, and a ``quantization_config`` (its ignore rules name
    ``backbone.`` modules the group probes of ``parse._quant_formats`` do not cover): one-line errors."""
    for key in ("attention_bias", "mlp_bias", "use_bias"):
        if cfg.get(key, False):
            raise ShardwiseError(f"config.json field '{key}' true is not supported for nemotron_h: use false")
    if cfg.get("quantization_config") is not None:
        raise ShardwiseError("config.json field 'quantization_config' is not supported for nemotron_h: plan the "
                             "BF16 config and give the checkpoint's formats with --quant / --experts / --dense")


def build_nemotron_h(cfg: Config) -> dict[str, Any]:
    """ModelSpec keyword arguments of a Nemotron-H config (see the module docstring)."""
    check_fields(cfg.data, POSITIVE, ())
    _refuse_unpriced(cfg)
    pattern = block_pattern(cfg)
    hidden, heads = cfg.int("hidden_size"), cfg.int("num_attention_heads")
    kv = cfg.int("num_key_value_heads", heads)
    hd = cfg.int("head_dim", cfg.int("attention_head_dim", hidden // heads))
    la = LinearAttentionSpec(
        num_key_heads=cfg.int("n_groups"), num_value_heads=cfg.int("mamba_num_heads"),
        key_head_dim=cfg.int("ssm_state_size"), value_head_dim=cfg.int("mamba_head_dim"),
        conv_kernel=cfg.int("conv_kernel"),
        value_heads_name="Mamba heads (config.json field 'mamba_num_heads')",
        key_heads_name="Mamba groups (config.json field 'n_groups')", key_heads_replicate=False,
    )
    if la.num_value_heads % la.num_key_heads:
        raise ShardwiseError(f"config.json field 'n_groups' ({la.num_key_heads}) must divide mamba_num_heads "
                             f"({la.num_value_heads})")
    conv_bias = bool(cfg.get("use_conv_bias", True))
    moe = _moe_spec(cfg) if "E" in pattern else None
    layers = []
    for i, block in enumerate(pattern):
        p = f"backbone.layers.{i}."
        m = p + "mixer."
        tensors = [norm(p + "norm.weight", hidden)]
        if block == "M":
            tensors += mamba2_tensors(m, hidden, la, conv_bias)
        elif block == "*":
            tensors += gqa_tensors(m, hidden, heads, kv, hd)
        elif block == "-":
            tensors += relu2_mlp(m, hidden, cfg.int("intermediate_size"), DENSE_MLP)
        else:
            tensors += moe_tensors(m, hidden, moe)
        kind = {"M": ("mamba2", "none"), "*": ("gqa", "none"), "-": ("none", "dense"), "E": ("none", "moe")}[block]
        layers.append(LayerSpec(i, *kind, tuple(tensors)))
    return dict(
        family="nemotron_h", float32_groups=(ROUTER,) if moe else (), num_layers=len(pattern), num_heads=heads,
        num_kv_heads=kv, head_dim=hd, intermediate_size=cfg.int("intermediate_size"), layers=tuple(layers), moe=moe,
        linear_attention=la, global_names=("backbone.embeddings.weight", "backbone.norm_f.weight"),
    )


def _moe_spec(cfg: Config) -> MoESpec:
    n_shared = cfg.int("n_shared_experts", 0)
    hidden, latent = cfg.int("hidden_size"), cfg.get("moe_latent_size")
    return MoESpec(
        num_experts=cfg.int("n_routed_experts"), top_k=cfg.int("num_experts_per_tok"), shared_experts=n_shared,
        intermediate_size=cfg.int("moe_intermediate_size"),
        shared_intermediate_size=cfg.int("moe_shared_expert_intermediate_size", 0) * n_shared,
        routing="sigmoid_grouped", n_group=cfg.int("n_group", 1), topk_group=cfg.int("topk_group", 1),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        latent_size=latent if latent is not None and latent != hidden else None,
    )


def relu2_mlp(prefix: str, hidden: int, inter: int, group: str) -> list[TensorSpec]:
    """Non-gated MLP: up column-parallel, down row-parallel (no gate)."""
    return [col(prefix + "up_proj.weight", inter, hidden, group), row(prefix + "down_proj.weight", hidden, inter, group)]


def moe_tensors(prefix: str, hidden: int, moe: MoESpec) -> list[TensorSpec]:
    """A MoE block: router weight and correction bias (float32, ``float32_groups``), the latent
    projections (replicated), per-expert up/down templates in the latent width, the shared expert."""
    width = moe.latent_size or hidden
    out = [
        rep(prefix + "gate.weight", (moe.num_experts, hidden), ROUTER),
        rep(prefix + "gate.e_score_correction_bias", (moe.num_experts,), ROUTER),
    ]
    if moe.latent_size:
        out += [rep(prefix + "fc1_latent_proj.weight", (width, hidden), LATENT_PROJ),
                rep(prefix + "fc2_latent_proj.weight", (hidden, width), LATENT_PROJ)]
    out += [
        TensorSpec(prefix + "experts.{e}.up_proj.weight", (moe.intermediate_size, width), ROUTED_EXPERTS, tp_dim=0,
                   experts=moe.num_experts),
        TensorSpec(prefix + "experts.{e}.down_proj.weight", (width, moe.intermediate_size), ROUTED_EXPERTS, tp_dim=1,
                   experts=moe.num_experts),
    ]
    if moe.shared_experts:
        out += relu2_mlp(prefix + "shared_experts.", hidden, moe.shared_intermediate_size, SHARED_EXPERTS)
    return out
