"""ModelSpec against published parameter counts and hand-computed cache sizes."""

import json

import pytest

from shardwise.errors import ShardwiseError
from shardwise.spec.model import ROUTED_EXPERTS
from shardwise.spec.parse import catalog_models, load_model, parse_config

# Published totals (shared/data/models/SOURCES.md), in parameters.
PUBLISHED_TOTALS = {
    "deepseek-v3": 671.0e9,
    "kimi-k2-instruct": 1.026e12,
    "qwen3-235b-a22b": 235e9,
    "qwen3-30b-a3b": 30.5e9,
    "gpt-oss-120b": 116.83e9,
    "gpt-oss-20b": 20.91e9,
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.6e9,
    "llama-3.1-405b": 405.9e9,
}


@pytest.mark.parametrize("key,published", sorted(PUBLISHED_TOTALS.items()))
def test_total_params_match_published_within_1_percent(key, published):
    total = load_model(key).total_params
    assert abs(total - published) / published < 0.01, (key, total)


def test_kimi_k3_total_within_3_percent_of_2_8_t_and_active_near_104_b():
    m = load_model("kimi-k3")
    assert abs(m.total_params - 2.8e12) / 2.8e12 < 0.03
    assert abs(m.active_params - 104e9) / 104e9 < 0.03
    assert m.moe.num_experts == 896 and m.moe.top_k == 16 and m.moe.shared_experts == 2
    assert m.moe.latent_size == 3584
    kinds = [layer.attention for layer in m.layers]
    assert kinds.count("kda") == 69 and kinds.count("gated_mla") == 24
    assert m.layers[0].mlp == "dense" and all(layer.mlp == "moe" for layer in m.layers[1:])
    # One routed expert: w1/w3 [3072, 3584] and w2 [3584, 3072] = 33.03 M parameters.
    per_expert = sum(t.numel for t in m.layers[1].tensors if t.group == ROUTED_EXPERTS)
    assert per_expert == 3 * 3072 * 3584


def test_gpt_oss_120b_active_excludes_input_embedding():
    m = load_model("gpt-oss-120b")
    assert abs(m.active_params - 5.13e9) / 5.13e9 < 0.01
    embedding = m.vocab_size * m.hidden_size
    assert m.active_params_by_group["embedding"] == 0
    assert m.params_by_group["embedding"] == embedding


def test_qwen3_5_hybrid_layers_and_total():
    m = load_model("qwen3.5-397b-a17b")
    assert abs(m.total_params - 397e9) / 397e9 < 0.01
    kinds = [layer.attention for layer in m.layers]
    assert kinds.count("gated_attention") == 15 and kinds.count("gated_deltanet") == 45
    assert m.linear_state_bytes() > 0


def test_cache_bytes_per_token_hand_computed():
    # Llama-3.1-70B: 80 layers x 2 (K, V) x 8 KV heads x 128 x 2 bytes.
    assert load_model("llama-3.1-70b").cache_bytes_per_token() == 80 * 2 * 8 * 128 * 2 == 327_680
    # DeepSeek-V3 MLA latent: 61 layers x (512 + 64) x 2 bytes.
    assert load_model("deepseek-v3").cache_bytes_per_token() == 61 * 576 * 2 == 70_272


def test_gpt_oss_sliding_layers_are_capped_at_the_window():
    m = load_model("gpt-oss-120b")
    per_layer = 2 * 8 * 64 * 2  # K and V, 8 KV heads, head_dim 64, bf16
    full = sum(1 for layer in m.layers if layer.attention == "gqa")
    sliding = sum(1 for layer in m.layers if layer.attention == "sliding")
    assert full == sliding == 18
    for ctx in (100, 4096, 131072):
        assert m.cache_bytes(ctx) == full * per_layer * ctx + sliding * per_layer * min(ctx, 128)


def test_quantization_config_sets_group_formats():
    assert load_model("gpt-oss-120b").group_formats()[ROUTED_EXPERTS] == "mxfp4"
    assert load_model("gpt-oss-120b").group_formats()["attention"] == "bf16"
    k3 = load_model("kimi-k3").group_formats()
    assert k3[ROUTED_EXPERTS] == "mxfp4"
    assert {k3[g] for g in ("attention", "linear_attention", "shared_experts", "dense_mlp", "lm_head")} == {"bf16"}
    assert load_model("deepseek-v3").group_formats()["attention"] == "fp8"
    assert load_model("llama-3.1-8b").group_formats()["dense_mlp"] == "bf16"


def _llama_config() -> dict:
    from importlib import resources

    return json.loads(resources.files("shardwise.spec.catalog.models").joinpath("llama-3.1-8b.json").read_text())


@pytest.mark.parametrize("qc,expected", [
    ({"quant_algo": "FP8", "ignore": ["lm_head"]}, {"attention": "fp8", "dense_mlp": "fp8"}),
    ({"quant_algo": "NVFP4", "ignore": ["lm_head", "model.layers.*.self_attn*"]}, {"attention": "bf16", "dense_mlp": "nvfp4"}),
    ({"quant_algo": "W4A16_NVFP4", "exclude_modules": ["*mlp*"]}, {"attention": "nvfp4", "dense_mlp": "bf16"}),
])
def test_modelopt_exports_set_group_formats(qc, expected):
    """NVIDIA ModelOpt checkpoints (quant_method modelopt): quant_algo for every matmul group the
    ignore / exclude_modules globs do not hit; the LM head and embedding stay in the dtype."""
    m = parse_config(_llama_config() | {"quantization_config": {"quant_method": "modelopt", **qc}})
    formats = m.group_formats()
    assert {g: formats[g] for g in expected} == expected and formats["lm_head"] == "bf16"
    assert m.quant_method == "modelopt"


def test_a_modelopt_algorithm_shardwise_cannot_price_is_one_line():
    cfg = _llama_config() | {"quantization_config": {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}}
    with pytest.raises(ShardwiseError, match="quant_algo 'MIXED_PRECISION' \\(modelopt\\) is not supported") as err:
        parse_config(cfg)
    assert "\n" not in str(err.value)


def test_every_catalog_model_parses():
    assert len(catalog_models()) >= 13
    for key in catalog_models():
        assert load_model(key).total_params > 0


def test_unsupported_model_type_names_it():
    with pytest.raises(ShardwiseError, match="unsupported model_type 'mamba'"):
        parse_config({"model_type": "mamba", "hidden_size": 8})


def test_missing_field_is_named():
    cfg = json.loads(json.dumps(load_model("llama-3.1-8b").config))
    del cfg["num_attention_heads"]
    with pytest.raises(ShardwiseError, match="missing required field 'num_attention_heads'"):
        parse_config(cfg)


def test_missing_model_type_and_text_config():
    with pytest.raises(ShardwiseError, match="model_type"):
        parse_config({"hidden_size": 8})
    with pytest.raises(ShardwiseError, match="text_config"):
        parse_config({"model_type": "kimi_k3"})


def test_unknown_catalog_key_suggests_close_names():
    with pytest.raises(ShardwiseError, match="did you mean .*kimi-k3"):
        load_model("kimi-k4")


def test_config_path_and_bad_json(tmp_path):
    good = tmp_path / "config.json"
    good.write_text(json.dumps(dict(load_model("qwen3-30b-a3b").config)))
    assert load_model(tmp_path).total_params == load_model("qwen3-30b-a3b").total_params
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ShardwiseError, match="not valid JSON"):
        load_model(bad)
