"""Qwen3.5 Gated DeltaNet (linear attention) over this rank's heads, as transformers'
``Qwen3_5MoeGatedDeltaNet`` computes it.

Per token: ``in_proj_qkv`` gives q|k|v (key_dim, key_dim, value_dim channels), convolved by a
short depthwise causal conv1d and SiLU; q and k are L2-normalised per head (q scaled by
``d_k^-1/2``); ``beta = sigmoid(in_proj_b x)``, the decay ``g = -exp(A_log) · softplus(in_proj_a x +
dt_bias)``; the gated delta rule updates the fp32 state ``S [value_heads, d_k, d_v]``::

    S ← S · exp(g);  S ← S + k ⊗ β (v − Sᵀk);  o = Sᵀ q

(each key head serves ``value_heads / key_heads`` consecutive value heads); the output goes
through a gated RMSNorm per value head (``norm(o) · silu(in_proj_z x)``) and ``out_proj``.

Tensor parallel (as vLLM / SGLang): heads split over ranks. ``in_proj_qkv`` and the conv are
split by channel **per part** — this rank's q heads, k heads and v heads, each cut from its own
part of the fused tensor (``plan.shard_spans`` of its declared ``tp_parts``; a plain row cut of the fused tensor would mix q, k
and v); key heads replicate when fewer than ranks (a rank's value heads all share one key
head). ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` / ``A_log`` / ``dt_bias`` split by value
head, ``out_proj`` row-parallel (the decoder layer's one all-reduce); the norm weight
(one head's width) is replicated.

Prefill (a call at position 0) uses the chunked form (``chunk_gated_delta_rule``, chunks of
64 as transformers' ``torch_chunk_gated_delta_rule``), every other call the recurrent form
position by position (``linear_state.fused_step``, one compiled call, else ``recurrent_step``);
the state lives in a ``linear_state.LinearStateCache``, per cache slot. Called with ``slots`` (continuous batching), each row runs that protocol alone in
its own slot from its own first position, exactly as a one-row call would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.plan import shard_spans
from shardwise.runtime.attention import per_slot
from shardwise.runtime.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Shard,
    linear,
    project_inputs,
    shard_param,
)
from shardwise.runtime.linear_state import LinearStateCache, causal_conv, delta_rule_step, fused_step
from shardwise.runtime.rms_norm import rms_norm
from shardwise.spec.mixers import LinearAttentionSpec
from shardwise.spec.model import TensorSpec

CHUNK = 64
"""Positions per chunk of the chunked form (transformers' and FLA's default)."""


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(Σx² + eps)`` over the last dimension (FLA's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_step(state, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """One position of the gated delta rule, float32: q, k [B, H, d_k], v [B, H, d_v], g, beta
    [B, H], state [B, H, d_k, d_v] → (output [B, H, d_v], the state, updated in place:
    ``linear_state.delta_rule_step`` with a per-head decay)."""
    return delta_rule_step(state, q, k, v, g.exp()[..., None, None], beta)


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T positions in chunks (the WY / UT-transform form), float32:
    q, k [B, H, T, d_k], v [B, H, T, d_v], g, beta [B, H, T], state [B, H, d_k, d_v] →
    (outputs [B, H, T, d_v], final state). Equal to T ``recurrent_step`` calls up to rounding."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    pad = -t % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(b, h, n, chunk).cumsum(dim=-1)  # log-decay from the chunk start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower triangular (diagonal ignored)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_values)
    for i in range(n):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(b, h, n * chunk, dv)[:, :, :t], state


def spanned_param(spec: TensorSpec, spans: list[tuple[int, int]], dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised parameter holding rows ``spans`` (along ``spec.tp_dim``) of ``spec``,
    concatenated; the loader reads exactly those rows (``param.spans``)."""
    shape = list(spec.shape)
    shape[spec.tp_dim] = sum(stop - start for start, stop in spans)
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.spec, p.expert, p.spans = spec, None, list(spans)  # type: ignore[attr-defined]
    return p


