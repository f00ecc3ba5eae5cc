"""Google Gemma 3 (model_type gemma3_text, and the gemma3 wrapper read through its text_config) and
Gemma 2: the bundled configs parse into sliding / full GQA layers with four norms each, their
parameter counts match hand counts from the config values and the published totals, the KV cache of
sliding layers is capped at the window (hand arithmetic below), plans run, bad values are one-line
errors naming the field, and the runtime refuses the family."""

import json
from importlib import resources

import pytest

from conftest import plan_json
from shardwise.errors import ShardwiseError
from shardwise.perf.measurements import match_alias
from shardwise.spec.parse import load_model, parse_config
from shardwise.spec.tensors import EMBEDDING, LM_HEAD

KEYS = ("gemma-3-1b-it", "gemma-3-4b-it", "gemma-3-12b-it")
MODELS = resources.files("shardwise.spec.catalog.models")


def config(key: str) -> dict:
    return json.loads(MODELS.joinpath(f"{key}.json").read_text())


def gemma_layer(h: int, heads: int, kv: int, hd: int, inter: int, qk_norm: bool = True) -> int:
    """One Gemma layer by hand: q, k, v, o; q/k norms over head_dim (Gemma 3); gate, up, down; four norms."""
    return h * heads * hd + 2 * h * kv * hd + heads * hd * h + (2 * hd if qk_norm else 0) + 3 * h * inter + 4 * h


@pytest.mark.parametrize("key", KEYS)
def test_configs_parse_into_sliding_and_full_layers(key):
    m = load_model(key)
    assert m.family == "gemma3" and m.tie_word_embeddings and m.params_by_group[LM_HEAD] == 0
    full = [layer.index for layer in m.layers if layer.attention == "gqa"]
    assert full == list(range(5, m.num_layers, 6))  # sliding_window_pattern 6: every sixth layer is full
    assert all(layer.window == m.sliding_window for layer in m.layers if layer.attention == "sliding")
    names = {t.name.rsplit(".", 2)[-2] for t in m.layers[0].tensors}
    assert {"q_norm", "k_norm", "pre_feedforward_layernorm", "post_feedforward_layernorm", "gate_proj"} <= names


def test_1b_count_by_hand_matches_the_published_total():
    cfg = config("gemma-3-1b-it")
    assert "tie_word_embeddings" not in cfg  # transformers' default ties the head
    h, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    assert (h, v, n, heads, kv, hd) == (1152, 262144, 26, 4, 1, 256)
    total = v * h + h + n * gemma_layer(h, 4, 1, 256, cfg["intermediate_size"])
    assert total == 999_885_952  # keras-hub's gemma3_instruct_1b "params" (SOURCES.md totals table)
    m = load_model("gemma-3-1b-it")
    assert m.total_params == total and m.active_params == total - v * h


def test_4b_takes_transformers_defaults_for_what_its_text_config_leaves_out():
    text = config("gemma-3-4b-it")["text_config"]
    assert not {"num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"} & set(text)
    m = load_model("gemma-3-4b-it")
    shape = (m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size, m.max_position_embeddings)
    assert shape == (8, 4, 256, 262208, 131072)
    h = 2560
    total = 262208 * h + h + 34 * gemma_layer(h, 8, 4, 256, 10240)
    assert m.total_params == total == 3_880_263_168
    assert total - 64 * h == 3_880_099_328  # keras-hub's text-only 4B, whose vocabulary has 64 rows fewer
    assert m.globals[0].name == "language_model.model.embed_tokens.weight"
    assert m.params_by_group[EMBEDDING] == 262208 * h


def test_12b_count_by_hand_matches_keras_hub_plus_its_64_extra_vocabulary_rows():
    text = config("gemma-3-12b-it")["text_config"]
    h, n = text["hidden_size"], text["num_hidden_layers"]
    assert (h, n, text["num_attention_heads"], text["num_key_value_heads"]) == (3840, 48, 16, 8)
    total = 262208 * h + h + n * gemma_layer(h, 16, 8, 256, text["intermediate_size"])
    assert load_model("gemma-3-12b-it").total_params == total == 11_766_034_176
    assert total - 64 * h == 11_765_788_416  # keras-hub's gemma3_instruct_12b_text "params"


@pytest.mark.parametrize("key,total", [("gemma-2-2b", 2_614_341_888), ("gemma-2-2b-it", 2_614_341_888),
                                       ("gemma-2-9b-it", 9_241_705_984)])
def test_gemma_2_counts_by_hand_match_keras_hub(key, total):
    """Gemma 2: no q / k norms, four norms a layer, sliding and full layers alternating from a sliding
    layer 0; keras-hub's gemma2 presets give 2,614,341,888 and 9,241,705,984 "params" (code index file ids
    401604204, 123073332)."""
    cfg = config(key)
    h, n, heads, kv, hd = (cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                            "num_key_value_heads", "head_dim"))
    m = load_model(key)
    assert m.family == "gemma2" and m.tie_word_embeddings
    per_layer = gemma_layer(h, heads, kv, hd, cfg["intermediate_size"], False)
    assert m.total_params == cfg["vocab_size"] * h + h + n * per_layer == total
    assert [layer.attention for layer in m.layers[:4]] == ["sliding", "gqa", "sliding", "gqa"]


