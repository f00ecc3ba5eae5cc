"""Per-sequence state of a linear-attention layer (Gated DeltaNet, KDA), positional like a KV cache.

A linear-attention layer keeps, per sequence and tensor rank, a fixed-size state instead of a
growing KV cache: the float32 recurrent state (``value_heads/tp × d_k × d_v`` for the delta
rule) and the window of its short causal convolution (the last ``kernel − 1`` inputs of the
convolved channels, ``conv_channels/tp``, in the run dtype like transformers' and vLLM's conv
state).

``LinearStateCache`` holds them for ``max_batch`` cache slots (one per sequence, as the KV
caches' rows), each as ``snapshots`` states indexed by position (``state_slots``: 1 for plain
decoding, ``max_step_tokens + 1`` when passes of up to ``max_step_tokens`` positions may be
rolled back): snapshot ``p mod snapshots`` holds the state **at** position p, i.e. after
positions ``< p``. A call at ``start`` reads the snapshot at ``start`` (zeros at 0: a new
sequence, whatever the slot held before) and writes one snapshot per position it runs, so a
later call may restart anywhere in the last ``snapshots`` positions — what speculative decoding
needs: a verify pass of k + 1 positions (built with ``max_step_tokens >= k + 1``) leaves the
states of every one of them, the next pass starts at the accepted length and reads that
position's snapshot; rejected drafts' updates are never read again (like keys past a query's
position in the static KV cache). A draft model, which writes its drafts one step at a time and
is rolled back up to ``k − 1`` of them, restarts the same way; so may a pass that re-runs the
last ``max_step_tokens`` positions from their start. A chunked prefill from position 0 writes
only its final state, so no later call may restart inside a prefill (none does). The conv
inputs are kept once per position, in a ring of ``kernel − 1 + snapshots − 1`` positions: the
window of every held position. Which positions a slot holds is kept per slot, so sequences in
different slots move independently (continuous batching). Bytes per layer and sequence on a
rank: ``snapshots · state · 4 + (kernel − 2 + snapshots) · conv_channels · run-dtype bytes``.

``run(start, rows, n, chunked, step)`` is the whole protocol for a mixer over the cache slots
``rows`` (all at the same positions): a call at 0 goes through ``chunked`` (the chunked form
over all n positions, one snapshot at the end); any other call goes through ``step`` position
by position (the recurrent form, one snapshot per position). Running every position past a
prefill through the same one-position function is what makes a verify pass compute bit for
bit what single decode steps compute (see ``runtime.exact``), so greedy speculative output
equals plain greedy output. A mixer called with per-row slots and positions runs ``run`` once
per row, on that row alone, as a one-row call would.

``causal_conv`` is the depthwise short convolution (Gated DeltaNet's), written as ``kernel``
elementwise multiply-adds so that each output element is computed the same way whatever
the number of positions in the call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.spec.mixers import state_slots  # the planner's formula: one for both

State = tuple[torch.Tensor, torch.Tensor]
"""(recurrent state [b, *state_shape] float32, conv window [b, channels, kernel - 1]: the conv
inputs of the kernel - 1 positions before)."""


class LinearStateCache(nn.Module):
    """``snapshots`` snapshots of one layer's recurrent state and the conv inputs behind them, for
    each of ``max_batch`` cache slots on this rank (see the module docstring).

    Buffers (row s: cache slot s): ``state_cache`` [max_batch, snapshots, *state_shape] float32,
    snapshot ``p mod snapshots`` the state at position p; ``conv_cache`` [max_batch, channels,
    kernel - 1 + snapshots - 1] in ``conv_dtype``, column ``p mod width`` the conv input of
    position p — enough for the window (the ``kernel - 1`` inputs before it) of every held
    position. ``held[s]`` = (low, high): slot s holds the states at positions ``low..high``."""

    def __init__(
        self,
        max_batch: int,
        state_shape: tuple[int, ...],
        conv_channels: int,
        conv_kernel: int,
        conv_dtype: torch.dtype,
        max_step_tokens: int = 1,
    ):
        super().__init__()
        if max_step_tokens < 1:
            raise ShardwiseError(f"max_step_tokens must be >= 1, got {max_step_tokens}")
        self.snapshots = state_slots(max_step_tokens)
        self.register_buffer(
            "state_cache", torch.zeros((max_batch, self.snapshots, *state_shape), dtype=torch.float32),
            persistent=False,
        )
        self.taps = conv_kernel - 1
        self.register_buffer(
            "conv_cache", torch.zeros((max_batch, conv_channels, self.taps + self.snapshots - 1), dtype=conv_dtype),
            persistent=False,
        )
        self.held = [(0, 0)] * max_batch

    def _spans(self, end: int) -> list[tuple[int, int, int]]:
        """Where the conv inputs of positions ``end - taps .. end - 1`` lie in the ring (position p in column
        p mod width): (first window column, first ring column, count) of its one or two runs of columns.
        Slices, not index_select / index_copy_ (those took 19 / 36 us per layer and token here)."""
        width = self.conv_cache.shape[-1]
        first = (end - self.taps) % width
        head = min(self.taps, width - first)
        return [(0, first, head)] + ([(head, 0, self.taps - head)] if head < self.taps else [])

    def read(self, start: int, rows: slice) -> State:
        """(state, window) at position ``start`` of cache slots ``rows``: fresh zeros at 0 (the slots
        start afresh), else the state snapshot (a view, valid until the next ``write``) and the conv
        inputs of the ``kernel - 1`` positions before ``start`` (zeros before position 0). Snapshots
        past ``start`` are dropped (rolled back)."""
        b = rows.stop - rows.start
        if start == 0:
            self.held[rows] = [(0, 0)] * b
            window = self.conv_cache.new_zeros((b, self.conv_cache.shape[1], self.taps))
            return self.state_cache.new_zeros((b, *self.state_cache.shape[2:])), window
        for slot in range(rows.start, rows.stop):
            low, high = self.held[slot]
            if not low <= start <= high:
                raise ShardwiseError(
                    f"the linear-attention state at position {start} is no longer held (held: {low}..{high}, "
                    f"{self.snapshots} snapshots): build the model with a larger max_step_tokens"
                )
            self.held[slot] = (low, start)
        ring = self.conv_cache[rows]
        window = torch.cat([ring[:, :, c : c + n] for _, c, n in self._spans(start)], dim=2)
        if start < self.taps:
            window[..., : self.taps - start] = 0
        return self.state_cache[rows, start % self.snapshots], window

    def write(self, position: int, rows: slice, state: torch.Tensor, window: torch.Tensor) -> None:
        """Hold ``state`` [b, ...] as the snapshot at ``position`` (after positions < position) of
        cache slots ``rows`` and ``window`` [b, C, kernel - 1] as the conv inputs of the positions
        before it."""
        held = self.state_cache[rows, position % self.snapshots]
        if held.data_ptr() != state.data_ptr():  # one snapshot: the steps updated it where it lies
            held.copy_(state)
        ring = self.conv_cache[rows]
        for w, c, n in self._spans(position):
            ring[:, :, c : c + n] = window[:, :, w : w + n]
        for slot in range(rows.start, rows.stop):
            low, high = self.held[slot]
            low = max(low, position - self.snapshots + 1) if position == high + 1 else position
            self.held[slot] = (low, position)

    def run(
        self,
        start: int,
        rows: slice,
        n: int,
        chunked: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        step: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Outputs [b, n, ...] of positions ``start..start+n-1`` in cache slots ``rows``, keeping the
        snapshots.

        ``chunked(state, window) -> (out [b, n, ...], state, window)`` runs all n positions at
        once (used from position 0); ``step(i, state, window) -> (out [b, 1, ...], state,
        window)`` runs the call's i-th position (every other call) and may update ``state`` in
        place (``delta_rule_step``): with one snapshot that is the held state itself, with more a
        copy of the one read."""
        state, window = self.read(start, rows)
        if start == 0:
            out, state, window = chunked(state, window)
            self.write(n, rows, state, window)
            return out
        if self.snapshots > 1:  # the steps update the state in place: keep the snapshot at ``start`` as it was
            state = state.clone()
        outs = []
        for i in range(n):
            out, state, window = step(i, state, window)
            self.write(start + i + 1, rows, state, window)
            outs.append(out)
        return outs[0] if n == 1 else torch.cat(outs, dim=1)


