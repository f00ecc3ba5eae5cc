"""Qwen3.5-MoE (``qwen3_5_moe``) blocks besides the Gated DeltaNet (``runtime.deltanet``).

- ``OffsetRMSNorm``: Qwen3.5's zero-centred RMSNorm, ``(1 + w) · rmsnorm(x)`` in float32, cast
  after the weight (every norm of the model but the DeltaNet's gated one).
- ``GatedAttention``: the full-attention layers. ``q_proj`` carries an output gate: per head
  ``[query (head_dim), gate (head_dim)]``, so column-splitting q_proj by heads of 2·head_dim
  keeps each head's gate with it; per-head q/k norms; rotary on the first
  ``partial_rotary_factor · head_dim`` channels (``rotate_half``; the multimodal RoPE sections
  are the plain RoPE for text); ``o_proj(attn · sigmoid(gate))``, row-parallel. The static KV
  cache, row-by-row verify attention and the per-slot rows of continuous batching are
  ``runtime.attention``'s (``full_attention``, ``per_slot``).
- ``GatedSharedExpertMoE``: softmax top-k routing (renormalised) over the routed experts (expert
  parallel like ``moe.SparseMoE``) plus one shared expert scaled per token by
  ``sigmoid(shared_expert_gate · x)``; the gate weight is replicated, so every rank scales its
  partial shared output by the same factor and one all-reduce sums routed and shared parts.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.runtime.attention import full_attention, per_slot
from shardwise.runtime.deltanet import GatedDeltaNet
from shardwise.runtime.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    Shard,
    allreduce,
    apply_rotary,
    project_inputs,
    rope_parameters,
)
from shardwise.runtime.moe import DenseMLP, SparseMoE
from shardwise.runtime.packed_weights import NONE, Quantization, quantization
from shardwise.runtime.rms_norm import RMSNorm
from shardwise.spec.model import LayerSpec, ModelSpec, MoESpec, TensorSpec

FAMILY = "qwen3_5_moe"
MIXERS = ("gated_deltanet", "gated_attention")


def rotary_dim(spec: ModelSpec) -> int:
    """Channels of each head that rotate: ``head_dim · partial_rotary_factor``."""
    cfg = spec.config
    factor = rope_parameters(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return int(spec.head_dim * factor)


class OffsetRMSNorm(RMSNorm):
    """``((1 + w) · rmsnorm(x.float())).to(dtype)`` (transformers' ``Qwen3_5MoeRMSNorm``)."""

    offset = True


class GatedAttention(nn.Module):
    """Qwen3.5 full attention over this rank's heads with a static KV cache [max_batch, kv_local, S, d]
    (one row per cache slot, index = position)."""

    input_projections = ("q_proj", "k_proj", "v_proj")  # read the layer input: one product once stacked (layers.stack_inputs)

    def __init__(self, tensors: dict[str, TensorSpec], shard: Shard, dtype: torch.dtype, *, head_dim: int,
                 rotary_dim: int, gated: bool, eps: float, max_seq_len: int, max_batch: int = 1):
        super().__init__()
        t = tensors
        self.q_proj = ColumnParallelLinear(t["q_proj.weight"], shard, dtype)
        self.k_proj = ColumnParallelLinear(t["k_proj.weight"], shard, dtype)
        self.v_proj = ColumnParallelLinear(t["v_proj.weight"], shard, dtype)
        self.o_proj = RowParallelLinear(t["o_proj.weight"], shard, dtype)
        self.q_norm = OffsetRMSNorm(t["q_norm.weight"], shard, dtype, eps)
        self.k_norm = OffsetRMSNorm(t["k_norm.weight"], shard, dtype, eps)
        self.head_dim, self.rotary_dim, self.gated = head_dim, rotary_dim, gated
        self.heads = self.q_proj.weight.shape[0] // (head_dim * (2 if gated else 1))
        self.kv_heads = self.k_proj.weight.shape[0] // head_dim
        self.scaling = head_dim**-0.5
        cache_shape = (max_batch, self.kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        if r == x.shape[-1]:
            return apply_rotary(x, cos, sin)
        return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                slots: list[int] | None = None) -> torch.Tensor:
        """x [B, T, hidden] at ``positions`` [T] in cache rows 0..B-1, or, with ``slots``, at
        ``positions`` [B, T] in cache slots ``slots`` (rope's cos/sin then [B, 1, T, rotary/2]),
        each row's cache write and attention alone (``attention.per_slot``)."""
        b, n, _ = x.shape
        q, k, v = project_inputs(self, x)
        q = q.view(b, n, self.heads, -1)
        gate = None
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
            gate = gate.reshape(b, n, -1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(b, n, self.kv_heads, self.head_dim))
        v = v.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q = self._rotate(q.transpose(1, 2), cos, sin)
        k = self._rotate(k.transpose(1, 2), cos, sin)
        if slots is None:
            out = self._cached(q, k, v, positions, slice(0, b))
        else:
            out = per_slot(self._cached, slots, positions, q, k, v)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _cached(self, q, k, v, positions: torch.Tensor, rows: slice) -> torch.Tensor:
        """k, v [b, kv, T, d] into cache rows ``rows`` at ``positions`` [T]; q [b, H, T, d] attends → [b, T, H·d]."""
        return full_attention(self.k_cache, self.v_cache, q, k, v, positions, rows, self.scaling)


class GatedSharedExpertMoE(SparseMoE):
    """Routed experts (``SparseMoE``) + ``sigmoid(shared_expert_gate · x) · shared_expert(x)``."""

    def __init__(self, tensors: dict[str, TensorSpec], moe: MoESpec, shard: Shard, dtype: torch.dtype,
                 quant: Quantization = NONE):
        super().__init__(tensors, moe, shard, dtype, dtype, quant)
        shared = {k.removeprefix("shared_expert."): v for k, v in tensors.items() if k.startswith("shared_expert.")}
        self.shared_expert = DenseMLP(shared, shard, dtype) if shared else None
        gate = tensors.get("shared_expert_gate.weight")
        self.shared_expert_gate = ReplicatedLinear(gate, shard, dtype) if gate is not None else None

    def shared_module(self) -> DenseMLP | None:
        return self.shared_expert

    def shared_gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """``sigmoid(shared_expert_gate · x)`` ([..., 1], in the run dtype), or None without the gate."""
        return None if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x))


