"""One builder per model family: a Hugging Face config (text part) → the keyword arguments of a
ModelSpec (layers with their tensors, MoE / MLA / linear-attention dimensions).

Mixer tensors come from ``shardwise.spec.mixers``, the rest from ``shardwise.spec.tensors``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardwise.errors import ShardwiseError, shown
from shardwise.spec.config_fields import Config, check_fields
from shardwise.spec.family_gemma import build_gemma
from shardwise.spec.family_glm4_moe import build_glm4_moe
from shardwise.spec.family_nemotron_h import build_nemotron_h
from shardwise.spec.family_phi3 import build_phi3
from shardwise.spec.mixers import (
    LinearAttentionSpec,
    MLASpec,
    gated_attention_tensors,
    gated_deltanet_tensors,
    gqa_tensors,
    kda_tensors,
    mla_tensors,
)
from shardwise.spec.model import LayerSpec, MoESpec
from shardwise.spec.tensors import (
    ATTENTION,
    DENSE_MLP,
    LATENT_PROJ,
    NORM,
    ROUTED_EXPERTS,
    ROUTER,
    SHARED_EXPERTS,
    TensorSpec,
    experts,
    layer_norms,
    norm,
    rep,
    swiglu,
)


def _build_llama(cfg: Config) -> dict[str, Any]:
    """Dense GQA decoders with a SwiGLU MLP: llama, and the plain variants of it that differ only in
    biases, q/k norms or a sliding window: qwen2 (q/k/v biases, no o_proj bias), qwen3 (RMSNorm per
    head on q and k), mistral (every layer sliding when ``sliding_window`` is set)."""
    mt = cfg.model_type
    hidden, heads, n_layers = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_hidden_layers")
    kv = cfg.int("num_key_value_heads", heads)
    hd = cfg.int("head_dim", hidden // heads)
    inter = cfg.int("intermediate_size")
    if mt in ("qwen2", "qwen3") and cfg.get("use_sliding_window", False):
        raise ShardwiseError(f"config.json field 'use_sliding_window' true is not supported for {mt}: use false")
    window = (cfg.int("sliding_window", 0) or None) if mt == "mistral" else None
    qk_norm = "head" if mt == "qwen3" else None
    layers = []
    for i in range(n_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if mt == "qwen2":  # Qwen2: biases on q/k/v only
            tensors = gqa_tensors(a, hidden, heads, kv, hd, False, None)
            tensors[3:3] = [
                TensorSpec(f"{a}q_proj.bias", (heads * hd,), ATTENTION, tp_dim=0, tp_unit=hd),
                TensorSpec(f"{a}k_proj.bias", (kv * hd,), ATTENTION, tp_dim=0, tp_unit=hd),
                TensorSpec(f"{a}v_proj.bias", (kv * hd,), ATTENTION, tp_dim=0, tp_unit=hd),
            ]
        else:
            tensors = gqa_tensors(a, hidden, heads, kv, hd, bool(cfg.get("attention_bias", False)), qk_norm)
        tensors += swiglu(p + "mlp.", hidden, inter, DENSE_MLP)
        if cfg.get("mlp_bias", False):
            raise ShardwiseError("config.json field 'mlp_bias' true is not supported: shardwise reads llama with mlp_bias false")
        tensors += layer_norms(p, hidden)
        layers.append(LayerSpec(i, "sliding" if window else "gqa", "dense", tuple(tensors), window))
    return dict(
        family="llama" if mt == "llama" else mt, num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=hd,
        intermediate_size=inter, layers=tuple(layers), sliding_window=window,
    )


def _build_qwen3_moe(cfg: Config) -> dict[str, Any]:
    olmoe = cfg.model_type == "olmoe"
    hidden, heads, n_layers = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_hidden_layers")
    kv = cfg.int("num_key_value_heads", heads)
    hd = cfg.int("head_dim", hidden // heads)
    inter = cfg.int("intermediate_size")
    # transformers 5 writes qwen3_moe's expert count as num_local_experts (4.x: num_experts)
    n_exp_key = "num_experts" if cfg.get("num_experts") is not None or cfg.get("num_local_experts") is None else "num_local_experts"
    n_exp, top_k, moe_inter = cfg.int(n_exp_key), cfg.int("num_experts_per_tok"), cfg.int("moe_intermediate_size", inter)
    step = cfg.int("decoder_sparse_step", 1)
    mlp_only = set(cfg.get("mlp_only_layers", []))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    layers = []
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors = gqa_tensors(p + "self_attn.", hidden, heads, kv, hd, bool(cfg.get("attention_bias", False)), "full" if olmoe else "head")
        moe = i not in mlp_only and n_exp > 0 and (i + 1) % step == 0
        if moe:
            tensors.append(rep(p + "mlp.gate.weight", (n_exp, hidden), ROUTER))
            tensors += experts(p + "mlp.experts.", hidden, moe_inter, n_exp)
        else:
            tensors += swiglu(p + "mlp.", hidden, inter, DENSE_MLP)
        tensors += layer_norms(p, hidden)
        layers.append(LayerSpec(i, "gqa", "moe" if moe else "dense", tuple(tensors)))
    moe_spec = MoESpec(
        num_experts=n_exp, top_k=top_k, shared_experts=0, intermediate_size=moe_inter, shared_intermediate_size=0,
        routing="softmax_topk", norm_topk_prob=bool(cfg.get("norm_topk_prob", not olmoe)),
    )
    return dict(
        family="olmoe" if olmoe else "qwen3_moe", num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=hd,
        intermediate_size=inter, layers=tuple(layers), moe=moe_spec, sliding_window=window,
    )


def _build_block_sparse_moe(cfg: Config) -> dict[str, Any]:
    """Every layer GQA + a routed-expert MLP under ``block_sparse_moe`` (experts w1/w3/w2), no shared
    expert: mixtral (softmax over all experts, top-k, renormalised) and minimax_m2 (sigmoid scores with
    a routing bias, top-k renormalised; q/k RMSNorm over all heads' width when ``qk_norm_type`` is
    "per_layer"; ``rotary_dim`` only changes which dimensions rotate, not a shape)."""
    minimax = cfg.model_type == "minimax_m2"
    hidden, heads, n_layers = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_hidden_layers")
    kv = cfg.int("num_key_value_heads", heads)
    hd = cfg.int("head_dim", hidden // heads)
    inter = cfg.int("intermediate_size")
    n_exp, top_k = cfg.int("num_local_experts"), cfg.int("num_experts_per_tok")
    window = cfg.int("sliding_window", 0) or None
    qk_norm = None
    if minimax:
        if cfg.int("shared_intermediate_size", 0):
            raise ShardwiseError("config.json field 'shared_intermediate_size' > 0 is not supported for minimax_m2: use 0")
        if cfg.get("use_qk_norm", False):
            if cfg.get("qk_norm_type", "per_layer") != "per_layer":
                raise ShardwiseError(f"config.json field 'qk_norm_type' {shown(cfg.get('qk_norm_type'))} is not "
                                     "supported for minimax_m2: shardwise reads per_layer")
            qk_norm = "full"
    layers = []
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors = gqa_tensors(p + "self_attn.", hidden, heads, kv, hd, bool(cfg.get("attention_bias", False)), qk_norm)
        m = p + "block_sparse_moe."
        tensors.append(rep(m + "gate.weight", (n_exp, hidden), ROUTER))
        if minimax and cfg.get("use_routing_bias", False):
            tensors.append(rep(m + "e_score_correction_bias", (n_exp,), ROUTER))
        tensors += experts(m + "experts.", hidden, inter, n_exp, names=("w1", "w3", "w2"))
        tensors += layer_norms(p, hidden)
        layers.append(LayerSpec(i, "sliding" if window else "gqa", "moe", tuple(tensors), window))
    moe_spec = MoESpec(
        num_experts=n_exp, top_k=top_k, shared_experts=0, intermediate_size=inter, shared_intermediate_size=0,
        routing="sigmoid_grouped" if minimax else "softmax_topk", norm_topk_prob=True,
    )
    return dict(
        family=cfg.model_type, num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=hd,
        intermediate_size=inter, layers=tuple(layers), moe=moe_spec, sliding_window=window,
    )


def _mla_spec(cfg: Config) -> MLASpec:
    return MLASpec(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg.int("kv_lora_rank"),
        qk_nope_head_dim=cfg.int("qk_nope_head_dim"),
        qk_rope_head_dim=cfg.int("qk_rope_head_dim"),
        v_head_dim=cfg.int("v_head_dim"),
    )


def _build_deepseek(cfg: Config) -> dict[str, Any]:
    hidden, heads, n_layers = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_hidden_layers")
    inter, moe_inter = cfg.int("intermediate_size"), cfg.int("moe_intermediate_size")
    n_exp, top_k = cfg.int("n_routed_experts"), cfg.int("num_experts_per_tok")
    n_shared = cfg.int("n_shared_experts", 0)
    first_dense, freq = cfg.int("first_k_dense_replace", 0), cfg.int("moe_layer_freq", 1)
    mla = _mla_spec(cfg)
    v3 = cfg.model_type in ("deepseek_v3", "kimi_k2") or cfg.get("scoring_func") == "sigmoid"
    layers = []
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors = mla_tensors(p + "self_attn.", hidden, heads, mla, gated=False)
        moe = i >= first_dense and i % freq == 0
        if moe:
            tensors.append(rep(p + "mlp.gate.weight", (n_exp, hidden), ROUTER))
            if v3:
                tensors.append(rep(p + "mlp.gate.e_score_correction_bias", (n_exp,), ROUTER))
            tensors += experts(p + "mlp.experts.", hidden, moe_inter, n_exp)
            if n_shared:
                tensors += swiglu(p + "mlp.shared_experts.", hidden, moe_inter * n_shared, SHARED_EXPERTS)
        else:
            tensors += swiglu(p + "mlp.", hidden, inter, DENSE_MLP)
        tensors += layer_norms(p, hidden)
        layers.append(LayerSpec(i, "mla", "moe" if moe else "dense", tuple(tensors)))
    moe_spec = MoESpec(
        num_experts=n_exp, top_k=top_k, shared_experts=n_shared, intermediate_size=moe_inter,
        shared_intermediate_size=moe_inter * n_shared,
        routing="sigmoid_grouped" if v3 else "softmax_grouped",
        n_group=cfg.int("n_group", 1), topk_group=cfg.int("topk_group", 1),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
    )
    return dict(
        family="deepseek_v3" if v3 else "deepseek_v2", float32_groups=(ROUTER,) if v3 else (),
        num_layers=n_layers, num_heads=heads,
        num_kv_heads=heads, head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim, intermediate_size=inter,
        layers=tuple(layers), moe=moe_spec, mla=mla,
    )


def _build_gpt_oss(cfg: Config) -> dict[str, Any]:
    hidden, heads, n_layers = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_hidden_layers")
    kv, hd = cfg.int("num_key_value_heads"), cfg.int("head_dim", hidden // heads)
    inter = cfg.int("intermediate_size")
    n_exp, top_k = cfg.int("num_local_experts"), cfg.int("num_experts_per_tok", cfg.get("experts_per_token"))
    window = cfg.int("sliding_window", 0) or None
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    layers = []
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors = gqa_tensors(p + "self_attn.", hidden, heads, kv, hd, True, None)
        tensors.append(TensorSpec(p + "self_attn.sinks", (heads,), ATTENTION, tp_dim=0))
        tensors += [
            rep(p + "mlp.router.weight", (n_exp, hidden), ROUTER),
            rep(p + "mlp.router.bias", (n_exp,), ROUTER),
            # Fused expert tensors [E, out, in]; gate/up rows interleaved (gate_j, up_j) pairs.
            TensorSpec(p + "mlp.experts.gate_up_proj", (n_exp, 2 * inter, hidden), ROUTED_EXPERTS, tp_dim=1, tp_unit=2, expert_dim=0),
            TensorSpec(p + "mlp.experts.gate_up_proj_bias", (n_exp, 2 * inter), ROUTED_EXPERTS, tp_dim=1, tp_unit=2, expert_dim=0),
            TensorSpec(p + "mlp.experts.down_proj", (n_exp, hidden, inter), ROUTED_EXPERTS, tp_dim=2, expert_dim=0),
            TensorSpec(p + "mlp.experts.down_proj_bias", (n_exp, hidden), ROUTED_EXPERTS, expert_dim=0),
        ]
        tensors += layer_norms(p, hidden)
        sliding = types[i] == "sliding_attention"
        layers.append(LayerSpec(i, "sliding" if sliding else "gqa", "moe", tuple(tensors), window if sliding else None))
    moe_spec = MoESpec(
        num_experts=n_exp, top_k=top_k, shared_experts=0, intermediate_size=inter, shared_intermediate_size=0,
        routing="topk_softmax",
    )
    return dict(
        family="gpt_oss", float32_groups=(NORM,), num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=hd,
        intermediate_size=inter, layers=tuple(layers), moe=moe_spec, sliding_window=window,
    )


def _build_qwen3_5_moe(cfg: Config) -> dict[str, Any]:
    """Qwen3.5 (and Qwen3-Next, its text-only predecessor with the same tensor shapes): Gated DeltaNet
    layers with a gated full-attention layer every ``full_attention_interval``; routed experts plus a
    gated shared expert, or (qwen3_5 / qwen3_5_text, the dense models) a SwiGLU MLP in every layer."""
    inner = cfg.data.get("model_type", cfg.model_type)
    dense = inner in ("qwen3_5", "qwen3_5_text")
    hidden, heads, n_layers = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_hidden_layers")
    kv, hd = cfg.int("num_key_value_heads"), cfg.int("head_dim", hidden // heads)
    if dense:
        n_exp = top_k = moe_inter = 0
    else:
        n_exp, top_k, moe_inter = cfg.int("num_experts"), cfg.int("num_experts_per_tok"), cfg.int("moe_intermediate_size")
    shared_inter = cfg.int("shared_expert_intermediate_size", 0)
    step = cfg.int("decoder_sparse_step", 1)
    mlp_only = set(cfg.get("mlp_only_layers", []))
    la = LinearAttentionSpec(
        num_key_heads=cfg.int("linear_num_key_heads"), num_value_heads=cfg.int("linear_num_value_heads"),
        key_head_dim=cfg.int("linear_key_head_dim"), value_head_dim=cfg.int("linear_value_head_dim"),
        conv_kernel=cfg.int("linear_conv_kernel_dim", 4),
    )
    interval = cfg.int("full_attention_interval", 4)
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
    ]
    gate = bool(cfg.get("attn_output_gate", True))
    layers = []
    # the multimodal wrapper nests the text model (the real checkpoint); a text-only one does not
    prefix = "model.language_model." if cfg.model_type in ("qwen3_5_moe", "qwen3_5") else "model."
    for i in range(n_layers):
        p = f"{prefix}layers.{i}."
        if types[i] == "full_attention":
            tensors = gated_attention_tensors(p + "self_attn.", hidden, heads, kv, hd, gate)
            kind = "gated_attention"
        else:
            tensors = gated_deltanet_tensors(p + "linear_attn.", hidden, la)
            kind = "gated_deltanet"
        m = p + "mlp."
        moe = not dense and i not in mlp_only and (i + 1) % step == 0
        if moe:
            tensors.append(rep(m + "gate.weight", (n_exp, hidden), ROUTER))
            tensors += experts(m + "experts.", hidden, moe_inter, n_exp)
            if shared_inter:
                tensors += swiglu(m + "shared_expert.", hidden, shared_inter, SHARED_EXPERTS)
                tensors.append(rep(m + "shared_expert_gate.weight", (1, hidden), ROUTER))
        else:
            tensors += swiglu(m, hidden, cfg.int("intermediate_size"), DENSE_MLP)
        tensors += layer_norms(p, hidden)
        layers.append(LayerSpec(i, kind, "moe" if moe else "dense", tuple(tensors)))
    if dense:
        return dict(
            family="qwen3_5", num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=hd,
            intermediate_size=cfg.int("intermediate_size"), layers=tuple(layers), linear_attention=la, prefix=prefix,
        )
    moe_spec = MoESpec(
        num_experts=n_exp, top_k=top_k, shared_experts=1 if shared_inter else 0, intermediate_size=moe_inter,
        shared_intermediate_size=shared_inter, routing="softmax_topk", norm_topk_prob=True,
    )
    return dict(
        family="qwen3_next" if cfg.model_type == "qwen3_next" else "qwen3_5_moe", num_layers=n_layers, num_heads=heads,
        num_kv_heads=kv, head_dim=hd, intermediate_size=cfg.int("moe_intermediate_size"), layers=tuple(layers),
        moe=moe_spec, linear_attention=la, prefix=prefix,
    )


def _build_kimi_linear(cfg: Config) -> dict[str, Any]:
    """Kimi K3 / Kimi Linear: KDA linear-attention layers + (gated) MLA layers, latent MoE.

    Tensor names follow transformers' kimi_linear and, for Kimi K3's extensions, Moonshot's
    ``modeling_kimi_linear.py`` (public transcriptions: vLLM's and SGLang's kimi_k3 models, the
    MLX and tinygrad ports): ``use_full_rank_gate`` makes the KDA output gate one full-rank
    [heads·dim, hidden] projection (g_proj), the forget gate staying low rank (f_a/f_b);
    ``mla_use_output_gate`` adds g_proj to MLA; ``routed_expert_hidden_size`` runs the routed
    experts in a latent space (routed_expert_down/up_proj, routed_expert_norm); ``attn_res_block_size``
    gives every layer two attention-residual norms and [1, hidden] projections and the model one
    more pair (output_attn_res_*). The latent projections and norms stay BF16 with the rest of the
    non-expert weights (the published checkpoint: 1453.7 GiB, dense trunk 108.81 GB).
    """
    hidden, heads, n_layers = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_hidden_layers")
    inter, moe_inter = cfg.int("intermediate_size"), cfg.int("moe_intermediate_size")
    n_exp = cfg.int("num_experts")
    top_k = cfg.int("num_experts_per_token", cfg.get("num_experts_per_tok"))
    n_shared = cfg.int("num_shared_experts", 0)
    first_dense = cfg.int("first_k_dense_replace", 0)
    latent = cfg.get("routed_expert_hidden_size") or hidden
    mla = _mla_spec(cfg)
    lac = cfg.req("linear_attn_config")
    if not isinstance(lac, Mapping):
        raise ShardwiseError(f"config.json field 'linear_attn_config' must be an object, got {shown(lac)}")
    check_fields(lac, ("num_heads", "head_dim", "short_conv_kernel_size"), (), "linear_attn_config.")
    kda = Config(lac, cfg.model_type)
    kda_heads, kda_dim, conv = kda.int("num_heads"), kda.int("head_dim"), kda.int("short_conv_kernel_size", 4)
    full_rank_gate = bool(lac.get("use_full_rank_gate", False))
    full_layers = {i - 1 for i in lac.get("full_attn_layers", [])}  # the config is 1-based
    gated_mla = bool(cfg.get("mla_use_output_gate", False))
    attn_res = cfg.get("attn_res_block_size") is not None
    la = LinearAttentionSpec(
        num_key_heads=kda_heads, num_value_heads=kda_heads, key_head_dim=kda_dim, value_head_dim=kda_dim,
        conv_kernel=conv,
    )
    layers = []
    for i in range(n_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if i in full_layers:
            tensors = mla_tensors(a, hidden, heads, mla, gated=gated_mla)
            kind = "gated_mla" if gated_mla else "mla"
        else:
            tensors = kda_tensors(a, hidden, la, full_rank_gate)
            kind = "kda"
        moe = i >= first_dense
        m = p + ("block_sparse_moe." if moe else "mlp.")  # the checkpoint's names (Moonshot, save_pretrained)
        if moe:
            tensors += [
                rep(m + "gate.weight", (n_exp, hidden), ROUTER),
                rep(m + "gate.e_score_correction_bias", (n_exp,), ROUTER),
            ]
            if latent != hidden:
                # Whole on every rank, as the serving engines that run K3 hold them: vLLM's
                # kimi_k3 model (vllm/models/kimi_k3/nvidia/model.py, KimiMoE: ReplicatedLinear
                # routed_expert_down_proj / routed_expert_up_proj, "the full weight lives on every
                # rank ... fuse the latent and shared reductions into a single all-reduce") with its
                # LatentMoERunner, and the K3 ports for SGLang-, TensorRT-LLM- and JAX-style
                # runtimes in the code corpus all build them unsharded. The MoE all-reduce then
                # carries the routed latent beside the shared output: see perf.core.
                tensors += [
                    rep(m + "routed_expert_down_proj.weight", (latent, hidden), LATENT_PROJ),
                    rep(m + "routed_expert_up_proj.weight", (hidden, latent), LATENT_PROJ),
                ]
                if cfg.get("latent_moe_use_norm", False):
                    tensors.append(norm(m + "routed_expert_norm.weight", latent))
            tensors += experts(m + "experts.", latent, moe_inter, n_exp, names=("w1", "w3", "w2"))
            if n_shared:
                tensors += swiglu(m + "shared_experts.", hidden, moe_inter * n_shared, SHARED_EXPERTS)
        else:
            tensors += swiglu(m, hidden, inter, DENSE_MLP)
        tensors += layer_norms(p, hidden)
        if attn_res:
            tensors += attn_res_tensors(p + "self_attention_res", hidden) + attn_res_tensors(p + "mlp_res", hidden)
        layers.append(LayerSpec(i, kind, "moe" if moe else "dense", tuple(tensors)))
    moe_spec = MoESpec(
        num_experts=n_exp, top_k=top_k, shared_experts=n_shared, intermediate_size=moe_inter,
        shared_intermediate_size=moe_inter * n_shared, routing="sigmoid_grouped",
        n_group=cfg.int("num_expert_group", 1), topk_group=cfg.int("topk_group", 1),
        norm_topk_prob=bool(cfg.get("moe_renormalize", True)) and top_k > 1,  # Moonshot renormalises only k > 1
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        latent_size=latent if latent != hidden else None,
    )
    return dict(
        family="kimi_linear", float32_groups=(ROUTER,), num_layers=n_layers, num_heads=heads, num_kv_heads=heads,
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim, intermediate_size=inter, layers=tuple(layers),
        moe=moe_spec, mla=mla, linear_attention=la,
        extra_globals=tuple(attn_res_tensors("model.output_attn_res", hidden)) if attn_res else (),
    )


def attn_res_tensors(stem: str, hidden: int) -> list[TensorSpec]:
    """Kimi K3's attention residual at one point: an RMSNorm weight and a [1, hidden] score
    projection (``{stem}_norm`` / ``{stem}_proj``: per layer ``self_attention_res`` and ``mlp_res``,
    the model's ``output_attn_res``), replicated on every rank."""
    return [norm(stem + "_norm.weight", hidden), rep(stem + "_proj.weight", (1, hidden), NORM)]


BUILDERS = {
    "llama": _build_llama,
    "mistral": _build_llama,
    "qwen2": _build_llama,
    "qwen3": _build_llama,
    "mixtral": _build_block_sparse_moe,
    "minimax_m2": _build_block_sparse_moe,
    "qwen3_moe": _build_qwen3_moe,
    "olmoe": _build_qwen3_moe,
    "deepseek_v2": _build_deepseek,
    "deepseek_v3": _build_deepseek,
    "kimi_k2": _build_deepseek,
    "gpt_oss": _build_gpt_oss,
    "qwen3_5_moe": _build_qwen3_5_moe,
    "qwen3_5_moe_text": _build_qwen3_5_moe,
    "qwen3_5": _build_qwen3_5_moe,
    "qwen3_5_text": _build_qwen3_5_moe,
    "qwen3_next": _build_qwen3_5_moe,
    "kimi_k3": _build_kimi_linear,
    "kimi_linear": _build_kimi_linear,
    "nemotron_h": build_nemotron_h,
    "gemma2": build_gemma,
    "gemma3": build_gemma,
    "gemma3_text": build_gemma,
    "phi3": build_phi3,
    "glm4_moe": build_glm4_moe,
}
"""Builder per ``model_type`` (the text config's, else the outer config's)."""
