"""Tensor-parallel building blocks: sharded linear layers, vocab-parallel embedding and LM
head, rotary embeddings and the all-reduce hook (RMSNorm: ``runtime.rms_norm``).

Sharding is declared on the layer: every parameter is created from its ``TensorSpec``
(the ModelSpec entry with the checkpoint name, logical shape and split dimension) and
shaped by ``plan.shard_shape``, so a layer holds exactly the slice the planner counts and
the loader knows which slice to read for it (``param.spec``, ``param.expert``).

Row-parallel layers return **partial sums**; the decoder layer adds the partial sums of a
whole block (attention, or routed + shared experts) with one call to ``allreduce``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.plan import ParallelPlan, shard_shape, shard_slice
from shardwise.runtime import cpp_ops, gemv
from shardwise.runtime.comm import get_allreduce
from shardwise.runtime.int_matmul import IntWeight
from shardwise.spec.model import TensorSpec

# ---------------------------------------------------------------------------- all-reduce hook

_allreduce_name = "builtin"
_allreduce_fn: Callable[..., torch.Tensor] = get_allreduce("builtin")


def set_allreduce(name: str) -> None:
    """Pick the all-reduce algorithm every block uses (a name of ``comm.ALLREDUCE_ALGORITHMS``)."""
    global _allreduce_name, _allreduce_fn
    _allreduce_fn = get_allreduce(name)
    _allreduce_name = name


def allreduce_name() -> str:
    """Name of the all-reduce algorithm in use."""
    return _allreduce_name


def allreduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over the tensor-parallel ranks in place and return it (identity on one rank).

    The single point every TP/EP reduction of the runtime goes through (one call per
    attention block, one per MLP/MoE block, one for the vocab-parallel embedding), so a
    tracer can wrap it to time collectives.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t
    return _allreduce_fn(t)


# ---------------------------------------------------------------------------- matmul


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; a one-row product without bias on CPU runs as ``gemv.mv``.

    Decode at batch 1 is one row per layer; torch's bfloat16 ``F.linear`` streams one row's weight at
    half ``torch.mv``'s speed (17 vs 33 GB/s here, 5632x4 x 2048). ``gemv.mv``: ``torch.mv`` (F.linear's
    bits) in float32, a compiled kernel in bfloat16. An ``IntWeight`` (packed int8/int4) runs its own
    kernel. Under ``exact.row_blocked()`` every product stays ``F.linear`` (made row-invariant there).
    """
    if isinstance(weight, IntWeight):  # weight-only int8/int4, packed in memory (runtime.int_matmul)
        y = weight.forward(x)  # a plain call: no module hooks are ever set on it
        return y if bias is None else y + bias
    if bias is None and x.numel() == x.shape[-1] and x.dtype == weight.dtype and gemv.applies(x):
        return gemv.mv(weight, x.reshape(-1)).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


# ---------------------------------------------------------------------------- shards


@dataclass(frozen=True)
class Shard:
    """Which slice of the model this process holds: the plan and its global rank."""

    plan: ParallelPlan
    rank: int = 0

    @property
    def tp_rank(self) -> int:
        """Index of this rank inside its tensor-parallel group."""
        return self.rank % self.plan.tp

    @property
    def tp(self) -> int:
        """Tensor-parallel degree."""
        return self.plan.tp

    @property
    def etp_rank(self) -> int:
        """Index of this rank among the ranks that split each of its experts."""
        return self.tp_rank % self.plan.etp

    def shape(self, spec: TensorSpec) -> tuple[int, ...]:
        """Shape of this rank's slice of ``spec``."""
        return shard_shape(spec, self.plan, self.tp_rank)

    def span(self, spec: TensorSpec) -> tuple[int, int]:
        """(start, stop) of this rank's slice along ``spec.tp_dim`` (the whole axis when unsplit)."""
        cut = shard_slice(spec, self.plan, self.tp_rank)
        if cut is None:
            assert spec.tp_dim is not None
            return 0, spec.shape[spec.tp_dim]
        return cut


