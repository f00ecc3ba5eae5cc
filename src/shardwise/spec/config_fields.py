"""A Hugging Face config's text part as the model builders read it: ``Config`` (typed reads with
one-line errors naming the field) and ``check_fields`` (sizes and counts within sane bounds,
before any builder multiplies them)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from shardwise.errors import ShardwiseError, shown


class Config:
    """Typed access to a config dict with one-line errors naming the missing field."""

    def __init__(self, data: Mapping[str, Any], model_type: str):
        self.data = data
        self.model_type = model_type

    def req(self, key: str) -> Any:
        if key not in self.data or self.data[key] is None:
            raise ShardwiseError(
                f"config.json ({self.model_type}) is missing required field '{key}': add it to the config"
            )
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key, default)
        return default if value is None else value

    def int(self, key: str, default: int | None = None) -> int:
        value = self.req(key) if default is None else self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ShardwiseError(f"config.json field '{key}' must be a non-negative integer, got {shown(value)}")
        return value


# ---- impossible values, refused before any arithmetic -----------------------------------------

POSITIVE_FIELDS = (  # sizes that divide, or that a model cannot have none of: whole numbers >= 1
    "hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "num_key_value_heads", "head_dim",
    "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts", "n_routed_experts",
    "num_experts_per_tok", "num_experts_per_token", "experts_per_token", "decoder_sparse_step", "moe_layer_freq",
    "full_attention_interval", "n_group", "num_expert_group", "topk_group", "kv_lora_rank", "qk_nope_head_dim",
    "v_head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
COUNT_FIELDS = (  # whole numbers >= 0 (0 or null: none)
    "n_shared_experts", "num_shared_experts", "first_k_dense_replace", "shared_expert_intermediate_size",
    "qk_rope_head_dim", "q_lora_rank", "routed_expert_hidden_size", "sliding_window", "max_position_embeddings",
    "model_max_length",
)
NUMBER_FIELDS = ("rms_norm_eps", "routed_scaling_factor")  # finite numbers
EXPERT_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token")
MAX_SIZE = 2**32  # any size or count: far past real models (vocabulary 256 k), inside int64 byte arithmetic
MOST = {  # tighter where the planner loops over the value
    "num_hidden_layers": 1024,  # 8x the deepest bundled model; each layer is built and priced
    "num_attention_heads": 4096, "num_key_value_heads": 4096,  # TP degrees are tried up to the head count
    **dict.fromkeys(EXPERT_FIELDS, 65536),
    **dict.fromkeys(TOP_K_FIELDS, 64),  # the exact expert-imbalance pmf costs k^3; 4x the most bundled (16)
}


def check_fields(data: Mapping[str, Any], positive=POSITIVE_FIELDS, counts=COUNT_FIELDS, where: str = "") -> None:
    """Refuse impossible config values (zero heads, negative or astronomic sizes, a head count the
    KV heads do not divide, more experts per token than experts, a layer list of the wrong
    length) in one line naming the field, before a builder divides by them."""
    def bad(key: str, want: str) -> ShardwiseError:
        return ShardwiseError(f"config.json field '{where}{key}' must be {want}, got {shown(data[key])}")

    for keys, least in ((positive, 1), (counts, 0)):
        for key in keys:
            value, most = data.get(key), MOST.get(key, MAX_SIZE)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not least <= value <= most):
                raise bad(key, f"a whole number in {least}..{most:,}")
    for key in NUMBER_FIELDS:
        value = data.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)):
            raise bad(key, "a finite number")
    for key, kind in (("mlp_only_layers", int), ("full_attn_layers", int), ("layer_types", str)):
        value = data.get(key)
        if value is not None and (not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool)
                                                                            for v in value)):
            raise bad(key, f"a list of {kind.__name__}s")
    layers, types = data.get("num_hidden_layers"), data.get("layer_types")
    if types is not None and layers is not None and len(types) != layers:
        raise ShardwiseError(f"config.json field 'layer_types' has {len(types)} entries, expected num_hidden_layers = {layers}")
    heads, kv, hidden = data.get("num_attention_heads"), data.get("num_key_value_heads"), data.get("hidden_size")
    if heads is not None and kv is not None and heads % kv:
        raise ShardwiseError(f"config.json field 'num_key_value_heads' ({kv}) must divide num_attention_heads ({heads})")
    if heads is not None and hidden is not None and data.get("head_dim") is None and hidden < heads:
        raise ShardwiseError(f"config.json field 'hidden_size' ({hidden}) is below num_attention_heads ({heads}): "
                             "give head_dim, or a hidden size of heads x head_dim")
    experts = next((data[k] for k in EXPERT_FIELDS if data.get(k) is not None), None)
    for key in TOP_K_FIELDS:
        if experts is not None and data.get(key) is not None and data[key] > experts:
            raise bad(key, f"at most the {experts} experts")


# ---- families --------------------------------------------------------------------------------
