"""One table of token mixers (the attention part of a decoder layer): one entry per kind.

Each entry gives the kind's parameter tensors (a builder), the cache it keeps per sequence and
what one decode position costs, all on one of ``tp`` tensor-parallel ranks:

- ``cache_elems_per_token``: cache elements held (and read) per token of context (KV heads
  split by TP, replicated when fewer KV heads than ranks; MLA's latent replicated on every rank;
  0 for linear attention);
- ``windowed``: the cache holds at most the layer's sliding window of tokens (plus the positions
  one step writes: ``cache_positions``, the planner's and the runtime's one ring formula);
- ``state_bytes``: constant per-sequence state held (linear attention: the fp32 delta-rule state
  ``value_heads · d_k · d_v`` plus the short-convolution window in the cache dtype, split by
  heads; Mamba-2 the same with its SSM state ``heads · head_dim · ssm_state_size``, see
  ``LinearAttentionSpec``; with ``step_tokens`` > 1 the ``state_slots`` snapshots a verify pass
  can roll back to);
- ``snapshot_bytes``: one fp32 state (what a decode position reads or writes);
- ``flops_per_ctx`` / ``flops_const``: attention FLOPs per position per context token, and the
  context-independent part (linear attention's state update and readout);
- ``allreduces``: all-reduces the mixer itself ends with under TP (its row-parallel output).

``ModelSpec``'s accounting, the planner's cost core and memory fit read this table; adding a
mixer kind is one entry here plus its runtime module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shardwise.spec.tensors import ATTENTION, LINEAR_ATTENTION, NORM, TensorSpec, col, norm, rep, row

if TYPE_CHECKING:
    from shardwise.spec.model import ModelSpec

STATE_BYTES = 4.0  # the linear-attention delta-rule state is kept in float32


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention dimensions (elements)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def latent_width(self) -> int:
        """Cached elements per token: the compressed KV plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Linear-attention (recurrent state) dimensions (elements).

    Mamba-2 fills it with the same roles: its input channels ``x`` are the value heads
    (``mamba_num_heads`` × ``mamba_head_dim``), its ``B`` and ``C`` the key heads (``n_groups`` ×
    ``ssm_state_size``; C reads the state as q does, B writes it as k does), so the SSM state is
    heads · head_dim · ssm_state_size and the conv window covers x, B and C, as vLLM's
    ``get_mamba_state_shape`` sizes them. ``value_heads_name`` / ``key_heads_name`` name them in
    a refused ``--tp``; ``key_heads_replicate`` False allows key heads fewer than TP ranks only
    when there is one (vLLM's MambaMixer2: n_groups divisible by tp, or 1 and replicated).
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    value_heads_name: str = "linear-attention value heads"
    key_heads_name: str = "linear-attention key heads"
    key_heads_replicate: bool = True

    @property
    def state_elems(self) -> int:
        """Delta-rule state of one sequence: value_heads · d_k · d_v."""
        return self.num_value_heads * self.key_head_dim * self.value_head_dim

    @property
    def conv_elems(self) -> int:
        """Short-convolution window of one sequence: (kernel − 1) positions of q, k and v channels."""
        channels = 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim
        return (self.conv_kernel - 1) * channels


def state_slots(step_tokens: int = 1) -> int:
    """fp32 states a linear-attention layer keeps per sequence: one for plain decoding; for verify
    passes of ``step_tokens`` positions the state at every position a pass may be rolled back to
    (``step_tokens + 1``), as the runtime's ``linear_state.LinearStateCache`` holds them."""
    return 1 if step_tokens <= 1 else step_tokens + 1


def cache_positions(context_tokens, window, step_tokens: int = 1):
    """Positions a layer's cache holds per sequence: the context, or for a sliding window the
    runtime's ring of ``window + step_tokens - 1`` positions (a call reads the ``window - 1``
    before it; a verify pass may roll back up to ``step_tokens - 1`` positions, which must not
    overwrite those), never more than the context. Works on numbers and numpy arrays (``window``
    inf: no window)."""
    return np.minimum(context_tokens, np.asarray(window) + (step_tokens - 1))


# ---- tensors per kind ---------------------------------------------------------------------------


def gqa_tensors(prefix: str, hidden: int, heads: int, kv: int, hd: int, bias: bool = False,
                qk_norm: str | None = None) -> list[TensorSpec]:
    """MHA/GQA/MQA (also the sliding-window kind): q/k/v column-parallel by heads, o row-parallel;
    ``qk_norm`` "head" (Qwen3: RMSNorm over head_dim) or "full" (OLMoE: over all heads' width)."""
    out = [
        col(f"{prefix}q_proj.weight", heads * hd, hidden, ATTENTION, hd),
        col(f"{prefix}k_proj.weight", kv * hd, hidden, ATTENTION, hd),
        col(f"{prefix}v_proj.weight", kv * hd, hidden, ATTENTION, hd),
    ]
    if bias:
        out += [
            TensorSpec(f"{prefix}q_proj.bias", (heads * hd,), ATTENTION, tp_dim=0, tp_unit=hd),
            TensorSpec(f"{prefix}k_proj.bias", (kv * hd,), ATTENTION, tp_dim=0, tp_unit=hd),
            TensorSpec(f"{prefix}v_proj.bias", (kv * hd,), ATTENTION, tp_dim=0, tp_unit=hd),
        ]
    out.append(row(f"{prefix}o_proj.weight", hidden, heads * hd, ATTENTION, hd))
    if bias:
        out.append(rep(f"{prefix}o_proj.bias", (hidden,), ATTENTION))
    if qk_norm == "head":
        out += [norm(f"{prefix}q_norm.weight", hd), norm(f"{prefix}k_norm.weight", hd)]
    elif qk_norm == "full":
        out += [
            TensorSpec(f"{prefix}q_norm.weight", (heads * hd,), NORM, tp_dim=0, tp_unit=hd),
            TensorSpec(f"{prefix}k_norm.weight", (kv * hd,), NORM, tp_dim=0, tp_unit=hd),
        ]
    return out


def gated_attention_tensors(prefix: str, hidden: int, heads: int, kv: int, hd: int, gate: bool = True) -> list[TensorSpec]:
    """Qwen3.5 full-attention layers: q_proj carries the output gate (2× wide), q/k norms per head."""
    q_width = hd * (2 if gate else 1)
    return [
        col(prefix + "q_proj.weight", heads * q_width, hidden, ATTENTION, q_width),
        col(prefix + "k_proj.weight", kv * hd, hidden, ATTENTION, hd),
        col(prefix + "v_proj.weight", kv * hd, hidden, ATTENTION, hd),
        row(prefix + "o_proj.weight", hidden, heads * hd, ATTENTION, hd),
        norm(prefix + "q_norm.weight", hd),
        norm(prefix + "k_norm.weight", hd),
    ]


def mla_tensors(prefix: str, hidden: int, heads: int, mla: MLASpec, gated: bool = False) -> list[TensorSpec]:
    """Multi-head latent attention: q_a and kv_a replicated, q_b / kv_b column-parallel by heads,
    o row-parallel; ``gated`` adds Kimi K3's sigmoid output gate per head channel."""
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    out: list[TensorSpec] = []
    if mla.q_lora_rank:
        out += [
            rep(prefix + "q_a_proj.weight", (mla.q_lora_rank, hidden), ATTENTION),
            norm(prefix + "q_a_layernorm.weight", mla.q_lora_rank),
            col(prefix + "q_b_proj.weight", heads * qk, mla.q_lora_rank, ATTENTION, qk),
        ]
    else:
        out.append(col(prefix + "q_proj.weight", heads * qk, hidden, ATTENTION, qk))
    kv_b = mla.qk_nope_head_dim + mla.v_head_dim
    out += [
        rep(prefix + "kv_a_proj_with_mqa.weight", (mla.latent_width, hidden), ATTENTION),
        norm(prefix + "kv_a_layernorm.weight", mla.kv_lora_rank),
        col(prefix + "kv_b_proj.weight", heads * kv_b, mla.kv_lora_rank, ATTENTION, kv_b),
        row(prefix + "o_proj.weight", hidden, heads * mla.v_head_dim, ATTENTION, mla.v_head_dim),
    ]
    if gated:
        out.append(col(prefix + "g_proj.weight", heads * mla.v_head_dim, hidden, ATTENTION, mla.v_head_dim))
    return out


def gated_deltanet_tensors(prefix: str, hidden: int, la: LinearAttentionSpec) -> list[TensorSpec]:
    """Qwen3.5 Gated DeltaNet: fused qkv, z, b, a projections and the short conv split by channel,
    gated RMSNorm per value head, out_proj row-parallel."""
    key_dim, value_dim = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
    vhd = la.value_head_dim
    channels = 2 * key_dim + value_dim
    parts = ((key_dim, la.key_head_dim), (key_dim, la.key_head_dim), (value_dim, vhd))  # q | k | v, each by heads
    return [
        TensorSpec(prefix + "in_proj_qkv.weight", (channels, hidden), LINEAR_ATTENTION, tp_dim=0, tp_parts=parts),
        col(prefix + "in_proj_z.weight", value_dim, hidden, LINEAR_ATTENTION, vhd),
        col(prefix + "in_proj_b.weight", la.num_value_heads, hidden, LINEAR_ATTENTION),
        col(prefix + "in_proj_a.weight", la.num_value_heads, hidden, LINEAR_ATTENTION),
        TensorSpec(prefix + "conv1d.weight", (channels, 1, la.conv_kernel), LINEAR_ATTENTION, tp_dim=0, tp_parts=parts),
        TensorSpec(prefix + "dt_bias", (la.num_value_heads,), LINEAR_ATTENTION, tp_dim=0),
        TensorSpec(prefix + "A_log", (la.num_value_heads,), LINEAR_ATTENTION, tp_dim=0),
        norm(prefix + "norm.weight", vhd),
        row(prefix + "out_proj.weight", hidden, value_dim, LINEAR_ATTENTION, vhd),
    ]


def kda_tensors(prefix: str, hidden: int, la: LinearAttentionSpec, full_rank_gate: bool = False) -> list[TensorSpec]:
    """Kimi Delta Attention (transformers' kimi_linear names): q/k/v and their short convs split by
    heads; the low-rank gate down-projections replicated, their up-projections split;
    ``full_rank_gate`` (Kimi K3) makes the output gate one full-rank projection (g_proj) in place of
    g_a/g_b, the forget gate staying low rank (Moonshot's modeling_kimi_linear.py,
    KimiDeltaAttention: ``use_full_rank_gate``); ``dt_bias`` held in float32 (``TensorSpec.keep_float32``)."""
    heads, dim = la.num_value_heads, la.value_head_dim
    qkv = heads * dim
    out = [
        col(prefix + "q_proj.weight", qkv, hidden, LINEAR_ATTENTION, dim),
        col(prefix + "k_proj.weight", qkv, hidden, LINEAR_ATTENTION, dim),
        col(prefix + "v_proj.weight", qkv, hidden, LINEAR_ATTENTION, dim),
        TensorSpec(prefix + "q_conv1d.weight", (qkv, 1, la.conv_kernel), LINEAR_ATTENTION, tp_dim=0, tp_unit=dim),
        TensorSpec(prefix + "k_conv1d.weight", (qkv, 1, la.conv_kernel), LINEAR_ATTENTION, tp_dim=0, tp_unit=dim),
        TensorSpec(prefix + "v_conv1d.weight", (qkv, 1, la.conv_kernel), LINEAR_ATTENTION, tp_dim=0, tp_unit=dim),
        rep(prefix + "f_a_proj.weight", (dim, hidden), LINEAR_ATTENTION),
        col(prefix + "f_b_proj.weight", qkv, dim, LINEAR_ATTENTION, dim),
        col(prefix + "b_proj.weight", heads, hidden, LINEAR_ATTENTION),
    ]
    if full_rank_gate:
        out.append(col(prefix + "g_proj.weight", qkv, hidden, LINEAR_ATTENTION, dim))
    else:
        out += [
            rep(prefix + "g_a_proj.weight", (dim, hidden), LINEAR_ATTENTION),
            col(prefix + "g_b_proj.weight", qkv, dim, LINEAR_ATTENTION, dim),
        ]
    return out + [
        TensorSpec(prefix + "A_log", (1, 1, heads, 1), LINEAR_ATTENTION, tp_dim=2),  # stored [1, 1, heads, 1]
        # dt_bias in float32 in any run dtype (transformers' _keep_in_fp32_modules_strict); A_log is not
        TensorSpec(prefix + "dt_bias", (qkv,), LINEAR_ATTENTION, tp_dim=0, tp_unit=dim, keep_float32=True),
        norm(prefix + "o_norm.weight", dim),
        row(prefix + "o_proj.weight", hidden, qkv, LINEAR_ATTENTION, dim),
    ]


def mamba2_tensors(prefix: str, hidden: int, la: LinearAttentionSpec, conv_bias: bool = True) -> list[TensorSpec]:
    """Mamba-2 mixer (transformers' NemotronHMamba2Mixer names): in_proj fused z | x | B | C | dt,
    z, x and dt split by heads, B and C by groups (each part on its own, ``tp_parts``); the
    depthwise conv1d (and its bias) over x | B | C likewise; A_log, D and dt_bias one per head; the
    gated RMSNorm over the heads' width, split with them; out_proj row-parallel (vLLM's
    MambaMixer2 shards it so)."""
    heads, hd, n = la.num_value_heads, la.value_head_dim, la.key_head_dim
    inner, bc = heads * hd, la.num_key_heads * n
    xbc = ((inner, hd), (bc, n), (bc, n))
    conv = (inner + 2 * bc,)
    out = [
        TensorSpec(prefix + "in_proj.weight", (2 * inner + 2 * bc + heads, hidden), LINEAR_ATTENTION, tp_dim=0,
                   tp_parts=((inner, hd),) + xbc + ((heads, 1),)),
        TensorSpec(prefix + "conv1d.weight", conv + (1, la.conv_kernel), LINEAR_ATTENTION, tp_dim=0, tp_parts=xbc),
    ]
    if conv_bias:
        out.append(TensorSpec(prefix + "conv1d.bias", conv, LINEAR_ATTENTION, tp_dim=0, tp_parts=xbc))
    return out + [
        TensorSpec(prefix + "dt_bias", (heads,), LINEAR_ATTENTION, tp_dim=0),
        TensorSpec(prefix + "A_log", (heads,), LINEAR_ATTENTION, tp_dim=0),
        TensorSpec(prefix + "D", (heads,), LINEAR_ATTENTION, tp_dim=0),
        TensorSpec(prefix + "norm.weight", (inner,), NORM, tp_dim=0, tp_unit=hd),
        row(prefix + "out_proj.weight", hidden, inner, LINEAR_ATTENTION, hd),
    ]


def no_tensors(*args) -> list[TensorSpec]:
    """The "none" mixer of an FFN-only block: no tensors."""
    return []


# ---- cost per cache style -----------------------------------------------------------------------


def _kv_cache(m: ModelSpec, tp: int) -> float:
    return 2 * max(m.num_kv_heads // tp, 1) * m.head_dim


def _kv_flops(m: ModelSpec, tp: int) -> float:
    return 4 * m.num_heads / tp * m.head_dim  # QK^T and AV, 2 FLOPs per multiply-add


def _latent_cache(m: ModelSpec, tp: int) -> float:
    return m.mla.latent_width  # replicated on every TP rank


def _latent_flops(m: ModelSpec, tp: int) -> float:
    return 2 * m.num_heads / tp * (2 * m.mla.kv_lora_rank + m.mla.qk_rope_head_dim)  # absorbed form


def _zero(m: ModelSpec, tp: int, *args) -> float:
    return 0.0


def _snapshot(m: ModelSpec, tp: int) -> float:
    return m.linear_attention.state_elems * STATE_BYTES / tp


def conv_channels(m: ModelSpec, tp: int) -> int:
    """Short-convolution channels on one of ``tp`` ranks: q and k of the key heads (replicated
    when fewer than ranks), v of the value heads."""
    la = m.linear_attention
    return 2 * max(la.num_key_heads // tp, 1) * la.key_head_dim + la.num_value_heads // tp * la.value_head_dim


def _state_held(m: ModelSpec, tp: int, kv_bytes: float = STATE_BYTES, step_tokens: int = 1) -> float:
    slots = state_slots(step_tokens)
    conv_positions = m.linear_attention.conv_kernel - 2 + slots
    return slots * _snapshot(m, tp) + conv_positions * conv_channels(m, tp) * kv_bytes


def _state_flops(m: ModelSpec, tp: int) -> float:
    return 4 * m.linear_attention.state_elems / tp  # state update and readout


@dataclass(frozen=True)
class Mixer:
    """One mixer kind (see the module docstring for the cost fields; all per rank of ``tp``)."""

    kind: str
    description: str
    build: Callable[..., list[TensorSpec]]
    cache_elems_per_token: Callable[[ModelSpec, int], float] = _zero
    windowed: bool = False
    state_bytes: Callable[..., float] = _zero  # (model, tp, kv_bytes, step_tokens)
    snapshot_bytes: Callable[[ModelSpec, int], float] = _zero
    flops_per_ctx: Callable[[ModelSpec, int], float] = _zero
    flops_const: Callable[[ModelSpec, int], float] = _zero
    allreduces: int = 1

    @property
    def is_linear(self) -> bool:
        """True when the layer keeps a constant-size recurrent state instead of a KV cache."""
        return self.state_bytes is not _zero


_KV = dict(cache_elems_per_token=_kv_cache, flops_per_ctx=_kv_flops)
_LATENT = dict(cache_elems_per_token=_latent_cache, flops_per_ctx=_latent_flops)
_STATE = dict(state_bytes=_state_held, snapshot_bytes=_snapshot, flops_const=_state_flops)

MIXERS: dict[str, Mixer] = {
    "gqa": Mixer("gqa", "full causal attention (MHA/GQA/MQA)", gqa_tensors, **_KV),
    "sliding": Mixer("sliding", "sliding-window GQA (cache capped at the window)", gqa_tensors, windowed=True, **_KV),
    "gated_attention": Mixer("gated_attention", "Qwen3.5 full attention with an output gate", gated_attention_tensors, **_KV),
    "mla": Mixer("mla", "multi-head latent attention (latent cache)", mla_tensors, **_LATENT),
    "gated_mla": Mixer("gated_mla", "Kimi K3 MLA with an output gate", mla_tensors, **_LATENT),
    "gated_deltanet": Mixer("gated_deltanet", "Qwen3.5 Gated DeltaNet (linear attention)", gated_deltanet_tensors, **_STATE),
    "kda": Mixer("kda", "Kimi Delta Attention (linear attention)", kda_tensors, **_STATE),
    "mamba2": Mixer("mamba2", "Mamba-2 selective state space (recurrent state)", mamba2_tensors, **_STATE),
    "none": Mixer("none", "no token mixer (a block with only an MLP or MoE)", no_tensors, allreduces=0),
}