FUSED = True
"""Whether one-position steps run the compiled ``fused_step`` op where it builds (tests switch it off to
hold the op against the torch path it replaces)."""


def fused_step(device: torch.device):
    """The compiled ``shardwise_la.gated_delta_step`` (``csrc/linear_attention.cpp``): one position of a
    gated delta-rule layer — short conv, SiLU, L2 norms, decay and delta rule — in one call, ``(x [B, C],
    window [B, C, K-1], conv weight [C, K], log-decay g [B, H] or [B, H, d_k], beta [B, H], state,
    key_heads, q scale[, a_log, dt_bias, lower_bound, log1p]) -> (o [B, H, d_v] float32, new window)``, the
    state updated in place; with ``a_log`` given, g and beta are the raw projections and the op forms the
    gates itself (the layers' ``log_decay`` / softplus and sigmoid). In torch
    ops the same step is ~50 small kernels per layer and token, whose dispatch cost more than their
    bytes. None when ``FUSED`` is off or the op cannot be built here (no C++ compiler): the torch ops
    (``causal_conv``, ``delta_rule_step``) run each step instead, to the same results within float32
    rounding. Always None for tensors on ``device`` other than the CPU."""
    if not FUSED or device.type != "cpu":
        return None
    from shardwise.runtime import cpp_ops

    return cpp_ops.optional_op("linear_attention.cpp", "shardwise_la", "gated_delta_step")


