"""Microsoft Phi-3 / Phi-3.5 / Phi-4 (``model_type`` phi3): a dense GQA decoder whose checkpoint
fuses q, k and v into one ``qkv_proj`` weight [q heads × head_dim + 2 × KV heads × head_dim, hidden]
and the MLP's gate and up into one ``gate_up_proj`` weight [2 × intermediate, hidden] (SiLU-gated),
as transformers' ``modeling_phi3.py`` declares them; no biases, two RMSNorms per layer.

Tensor parallelism splits each part of a fused weight on its own (q, k and v by heads; gate and up
by rows), as vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` load them. When the
config sets ``sliding_window`` every layer attends within that many tokens (transformers passes it
to every layer), so every layer is the planner's "sliding" mixer, its KV cache capped at the window.
"""

from __future__ import annotations

from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.spec.config_fields import Config
from shardwise.spec.model import LayerSpec
from shardwise.spec.tensors import ATTENTION, DENSE_MLP, TensorSpec, layer_norms, row


def build_phi3(cfg: Config) -> dict[str, Any]:
    """ModelSpec keyword arguments of a Phi-3 config (see the module docstring)."""
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key, False):
            raise ShardwiseError(f"config.json field '{key}' true is not supported for phi3: use false")
    hidden, heads, n_layers = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_hidden_layers")
    kv = cfg.int("num_key_value_heads", heads)
    hd = cfg.int("head_dim", hidden // heads)
    inter = cfg.int("intermediate_size")
    window = cfg.int("sliding_window", 0) or None
    qkv_parts = ((heads * hd, hd), (kv * hd, hd), (kv * hd, hd))
    layers = []
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors = [
            TensorSpec(p + "self_attn.qkv_proj.weight", ((heads + 2 * kv) * hd, hidden), ATTENTION, tp_dim=0,
                       tp_unit=hd, tp_parts=qkv_parts),
            row(p + "self_attn.o_proj.weight", hidden, heads * hd, ATTENTION, hd),
            TensorSpec(p + "mlp.gate_up_proj.weight", (2 * inter, hidden), DENSE_MLP, tp_dim=0,
                       tp_parts=((inter, 1), (inter, 1))),
            row(p + "mlp.down_proj.weight", hidden, inter, DENSE_MLP),
        ]
        tensors += layer_norms(p, hidden)
        layers.append(LayerSpec(i, "sliding" if window else "gqa", "dense", tuple(tensors), window))
    return dict(
        family="phi3", num_layers=n_layers, num_heads=heads, num_kv_heads=kv, head_dim=hd, intermediate_size=inter,
        layers=tuple(layers), sliding_window=window,
    )
