"""Attention blocks with a static per-rank KV cache.

- ``GQAttention``: Llama / Qwen3-MoE / gpt-oss attention. q, k, v are column-parallel by
  heads (KV heads replicate when there are fewer than TP ranks), o_proj row-parallel.
  Options: per-head q/k RMSNorm (Qwen3), biases and attention sinks (gpt-oss), a sliding
  window (gpt-oss's alternating layers), whose cache is a ring of
  ``sliding_cache_len(max_seq_len, window, max_step_tokens)`` positions.
- ``MLAttention``: DeepSeek-V3 multi-head latent attention. q_a and kv_a are replicated,
  q_b and kv_b column-parallel by heads, o_proj row-parallel; the cache holds the latent
  (kv_lora_rank normalised + qk_rope_head_dim rotated) per token, replicated on every rank.
  ``rope=False`` is Kimi Linear's NoPE MLA (``mla_use_nope``): the same tensors, no rotation.

Both return this rank's partial o_proj output; the decoder layer all-reduces it. Called with
``slots`` (``ShardedCausalLM.forward(ids, start, slots)``: continuous batching), row i of the
input sits at its own positions ``positions[i]`` and reads and writes cache slot ``slots[i]``;
its attention then runs alone, exactly as a one-row call at those positions in that slot would
(the same kernel shapes, so the same bits), and only the projections run on every row at once.
``per_slot`` (that row loop) and ``full_attention`` (the static full-attention cache) serve
``qwen3_5.GatedAttention`` and the linear-attention mixers too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.runtime import cpp_ops
from shardwise.runtime.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    Shard,
    apply_rotary,
    apply_rotary_interleaved,
    linear,
    project_inputs,
    shard_param,
)
from shardwise.runtime.rms_norm import RMSNorm
from shardwise.spec.mixers import cache_positions
from shardwise.spec.model import TensorSpec


def sliding_cache_len(max_seq_len: int, window: int, max_step_tokens: int = 1) -> int:
    """Positions a sliding-window layer's ring cache holds per sequence:
    ``min(max_seq_len, window + max_step_tokens - 1)``.

    A call at ``start`` reads the ``window - 1`` positions before it from the ring. Positions
    that a later call may roll back (at most ``max_step_tokens - 1`` past the restart point:
    the rejected drafts of a verify pass, or the drafts a draft model wrote one by one) must
    not overwrite those, so the ring holds ``window - 1 + max_step_tokens - 1`` positions at
    least; one more keeps it at exactly ``window`` for plain decoding. The formula is the mixer
    table's (``spec.mixers.cache_positions``), which the planner counts too."""
    return int(cache_positions(max_seq_len, window, max_step_tokens))


