"""Microsoft Phi-3 / Phi-3.5 (model_type phi3): the bundled config parses into layers with one fused
qkv and one fused gate_up weight, its parameter count matches a hand count from the config values
and the published 3.8B, tensor parallelism splits each fused part on its own, the KV cache is priced
by hand, plans run, bad values are one-line errors naming the field, and the runtime refuses the family."""

import json
from importlib import resources

import pytest

from conftest import plan_json
from shardwise.errors import ShardwiseError
from shardwise.perf.measurements import match_alias
from shardwise.spec.parse import load_model, parse_config

KEY = "phi-3.5-mini-instruct"
MODELS = resources.files("shardwise.spec.catalog.models")


def config() -> dict:
    return json.loads(MODELS.joinpath(f"{KEY}.json").read_text())


def test_layers_hold_one_fused_qkv_and_one_fused_gate_up():
    m = load_model(KEY)
    assert m.family == "phi3" and not m.tie_word_embeddings and m.num_layers == 32
    shapes = {t.name.split("layers.0.", 1)[1]: t.shape for t in m.layers[0].tensors}
    assert shapes == {
        "self_attn.qkv_proj.weight": (3 * 3072, 3072), "self_attn.o_proj.weight": (3072, 3072),
        "mlp.gate_up_proj.weight": (2 * 8192, 3072), "mlp.down_proj.weight": (3072, 8192),
        "input_layernorm.weight": (3072,), "post_attention_layernorm.weight": (3072,),
    }


def test_count_by_hand_matches_the_published_3_8b():
    cfg = config()
    h, v, n, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    assert (h, v, n, inter, cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (3072, 32064, 32, 8192, 32, 32)
    layer = (32 + 2 * 32) * 96 * h + h * 32 * 96 + 2 * inter * h + h * inter + 2 * h
    total = 2 * v * h + h + n * layer  # untied: embedding and LM head
    assert total == 3_821_079_552
    m = load_model(KEY)
    assert m.total_params == total and round(total / 1e9, 1) == 3.8
    assert m.active_params == total - v * h


def test_phi_4_count_by_hand_matches_its_gguf_parameter_count():
    """Phi-4: 40 layers of hidden 5120, 40 query / 10 KV heads of 128, MLP 17920, vocab 100352, untied;
    Ollama's phi4 GGUF gives ``general.parameter_count`` 14,659,507,200 (code index file id 366615949)."""
    cfg = json.loads(MODELS.joinpath("phi-4.json").read_text())
    h, n, inter, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    assert (h, n, inter, v, cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (5120, 40, 17920, 100352, 40, 10)
    layer = (40 + 2 * 10) * 128 * h + 40 * 128 * h + 2 * inter * h + inter * h + 2 * h
    m = load_model("phi-4")
    assert m.family == "phi3" and m.total_params == 2 * v * h + h + n * layer == 14_659_507_200


def test_tp_splits_each_fused_part_on_its_own():
    m = load_model(KEY)
    qkv, _, gate_up, _ = m.layers[0].tensors[:4]
    assert qkv.tp_shard_len(4) == 3 * 3072 // 4 and gate_up.tp_shard_len(4) == 2 * 8192 // 4
    gqa = parse_config(config() | {"num_key_value_heads": 8})  # q 32 heads, k and v 8 heads of 96
    qkv = gqa.layers[0].tensors[0]
    assert qkv.shape == ((32 + 16) * 96, 3072) and qkv.tp_shard_len(8) == (4 + 1 + 1) * 96
    assert qkv.tp_shard_len(16) == (2 + 1 + 1) * 96  # 8 KV heads over 16 ranks: each rank holds one


def test_kv_cache_by_hand():
    """32 layers, each K and V of 32 heads of 96 in bf16 (2 bytes): 393,216 bytes a token. The window
    (262,144) is above the 131,072 context, so it never caps."""
    m = load_model(KEY)
    assert all(layer.attention == "sliding" and layer.window == 262144 for layer in m.layers)
    per_token = 32 * 2 * 32 * 96 * 2
    assert per_token == 393_216
    assert m.cache_bytes(131072, 2.0) == per_token * 131072
    windowed = parse_config(config() | {"sliding_window": 2047})  # Phi-3-mini-4k's window
    assert windowed.cache_bytes(4096, 2.0) == per_token * 2047


def test_names_resolve_to_phi_3_5_mini_only():
    assert match_alias("models", "Phi-3.5-mini-instruct")["key"] == KEY
    assert match_alias("models", "phi3.5")["key"] == KEY  # Ollama's tag
    assert match_alias("models", "phi4")["key"] == "phi-4"
    for other in ("Phi-3-mini-4k-instruct", "phi4-mini", "Phi-3.5-MoE-instruct", "phi3:14b"):
        assert match_alias("models", other) is None, other


def test_plan_runs():
    doc = plan_json("--model", KEY, "--boxes", "1")
    assert doc["model"]["total_params"] == load_model(KEY).total_params
    assert doc["decode"]["tok_per_s"] > 0


@pytest.mark.parametrize("change,field", [
    ({"attention_bias": True}, "attention_bias"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"intermediate_size": -1}, "intermediate_size"),
])
def test_bad_configs_are_one_line_errors_naming_the_field(change, field):
    with pytest.raises(ShardwiseError, match=f"'{field}'") as err:
        parse_config(config() | change)
    assert "\n" not in str(err.value)


def test_runtime_refuses_the_family(tmp_path):
    """The torch runtime does not run the family: its one check and make-checkpoint say so in one line
    (the CLI path of such an error is held end to end in test_nemotron_h.py)."""
    from shardwise.plan import ParallelPlan
    from shardwise.runtime.checkpoint import make_checkpoint
    from shardwise.runtime.model import check_runnable

    with pytest.raises(ShardwiseError, match="'phi3' can be planned but not run") as err:
        check_runnable(load_model(KEY), ParallelPlan())
    assert "\n" not in str(err.value)
    with pytest.raises(ShardwiseError, match="not 'phi3'"):
        make_checkpoint(KEY, "tiny", tmp_path / "ck")
    assert not (tmp_path / "ck").exists()