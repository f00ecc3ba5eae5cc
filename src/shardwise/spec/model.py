"""ModelSpec: one normalized description of a transformer, parsed from a Hugging Face config.json
(``shardwise.spec.parse``).

A ModelSpec knows every weight tensor's checkpoint name, logical shape, tensor group and how
tensor parallelism splits it, so the planner can count parameters and bytes and the runtime
can load exactly those tensors. Per-layer cache, state and attention FLOPs come from the layer's
mixer kind (``shardwise.spec.mixers``). No torch here: the planning path stays fast.

Parameter-count conventions (stated in every report):
- ``total_params``: every weight of the text model, both embeddings and the LM head included;
  multi-token-prediction (MTP / nextn) layers and vision towers excluded.
- ``active_params``: the weights one decoded token touches, **excluding the input embedding**
  (a lookup of one row, not a matmul) and counting only ``top_k`` of the routed experts.
  This is the convention of gpt-oss's model card (5.13 B active for gpt-oss-120b).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from shardwise.quant.formats import get_format
from shardwise.spec.mixers import MIXERS, STATE_BYTES, LinearAttentionSpec, MLASpec, Mixer
from shardwise.spec.tensors import (  # noqa: F401  (the tensor vocabulary, re-exported)
    ATTENTION,
    DENSE_MLP,
    EMBEDDING,
    LATENT_PROJ,
    LINEAR_ATTENTION,
    LM_HEAD,
    FLOAT32_BITS,
    MATMUL_GROUPS,
    NORM,
    ROUTED_EXPERTS,
    ROUTER,
    SHARED_EXPERTS,
    TENSOR_GROUPS,
    TensorSpec,
    unpacked_key,
)


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer.

    attention: the mixer kind, a key of ``shardwise.spec.mixers.MIXERS`` ("none": no mixer).
    mlp: "dense", "moe" or "none" (a block with a mixer only: Nemotron-H's Mamba and attention
        blocks; its MLP all-reduce is then not counted).
    window: sliding-window length in tokens for "sliding" layers.
    """

    index: int
    attention: str
    mlp: str
    tensors: tuple[TensorSpec, ...]
    window: int | None = None

    @property
    def mixer(self) -> Mixer:
        """The layer's entry in the mixer table (cache, state and FLOP figures)."""
        return MIXERS[self.attention]

    @property
    def is_linear_attention(self) -> bool:
        """True when the layer keeps a constant-size recurrent state instead of a KV cache."""
        return self.mixer.is_linear


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
    float32_groups: tuple[str, ...] = ()  # groups transformers (and the runtime) keep in float32 in any run dtype
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
        """An id per layer; layers with equal ids have the same mixer kind, MLP, window and tensor
        shapes, groups and splits (so they cost the same)."""
        ids: dict[tuple, int] = {}
        out = []
        for layer in self.layers:
            key = (layer.attention, layer.mlp, layer.window) + tuple(
                (t.shape, t.group, t.tp_dim, t.tp_unit, t.tp_pad, t.tp_parts, t.experts, t.expert_dim, t.keep_float32)
                for t in layer.tensors)
            out.append(ids.setdefault(key, len(ids)))
        return tuple(out)

    @cached_property
    def distinct_tensors(self) -> tuple[TensorSpec, ...]:
        """The tensors of one layer per ``layer_structure`` id, then the globals: every distinct
        shape and split the model has (what layout rules need to look at)."""
        firsts = {sid: i for i, sid in reversed(list(enumerate(self.layer_structure)))}
        return tuple(t for i in sorted(firsts.values()) for t in self.layers[i].tensors) + tuple(self.globals)

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
        return self._active(self.params_by_group)

    @cached_property
    def unpacked_params_by_group(self) -> dict[str, int]:
        """Per group, the parameters that are not matmul weights (biases, 1-D parameters) and not
        ``keep_float32``: they stay unpacked when the group is stored in a block format
        (``tensors.tensor_bits``) (elements)."""
        counts = dict.fromkeys(TENSOR_GROUPS, 0)
        for t in self.tensors():
            if not t.is_matmul and not t.keep_float32:
                counts[t.group] += t.total_numel
        return counts

    @cached_property
    def float32_params_by_group(self) -> dict[str, int]:
        """Per group, the parameters of ``keep_float32`` tensors, held at ``FLOAT32_BITS`` whatever
        the group's format (elements)."""
        counts = dict.fromkeys(TENSOR_GROUPS, 0)
        for t in self.tensors():
            if t.keep_float32:
                counts[t.group] += t.total_numel
        return counts

    def _active(self, counts: Mapping[str, int]) -> dict[str, int]:
        out = dict(counts)
        out[EMBEDDING] = 0
        if self.moe is not None:
            out[ROUTED_EXPERTS] = out[ROUTED_EXPERTS] * self.moe.top_k // self.moe.num_experts
        return out

    def weight_bytes(self, formats_bits: Mapping[str, float], active: bool = False) -> float:
        """Bytes of every weight (``active``: of the weights one decoded token touches) at
        ``formats_bits`` (bits per weight per group), biases and 1-D parameters of packed groups
        unpacked, ``keep_float32`` tensors at ``FLOAT32_BITS``."""
        small, fp32 = self.unpacked_params_by_group, self.float32_params_by_group
        counts = self.params_by_group
        if active:
            counts, small, fp32 = self.active_params_by_group, self._active(small), self._active(fp32)
        return sum((n - small[g] - fp32[g]) * formats_bits[g] + fp32[g] * FLOAT32_BITS
                   + small[g] * formats_bits.get(unpacked_key(g), formats_bits[g]) for g, n in counts.items()) / 8

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
    def launch_layers(self) -> float:
        """Decoder layers as the per-layer launch overhead counts them (``perf.decode.overhead_seconds``):
        a layer with a token mixer and an MLP is 1, a block with only one of them (Nemotron-H's Mamba,
        attention, MLP and MoE blocks) is 1/2: it launches about half a full layer's kernels."""
        return sum(0.5 if "none" in (layer.attention, layer.mlp) else 1.0 for layer in self.layers)

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

    def run_formats(self, dtype: str) -> dict[str, str]:
        """Format per tensor group as the shardwise runtime holds a run in ``dtype`` (a format
        name: fp32, bf16, fp16): every group at ``dtype`` except ``float32_groups`` (fp32),
        routed experts the checkpoint packs in MXFP4 and every group it packs as weight-only int8 /
        int4 (``runtime.int_matmul``), which stay packed. Single ``keep_float32`` tensors are float32
        whatever their group's format (priced so by the planner itself)."""
        formats = {g: "fp32" if g in self.float32_groups else dtype for g in TENSOR_GROUPS}
        if self.quant_formats.get(ROUTED_EXPERTS) == "mxfp4":
            formats[ROUTED_EXPERTS] = "mxfp4"
        formats.update({g: f for g, f in self.quant_formats.items() if get_format(f).weight_only_int})
        return formats

    # ---- cache (one sequence, tp = 1; per-rank figures: shardwise.perf.core) --------------
    def cache_bytes_per_token(self, kv_bytes: float = 2.0) -> float:
        """KV-cache bytes per token of context over layers whose cache grows without bound
        (sliding-window and linear-attention layers excluded: see ``cache_bytes``)."""
        return kv_bytes * sum(
            layer.mixer.cache_elems_per_token(self, 1) for layer in self.layers if not layer.mixer.windowed
        )

    def linear_state_bytes(self, kv_bytes: float = STATE_BYTES) -> float:
        """Constant recurrent state of all linear-attention layers (bytes): fp32 states plus the
        conv windows at ``kv_bytes`` per element (the cache dtype; fp32 by default)."""
        return sum(layer.mixer.state_bytes(self, 1, kv_bytes) for layer in self.layers)

    def cache_bytes(self, context_tokens: int, kv_bytes: float = 2.0) -> float:
        """Whole cache for one sequence of ``context_tokens`` (bytes): full layers grow with
        context, sliding layers are capped at their window, linear layers are constant."""
        total = 0.0
        for layer in self.layers:
            mixer = layer.mixer
            ctx = min(context_tokens, layer.window or 0) if mixer.windowed else context_tokens
            total += mixer.cache_elems_per_token(self, 1) * kv_bytes * ctx + mixer.state_bytes(self, 1, kv_bytes)
        return total

    # ---- compute -------------------------------------------------------------------------
    def attention_flops_per_token(self, context_tokens: int) -> float:
        """Attention FLOPs for one new token attending to ``context_tokens`` (FLOP), per the
        mixer table: window-capped for sliding layers, constant for linear layers."""
        flops = 0.0
        for layer in self.layers:
            mixer = layer.mixer
            ctx = min(context_tokens, layer.window or 0) if mixer.windowed else context_tokens
            flops += mixer.flops_per_ctx(self, 1) * ctx + mixer.flops_const(self, 1)
        return flops

    def flops_per_token(self, context_tokens: int = 0) -> float:
        """FLOPs to decode one token: 2 per active matmul weight plus attention (FLOP)."""
        matmul = 2 * (self.active_params - self.active_params_by_group[NORM])
        return matmul + self.attention_flops_per_token(context_tokens)