def attention_mask(
    q_pos: torch.Tensor, length: int, window: int | None, key_start: int = 0
) -> torch.Tensor:
    """Boolean mask [T, length] over keys at positions ``key_start..key_start+length-1``
    (True = attend): query at position p sees keys j <= p (and j > p - window)."""
    k_pos = torch.arange(key_start, key_start + length)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of q [B, H, T, d] over k/v [B, kv, L, d] (each KV head serves H / kv
    query heads; ``mask`` [T, L] boolean, None: every query sees every key) → [B, T, H·dv].

    One query row per head on the CPU (a decode step, a verify pass's row) runs the compiled
    ``shardwise_attn.decode`` (``csrc/decode_attention.cpp``: float32 scores and softmax, the caches
    read in place, one fixed summation order per row) where it builds: torch's flash kernel for
    one row took 1.1-12× as long on an AMD EPYC VM (float32 26 vs 33 µs at 64 keys, 1.1 vs 2.4 ms
    at 4096; bfloat16 20 vs 131 µs, 0.8 vs 10.2 ms). Otherwise, without sinks, it is torch's
    ``scaled_dot_product_attention`` (its CPU kernel reads the KV heads in place, no copy per query
    group, and keeps the scores in float32). With sinks (gpt-oss: one learned logit per head joins
    the softmax and is then dropped) it is the eager form, as transformers computes it."""
    groups = q.shape[1] // k.shape[1]
    if sinks is None and mask is None and q.shape[2] == 1:
        op = _one_row_kernel(q, k, v)
        if op is not None:
            return op(q.contiguous(), k, v, scaling)
    if sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(v.dtype)
    out = torch.matmul(probs, v)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def _one_row_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The compiled one-row attention op for these tensors, or None: off the CPU, another dtype, a
    cache not contiguous along its last dim, or no build for this CPU (no AVX-512 / compiler)."""
    if (q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16) or k.dtype != q.dtype
            or v.dtype != q.dtype or k.stride(-1) != 1 or v.stride(-1) != 1):
        return None
    return cpp_ops.optional_op("decode_attention.cpp", "shardwise_attn", "decode")


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    window: int | None,
    scaling: float,
    sinks: torch.Tensor | None = None,
    key_start: int = 0,
) -> torch.Tensor:
    """Causal attention of queries q [B, H, T, d] at ``positions`` over keys/values
    [B, kv, L, d] (H a multiple of kv) at positions ``key_start..key_start+L-1``.

    A single-token step attends over all L keys (the caller passes exactly the keys it sees:
    no mask); a prefill (first position 0) attends in one masked call. A multi-token pass past
    position 0 — a speculative verify pass — attends **row by row**, each query over exactly
    the keys ``0..p`` a single-token step at its position p sees, so every row runs the same
    kernel shapes as that step and gives bit-identical output (a wider softmax or matmul
    changes the summation order). Keys past a row's position — rejected drafts of an earlier
    pass included — are never read, so rolling the static cache back only needs the next pass
    to start at the accepted length. Sliding layers pass only the keys of the window
    (``key_start`` = first position of the first query's window), and a row reads only its own
    window: the keys a single-token step at its position gets.
    """
    if positions.numel() == 1:
        return _attend(q, k, v, None, scaling, sinks)
    held = positions.tolist()  # one host read of the positions (indexing them one by one costs ~2.5 us each)
    if held[0] == 0:
        return _attend(q, k, v, attention_mask(positions, k.shape[2], window, key_start), scaling, sinks)
    rows = []
    for i, p in enumerate(held):
        end = p + 1 - key_start
        begin = max(0, p - window + 1 - key_start) if window is not None else 0
        rows.append(_attend(q[:, :, i : i + 1], k[:, :, begin:end], v[:, :, begin:end], None, scaling, sinks))
    return torch.cat(rows, dim=1)


def span(positions: torch.Tensor) -> tuple[int, int]:
    """(first position, one past the last) of ``positions`` [T], read from the tensor once."""
    held = positions.tolist()
    return held[0], held[-1] + 1


