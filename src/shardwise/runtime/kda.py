"""Kimi Delta Attention (KDA), the linear-attention mixer of Kimi Linear, on one rank's heads.

Per head, a state S (d_k × d_v, float32) replaces the KV cache. For each token t, with
q_t, k_t L2-normalised (q_t also scaled by d_k^-½), a per-channel log-decay g_t ≤ 0 and a
write strength β_t ∈ (0, 1):

    S ← diag(exp g_t) · S                        forget, channel by channel
    S ← S + k_t · (β_t (v_t − Sᵀ k_t))ᵀ          delta rule: write what S does not yet predict
    o_t = Sᵀ q_t

- ``kda_step`` is that recurrence for one token (decode, and speculative verify position by
  position); ``kda_chunked`` computes the same thing for a whole prompt chunk by chunk
  (prefill): inside a chunk the delta-rule writes form a unit lower-triangular system
  (I + diag(β) A) U = β (V − (K ⊙ Γ) S₀), solved at once; only the state crosses chunks.
  ``tests/test_runtime_kimi_linear.py`` holds the two equal.
- The inputs, as transformers' ``KimiLinearDeltaAttention``: q, k, v projections, each through
  a depthwise causal conv (kernel 4, no bias) and SiLU; g = −exp(A_log) · softplus(f_b(f_a(x))
  + dt_bias) (low-rank forget gate, A_log per head, dt_bias per channel); β = sigmoid(b_proj(x));
  the output per head RMS-normalised (o_norm, over d_v) times sigmoid(g_b(g_a(x))), then o_proj.
  Kimi K3 (Moonshot's ``modeling_kimi_linear.py``): the output gate is one full-rank g_proj(x)
  (``use_full_rank_gate``) and g = gate_lower_bound · sigmoid(exp(A_log) · (f + dt_bias))
  (``gate_lower_bound``: ``log_decay``).

Tensor parallelism (vLLM's and SGLang's ``KimiDeltaAttention``): heads split over the ranks —
q/k/v, their convs, f_b, g_b, b_proj, A_log and dt_bias by channel or head; f_a and g_a (the
low-rank down-projections, d_k wide) replicated; o_proj row-parallel, so the block ends with the
decoder layer's one all-reduce. The recurrence needs no communication.

State per sequence and rank: the float32 state ``heads/tp × d_k × d_v`` and the last
``kernel − 1`` conv inputs (``3 · heads/tp · d`` channels, run dtype), in the positional
``linear_state.LinearStateCache`` Gated DeltaNet uses too: a call at ``start`` continues from the
snapshot at ``start``; built for speculative decoding (``max_step_tokens`` > 1) it keeps a snapshot
per position of the last pass, so a rejected draft's update is simply never read — the next pass
restarts at the accepted length. Prefill (a call at 0) runs the chunked form, every other call
``kda_step`` position by position (one compiled call: ``linear_state.fused_step``), which makes a
verify pass bit-identical to single steps. The state is kept per cache slot: called with ``slots``
(continuous batching), each row runs that protocol alone in its own slot from its own first
position, exactly as a one-row call would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.runtime.attention import per_slot
from shardwise.runtime.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    Shard,
    join_rows,
    project_inputs,
    shard_param,
)
from shardwise.runtime.linear_state import LinearStateCache, causal_conv, delta_rule_step, fused_step
from shardwise.runtime.rms_norm import rms_norm
from shardwise.spec.model import TensorSpec

CHUNK = 64
"""Positions per chunk of the prefill form."""


# ---------------------------------------------------------------------------- the math


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dimension (FLA's and transformers' form)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def log_decay(raw: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int,
              lower_bound: float | None = None) -> torch.Tensor:
    """Per-channel log-decay g = −exp(A_log) · softplus(raw + dt_bias), float32 [..., H, d_k]; with
    ``lower_bound`` (Kimi K3's ``gate_lower_bound``, the "safe gate") g = lower_bound ·
    sigmoid(exp(A_log) · (raw + dt_bias)), which keeps each step's decay above exp(lower_bound)
    (flash-linear-attention ``fla/ops/kda/gate.py``, ``naive_kda_lowerbound_gate``)."""
    g = (raw.float() + dt_bias.float()).view(*raw.shape[:-1], -1, head_dim)
    a = torch.exp(a_log.float().reshape(-1, 1))
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * g)
    softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
    return -a * softplus


def kda_step(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: q, k, g [B, H, d_k], v [B, H, d_v], beta [B, H], state [B, H, d_k, d_v]
    (all float32; q, k normalised, q scaled) → (output [B, H, d_v], the state, updated in place:
    ``linear_state.delta_rule_step`` with a per-channel decay)."""
    return delta_rule_step(state, q, k, v, g.exp().unsqueeze(-1), beta)


def kda_chunked(q, k, v, g, beta, state, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole sequence: q, k, g [B, T, H, d_k], v [B, T, H, d_v], beta [B, T, H], state
    [B, H, d_k, d_v] (float32, as for ``kda_step``) → (outputs [B, T, H, d_v], final state).

    Per chunk of C positions with cumulative log-decay G (Γ = exp G): A[t, s] = Σ_c k_t k_s
    exp(G_t − G_s) for s < t; U = (I + diag β A)⁻¹ β (V − (K ⊙ Γ) S₀) are the delta-rule writes;
    O = (Q ⊙ Γ) S₀ + (P ⊙ causal) U with P[t, s] = Σ_c q_t k_s exp(G_t − G_s); and
    S = diag(Γ_C) S₀ + Σ_s (k_s ⊙ exp(G_C − G_s)) u_sᵀ. Every exponent is ≤ 0.
    """
    b, t, h, dk = k.shape
    pad = -t % chunk
    q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (q, k, v, g))  # [B, H, T', d]
    beta = F.pad(beta, (0, 0, 0, pad)).transpose(1, 2)  # [B, H, T']; padded positions write nothing
    eye = torch.eye(chunk, dtype=q.dtype)
    causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    out = []
    for c in range(0, t + pad, chunk):
        qc, kc, vc = (x[:, :, c : c + chunk] for x in (q, k, v))
        bc = beta[:, :, c : c + chunk]
        G = g[:, :, c : c + chunk].cumsum(dim=-2)  # [B, H, C, d_k]
        diff = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~causal[..., None], float("-inf")).exp()  # [B,H,C,C,d_k]
        A = (kc.unsqueeze(-2) * kc.unsqueeze(-3) * diff).sum(-1).masked_fill(eye.bool(), 0.0)  # strictly lower
        P = (qc.unsqueeze(-2) * kc.unsqueeze(-3) * diff).sum(-1)  # lower, diagonal included
        rhs = bc.unsqueeze(-1) * (vc - (kc * G.exp()) @ state)
        U = torch.linalg.solve_triangular(eye + bc.unsqueeze(-1) * A, rhs, upper=False, unitriangular=True)
        out.append((qc * G.exp()) @ state + P @ U)
        last = G[:, :, -1:]
        state = state * last.transpose(-1, -2).exp() + (kc * (last - G).exp()).transpose(-1, -2) @ U
    return torch.cat(out, dim=2)[:, :, :t].transpose(1, 2), state


# ---------------------------------------------------------------------------- the layer


class KimiDeltaAttention(nn.Module):
    """KDA over this rank's heads (see the module docstring); returns o_proj's partial sum."""

    recurrent = True  # per-sequence state: ``ShardedCausalLM.check_step_tokens`` sizes rollback by it

    def __init__(self, tensors: dict[str, TensorSpec], shard: Shard, dtype: torch.dtype, *, head_dim: int,
                 kernel: int, eps: float, max_batch: int = 1, max_step_tokens: int = 1,
                 lower_bound: float | None = None):
        super().__init__()
        t = tensors
        self.full_rank_gate = "g_proj.weight" in t  # Kimi K3's use_full_rank_gate: one output-gate projection
        gate = ("g_proj",) if self.full_rank_gate else ("g_a_proj",)
        # the projections of the layer input: one product once stacked (layers.stack_inputs)
        self.input_projections = ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", *gate)
        for name in ("q_proj", "k_proj", "v_proj", "b_proj", "f_b_proj") + (gate if self.full_rank_gate else ("g_b_proj",)):
            setattr(self, name, ColumnParallelLinear(t[f"{name}.weight"], shard, dtype))
        self.f_a_proj = ReplicatedLinear(t["f_a_proj.weight"], shard, dtype)
        if not self.full_rank_gate:
            self.g_a_proj = ReplicatedLinear(t["g_a_proj.weight"], shard, dtype)
        self.lower_bound = lower_bound
        self.o_proj = RowParallelLinear(t["o_proj.weight"], shard, dtype)
        convs = [shard_param(t[f"{name}.weight"], shard, dtype) for name in ("q_conv1d", "k_conv1d", "v_conv1d")]
        for name, weight in zip(("q_conv1d", "k_conv1d", "v_conv1d"), convs):
            setattr(self, name, nn.Module())
            getattr(self, name).weight = weight
        self.conv_weight = join_rows(convs)[:, 0]  # q|k|v [3·width, kernel]: the parameters are views of it
        self.A_log = shard_param(t["A_log"], shard, dtype)
        keep = t["dt_bias"].keep_float32  # float32 as in transformers; the planner reads the same marker
        self.dt_bias = shard_param(t["dt_bias"], shard, torch.float32 if keep else dtype)
        self.o_norm = nn.Module()
        self.o_norm.weight = shard_param(t["o_norm.weight"], shard, dtype)
        self.head_dim, self.eps = head_dim, eps
        self.width = self.q_proj.weight.shape[0]  # this rank's heads × head_dim
        self.heads = self.width // head_dim
        self.state = LinearStateCache(max_batch, (self.heads, head_dim, head_dim), 3 * self.width, kernel, dtype,
                                      max_step_tokens)

    def _prepare(self, mixed, f, braw):
        """Conv outputs [..., C] → (q, k, v, g, beta) float32 for the recurrence (any number of positions).
        The conv output is rounded to the run dtype before SiLU, as transformers convolves in it."""
        q, k, v = F.silu(mixed.to(f.dtype)).split(self.width, dim=-1)
        shape = (*q.shape[:-1], self.heads, self.head_dim)
        q = l2_normalize(q.float().reshape(shape)) * self.head_dim**-0.5
        k = l2_normalize(k.float().reshape(shape))
        g = log_decay(f, self.A_log, self.dt_bias, self.head_dim, self.lower_bound)
        return q, k, v.float().reshape(shape), g, torch.sigmoid(braw).float()

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope=None,
                slots: list[int] | None = None) -> torch.Tensor:
        """x [B, T, hidden] at ``positions`` [T] in cache slots 0..B-1, or, with ``slots``, at
        ``positions`` [B, T] in cache slots ``slots``: the projections run on every row at once,
        the state protocol on each row alone, as a one-row call would (``attention.per_slot``)."""
        b, n, _ = x.shape
        q, k, v, fa, braw, g = project_inputs(self, x)
        inputs = torch.cat([q, k, v], dim=-1).transpose(1, 2)  # [b, C, n]
        f, gate = self.f_b_proj(fa), (g if self.full_rank_gate else self.g_b_proj(g))
        if slots is None:
            out = self._mix(inputs, f, braw, positions, slice(0, b))
        else:
            out = per_slot(self._mix, slots, positions, inputs, f, braw)
        return self.o_proj(self._gated_norm(out.to(x.dtype), gate).reshape(b, n, self.width))

    def _mix(self, inputs: torch.Tensor, f: torch.Tensor, braw: torch.Tensor, positions: torch.Tensor,
             rows: slice) -> torch.Tensor:
        """The recurrence over conv inputs ``inputs`` [b, C, T], forget-gate and beta projections
        ``f`` [b, T, H·d_k], ``braw`` [b, T, H] at ``positions`` [T] in cache slots ``rows`` →
        [b, T, H, d_v] float32."""
        weight = self.conv_weight

        def chunked(state, window):  # prefill: every position at once, one snapshot at the end
            y, window = causal_conv(inputs, window, weight)
            out, state = kda_chunked(*self._prepare(y.transpose(1, 2), f, braw), state)
            return out, state, window

        def step(i, state, window):  # decode / verify: position i exactly as a single-token step
            op = fused_step(inputs.device)
            if op is not None:  # the same step in one compiled call
                out, window = op(inputs[:, :, i].contiguous(), window.contiguous(), weight, f[:, i], braw[:, i],
                                 state, self.heads, self.head_dim**-0.5, self.A_log, self.dt_bias, self.lower_bound)
                return out[:, None], state, window
            y, window = causal_conv(inputs[:, :, i : i + 1], window, weight)
            out, state = kda_step(*self._prepare(y[:, :, 0], f[:, i], braw[:, i]), state)
            return out[:, None], state, window

        return self.state.run(positions.tolist()[0], rows, inputs.shape[-1], chunked, step)

    def _gated_norm(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's d_v (float32), times sigmoid(gate), in the run dtype."""
        h = rms_norm(out.float(), self.o_norm.weight.float(), self.eps)  # float32: w · h
        return (h * torch.sigmoid(gate.float().view(out.shape))).to(out.dtype)