def shard_param(spec: TensorSpec, shard: Shard, dtype: torch.dtype, expert: int | None = None) -> nn.Parameter:
    """An uninitialised parameter holding this rank's slice of ``spec`` (filled by the loader)."""
    p = nn.Parameter(torch.empty(shard.shape(spec), dtype=dtype), requires_grad=False)
    p.spec = spec  # type: ignore[attr-defined]
    p.expert = expert  # type: ignore[attr-defined]
    return p


class _ShardedLinear(nn.Module):
    """``y = x Wᵀ (+ b)`` over this rank's slice of W and b, as ``shard_param`` cuts them
    from the TensorSpec (split on its ``tp_dim``, or whole when it has none)."""

    def __init__(self, weight: TensorSpec, shard: Shard, dtype: torch.dtype, bias: TensorSpec | None = None):
        super().__init__()
        self.weight = shard_param(weight, shard, dtype)
        self.bias = shard_param(bias, shard, dtype) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class Stack:
    """Weights of several linears of one input as row blocks of one weight (``stack_weights``): a
    float tensor or an ``IntWeight``, and each linear's rows (a plain attribute: not registered as a
    parameter, so the model's bytes count each weight once)."""

    weight: torch.Tensor | IntWeight
    rows: tuple[int, ...]


def stack_weights(*linears: nn.Module) -> Stack | None:
    """Store the weights of ``linears`` (products of the same input) as consecutive row blocks of one
    new weight and return it; each linear's weight becomes a view of its block, so nothing is held
    twice and a later in-place load still fills the stack. One GEMV over the stack then reads what
    several did, with one call's overhead: q|k|v of 2048→2048+512+512 and gate|up of 2048→2×5632, ten
    layers in bfloat16, took 19.7-22.1 ms instead of 22.4-25.3 ms measured side by side here. Float
    weights stack as one tensor, packed int weights as one ``IntWeight`` (``IntWeight.stack``). None
    (nothing changed) when a linear has a bias, a weight is neither (MXFP4 blocks), or the weights'
    kinds, dtypes or input widths differ."""
    weights = [getattr(m, "weight", None) for m in linears]
    if any(getattr(m, "bias", None) is not None for m in linears):
        return None
    if all(isinstance(w, IntWeight) for w in weights):
        stacked = IntWeight.stack(weights)
        return None if stacked is None else Stack(stacked, tuple(w.q.shape[0] for w in weights))
    if not all(isinstance(w, nn.Parameter) and w.dim() == 2 for w in weights):
        return None
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return None
    return Stack(join_rows(weights), tuple(w.shape[0] for w in weights))


def join_rows(params: list[nn.Parameter]) -> torch.Tensor:
    """One new tensor holding ``params`` (same dtype, device and trailing shape) as consecutive row
    blocks; each parameter's data becomes a view of its block, so nothing is held twice and a later
    in-place load of a parameter fills the joined tensor too."""
    joined = torch.cat([p.detach() for p in params])
    start = 0
    for p in params:
        p.data = joined[start : start + p.shape[0]]
        start += p.shape[0]
    return joined


def stack_inputs(module: nn.Module) -> None:
    """Stack the weights of ``module.input_projections`` (the names of its linears that all read the
    module's input) as ``module.stack`` (``stack_weights``; None when they cannot share one)."""
    module.stack = stack_weights(*(getattr(module, name) for name in module.input_projections))


