"""A model's one-token decode step as flat calls: each layer's norms, products and attention op bound once.

Batch-1 decode runs one token through every layer per step. Through the modules, each step also pays for ~70
``nn.Module`` calls and the per-call checks of ``layers.linear``, ``IntWeight.forward`` and
``GQAttention._one_token_step`` — Python that runs between the weight products, where the products' weight stream
has just pushed the interpreter's own data out of the caches: on a Xeon VM (2 vCPUs) the 2048x10 llama's int4
step spent 2.8 ms (bfloat16) between its 41 products, against 1.0 ms for the same Python with the products'
outputs cached. ``TokenStep`` runs the same ops in the same order (so the same bits) from closures that hold what
those checks decided: int4 15.9 -> 14.1 ms a step, int8 21.5 -> 19.6, bfloat16 37.6 -> 36.4, float32 72.6 -> 71.7
(side by side in one process, 4 rounds of 20 steps).

What it binds per decoder layer: grouped-query attention where ``GQAttention``'s compiled one-token step applies
(RMSNorm, the stacked q|k|v product, ``shardwise_attn.step``, o_proj without bias) and a dense gated MLP with
stacked gate|up (RMSNorm, the stacked product, the activation, down). Any other part (MLA, linear attention,
sliding windows, MoE blocks, biases) runs through its module inside the same step. The all-reduces are the
layer's ``reduce_attn`` / ``reduce_mlp`` as they are at call time. ``ShardedCausalLM`` runs a ``TokenStep`` for
one token of one sequence (no cache slots) on the CPU in float32 / bfloat16, outside ``exact.row_blocked()`` and
while no tracer hooks the layers; a step's bound choices (threads, ``int_matmul.activations``) are checked each
call and the step rebuilt when they change.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardwise.runtime import gemv
from shardwise.runtime.attention import GQAttention
from shardwise.runtime.int_matmul import IntWeight, activations
from shardwise.runtime.moe import DenseMLP
from shardwise.runtime.rms_norm import RMSNorm

__all__ = ["TokenStep", "token_step"]

DTYPES = (torch.float32, torch.bfloat16)
"""Model dtypes a ``TokenStep`` runs (those of the compiled products and attention op)."""

Rope = tuple[torch.Tensor, torch.Tensor]


def _row_product(weight, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``layers.linear`` of one row [1, in] of ``dtype`` by ``weight`` (no bias) → [1, out], decided now; None
    where linear would not take a one-row product (a float weight of another dtype)."""
    if isinstance(weight, IntWeight):
        return weight.row_product(dtype)
    if not isinstance(weight, torch.Tensor) or weight.dtype != dtype:
        return None
    return gemv.row_product(weight)


def _attention(layer, dtype: torch.dtype, rope: Rope) -> Callable | None:
    """``layer._attention`` for one token as bound calls ``f(h, positions, cos, sin)``, or None (the module runs)."""
    attn, norm = layer.self_attn, layer.input_layernorm
    if not isinstance(attn, GQAttention) or not isinstance(norm, RMSNorm) or attn.o_proj.bias is not None:
        return None
    step = attn._one_token_step(torch.zeros(1, 1, attn.k_cache.shape[-1], dtype=dtype), rope, None)
    if step is None:
        return None
    qkv, o = _row_product(attn.stack.weight, dtype), _row_product(attn.o_proj.weight, dtype)
    if qkv is None or o is None:
        return None
    normed = norm.bound(dtype)
    qn = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if attn.q_norm is not None else (None, None, 0.0)
    k_cache, v_cache, heads, scaling = attn.k_cache, attn.v_cache, attn.heads, attn.scaling

    def run(h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        y = step(qkv(normed(h)).view(1, 1, -1), cos, sin, k_cache, v_cache, positions, heads, scaling, *qn)
        return layer.reduce_attn(o(y.view(1, -1)))

    return run


def _mlp(layer, dtype: torch.dtype) -> Callable | None:
    """``layer._mlp`` for one token as bound calls ``f(h)``, or None (the module runs)."""
    mlp, norm = layer.mlp, layer.post_attention_layernorm
    if type(mlp) is not DenseMLP or getattr(mlp, "stack", None) is None or not isinstance(norm, RMSNorm):
        return None
    gate_up, down = _row_product(mlp.stack.weight, dtype), _row_product(mlp.down_proj.weight, dtype)
    if gate_up is None or down is None:
        return None
    normed, rows, act = norm.bound(dtype), mlp.stack.rows, mlp.act

    def run(h: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up(normed(h)).split(rows, dim=-1)
        return layer.reduce_mlp(down(act(gate, up)))

    return run


class TokenStep:
    """The decoder layers and final norm of one token (hidden [1, 1, H] → [1, 1, H]) as bound calls, the hidden
    state held as one row [1, H] in between (a module part gets and returns [1, 1, H])."""

    def __init__(self, model, key: tuple):
        self.key = key
        rope = model.rotary(torch.zeros(1, dtype=torch.long), model.dtype)
        self.parts = [(layer, _attention(layer, model.dtype, rope), _mlp(layer, model.dtype)) for layer in model.model.layers]
        self.norm = model.model.norm.bound(model.dtype)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
        cos, sin = rope
        shape, h = h.shape, h.view(1, -1)
        for layer, attention, mlp in self.parts:
            if attention is not None:
                h = h + attention(h, positions, cos, sin)
            else:
                h = h + layer._attention(h.view(shape), positions, rope, None).view(1, -1)
            h = h + (mlp(h) if mlp is not None else layer._mlp(h.view(shape)).view(1, -1))
        return self.norm(h).view(shape)


def token_step(model, h: torch.Tensor) -> TokenStep | None:
    """``model``'s ``TokenStep`` for the hidden state ``h`` of one token of one sequence, or None where the module
    path must run (another dtype or device, ``exact.row_blocked()``, a tracer's hooks, attention residuals);
    built on first use and again when a choice it bound changes (``ShardedCausalLM.stack_projections`` drops it)."""
    layers = model.model.layers
    if (h.dtype not in DTYPES or model.dtype != h.dtype or not gemv.applies(h) or model.attn_res
            or layers[0]._forward_pre_hooks or layers[0]._forward_hooks):
        return None
    key = (torch.get_num_threads(), activations())
    step = model.__dict__.get("_token_step")
    if step is None or step.key != key:
        step = model.__dict__["_token_step"] = TokenStep(model, key)
    return step