def delta_rule_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                    beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One position of the gated delta rule, **in place** on ``state`` [B, H, d_k, d_v] (float32):
    ``S ← S · decay``, ``S ← S + k ⊗ β (v − Sᵀk)``, ``o = Sᵀq`` for q, k [B, H, d_k], v [B, H, d_v],
    beta [B, H] and ``decay`` broadcasting to the state (per channel [B, H, d_k, 1]: KDA; per head
    [B, H, 1, 1]: Gated DeltaNet). The products run as batched matrix products over the B·H heads
    (a few calls, no [B, H, d_k, d_v] temporaries). Returns (o [B, H, d_v], the updated state)."""
    b, h, dk, dv = state.shape
    state.mul_(decay)
    heads = state.view(b * h, dk, dv)
    keys = k.reshape(b * h, 1, dk)
    delta = (v.reshape(b * h, 1, dv) - torch.bmm(keys, heads)) * beta.reshape(b * h, 1, 1)
    heads.baddbmm_(keys.transpose(1, 2), delta)
    return torch.bmm(q.reshape(b * h, 1, dk), heads).view(b, h, dv), state


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of ``x`` [B, C, T] continuing ``window`` [B, C, K-1] (the
    inputs before it) with ``weight`` [C, K]: (outputs [B, C, T] in float32, the new window
    [B, C, K-1] in the window's dtype). Computed as K multiply-adds in float32 (transformers
    convolves in the weight dtype); one position (every call past position 0, where verify passes
    and decode steps must agree bit for bit) as one product and one sum over the K taps."""
    kernel = weight.shape[-1]
    full = torch.cat([window.to(x.dtype), x], dim=-1)
    t = x.shape[-1]
    w = weight.float()
    if t == 1:  # a decode / verify step (every call past position 0): one product and one sum
        return (full.float() * w).sum(-1, keepdim=True), full[..., 1:].to(window.dtype)
    out = full[..., 0:t].float() * w[:, 0:1]
    for j in range(1, kernel):
        out = out + full[..., j : j + t].float() * w[:, j : j + 1]
    return out, full[..., t:].to(window.dtype).contiguous()
