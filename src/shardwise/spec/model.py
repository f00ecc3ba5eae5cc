"""ModelSpec: one normalized description of a transformer, parsed from a Hugging Face config.json.

A ModelSpec knows every weight tensor's checkpoint name, logical shape, tensor group and how
tensor parallelism splits it, so the planner can count parameters and bytes and the runtime
can load exactly those tensors. No torch here: the planning path stays fast.

Parameter-count conventions (stated in every report):
- ``total_params``: every weight of the text model, both embeddings and the LM head included;
  multi-token-prediction (MTP / nextn) layers and vision towers excluded.
- ``active_params``: the weights one decoded token touches, **excluding the input embedding**
  (a lookup of one row, not a matmul) and counting only ``top_k`` of the routed experts.
  This is the convention of gpt-oss's model card (5.13 B active for gpt-oss-120b).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError, unknown_name

# Tensor groups: the unit of precision choice and of bytes accounting.
EMBEDDING = "embedding"
LM_HEAD = "lm_head"
ATTENTION = "attention"
LINEAR_ATTENTION = "linear_attention"
DENSE_MLP = "dense_mlp"
ROUTER = "router"
SHARED_EXPERTS = "shared_experts"
ROUTED_EXPERTS = "routed_experts"
LATENT_PROJ = "latent_proj"
NORM = "norm"

TENSOR_GROUPS = (
    EMBEDDING,
    ATTENTION,
    LINEAR_ATTENTION,
    DENSE_MLP,
    ROUTER,
    SHARED_EXPERTS,
    ROUTED_EXPERTS,
    LATENT_PROJ,
    NORM,
    LM_HEAD,
)

# Groups that hold matmul weights a quantization scheme may compress (norms, routers and
# biases stay in the model's dtype in every scheme we read).
MATMUL_GROUPS = (ATTENTION, LINEAR_ATTENTION, DENSE_MLP, SHARED_EXPERTS, ROUTED_EXPERTS, LATENT_PROJ)

SUPPORTED_MODEL_TYPES = (
    "llama",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "kimi_k2",
    "gpt_oss",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "kimi_k3",
    "kimi_linear",
)


@dataclass(frozen=True)
class TensorSpec:
    """One weight tensor (or one per-expert template) of the checkpoint.

    name: checkpoint name; per-expert templates contain ``{e}``.
    shape: logical (unquantized) shape of one tensor, ``[out, in]`` for linear weights.
    group: tensor group (precision and accounting unit).
    tp_dim: dimension split across tensor-parallel ranks, or None if replicated.
    tp_unit: size of the indivisible unit along ``tp_dim`` (a head's width, 2 for interleaved
        gate/up pairs); when there are fewer units than ranks each rank holds one unit (replication).
    experts: number of copies of a per-expert template (1 for ordinary tensors).
    expert_dim: dimension that indexes experts in a fused expert tensor (gpt-oss), else None.
    """

    name: str
    shape: tuple[int, ...]
    group: str
    tp_dim: int | None = None
    tp_unit: int = 1
    experts: int = 1
    expert_dim: int | None = None

    @property
    def numel(self) -> int:
        """Elements of one tensor (one expert's copy for templates)."""
        return math.prod(self.shape)

    @property
    def total_numel(self) -> int:
        """Elements over all expert copies."""
        return self.numel * self.experts

    @property
    def is_routed(self) -> bool:
        """True for routed-expert weights (split by expert parallelism)."""
        return self.group == ROUTED_EXPERTS

    @property
    def num_experts(self) -> int:
        """Experts this tensor covers (templates: copies; fused: the expert dimension)."""
        if self.expert_dim is not None:
            return self.shape[self.expert_dim]
        return self.experts

    def tp_shard_len(self, tp: int) -> int:
        """Length of ``tp_dim`` held by one of ``tp`` ranks (units replicate when tp > units)."""
        if self.tp_dim is None or tp == 1:
            return self.shape[self.tp_dim] if self.tp_dim is not None else 0
        units = self.shape[self.tp_dim] // self.tp_unit
        return max(units // tp, 1) * self.tp_unit


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer.

    attention: "gqa" (full causal attention, MHA/GQA/MQA), "sliding" (windowed GQA),
        "mla" (multi-head latent attention), "gated_mla", "gated_attention" (Qwen3.5 full
        layers with an output gate), "gated_deltanet" (Qwen3.5 linear attention),
        "kda" (Kimi Delta Attention, linear).
    mlp: "dense" or "moe".
    window: sliding-window length in tokens for "sliding" layers.
    """

    index: int
    attention: str
    mlp: str
    tensors: tuple[TensorSpec, ...]
    window: int | None = None

    @property
    def is_linear_attention(self) -> bool:
        """True when the layer keeps a constant-size recurrent state instead of a KV cache."""
        return self.attention in ("gated_deltanet", "kda")


@dataclass(frozen=True)
class MoESpec:
    """Routed-expert structure.

    routing: "softmax_topk" (Qwen3-MoE/OLMoE: softmax over all, top-k, optional renorm),
        "sigmoid_grouped" (DeepSeek-V3/Kimi: sigmoid + correction bias, group-limited top-k),
        "softmax_grouped" (DeepSeek-V2: softmax, group-limited top-k),
        "topk_softmax" (gpt-oss: top-k on logits then softmax over the k).
    latent_size: width the routed experts work on (Kimi K3's latent MoE), else the hidden size.
    """

    num_experts: int
    top_k: int
    shared_experts: int
    intermediate_size: int
    shared_intermediate_size: int
    routing: str
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    latent_size: int | None = None


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention dimensions (elements)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Linear-attention (recurrent state) dimensions (elements)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int


@dataclass(frozen=True)
class ModelSpec:
    """A transformer's structure, from its Hugging Face config (text part only)."""

    name: str
    model_type: str
    family: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    layers: tuple[LayerSpec, ...]
    globals: tuple[TensorSpec, ...]
    tie_word_embeddings: bool
    dtype: str
    quant_formats: Mapping[str, str]
    quant_method: str | None
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    linear_attention: LinearAttentionSpec | None = None
    sliding_window: int | None = None
    max_position_embeddings: int = 0
    rms_norm_eps: float = 1e-6
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    # ---- tensors -------------------------------------------------------------------------
    def tensors(self) -> list[TensorSpec]:
        """Every tensor: globals then each layer's, in checkpoint order."""
        out = [t for t in self.globals if t.group == EMBEDDING]
        for layer in self.layers:
            out.extend(layer.tensors)
        out.extend(t for t in self.globals if t.group != EMBEDDING)
        return out

    @cached_property
    def layer_structure(self) -> tuple[int, ...]:
        """An id per layer; layers with equal ids have identical tensor shapes, groups and splits."""
        ids: dict[tuple, int] = {}
        out = []
        for layer in self.layers:
            key = tuple((t.shape, t.group, t.tp_dim, t.tp_unit, t.experts, t.expert_dim) for t in layer.tensors)
            out.append(ids.setdefault(key, len(ids)))
        return tuple(out)

    @cached_property
    def params_by_group(self) -> dict[str, int]:
        """Total parameters per tensor group (elements)."""
        counts = dict.fromkeys(TENSOR_GROUPS, 0)
        for t in self.tensors():
            counts[t.group] += t.total_numel
        return counts

    @cached_property
    def active_params_by_group(self) -> dict[str, int]:
        """Parameters one decoded token touches per group; input embedding excluded."""
        counts = dict(self.params_by_group)
        counts[EMBEDDING] = 0
        if self.moe is not None:
            counts[ROUTED_EXPERTS] = counts[ROUTED_EXPERTS] * self.moe.top_k // self.moe.num_experts
        return counts

    @property
    def total_params(self) -> int:
        """All text-model weights (elements), embeddings and LM head included."""
        return sum(self.params_by_group.values())

    @property
    def active_params(self) -> int:
        """Weights touched per decoded token (elements), input embedding excluded."""
        return sum(self.active_params_by_group.values())

    @property
    def is_moe(self) -> bool:
        """True when the model has routed experts."""
        return self.moe is not None

    @property
    def num_moe_layers(self) -> int:
        """Layers with routed experts."""
        return sum(1 for layer in self.layers if layer.mlp == "moe")

    # ---- precision -----------------------------------------------------------------------
    def group_formats(self, overrides: Mapping[str, str] | None = None) -> dict[str, str]:
        """Quantization format name per tensor group: the checkpoint's, then ``overrides``."""
        formats = {g: self.quant_formats.get(g, self.dtype) for g in TENSOR_GROUPS}
        formats.update(overrides or {})
        return formats

    # ---- cache ---------------------------------------------------------------------------
    def cache_bytes_per_token(self, kv_bytes: float = 2.0) -> float:
        """KV-cache bytes per token of context over layers whose cache grows without bound.

        GQA: 2 · kv_heads · head_dim per layer; MLA: (kv_lora_rank + rope dim) latent per layer.
        Sliding-window and linear-attention layers are excluded (see ``cache_bytes``).
        """
        per_token = 0
        for layer in self.layers:
            if layer.attention in ("gqa", "gated_attention"):
                per_token += 2 * self.num_kv_heads * self.head_dim
            elif layer.attention in ("mla", "gated_mla"):
                assert self.mla is not None
                per_token += self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return per_token * kv_bytes

    def linear_state_bytes(self, state_bytes: float = 4.0) -> float:
        """Constant recurrent state of all linear-attention layers (bytes, fp32 by default).

        Per layer: value_heads · key_head_dim · value_head_dim (the delta-rule state) plus the
        short-convolution window (conv_kernel − 1 positions of q, k and v channels).
        """
        la = self.linear_attention
        if la is None:
            return 0.0
        state = la.num_value_heads * la.key_head_dim * la.value_head_dim
        conv_channels = 2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim
        conv = (la.conv_kernel - 1) * conv_channels
        n = sum(1 for layer in self.layers if layer.is_linear_attention)
        return n * (state + conv) * state_bytes

    def cache_bytes(self, context_tokens: int, kv_bytes: float = 2.0) -> float:
        """Whole cache for one sequence of ``context_tokens`` (bytes): full layers grow with
        context, sliding layers are capped at their window, linear layers are constant."""
        total = self.cache_bytes_per_token(kv_bytes) * context_tokens
        for layer in self.layers:
            if layer.attention == "sliding":
                total += 2 * self.num_kv_heads * self.head_dim * kv_bytes * min(context_tokens, layer.window or 0)
        return total + self.linear_state_bytes()

    # ---- compute -------------------------------------------------------------------------
    def attention_flops_per_token(self, context_tokens: int) -> float:
        """Attention-score FLOPs for one new token attending to ``context_tokens`` (FLOP).

        QK^T and AV: 2 · 2 · heads · head_dim · context per full layer (window-capped for
        sliding layers). MLA uses the absorbed form: heads · (2·kv_lora + rope) · 2 · context.
        Linear-attention layers: ~4 · value_heads · dk · dv (state update and readout).
        """
        flops = 0.0
        for layer in self.layers:
            if layer.attention in ("gqa", "gated_attention"):
                flops += 4 * self.num_heads * self.head_dim * context_tokens
            elif layer.attention == "sliding":
                flops += 4 * self.num_heads * self.head_dim * min(context_tokens, layer.window or 0)
            elif layer.attention in ("mla", "gated_mla"):
                assert self.mla is not None
                width = 2 * self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
                flops += 2 * self.num_heads * width * context_tokens
            else:
                la = self.linear_attention
                assert la is not None
                flops += 4 * la.num_value_heads * la.key_head_dim * la.value_head_dim
        return flops

    def flops_per_token(self, context_tokens: int = 0) -> float:
        """FLOPs to decode one token: 2 per active matmul weight plus attention (FLOP)."""
        matmul = 2 * (self.active_params - self.active_params_by_group[NORM])
        return matmul + self.attention_flops_per_token(context_tokens)


# ======================================================================================
# Parsing
# ======================================================================================

_CATALOG_PACKAGE = "shardwise.spec.catalog.models"


def catalog_models() -> list[str]:
    """Keys of the bundled model configs (file names without .json)."""
    files = resources.files(_CATALOG_PACKAGE).iterdir()
    return sorted(p.name[: -len(".json")] for p in files if p.name.endswith(".json"))


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A ModelSpec from a catalog key (``kimi-k3``), a config.json path or a checkpoint folder."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise ShardwiseError(f"model config '{path}' does not exist: pass a catalog key or a config.json path")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ShardwiseError(f"model config '{path}' is not valid JSON (line {exc.lineno}): {exc.msg}") from None
        return parse_config(config, name=path.parent.name if path.name == "config.json" else path.stem)
    key = str(name_or_path)
    known = catalog_models()
    if key not in known:
        raise unknown_name("model", key, known)
    text = resources.files(_CATALOG_PACKAGE).joinpath(f"{key}.json").read_text()
    return parse_config(json.loads(text), name=key)


class _Cfg:
    """Typed access to a config dict with one-line errors naming the missing field."""

    def __init__(self, data: Mapping[str, Any], model_type: str):
        self.data = data
        self.model_type = model_type

    def req(self, key: str) -> Any:
        if key not in self.data or self.data[key] is None:
            raise ShardwiseError(
                f"config.json ({self.model_type}) is missing required field '{key}': add it to the config"
            )
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key, default)
        return default if value is None else value

    def int(self, key: str, default: int | None = None) -> int:
        value = self.req(key) if default is None else self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ShardwiseError(f"config.json field '{key}' must be a non-negative integer, got {value!r}")
        return value


def parse_config(config: Mapping[str, Any], name: str = "model") -> ModelSpec:
    """Parse a Hugging Face config dict into a ModelSpec (raises ShardwiseError on bad input)."""
    if not isinstance(config, Mapping):
        raise ShardwiseError("config.json must be a JSON object")
    model_type = config.get("model_type")
    if model_type is None:
        raise ShardwiseError("config.json is missing 'model_type': this is not a Hugging Face model config")
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else None
    if model_type in ("kimi_k3", "qwen3_5_moe") and text is None:
        raise ShardwiseError(f"config.json ({model_type}) is missing 'text_config'")
    data = dict(text) if text is not None else dict(config)
    inner_type = data.get("model_type", model_type)
    builders = {
        "llama": _build_llama,
        "qwen3_moe": _build_qwen3_moe,
        "olmoe": _build_qwen3_moe,
        "deepseek_v2": _build_deepseek,
        "deepseek_v3": _build_deepseek,
        "kimi_k2": _build_deepseek,
        "gpt_oss": _build_gpt_oss,
        "qwen3_5_moe": _build_qwen3_5_moe,
        "qwen3_5_moe_text": _build_qwen3_5_moe,
        "kimi_k3": _build_kimi_linear,
        "kimi_linear": _build_kimi_linear,
    }
    builder = builders.get(inner_type) or builders.get(model_type)
    if builder is None:
        raise ShardwiseError(
            f"unsupported model_type '{model_type}': shardwise reads {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    cfg = _Cfg(data, model_type)
    spec_kwargs = builder(cfg)
    hidden = cfg.int("hidden_size")
    vocab = cfg.int("vocab_size")
    tie = bool(config.get("tie_word_embeddings", data.get("tie_word_embeddings", False)))
    prefix = spec_kwargs.pop("prefix", "model.")
    globals_ = [TensorSpec(f"{prefix}embed_tokens.weight", (vocab, hidden), EMBEDDING, tp_dim=0)]
    globals_.append(TensorSpec(f"{prefix}norm.weight", (hidden,), NORM))
    if not tie:
        globals_.append(TensorSpec("lm_head.weight", (vocab, hidden), LM_HEAD, tp_dim=0))
    dtype = _dtype_name(data.get("torch_dtype") or data.get("dtype") or config.get("torch_dtype") or "bfloat16")
    quant_method, formats = _quant_formats(data.get("quantization_config") or config.get("quantization_config"))
    return ModelSpec(
        name=name,
        model_type=model_type,
        hidden_size=hidden,
        vocab_size=vocab,
        globals=tuple(globals_),
        tie_word_embeddings=tie,
        dtype=dtype,
        quant_formats=formats,
        quant_method=quant_method,
        max_position_embeddings=cfg.get("max_position_embeddings", 0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        config=data,
        **spec_kwargs,
    )


def _dtype_name(value: str) -> str:
    value = str(value).replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(value, "bf16")


def _quant_formats(qc: Mapping[str, Any] | None) -> tuple[str | None, dict[str, str]]:
    """Format per tensor group from a ``quantization_config`` (empty when unquantized)."""
    if not qc:
        return None, {}
    method = qc.get("quant_method")
    if method == "mxfp4":  # gpt-oss: experts MXFP4, modules_to_not_convert stay BF16
        return method, {ROUTED_EXPERTS: "mxfp4"}
    if method == "fp8":  # DeepSeek-V3 block FP8: every linear except router, embeddings, head
        return method, {g: "fp8" for g in MATMUL_GROUPS}
    if method == "compressed-tensors":
        fmt = qc.get("format", "")
        if "mxfp4" in fmt:
            name = "mxfp4"
        elif "nvfp4" in fmt:
            name = "nvfp4"
        elif "float-quantized" in fmt:
            name = "fp8"
        elif "pack-quantized" in fmt:
            name = "int4-g128"
        else:
            raise ShardwiseError(f"quantization_config format '{fmt}' is not supported: use mxfp4, nvfp4 or fp8")
        ignore = [p[3:] for p in qc.get("ignore", []) if isinstance(p, str) and p.startswith("re:")]
        # A representative module name per group; a group is quantized unless an ignore rule hits it.
        probes = {
            ATTENTION: "model.layers.1.self_attn.o_proj",
            LINEAR_ATTENTION: "model.layers.1.self_attn.o_proj",
            DENSE_MLP: "model.layers.0.mlp.down_proj",
            SHARED_EXPERTS: "model.layers.1.mlp.shared_experts.down_proj",
            ROUTED_EXPERTS: "model.layers.1.mlp.experts.0.w2",
        }
        formats = {g: name for g, probe in probes.items() if not any(re.match(p, probe) for p in ignore)}
        return method, formats
    raise ShardwiseError(
        f"quantization_config quant_method '{method}' is not supported: shardwise reads mxfp4, fp8, compressed-tensors"
    )


# ---- shared pieces ---------------------------------------------------------------------------


def _norm(name: str, width: int) -> TensorSpec:
    return TensorSpec(name, (width,), NORM)


def _col(name: str, out: int, inp: int, group: str, unit: int = 1) -> TensorSpec:
    """Column-parallel linear weight [out, in], split on out."""
    return TensorSpec(name, (out, inp), group, tp_dim=0, tp_unit=unit)


def _row(name: str, out: int, inp: int, group: str, unit: int = 1) -> TensorSpec:
    """Row-parallel linear weight [out, in], split on in."""
    return TensorSpec(name, (out, inp), group, tp_dim=1, tp_unit=unit)


def _rep(name: str, shape: tuple[int, ...], group: str) -> TensorSpec:
    return TensorSpec(name, shape, group)


def _swiglu(prefix: str, hidden: int, inter: int, group: str) -> list[TensorSpec]:
    return [
        _col(f"{prefix}gate_proj.weight", inter, hidden, group),
        _col(f"{prefix}up_proj.weight", inter, hidden, group),
        _row(f"{prefix}down_proj.weight", hidden, inter, group),
    ]


def _experts(prefix: str, hidden: int, inter: int, n: int, names=("gate_proj", "up_proj", "down_proj")) -> list[TensorSpec]:
    """Per-expert SwiGLU templates ``{prefix}{e}.<name>.weight``."""
    gate, up, down = names
    return [
        TensorSpec(f"{prefix}{{e}}.{gate}.weight", (inter, hidden), ROUTED_EXPERTS, tp_dim=0, experts=n),
        TensorSpec(f"{prefix}{{e}}.{up}.weight", (inter, hidden), ROUTED_EXPERTS, tp_dim=0, experts=n),
        TensorSpec(f"{prefix}{{e}}.{down}.weight", (hidden, inter), ROUTED_EXPERTS, tp_dim=1, experts=n),
    ]


def _gqa(prefix: str, cfg: _Cfg, hidden: int, heads: int, kv: int, hd: int, bias: bool, qk_norm: str | None) -> list[TensorSpec]:
    out = [
        _col(f"{prefix}q_proj.weight", heads * hd, hidden, ATTENTION, hd),
        _col(f"{prefix}k_proj.weight", kv * hd, hidden, ATTENTION, hd),
        _col(f"{prefix}v_proj.weight", kv * hd, hidden, ATTENTION, hd),
    ]
    if bias:
        out += [
            TensorSpec(f"{prefix}q_proj.bias", (heads * hd,), ATTENTION, tp_dim=0, tp_unit=hd),
            TensorSpec(f"{prefix}k_proj.bias", (kv * hd,), ATTENTION, tp_dim=0, tp_unit=hd),
            TensorSpec(f"{prefix}v_proj.bias", (kv * hd,), ATTENTION, tp_dim=0, tp_unit=hd),
        ]
    out.append(_row(f"{prefix}o_proj.weight", hidden, heads * hd, ATTENTION, hd))
    if bias:
        out.append(_rep(f"{prefix}o_proj.bias", (hidden,), ATTENTION))
    if qk_norm == "head":  # Qwen3: RMSNorm over head_dim, shared by heads
        out += [_norm(f"{prefix}q_norm.weight", hd), _norm(f"{prefix}k_norm.weight", hd)]
    elif qk_norm == "full":  # OLMoE: RMSNorm over all heads' width
        out += [
            TensorSpec(f"{prefix}q_norm.weight", (heads * hd,), NORM, tp_dim=0, tp_unit=hd),
            TensorSpec(f"{prefix}k_norm.weight", (kv * hd,), NORM, tp_dim=0, tp_unit=hd),
        ]
    return out


def _layer_norms(prefix: str, hidden: int) -> list[TensorSpec]:
    return [_norm(f"{prefix}input_layernorm.weight", hidden), _norm(f"{prefix}post_attention_layernorm.weight", hidden)]


# ---- families --------------------------------------------------------------------------------


def _build_llama(cfg: _Cfg) -> dict[str, Any]:
    hidden, heads, n_layers = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_hidden_layers")
    kv = cfg.int("num_key_value_heads", heads)
    hd = cfg.int("head_dim", hidden // heads)
    inter = cfg.int("intermediate_size")
    layers = []
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors = _gqa(p + "self_attn.", cfg, hidden, heads, kv, hd, bool(cfg.get("attention_bias", False)), None)
        tensors += _swiglu(p + "mlp.", hidden, inter, DENSE_MLP)
        if cfg.get("mlp_bias", False):
            raise ShardwiseError("config.json field 'mlp_bias' true is not supported: shardwise reads llama with mlp_bias false")
        tensors += _layer_norms(p, hidden)
        layers.append(LayerSpec(i, "gqa", "dense", tuple(tensors)))
    return dict(
        family="llama", num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=hd,
        intermediate_size=inter, layers=tuple(layers),
    )


def _build_qwen3_moe(cfg: _Cfg) -> dict[str, Any]:
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
        tensors = _gqa(p + "self_attn.", cfg, hidden, heads, kv, hd, bool(cfg.get("attention_bias", False)), "full" if olmoe else "head")
        moe = i not in mlp_only and n_exp > 0 and (i + 1) % step == 0
        if moe:
            tensors.append(_rep(p + "mlp.gate.weight", (n_exp, hidden), ROUTER))
            tensors += _experts(p + "mlp.experts.", hidden, moe_inter, n_exp)
        else:
            tensors += _swiglu(p + "mlp.", hidden, inter, DENSE_MLP)
        tensors += _layer_norms(p, hidden)
        layers.append(LayerSpec(i, "gqa", "moe" if moe else "dense", tuple(tensors)))
    moe_spec = MoESpec(
        num_experts=n_exp, top_k=top_k, shared_experts=0, intermediate_size=moe_inter, shared_intermediate_size=0,
        routing="softmax_topk", norm_topk_prob=bool(cfg.get("norm_topk_prob", not olmoe)),
    )
    return dict(
        family="olmoe" if olmoe else "qwen3_moe", num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=hd,
        intermediate_size=inter, layers=tuple(layers), moe=moe_spec, sliding_window=window,
    )


def _mla_tensors(p: str, hidden: int, heads: int, mla: MLASpec, gated: bool) -> list[TensorSpec]:
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    out: list[TensorSpec] = []
    if mla.q_lora_rank:
        out += [
            _rep(p + "q_a_proj.weight", (mla.q_lora_rank, hidden), ATTENTION),
            _norm(p + "q_a_layernorm.weight", mla.q_lora_rank),
            _col(p + "q_b_proj.weight", heads * qk, mla.q_lora_rank, ATTENTION, qk),
        ]
    else:
        out.append(_col(p + "q_proj.weight", heads * qk, hidden, ATTENTION, qk))
    kv_b = mla.qk_nope_head_dim + mla.v_head_dim
    out += [
        _rep(p + "kv_a_proj_with_mqa.weight", (mla.kv_lora_rank + mla.qk_rope_head_dim, hidden), ATTENTION),
        _norm(p + "kv_a_layernorm.weight", mla.kv_lora_rank),
        _col(p + "kv_b_proj.weight", heads * kv_b, mla.kv_lora_rank, ATTENTION, kv_b),
        _row(p + "o_proj.weight", hidden, heads * mla.v_head_dim, ATTENTION, mla.v_head_dim),
    ]
    if gated:  # Kimi K3 gated MLA: sigmoid output gate per head channel
        out.append(_col(p + "g_proj.weight", heads * mla.v_head_dim, hidden, ATTENTION, mla.v_head_dim))
    return out


def _mla_spec(cfg: _Cfg) -> MLASpec:
    return MLASpec(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg.int("kv_lora_rank"),
        qk_nope_head_dim=cfg.int("qk_nope_head_dim"),
        qk_rope_head_dim=cfg.int("qk_rope_head_dim"),
        v_head_dim=cfg.int("v_head_dim"),
    )


def _build_deepseek(cfg: _Cfg) -> dict[str, Any]:
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
        tensors = _mla_tensors(p + "self_attn.", hidden, heads, mla, gated=False)
        moe = i >= first_dense and i % freq == 0
        if moe:
            tensors.append(_rep(p + "mlp.gate.weight", (n_exp, hidden), ROUTER))
            if v3:
                tensors.append(_rep(p + "mlp.gate.e_score_correction_bias", (n_exp,), ROUTER))
            tensors += _experts(p + "mlp.experts.", hidden, moe_inter, n_exp)
            if n_shared:
                tensors += _swiglu(p + "mlp.shared_experts.", hidden, moe_inter * n_shared, SHARED_EXPERTS)
        else:
            tensors += _swiglu(p + "mlp.", hidden, inter, DENSE_MLP)
        tensors += _layer_norms(p, hidden)
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
        family="deepseek_v3" if v3 else "deepseek_v2", num_layers=n_layers, num_heads=heads,
        num_kv_heads=heads, head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim, intermediate_size=inter,
        layers=tuple(layers), moe=moe_spec, mla=mla,
    )


def _build_gpt_oss(cfg: _Cfg) -> dict[str, Any]:
    hidden, heads, n_layers = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_hidden_layers")
    kv, hd = cfg.int("num_key_value_heads"), cfg.int("head_dim", hidden // heads)
    inter = cfg.int("intermediate_size")
    n_exp, top_k = cfg.int("num_local_experts"), cfg.int("num_experts_per_tok", cfg.get("experts_per_token", 0))
    window = cfg.int("sliding_window", 0) or None
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    if len(types) != n_layers:
        raise ShardwiseError(f"config.json field 'layer_types' has {len(types)} entries, expected num_hidden_layers = {n_layers}")
    layers = []
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors = _gqa(p + "self_attn.", cfg, hidden, heads, kv, hd, True, None)
        tensors.append(TensorSpec(p + "self_attn.sinks", (heads,), ATTENTION, tp_dim=0))
        tensors += [
            _rep(p + "mlp.router.weight", (n_exp, hidden), ROUTER),
            _rep(p + "mlp.router.bias", (n_exp,), ROUTER),
            # Fused expert tensors [E, out, in]; gate/up rows interleaved (gate_j, up_j) pairs.
            TensorSpec(p + "mlp.experts.gate_up_proj", (n_exp, 2 * inter, hidden), ROUTED_EXPERTS, tp_dim=1, tp_unit=2, expert_dim=0),
            TensorSpec(p + "mlp.experts.gate_up_proj_bias", (n_exp, 2 * inter), ROUTED_EXPERTS, tp_dim=1, tp_unit=2, expert_dim=0),
            TensorSpec(p + "mlp.experts.down_proj", (n_exp, hidden, inter), ROUTED_EXPERTS, tp_dim=2, expert_dim=0),
            TensorSpec(p + "mlp.experts.down_proj_bias", (n_exp, hidden), ROUTED_EXPERTS, expert_dim=0),
        ]
        tensors += _layer_norms(p, hidden)
        sliding = types[i] == "sliding_attention"
        layers.append(LayerSpec(i, "sliding" if sliding else "gqa", "moe", tuple(tensors), window if sliding else None))
    moe_spec = MoESpec(
        num_experts=n_exp, top_k=top_k, shared_experts=0, intermediate_size=inter, shared_intermediate_size=0,
        routing="topk_softmax",
    )
    return dict(
        family="gpt_oss", num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=hd,
        intermediate_size=inter, layers=tuple(layers), moe=moe_spec, sliding_window=window,
    )


def _build_qwen3_5_moe(cfg: _Cfg) -> dict[str, Any]:
    hidden, heads, n_layers = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_hidden_layers")
    kv, hd = cfg.int("num_key_value_heads"), cfg.int("head_dim", hidden // heads)
    n_exp, top_k, moe_inter = cfg.int("num_experts"), cfg.int("num_experts_per_tok"), cfg.int("moe_intermediate_size")
    shared_inter = cfg.int("shared_expert_intermediate_size", 0)
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
    key_dim, value_dim = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
    vhd = la.value_head_dim
    layers = []
    prefix = "model.language_model."
    for i in range(n_layers):
        p = f"{prefix}layers.{i}."
        if types[i] == "full_attention":
            a = p + "self_attn."
            tensors = [
                _col(a + "q_proj.weight", heads * hd * (2 if gate else 1), hidden, ATTENTION, hd * (2 if gate else 1)),
                _col(a + "k_proj.weight", kv * hd, hidden, ATTENTION, hd),
                _col(a + "v_proj.weight", kv * hd, hidden, ATTENTION, hd),
                _row(a + "o_proj.weight", hidden, heads * hd, ATTENTION, hd),
                _norm(a + "q_norm.weight", hd),
                _norm(a + "k_norm.weight", hd),
            ]
            kind = "gated_attention"
        else:
            a = p + "linear_attn."
            # Split by value-head groups: each key head serves value_heads/key_heads value heads.
            tensors = [
                _col(a + "in_proj_qkv.weight", 2 * key_dim + value_dim, hidden, LINEAR_ATTENTION),
                _col(a + "in_proj_z.weight", value_dim, hidden, LINEAR_ATTENTION, vhd),
                _col(a + "in_proj_b.weight", la.num_value_heads, hidden, LINEAR_ATTENTION),
                _col(a + "in_proj_a.weight", la.num_value_heads, hidden, LINEAR_ATTENTION),
                TensorSpec(a + "conv1d.weight", (2 * key_dim + value_dim, 1, la.conv_kernel), LINEAR_ATTENTION, tp_dim=0),
                TensorSpec(a + "dt_bias", (la.num_value_heads,), LINEAR_ATTENTION, tp_dim=0),
                TensorSpec(a + "A_log", (la.num_value_heads,), LINEAR_ATTENTION, tp_dim=0),
                _norm(a + "norm.weight", vhd),
                _row(a + "out_proj.weight", hidden, value_dim, LINEAR_ATTENTION, vhd),
            ]
            kind = "gated_deltanet"
        m = p + "mlp."
        tensors.append(_rep(m + "gate.weight", (n_exp, hidden), ROUTER))
        tensors += _experts(m + "experts.", hidden, moe_inter, n_exp)
        if shared_inter:
            tensors += _swiglu(m + "shared_expert.", hidden, shared_inter, SHARED_EXPERTS)
            tensors.append(_rep(m + "shared_expert_gate.weight", (1, hidden), ROUTER))
        tensors += _layer_norms(p, hidden)
        layers.append(LayerSpec(i, kind, "moe", tuple(tensors)))
    moe_spec = MoESpec(
        num_experts=n_exp, top_k=top_k, shared_experts=1 if shared_inter else 0, intermediate_size=moe_inter,
        shared_intermediate_size=shared_inter, routing="softmax_topk", norm_topk_prob=True,
    )
    return dict(
        family="qwen3_5_moe", num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=hd,
        intermediate_size=cfg.int("moe_intermediate_size"), layers=tuple(layers), moe=moe_spec,
        linear_attention=la, prefix=prefix,
    )


def _build_kimi_linear(cfg: _Cfg) -> dict[str, Any]:
    """Kimi K3 / Kimi Linear: KDA linear-attention layers + (gated) MLA layers, latent MoE.

    Tensor names follow transformers' kimi_linear. Two choices the config does not pin down,
    taken so the totals match the published checkpoint (1453.7 GiB, dense trunk 108.81 GB):
    ``use_full_rank_gate`` makes the KDA forget gate one full-rank [heads·dim, hidden]
    projection (f_proj) while the output gate stays low rank (g_a/g_b); the latent down/up
    projections and the latent norm stay BF16 with the rest of the non-expert weights.
    """
    hidden, heads, n_layers = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_hidden_layers")
    inter, moe_inter = cfg.int("intermediate_size"), cfg.int("moe_intermediate_size")
    n_exp = cfg.int("num_experts")
    top_k = cfg.int("num_experts_per_token", cfg.get("num_experts_per_tok", 0))
    n_shared = cfg.int("num_shared_experts", 0)
    first_dense = cfg.int("first_k_dense_replace", 0)
    latent = cfg.get("routed_expert_hidden_size") or hidden
    mla = _mla_spec(cfg)
    lac = cfg.req("linear_attn_config")
    kda_heads, kda_dim = int(lac["num_heads"]), int(lac["head_dim"])
    conv = int(lac.get("short_conv_kernel_size", 4))
    full_rank_gate = bool(lac.get("use_full_rank_gate", False))
    full_layers = {int(i) - 1 for i in lac.get("full_attn_layers", [])}  # the config is 1-based
    gated_mla = bool(cfg.get("mla_use_output_gate", False))
    qkv = kda_heads * kda_dim
    layers = []
    for i in range(n_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if i in full_layers:
            tensors = _mla_tensors(a, hidden, heads, mla, gated=gated_mla)
            kind = "gated_mla" if gated_mla else "mla"
        else:
            tensors = [
                _col(a + "q_proj.weight", qkv, hidden, LINEAR_ATTENTION, kda_dim),
                _col(a + "k_proj.weight", qkv, hidden, LINEAR_ATTENTION, kda_dim),
                _col(a + "v_proj.weight", qkv, hidden, LINEAR_ATTENTION, kda_dim),
                TensorSpec(a + "q_conv1d.weight", (qkv, 1, conv), LINEAR_ATTENTION, tp_dim=0, tp_unit=kda_dim),
                TensorSpec(a + "k_conv1d.weight", (qkv, 1, conv), LINEAR_ATTENTION, tp_dim=0, tp_unit=kda_dim),
                TensorSpec(a + "v_conv1d.weight", (qkv, 1, conv), LINEAR_ATTENTION, tp_dim=0, tp_unit=kda_dim),
            ]
            if full_rank_gate:
                tensors.append(_col(a + "f_proj.weight", qkv, hidden, LINEAR_ATTENTION, kda_dim))
            else:
                tensors += [
                    _rep(a + "f_a_proj.weight", (kda_dim, hidden), LINEAR_ATTENTION),
                    _col(a + "f_b_proj.weight", qkv, kda_dim, LINEAR_ATTENTION, kda_dim),
                ]
            tensors += [
                _col(a + "b_proj.weight", kda_heads, hidden, LINEAR_ATTENTION),
                _rep(a + "g_a_proj.weight", (kda_dim, hidden), LINEAR_ATTENTION),
                _col(a + "g_b_proj.weight", qkv, kda_dim, LINEAR_ATTENTION, kda_dim),
                TensorSpec(a + "A_log", (kda_heads,), LINEAR_ATTENTION, tp_dim=0),
                TensorSpec(a + "dt_bias", (qkv,), LINEAR_ATTENTION, tp_dim=0, tp_unit=kda_dim),
                _norm(a + "o_norm.weight", kda_dim),
                _row(a + "o_proj.weight", hidden, qkv, LINEAR_ATTENTION, kda_dim),
            ]
            kind = "kda"
        moe = i >= first_dense
        m = p + "mlp."
        if moe:
            tensors += [
                _rep(m + "gate.weight", (n_exp, hidden), ROUTER),
                _rep(m + "gate.e_score_correction_bias", (n_exp,), ROUTER),
            ]
            if latent != hidden:
                tensors += [
                    # Column-parallel down (then an all-gather of the latent), row-parallel up
                    # (after a reduce-scatter of the routed output): see perf.decode.
                    _col(m + "latent_down_proj.weight", latent, hidden, LATENT_PROJ),
                    _row(m + "latent_up_proj.weight", hidden, latent, LATENT_PROJ),
                ]
                if cfg.get("latent_moe_use_norm", False):
                    tensors.append(_norm(m + "latent_norm.weight", latent))
            tensors += _experts(m + "experts.", latent, moe_inter, n_exp, names=("w1", "w3", "w2"))
            if n_shared:
                tensors += _swiglu(m + "shared_experts.", hidden, moe_inter * n_shared, SHARED_EXPERTS)
        else:
            tensors += _swiglu(m, hidden, inter, DENSE_MLP)
        tensors += _layer_norms(p, hidden)
        layers.append(LayerSpec(i, kind, "moe" if moe else "dense", tuple(tensors)))
    moe_spec = MoESpec(
        num_experts=n_exp, top_k=top_k, shared_experts=n_shared, intermediate_size=moe_inter,
        shared_intermediate_size=moe_inter * n_shared, routing="sigmoid_grouped",
        n_group=cfg.int("num_expert_group", 1), topk_group=cfg.int("topk_group", 1),
        norm_topk_prob=bool(cfg.get("moe_renormalize", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        latent_size=latent if latent != hidden else None,
    )
    la = LinearAttentionSpec(
        num_key_heads=kda_heads, num_value_heads=kda_heads, key_head_dim=kda_dim, value_head_dim=kda_dim,
        conv_kernel=conv,
    )
    return dict(
        family="kimi_linear", num_layers=n_layers, num_heads=heads, num_kv_heads=heads,
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim, intermediate_size=inter, layers=tuple(layers),
        moe=moe_spec, mla=mla, linear_attention=la,
    )