def project_inputs(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of ``module.input_projections``' outputs for ``x``: one product over ``module.stack``
    (``stack_inputs``), split by rows, or (not stacked) one product per linear."""
    stack = getattr(module, "stack", None)
    if stack is None:
        return tuple(getattr(module, name)(x) for name in module.input_projections)
    return linear(x, stack.weight).split(stack.rows, dim=-1)


class ColumnParallelLinear(_ShardedLinear):
    """``y = x Wᵀ (+ b)`` with W's output rows split over TP ranks (whole heads per rank).

    The output stays split: rank r computes only its heads' / channels' outputs.
    """


class RowParallelLinear(_ShardedLinear):
    """``y = x Wᵀ (+ b)`` with W's input columns split over TP ranks; returns a partial sum.

    The caller sums the partial outputs of all ranks with one ``allreduce``. The bias is
    replicated but added on tensor rank 0 only, so the sum contains it exactly once.
    """

    def __init__(self, weight: TensorSpec, shard: Shard, dtype: torch.dtype, bias: TensorSpec | None = None):
        super().__init__(weight, shard, dtype, bias)
        self.add_bias = shard.tp_rank == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias if self.add_bias else None)


class ReplicatedLinear(_ShardedLinear):
    """``y = x Wᵀ (+ b)`` with the whole weight on every rank (MLA's q_a / kv_a, routers)."""


def vocab_rows(vocab: int, tp: int) -> int:
    """Rows of the embedding / LM head each of ``tp`` ranks holds: ``ceil(vocab / tp)``.

    Rank r holds ids ``[r·rows, min((r+1)·rows, vocab))``; when ``tp`` does not divide the
    vocabulary the last rank(s) pad their slice with zero rows that no id maps to (vLLM's
    VocabParallelEmbedding / ParallelLMHead)."""
    return -(-vocab // tp)


def vocab_span(vocab: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """(start, stop) of the real vocabulary ids tensor rank ``tp_rank`` holds (possibly empty)."""
    rows = vocab_rows(vocab, tp)
    start = min(tp_rank * rows, vocab)
    return start, min(start + rows, vocab)


def _vocab_param(weight: TensorSpec, shard: Shard, dtype: torch.dtype) -> tuple[nn.Parameter, int, int, bool]:
    """(parameter, first id, stop id, split) of this rank's vocabulary rows: ``vocab_rows``
    rows (zero-padded past ``stop``) when split over TP, the whole table otherwise."""
    split = shard.tp > 1 and weight.tp_dim is not None
    if not split:
        return shard_param(weight, shard, dtype), 0, weight.shape[0], False
    assert weight.tp_dim == 0, f"{weight.name}: vocabulary rows must be split on dim 0"
    vocab = weight.shape[0]
    start, stop = vocab_span(vocab, shard.tp, shard.tp_rank)
    p = nn.Parameter(torch.zeros((vocab_rows(vocab, shard.tp), *weight.shape[1:]), dtype=dtype), requires_grad=False)
    p.spec = weight  # type: ignore[attr-defined]
    p.expert = None  # type: ignore[attr-defined]
    p.rows = (start, stop)  # type: ignore[attr-defined]  # the loader reads only these rows
    return p, start, stop, True


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split over TP ranks (``vocab_rows`` per rank).

    Each rank looks up the ids that fall in its row range and writes zeros for the rest;
    one all-reduce adds the ranks' rows (one non-zero term per element, so the sum is exact).
    Padding rows (past the vocabulary, on the last rank) are never looked up.
    """

    def __init__(self, weight: TensorSpec, shard: Shard, dtype: torch.dtype):
        super().__init__()
        self.weight, self.start, self.stop, self.split = _vocab_param(weight, shard, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.stop)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return allreduce(out.contiguous())


class VocabParallelLMHead(nn.Module):
    """LM head with vocabulary rows split over TP ranks (or sharing the tied embedding).

    ``local_logits`` gives this rank's vocabulary slice (``vocab_rows`` columns, the padding
    ones -inf); ``greedy`` all-gathers only one (value, index) pair per rank and never picks
    a padding row; ``logits`` all-gathers the full vocabulary and returns exactly
    ``vocab_size`` columns (sampling, tests).
    """

    def __init__(self, weight: TensorSpec | None, shard: Shard, dtype: torch.dtype, tied: VocabParallelEmbedding | None = None):
        super().__init__()
        if weight is not None:
            self.weight, self.start, self.stop, self.split = _vocab_param(weight, shard, dtype)
            self.vocab = weight.shape[0]
        else:
            assert tied is not None
            self.weight = tied.weight  # tied embeddings: the same parameter, counted once
            self.start, self.stop, self.split = tied.start, tied.stop, tied.split
            self.vocab = tied.weight.spec.shape[0]

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's rows ``[..., vocab_rows]``; padding rows are -inf."""
        local = linear(hidden, self.weight)
        valid = self.stop - self.start
        if valid < local.shape[-1]:
            local[..., valid:] = float("-inf")
        return local

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[..., vocab]`` on every rank."""
        local = self.local_logits(hidden).contiguous()
        if not self.split:
            return local
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[..., : self.vocab]  # rank r's rows start at r·vocab_rows

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Argmax token ids ``[...]`` over the whole vocabulary (the lowest id on ties)."""
        local = self.local_logits(hidden)
        value, index = local.max(dim=-1)  # a padding row (-inf) only wins on a rank without real rows
        if not self.split:
            return index
        # every rank's (value, id) through the chosen all-reduce (one TCP round trip less per token than
        # gloo's all_gather when the layers reduce through shared memory): each rank fills its own row of
        # zeros, so the sum is every rank's pair, exactly
        stacked = value.new_zeros((dist.get_world_size(), *value.shape, 2), dtype=torch.float32)
        stacked[dist.get_rank()] = torch.stack([value.float(), (index + self.start).float()], dim=-1)
        stacked = allreduce(stacked)  # [ranks, ..., 2]; ranks hold ascending ids
        best = stacked[..., 0].argmax(dim=0, keepdim=True)  # first maximum = lowest id
        return stacked[..., 1].gather(0, best).squeeze(0).long()


# ---------------------------------------------------------------------------- rotary embeddings

_DEFAULT_THETA = {"gpt_oss": 150000.0}


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE settings from a config in either layout: transformers 5 ``rope_parameters`` or
    the older ``rope_theta`` + ``rope_scaling`` (with ``type`` or ``rope_type``)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta") or _DEFAULT_THETA.get(config.get("model_type"), 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(params: Mapping[str, Any], dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2], attention scaling of cos/sin), as transformers'
    ``ROPE_INIT_FUNCTIONS`` compute them for the default, llama3 and yarn types."""
    base = float(params["rope_theta"])
    kind = params["rope_type"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    if kind == "default":
        return 1.0 / (base**exponents), 1.0
    if kind == "llama3":
        inv_freq = 1.0 / (base**exponents)
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        factor = params.get("factor")
        original = params["original_max_position_embeddings"]
        if factor is None:
            factor = max_position_embeddings / original
        attention_factor = params.get("attention_factor")
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if attention_factor is None:
            if mscale and mscale_all:
                attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all))
            else:
                attention_factor = _yarn_mscale(factor)
        beta_fast = params.get("beta_fast") or 32
        beta_slow = params.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        keep = 1 - ramp
        return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)
    raise ShardwiseError(f"rope type '{kind}' is not supported by the runtime: use default, llama3 or yarn")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions 0..max_positions-1 (half width: one angle per pair).

    Computed once in float32 like transformers (angle = position · inv_freq, then
    cos/sin times the attention scaling), cast to the model dtype on use.
    """

    def __init__(self, params: Mapping[str, Any], dim: int, max_positions: int, max_position_embeddings: int):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(params, dim, max_position_embeddings)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def _compiled_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor | None:
    """``shardwise_rope.rope`` (``csrc/rotary.cpp``: one call instead of seven torch ops, the same bits) for a
    CPU float32 / bfloat16 ``x [B, H, T, d]`` (cos / sin [T, d/2] or per slot [B, 1, T, d/2]); None where it
    does not apply or build (the torch expression then runs)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 4 or cos.dtype != x.dtype:
        return None
    op = cpp_ops.optional_op("rotary.cpp", "shardwise_rope", "rope")
    return None if op is None else op(x, cos, sin, interleaved)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of ``x [..., T, d]`` (the Llama/"rotate_half" layout)."""
    out = _compiled_rotary(x, cos, sin, False)
    if out is not None:
        return out
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (2i, 2i+1) (DeepSeek's layout); the result comes out
    de-interleaved (evens then odds), exactly as transformers returns it."""
    out = _compiled_rotary(x, cos, sin, True)
    if out is not None:
        return out
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