class SpannedLinear(nn.Module):
    """Column-parallel ``y = x Wᵀ`` over rows ``spans`` of W (a fused q|k|v projection)."""

    def __init__(self, weight: TensorSpec, spans: list[tuple[int, int]], dtype: torch.dtype):
        super().__init__()
        self.weight = spanned_param(weight, spans, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class GatedRMSNorm(nn.Module):
    """``w · rmsnorm(x) · silu(gate)`` per head (transformers' ``Qwen3_5MoeRMSNormGated``)."""

    def __init__(self, weight: TensorSpec, shard: Shard, dtype: torch.dtype, eps: float):
        super().__init__()
        self.weight = shard_param(weight, shard, dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.weight, self.eps)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer on this rank's heads (see the module docstring); returns the
    partial ``out_proj`` output the decoder layer all-reduces."""

    recurrent = True  # per-sequence state: ``ShardedCausalLM.check_step_tokens`` sizes rollback by it

    input_projections = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # read the layer input: one product once stacked (layers.stack_inputs)

    def __init__(self, tensors: dict[str, TensorSpec], la: LinearAttentionSpec, shard: Shard, dtype: torch.dtype, *,
                 eps: float, max_batch: int = 1, max_step_tokens: int = 1):
        super().__init__()
        t = tensors
        spans = shard_spans(t["in_proj_qkv.weight"], shard.plan, shard.tp_rank)
        self.in_proj_qkv = SpannedLinear(t["in_proj_qkv.weight"], spans, dtype)
        self.conv1d = nn.Module()  # transformers' nn.Conv1d: only its weight [C, 1, K] (no bias)
        self.conv1d.weight = spanned_param(t["conv1d.weight"], spans, dtype)
        self.in_proj_z = ColumnParallelLinear(t["in_proj_z.weight"], shard, dtype)
        self.in_proj_b = ColumnParallelLinear(t["in_proj_b.weight"], shard, dtype)
        self.in_proj_a = ColumnParallelLinear(t["in_proj_a.weight"], shard, dtype)
        self.dt_bias = shard_param(t["dt_bias"], shard, dtype)
        self.A_log = shard_param(t["A_log"], shard, dtype)
        self.norm = GatedRMSNorm(t["norm.weight"], shard, dtype, eps)
        self.out_proj = RowParallelLinear(t["out_proj.weight"], shard, dtype)
        self.dk, self.dv = la.key_head_dim, la.value_head_dim
        self.k_heads = (spans[0][1] - spans[0][0]) // self.dk
        self.v_heads = self.A_log.shape[0]
        self.split = [self.k_heads * self.dk, self.k_heads * self.dk, self.v_heads * self.dv]
        self.state = LinearStateCache(max_batch, (self.v_heads, self.dk, self.dv), sum(self.split), la.conv_kernel,
                                      dtype, max_step_tokens)

    def _inputs(self, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
        """q, k, v [B, H_v, T, d] float32 and g, beta [B, H_v, T] from the convolved q|k|v
        ``y`` [B, T, C] (float32) and the in_proj_a / in_proj_b outputs [B, T, H_v]."""
        bsz, n, _ = y.shape
        q, k, v = y.split(self.split, dim=-1)
        q = l2norm(q.reshape(bsz, n, self.k_heads, self.dk)) * self.dk**-0.5
        k = l2norm(k.reshape(bsz, n, self.k_heads, self.dk))
        v = v.reshape(bsz, n, self.v_heads, self.dv)
        if self.v_heads != self.k_heads:
            q = q.repeat_interleave(self.v_heads // self.k_heads, dim=2)
            k = k.repeat_interleave(self.v_heads // self.k_heads, dim=2)
        beta = b.sigmoid().float()
        g = self._log_decay(a)
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        return q, k, v, g.transpose(1, 2).contiguous(), beta.transpose(1, 2).contiguous()

    def _log_decay(self, a: torch.Tensor) -> torch.Tensor:
        """g = −exp(A_log) · softplus(a + dt_bias), float32, from the in_proj_a outputs ``a`` [..., H_v]."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def _conv(self, qkv: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """SiLU(conv(q|k|v)) [B, T, C] in the run dtype, rounded as transformers rounds it, and the new window."""
        y, window = causal_conv(qkv.transpose(1, 2), window, self.conv1d.weight[:, 0])
        return F.silu(y.to(qkv.dtype)).float().transpose(1, 2).contiguous(), window

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope=None,
                slots: list[int] | None = None) -> torch.Tensor:
        """x [B, T, hidden] at ``positions`` [T] in cache slots 0..B-1, or, with ``slots``, at
        ``positions`` [B, T] in cache slots ``slots``: the projections run on every row at once,
        the state protocol on each row alone, as a one-row call would (``per_slot``)."""
        bsz, n, _ = x.shape
        qkv, z, b, a = project_inputs(self, x)
        z = z.view(bsz, n, self.v_heads, self.dv)
        if slots is None:
            core = self._mix(qkv, a, b, positions, slice(0, bsz))
        else:
            core = per_slot(self._mix, slots, positions, qkv, a, b)
        out = self.norm(core.to(x.dtype), z).reshape(bsz, n, -1)
        return self.out_proj(out)

    def _mix(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, positions: torch.Tensor,
             rows: slice) -> torch.Tensor:
        """The delta rule over ``qkv`` [b, T, C], ``a`` / ``b`` [b, T, H_v] (projection outputs) at
        ``positions`` [T] in cache slots ``rows`` → [b, T, H_v, d_v] float32."""

        def chunked(state, window):
            y, window = self._conv(qkv, window)
            q, k, v, g, beta = self._inputs(y, a, b)
            out, state = chunk_gated_delta_rule(q, k, v, g, beta, state)
            return out.transpose(1, 2), state, window

        def step(i, state, window):
            op = fused_step(qkv.device)
            if op is not None:  # the same step in one compiled call
                out, window = op(qkv[:, i].contiguous(), window.contiguous(), self.conv1d.weight[:, 0].contiguous(),
                                 a[:, i], b[:, i], state, self.k_heads, self.dk**-0.5, self.A_log, self.dt_bias, None, True)
                return out[:, None], state, window
            y, window = self._conv(qkv[:, i : i + 1], window)
            q, k, v, g, beta = self._inputs(y, a[:, i : i + 1], b[:, i : i + 1])
            out, state = recurrent_step(state, q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0])
            return out[:, None], state, window

        return self.state.run(positions.tolist()[0], rows, qkv.shape[1], chunked, step)
