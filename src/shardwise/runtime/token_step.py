"""A model's one-token decode step as flat calls: each layer's norms, products and attention op bound once.

Batch-1 decode runs one token through every layer per step. Through the modules, each step also pays for ~70
``nn.Module`` calls and the per-call checks of ``layers.linear``, ``IntWeight.forward`` and
``GQAttention.one_token_step`` — Python that runs between the weight products, where the products' weight stream
has just pushed the interpreter's own data out of the caches: on a Xeon VM (2 vCPUs) the 2048x10 llama's int4
step spent 2.8 ms (bfloat16) between its 41 products, against 1.0 ms for the same Python with the products'
outputs cached. ``TokenStep`` runs the same ops in the same order (so the same bits) from closures that hold what
those checks decided: int4 15.9 -> 14.1 ms a step, int8 21.5 -> 19.6, bfloat16 37.6 -> 36.4, float32 72.6 -> 71.7
(side by side in one process, 4 rounds of 20 steps); the hidden state held as one row [1, H] in between, 8 fewer
reshapes a layer: int4 13.89 -> 13.64 ms, bfloat16 30.23 -> 29.91.

What it binds per decoder layer: grouped-query attention where ``GQAttention``'s compiled one-token step applies
(RMSNorm, the stacked q|k|v product, ``shardwise_attn.step``, o_proj without bias) and a dense gated MLP with
stacked gate|up (RMSNorm, the stacked product, the activation, down; SwiGLU as one compiled call, torch's bits —
``csrc/swiglu.cpp`` — where its width is a multiple of 64: side by side in one process, 10 rounds, the 2048x10 llama's
int4 decode 76.9 -> 78.5 tok/s in bfloat16 and 71.2 -> 73.8 in float32, its bfloat16 decode 28.8 -> 29.1). Where both
products of a half are packed int weights on one rank, the half is one compiled call (``csrc/layer_step.cpp``: norm,
products, attention step or SwiGLU, residual add; the same ops and bits): int4 decode, 10 rounds side by side, bfloat16
88.7 -> 89.6 tok/s, float32 77.9 -> 81.1. Any other part (MLA, linear attention,
sliding windows, MoE blocks, biases) runs through its module inside the same step. The all-reduces are the
layer's ``reduce_attn`` / ``reduce_mlp`` as they are at call time.

Two kinds, for the two ways a one-row step is computed: plain (``runtime.gemv``'s one-row products) and exact —
under ``exact.row_blocked()`` (``generate(exact=True)``, serving's decode steps), whose products are the
row-invariant ones (``exact.fixed_order_linear``) and whose SiLU / sigmoid run on whole 64-element blocks: the exact
kind binds those products, binds an MLP only where its width is a whole number of such blocks (padding then changes
nothing), and runs its bound calls with the mode switched off (its Python callback on every torch call is most of
what exact decode paid over plain), the module parts under it. ``ShardedCausalLM`` runs a ``TokenStep`` for one
token of one sequence — in cache row 0, or in one cache slot where every layer's attention is bound — on the CPU in
float32 / bfloat16, while no tracer hooks the layers; its bound choices (threads, ``int_matmul.activations``, the
kind) are checked each call and the step rebuilt when they change.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from shardwise.runtime import cpp_ops, gemv
from shardwise.runtime.attention import GQAttention
from shardwise.runtime.exact import VECTOR_BLOCK, fixed_order_linear, row_blocked
from shardwise.runtime.int_matmul import IntWeight, activations
from shardwise.runtime.layers import allreduce
from shardwise.runtime.moe import DenseMLP, silu_and_mul
from shardwise.runtime.rms_norm import RMSNorm

__all__ = ["TokenStep", "token_step"]

DTYPES = (torch.float32, torch.bfloat16)
"""Model dtypes a ``TokenStep`` runs (those of the compiled products and attention op)."""

Rope = tuple[torch.Tensor, torch.Tensor]


def _row_product(weight, dtype: torch.dtype, exact: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``layers.linear`` of one row [1, in] of ``dtype`` by ``weight`` (no bias) → [1, out], decided now (under
    ``row_blocked`` with ``exact``); None where linear would not take one op for it."""
    if isinstance(weight, IntWeight):  # row-invariant either way: each output its own chain
        return weight.row_product(dtype)
    if not isinstance(weight, torch.Tensor) or weight.dtype != dtype:
        return None
    if not exact:
        return gemv.row_product(weight)
    op = fixed_order_linear(torch.empty(1, weight.shape[1], dtype=dtype), weight)
    return None if op is None else lambda x: op(x, weight)