def layer_prefix(layer: LayerSpec) -> str:
    """The tensor-name prefix of ``layer`` (``model.language_model.layers.3.`` in the
    multimodal checkpoint, ``model.layers.3.`` in a text-only one), read off its input norm."""
    name = next(t.name for t in layer.tensors if t.name.endswith(".input_layernorm.weight"))
    return name.removesuffix("input_layernorm.weight")


def _under(layer: LayerSpec, prefix: str) -> dict[str, TensorSpec]:
    return {t.name[len(prefix):]: t for t in layer.tensors if t.name.startswith(prefix)}


def build_layer(module: nn.Module, spec: ModelSpec, layer: LayerSpec, shard: Shard, dtype: torch.dtype, *,
                max_seq_len: int, max_batch: int, max_step_tokens: int) -> None:
    """Fill a ``model.DecoderLayer`` for a qwen3_5_moe layer: its norms, token mixer (``self_attn``:
    a ``GatedDeltaNet`` or a ``GatedAttention``), MoE block and all-reduce hooks."""
    p, eps = layer_prefix(layer), spec.rms_norm_eps
    t = _under(layer, p)
    module.input_layernorm = OffsetRMSNorm(t["input_layernorm.weight"], shard, dtype, eps)
    module.post_attention_layernorm = OffsetRMSNorm(t["post_attention_layernorm.weight"], shard, dtype, eps)
    if layer.attention == "gated_deltanet":
        assert spec.linear_attention is not None
        module.self_attn = GatedDeltaNet(_under(layer, p + "linear_attn."), spec.linear_attention, shard, dtype,
                                         eps=eps, max_batch=max_batch, max_step_tokens=max_step_tokens)
    else:
        attn = _under(layer, p + "self_attn.")
        gated = attn["q_proj.weight"].shape[0] == 2 * spec.num_heads * spec.head_dim
        module.self_attn = GatedAttention(attn, shard, dtype, head_dim=spec.head_dim, rotary_dim=rotary_dim(spec),
                                          gated=gated, eps=eps, max_seq_len=max_seq_len, max_batch=max_batch)
    assert spec.moe is not None
    module.mlp = GatedSharedExpertMoE(_under(layer, p + "mlp."), spec.moe, shard, dtype, quantization(spec))
    module.reduce_attn = allreduce
    module.reduce_mlp = allreduce