def test_27b_count_by_hand():
    text = config("gemma-3-27b-it")["text_config"]
    h, n = text["hidden_size"], text["num_hidden_layers"]
    assert (h, n, text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]) == (5376, 62, 32, 16, 128)
    total = 262208 * h + h + n * gemma_layer(h, 32, 16, 128, text["intermediate_size"])
    assert load_model("gemma-3-27b-it").total_params == total == 27_009_346_304


def test_kv_cache_by_hand_caps_the_sliding_layers_at_the_window():
    """1B: 26 layers, 4 full (5, 11, 17, 23) and 22 sliding at 512 tokens; each layer keeps K and V of
    one KV head of 256 in bf16 (2 bytes): 1024 bytes a token."""
    m = load_model("gemma-3-1b-it")
    per_layer = 2 * 1 * 256 * 2
    assert m.cache_bytes_per_token(2.0) == 4 * per_layer == 4096  # the growing part: full layers only
    for ctx in (100, 512, 8192):
        assert m.cache_bytes(ctx, 2.0) == 4 * per_layer * ctx + 22 * per_layer * min(ctx, 512)
    m4 = load_model("gemma-3-4b-it")  # 5 full, 29 sliding at 1024; 4 KV heads of 256
    per_layer = 2 * 4 * 256 * 2
    assert m4.cache_bytes(32768, 2.0) == 5 * per_layer * 32768 + 29 * per_layer * 1024


def test_names_resolve_to_the_bundled_sizes_only():
    assert match_alias("models", "Gemma-3-4B-it (QAT)")["key"] == "gemma-3-4b-it"  # data/measurements.csv row 38
    assert match_alias("models", "gemma3")["key"] == "gemma-3-4b-it"  # Ollama's default tag is the 4B
    assert match_alias("models", "gemma3:1b")["key"] == "gemma-3-1b-it"
    assert match_alias("models", "gemma3:12b")["key"] == "gemma-3-12b-it"
    assert match_alias("models", "gemma3:27b")["key"] == "gemma-3-27b-it"
    assert match_alias("models", "gemma2:9b")["key"] == "gemma-2-9b-it"
    assert match_alias("models", "Gemma 2 2B")["key"] == "gemma-2-2b"
    for other in ("Gemma 2 27B", "gemma2:27b", "gemma3:270m"):
        assert match_alias("models", other) is None, other  # no bundled config: unresolved, not guessed


@pytest.mark.parametrize("key", KEYS)
def test_plan_runs(key):
    doc = plan_json("--model", key, "--boxes", "1")
    assert doc["model"]["total_params"] == load_model(key).total_params
    assert doc["decode"]["tok_per_s"] > 0


def test_gemma2_slides_every_even_layer_without_qk_norms():
    """A Gemma 2 config (values as transformers' Gemma2Config defaults, the 2B shapes; not a bundled file)."""
    cfg = {"model_type": "gemma2", "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 256000,
           "sliding_window": 4096}
    m = parse_config(cfg)
    assert m.family == "gemma2" and m.tie_word_embeddings
    assert [layer.attention for layer in m.layers[:4]] == ["sliding", "gqa", "sliding", "gqa"]
    assert m.total_params == 256000 * 2304 + 2304 + 26 * gemma_layer(2304, 8, 4, 256, 9216, qk_norm=False)


@pytest.mark.parametrize("change,field", [
    ({"layer_types": ["chunked_attention"] * 26}, "layer_types"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_bad_configs_are_one_line_errors_naming_the_field(change, field):
    with pytest.raises(ShardwiseError, match=f"'{field}'") as err:
        parse_config(config("gemma-3-1b-it") | change)
    assert "\n" not in str(err.value)


def test_runtime_refuses_the_family(tmp_path):
    """The torch runtime does not run the family: its one check and make-checkpoint say so in one line
    (the CLI path of such an error is held end to end in test_nemotron_h.py)."""
    from shardwise.plan import ParallelPlan
    from shardwise.runtime.checkpoint import make_checkpoint
    from shardwise.runtime.model import check_runnable

    with pytest.raises(ShardwiseError, match="'gemma3_text' can be planned but not run") as err:
        check_runnable(load_model("gemma-3-1b-it"), ParallelPlan())
    assert "\n" not in str(err.value)
    with pytest.raises(ShardwiseError, match="not 'gemma3_text'"):
        make_checkpoint("gemma-3-1b-it", "tiny", tmp_path / "ck")
    assert not (tmp_path / "ck").exists()