def _outside_modes(fn: Callable) -> Callable:
    """``fn`` run with torch-function modes off (the exact kind's bound calls: ``row_blocked``'s callback would
    only pass them through)."""

    def run(*args):
        with torch._C.DisableTorchFunction():
            return fn(*args)

    return run


def _attention(layer, dtype: torch.dtype, rope: Rope, exact: bool, slots: int) -> Callable | None:
    """``h + layer.attention_out(h)`` for one token as bound calls ``f(h [1, H], positions, cos, sin, slot)``, or None
    (the module runs)."""
    attn, norm = layer.self_attn, layer.input_layernorm
    if not isinstance(attn, GQAttention) or not isinstance(norm, RMSNorm) or attn.o_proj.bias is not None:
        return None
    step = attn.one_token_step(torch.zeros(1, 1, attn.k_cache.shape[-1], dtype=dtype), rope, None)
    normed = norm.bound(dtype)
    if step is None or normed is None:
        return None
    qkv, o = _row_product(attn.stack.weight, dtype, exact), _row_product(attn.o_proj.weight, dtype, exact)
    if qkv is None or o is None:
        return None
    qn = attn.step_norms()
    caches = [(attn.k_cache[s : s + 1], attn.v_cache[s : s + 1]) for s in range(slots)]  # each slot's rows
    heads, scaling = attn.heads, attn.scaling
    fused = _fused("int_attention", layer.reduce_attn, attn.stack.weight, attn.o_proj.weight)
    if fused is not None:  # the whole half in one call (csrc/layer_step.cpp), the same ops and bits
        args = (*_norm_args(norm), *_int_args(attn.stack.weight, dtype), *_int_args(attn.o_proj.weight, dtype))

        def run_fused(h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot: int) -> torch.Tensor:
            return fused(h, *args, cos, sin, *caches[slot], positions, heads, scaling, *qn)

        return run_fused

    def run(h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot: int) -> torch.Tensor:
        y = step(qkv(normed(h)).view(1, 1, -1), cos, sin, *caches[slot], positions, heads, scaling, *qn)
        return h + layer.reduce_attn(o(y.view(1, -1)))

    return run