def per_slot(run, slots: list[int], positions: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    """Continuous batching: ``run(*row_i, positions[i], slice(slots[i], slots[i] + 1))`` for each
    row i of ``tensors`` (sliced ``[i : i + 1]``) at its positions ``positions[i]`` [T] in cache
    slot ``slots[i]``, each alone — the shapes a one-row call has — concatenated along rows."""
    rows = [run(*(t[i : i + 1] for t in tensors), positions[i], slice(s, s + 1)) for i, s in enumerate(slots)]
    return torch.cat(rows)


def full_attention(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    rows: slice,
    scaling: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write k, v [b, kv, T, d] at ``positions`` [T] (index = position) into rows ``rows`` of the
    static caches [max_batch, kv, S, d] and attend q [b, H, T, d] (H a multiple of kv: each KV head
    serves H / kv query heads) over those rows' keys ``0..positions[-1]`` → [b, T, H·d]."""
    start, end = span(positions)
    k_cache[rows, :, start:end] = k
    v_cache[rows, :, start:end] = v
    return attend(q, k_cache[rows, :, :end], v_cache[rows, :, :end], positions, None, scaling, sinks)


class GQAttention(nn.Module):
    """Grouped-query attention over this rank's heads, static KV cache [max_batch, kv_local, S, d]
    (one row per cache slot: per sequence).

    Full attention: S = ``max_seq_len``, position p at index p. Sliding window: a ring of
    S = ``sliding_cache_len(max_seq_len, window, max_step_tokens)`` positions, position p at
    index p mod S, with its bookkeeping per cache slot; a call at ``start`` attends over the
    ring's ``window - 1`` positions before ``start`` followed by its own new keys, then writes
    its last (up to S) positions.
    """

    input_projections = ("q_proj", "k_proj", "v_proj")  # read the layer input: one product once stacked (layers.stack_inputs)

    def __init__(
        self,
        tensors: dict[str, TensorSpec],
        shard: Shard,
        dtype: torch.dtype,
        *,
        head_dim: int,
        eps: float,
        max_seq_len: int,
        max_batch: int = 1,
        window: int | None = None,
        max_step_tokens: int = 1,
    ):
        super().__init__()
        t = tensors
        self.q_proj = ColumnParallelLinear(t["q_proj.weight"], shard, dtype, t.get("q_proj.bias"))
        self.k_proj = ColumnParallelLinear(t["k_proj.weight"], shard, dtype, t.get("k_proj.bias"))
        self.v_proj = ColumnParallelLinear(t["v_proj.weight"], shard, dtype, t.get("v_proj.bias"))
        self.o_proj = RowParallelLinear(t["o_proj.weight"], shard, dtype, t.get("o_proj.bias"))
        self.q_norm = RMSNorm(t["q_norm.weight"], shard, dtype, eps) if "q_norm.weight" in t else None
        self.k_norm = RMSNorm(t["k_norm.weight"], shard, dtype, eps) if "k_norm.weight" in t else None
        self.sinks = shard_param(t["sinks"], shard, dtype) if "sinks" in t else None
        self.head_dim = head_dim
        self.heads = self.q_proj.weight.shape[0] // head_dim
        self.kv_heads = self.k_proj.weight.shape[0] // head_dim
        self.scaling = head_dim**-0.5
        self.window = window
        self.cache_len = max_seq_len if window is None else sliding_cache_len(max_seq_len, window, max_step_tokens)
        # sliding ring of each cache slot: (low, written), positions low..written-1 are held (the rest are stale)
        self.rings = [(0, 0)] * max_batch
        cache_shape = (max_batch, self.kv_heads, self.cache_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)

    @property
    def written(self) -> int:
        """One past the last position written into slot 0's ring (the one-sequence path's bookkeeping)."""
        return self.rings[0][1]

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
        slots: list[int] | None = None,
    ) -> torch.Tensor:
        """x [B, T, hidden] at ``positions`` [T] in cache rows 0..B-1, or, with ``slots``, at
        ``positions`` [B, T] in cache slots ``slots`` (rope's cos/sin then [B, 1, T, d/2])."""
        step = self.one_token_step(x, rope, slots)
        if step is not None:
            qkv = linear(x, self.stack.weight)
            return self.o_proj(step(qkv, *rope, self.k_cache, self.v_cache, positions, self.heads, self.scaling, *self.step_norms()))
        b, n, _ = x.shape
        q, k, v = project_inputs(self, x)
        q = q.view(b, n, self.heads, self.head_dim)
        k = k.view(b, n, self.kv_heads, self.head_dim)
        v = v.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        if slots is None:
            return self.o_proj(self._cached(q, k, v, positions, slice(0, b)))
        return self.o_proj(per_slot(self._cached, slots, positions, q, k, v))

    def step_norms(self) -> tuple:
        """``shardwise_attn.step``'s q / k RMSNorm arguments: (q weight, k weight, eps), or (None, None, 0.0)."""
        return (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm is not None else (None, None, 0.0)

    def one_token_step(self, x: torch.Tensor, rope, slots: list[int] | None):
        """``shardwise_attn.step`` (``csrc/decode_attention.cpp``: the rest of this forward after the stacked
        q|k|v product, in one call, with the same ops and bits) where it applies: one token per row of full
        attention on the CPU in float32 / bfloat16, q|k|v stacked, full-width rotary tables, no sinks, the
        Llama form of any q/k norms; and the norm and attention ops built here. Else None."""
        if (slots is not None or x.shape[1] != 1 or self.window is not None or self.sinks is not None
                or getattr(self, "stack", None) is None or x.device.type != "cpu" or x.dtype != self.k_cache.dtype
                or x.dtype not in (torch.float32, torch.bfloat16) or rope[0].dim() != 2
                or 2 * rope[0].shape[-1] != self.head_dim or rope[0].dtype != x.dtype):
            return None
        if self.q_norm is not None and (self.q_norm.cast_after_weight or self.k_norm.cast_after_weight
                                        or self.q_norm.eps != self.k_norm.eps
                                        or cpp_ops.optional_op("rms_norm.cpp", "shardwise_norm", "rms_norm") is None):
            return None
        return cpp_ops.optional_op("decode_attention.cpp", "shardwise_attn", "step")

    def _cached(self, q, k, v, positions: torch.Tensor, rows: slice) -> torch.Tensor:
        """Write k, v [b, kv, T, d] at ``positions`` [T] into cache rows ``rows`` and attend
        q [b, H, T, d] over those rows' keys → [b, T, H·d]."""
        if self.window is None:
            return full_attention(self.k_cache, self.v_cache, q, k, v, positions, rows, self.scaling, self.sinks)
        return self._sliding(q, k, v, positions, rows, *span(positions))

    def _sliding(self, q, k, v, positions, rows: slice, start: int, end: int) -> torch.Tensor:
        """Attention over the ring's window before ``start`` plus this call's keys; then the
        call's last ``cache_len`` positions go into the ring. The bookkeeping is ``rows``' first
        slot's (a call at position 0 starts it afresh: a reused slot holds nothing of its past)."""
        size, window = self.cache_len, self.window
        low, written = self.rings[rows.start]
        first = max(0, start - window + 1)  # first key position the first query sees
        if first < start and first < low and start <= written:
            raise ShardwiseError(
                f"the sliding-window cache of {size} positions no longer holds position {first} "
                f"(a pass at {start} after positions up to {written - 1}): build the model with a "
                "larger max_step_tokens"
            )
        device = self.k_cache.device
        ring = torch.arange(first, start, device=device) % size
        keys = torch.cat([self.k_cache[rows, :, ring], k], dim=2)
        values = torch.cat([self.v_cache[rows, :, ring], v], dim=2)
        keep = min(end - start, size)
        ring = torch.arange(end - keep, end, device=device) % size
        self.k_cache[rows, :, ring] = k[:, :, -keep:]
        self.v_cache[rows, :, ring] = v[:, :, -keep:]
        held = min(low, start) if start <= written else start
        self.rings[rows] = [(max(held, end - size), end)] * (rows.stop - rows.start)
        return attend(q, keys, values, positions, window, self.scaling, self.sinks, key_start=first)


class MLAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention over this rank's heads.

    The latent cache [max_batch, S, kv_lora_rank + rope] (one row per cache slot) is what
    DeepSeek stores per token. A prefill expands keys and values of this rank's heads from it
    through kv_b; later passes attend in the absorbed form (``_absorbed``) where it runs.
    """

    def __init__(
        self,
        tensors: dict[str, TensorSpec],
        shard: Shard,
        dtype: torch.dtype,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scaling: float,
        interleaved_rope: bool,
        eps: float,
        max_seq_len: int,
        max_batch: int = 1,
        rope: bool = True,
    ):
        super().__init__()
        t = tensors
        if "q_a_proj.weight" in t:
            self.q_a_proj = ReplicatedLinear(t["q_a_proj.weight"], shard, dtype)
            self.q_a_layernorm = RMSNorm(t["q_a_layernorm.weight"], shard, dtype, eps)
            self.q_b_proj = ColumnParallelLinear(t["q_b_proj.weight"], shard, dtype)
            self.q_proj = None
        else:
            self.q_proj = ColumnParallelLinear(t["q_proj.weight"], shard, dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(t["kv_a_proj_with_mqa.weight"], shard, dtype)
        self.kv_a_layernorm = RMSNorm(t["kv_a_layernorm.weight"], shard, dtype, eps)
        self.kv_b_proj = ColumnParallelLinear(t["kv_b_proj.weight"], shard, dtype)
        self.o_proj = RowParallelLinear(t["o_proj.weight"], shard, dtype)
        # Kimi K3's mla_use_output_gate: the heads' outputs times sigmoid(g_proj(x)) before o_proj
        # (Moonshot's modeling_kimi_linear.py, KimiMLAAttention); column-parallel like the heads
        self.g_proj = ColumnParallelLinear(t["g_proj.weight"], shard, dtype) if "g_proj.weight" in t else None
        self.kv_lora_rank, self.nope, self.rope_dim, self.v_dim = kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.heads = self.kv_b_proj.weight.shape[0] // (qk_nope_head_dim + v_head_dim)
        self.scaling = scaling
        self.rotate = apply_rotary_interleaved if interleaved_rope else apply_rotary
        self.rope = rope
        shape = (max_batch, max_seq_len, kv_lora_rank + qk_rope_head_dim)
        self.register_buffer("latent_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
        slots: list[int] | None = None,
    ) -> torch.Tensor:
        """x [B, T, hidden] at ``positions`` [T] in cache rows 0..B-1, or, with ``slots``, at
        ``positions`` [B, T] in cache slots ``slots`` (rope's cos/sin then [B, 1, T, rope/2])."""
        b, n, _ = x.shape
        if self.q_proj is None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(b, n, self.heads, self.nope + self.rope_dim).transpose(1, 2)
        q_pass, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        kv_nope, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope)
        if self.rope:
            cos, sin = rope
            q_rot = self.rotate(q_rot, cos, sin)
            k_rot = self.rotate(k_rot.unsqueeze(1), cos, sin).squeeze(1)
        new = torch.cat([kv_nope, k_rot], dim=-1)
        query = torch.cat([q_pass, q_rot], dim=-1)
        if slots is None:
            out = self._cached(query, new, positions, slice(0, b))
        else:
            out = per_slot(self._cached, slots, positions, query, new)
        if self.g_proj is not None:
            out = out * self.g_proj(x).sigmoid()
        return self.o_proj(out)

    def _cached(self, query: torch.Tensor, new: torch.Tensor, positions: torch.Tensor, rows: slice) -> torch.Tensor:
        """Write latents ``new`` [b, T, rank + rope] at ``positions`` [T] into cache rows ``rows``
        and attend ``query`` [b, H, T, nope + rope] over those rows' keys → [b, T, H·v_dim]: a prefill
        from position 0 through keys and values expanded by ``kv_b_proj``, every other pass (decode
        steps, verify passes: ``attend``'s row-by-row cases) in the absorbed form where it runs."""
        b = query.shape[0]
        start, end = span(positions)
        self.latent_cache[rows, start:end] = new
        if positions.numel() == 1 or start > 0:
            absorbed = self._absorbed(query, positions, rows)
            if absorbed is not None:
                return absorbed
        latent = self.latent_cache[rows, :end]
        kv = self.kv_b_proj(latent[..., : self.kv_lora_rank]).view(b, end, self.heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, values = kv.split([self.nope, self.v_dim], dim=-1)
        keys = torch.cat([k_nope, latent[..., self.kv_lora_rank :].unsqueeze(1).expand(-1, self.heads, -1, -1)], dim=-1)
        return attend(query, keys, values, positions, None, self.scaling)

    def _absorbed(self, query: torch.Tensor, positions: torch.Tensor, rows: slice) -> torch.Tensor | None:
        """Attention in the absorbed form (DeepSeek-V2 §2.1.2; vLLM's MLA decode), row by row: each
        head's no-rope query times its ``kv_b_proj`` key block [nope, rank] gives a query in latent
        space, which attends over the cached latents as one shared KV head (keys: latent | rope part,
        values: the latent), and the latent output times its value block [v, rank]ᵀ is the head's
        output. Nothing is expanded per cached token: a step reads the cache once, where the expanded
        form multiplies every cached latent by ``kv_b_proj`` again. Each row runs a one-row step's
        shapes, so a verify pass's rows get a step's bits. None where it does not run: not on the
        CPU kernel ``attend`` uses for one row, or a ``kv_b_proj`` held packed (int weights)."""
        weight = self.kv_b_proj.weight
        cache = self.latent_cache[rows]
        if not isinstance(weight, torch.Tensor) or weight.dtype != query.dtype:
            return None
        op = _one_row_kernel(query, cache, cache)
        if op is None:
            return None
        b, heads, rank = query.shape[0], self.heads, self.kv_lora_rank
        blocks = weight.view(heads, self.nope + self.v_dim, rank)
        keys, values = blocks[:, : self.nope], blocks[:, self.nope :]  # [H, nope, rank], [H, v, rank]
        rows_out = []
        for i, position in enumerate(positions.tolist()):
            end = position + 1
            q = query[:, :, i : i + 1]  # [b, H, 1, nope + rope]
            q_latent = torch.matmul(q[..., : self.nope], keys)  # [b, H, 1, rank]
            latent = cache[:, :end].unsqueeze(1)  # [b, 1, L, rank + rope]: one KV head for all H
            out = op(torch.cat([q_latent, q[..., self.nope :]], dim=-1).contiguous(), latent, latent[..., :rank], self.scaling)
            if out.dtype == torch.bfloat16:  # a bmm against the blocks as stored: 2-2.5x the matmul against their
                # transpose here (16 heads, rank 512: 260-315 vs 630-670 us); float32 the other way round (650 vs 300)
                heads_out = torch.stack([torch.bmm(values, o.view(heads, rank, 1)) for o in out.view(b, heads, rank)])
            else:
                heads_out = torch.matmul(out.view(b, heads, 1, rank), values.transpose(1, 2))
            rows_out.append(heads_out.reshape(b, 1, heads * self.v_dim))
        return torch.cat(rows_out, dim=1)