def _mlp(layer, dtype: torch.dtype, exact: bool) -> Callable | None:
    """``h + layer.mlp_out(h)`` for one token as bound calls ``f(h [1, H])``, or None (the module runs)."""
    mlp, norm = layer.mlp, layer.post_attention_layernorm
    if type(mlp) is not DenseMLP or getattr(mlp, "stack", None) is None or not isinstance(norm, RMSNorm):
        return None
    if exact and mlp.stack.rows[0] % VECTOR_BLOCK:  # row_blocked would pad the activation's input
        return None
    gate_up, down = _row_product(mlp.stack.weight, dtype, exact), _row_product(mlp.down_proj.weight, dtype, exact)
    normed, rows, act = norm.bound(dtype), mlp.stack.rows, mlp.act
    if gate_up is None or down is None or normed is None:
        return None

    swiglu = cpp_ops.optional_op("swiglu.cpp", "shardwise_act", "silu_mul")
    if act is silu_and_mul and swiglu is not None and rows[0] == rows[1] and rows[0] % 64 == 0:  # one call, the same bits
        fused = _fused("int_mlp", layer.reduce_mlp, mlp.stack.weight, mlp.down_proj.weight)
        if fused is not None:  # the whole half in one call (csrc/layer_step.cpp)
            args = (*_norm_args(norm), *_int_args(mlp.stack.weight, dtype), *_int_args(mlp.down_proj.weight, dtype))
            return lambda h: fused(h, *args)

        def run(h: torch.Tensor) -> torch.Tensor:
            return h + layer.reduce_mlp(down(swiglu(gate_up(normed(h)))))

        return run

    def run(h: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up(normed(h)).split(rows, dim=-1)
        return h + layer.reduce_mlp(down(act(gate, up)))

    return run


def _fused(name: str, reduce: Callable, *weights) -> Callable | None:
    """``shardwise_layer.<name>`` (``csrc/layer_step.cpp``) where a layer half can run as one call: packed int
    weights, one rank (the half's all-reduce the plain identity), the op built here; else None."""
    if not all(isinstance(w, IntWeight) for w in weights) or reduce is not allreduce:
        return None
    if dist.is_initialized() and dist.get_world_size() > 1:
        return None
    return cpp_ops.optional_op("layer_step.cpp", "shardwise_layer", name)


def _norm_args(norm: RMSNorm) -> tuple:
    """An RMSNorm as the fused ops take it: (weight, eps, cast_after_weight, offset)."""
    return norm.weight, norm.eps, norm.cast_after_weight, norm.offset


def _int_args(weight: IntWeight, dtype: torch.dtype) -> tuple:
    """A packed product as the fused ops take it: (q, scale, [bits, group, widen, pairs, q8, grids])."""
    return weight.q, weight.scale, weight.kernel_args(dtype)


class TokenStep:
    """The decoder layers and final norm of one token (hidden [1, 1, H] → [1, 1, H]) as bound calls, the hidden
    state held as one row [1, H] in between (a module part gets and returns [1, 1, H])."""

    def __init__(self, model, key: tuple, exact: bool):
        self.key, dtype = key, model.dtype
        rope = model.rotary(torch.zeros(1, dtype=torch.long), dtype)
        wrap = _outside_modes if exact else (lambda fn: fn)
        self.parts = []
        for layer in model.model.layers:
            attention, mlp = _attention(layer, dtype, rope, exact, model.max_batch), _mlp(layer, dtype, exact)
            self.parts.append((layer, attention and wrap(attention), mlp and wrap(mlp)))
        self.every_attention_bound = all(attention is not None for _, attention, _ in self.parts)
        """Whether it runs a cache slot other than row 0 (a module part would need the slot's own arguments)."""
        norm = model.model.norm.bound(dtype)
        self.norm = model.model.norm if norm is None else wrap(norm)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, rope: Rope, slot: int = 0) -> torch.Tensor:
        cos, sin = rope
        shape, h = h.shape, h.view(1, -1)
        for layer, attention, mlp in self.parts:
            if attention is not None:
                h = attention(h, positions, cos, sin, slot)
            else:
                h = h + layer.attention_out(h.view(shape), positions, rope, None).view(1, -1)
            h = mlp(h) if mlp is not None else h + layer.mlp_out(h.view(shape)).view(1, -1)
        return self.norm(h).view(shape)


def _kind() -> bool | None:
    """Which kind of step this moment's torch-function modes call for: False (plain: none), True (exact: only
    ``row_blocked`` with its vector kernels), None (any other: the modules must run)."""
    modes = torch.overrides._get_current_function_mode_stack()
    if not modes:
        return False
    if len(modes) == 1 and isinstance(modes[0], row_blocked) and modes[0].vector_kernels:
        return True
    return None


def token_step(model, slot: int = 0) -> TokenStep | None:
    """``model``'s ``TokenStep`` for one token of one sequence in cache ``slot``, or None where the module path must
    run (another dtype or device, other torch-function modes, a tracer's hooks, attention residuals, a slot other
    than 0 with a module part); built on first use and again when a choice it bound changes
    (``ShardedCausalLM.stack_projections`` drops it)."""
    layers, exact = model.model.layers, _kind()
    if (exact is None or model.dtype not in DTYPES or model.model.embed_tokens.weight.device.type != "cpu"
            or model.attn_res or layers[0]._forward_pre_hooks or layers[0]._forward_hooks):
        return None
    key = (torch.get_num_threads(), activations(), exact)
    step = model.__dict__.get("_token_step")
    if step is None or step.key != key:
        step = model.__dict__["_token_step"] = TokenStep(model, key, exact)
    return step if slot == 0 or step.every_attention_bound else None
