"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (model_type glm4_moe): the planner's tensors and parameter count
equal those of transformers' own ``Glm4MoeForCausalLM`` built from small random configs (every
option on and off: q/k/v biases, q/k norms, shared experts, dense first layers, tied head), the MTP
layers are not counted (as for DeepSeek-V3), the router is kept in float32, the KV cache is priced
by hand, bad values are one-line errors naming the field, and the runtime refuses the family."""

import json
from importlib import resources

import pytest

from shardwise.errors import ShardwiseError
from shardwise.spec.parse import load_model, parse_config
from shardwise.spec.tensors import ROUTED_EXPERTS, ROUTER

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Glm4MoeConfig = pytest.importorskip("transformers.models.glm4_moe").Glm4MoeConfig

TINY = dict(
    model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], vocab_size=320, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=24, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, n_group=2,
    topk_group=1, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
    num_nextn_predict_layers=1, routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False,
    max_position_embeddings=4096, rms_norm_eps=1e-5,
)
VARIANTS = {
    "glm-4.5-like": {},  # biases and q/k norms on, two shared experts, one dense layer
    "no-bias-no-qk-norm": dict(attention_bias=False, use_qk_norm=False),
    "no-shared-expert": dict(n_shared_experts=0),
    "two-dense-layers": dict(first_k_dense_replace=2, num_hidden_layers=4),
    "all-moe-tied-head": dict(first_k_dense_replace=0, tie_word_embeddings=True, head_dim=None),
}


def reference(config: dict):
    """transformers' own model of ``config`` (random weights, CPU, float32)."""
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "architectures") and v is not None}
    torch.manual_seed(0)
    return transformers.Glm4MoeForCausalLM(Glm4MoeConfig(**kwargs))


def planned_shapes(spec) -> dict[str, tuple[int, ...]]:
    """The spec's tensors by name, routed-expert templates stacked over experts the way transformers 5
    fuses them: ``experts.gate_up_proj`` [E, 2·I, H] (gate and up) and ``experts.down_proj`` [E, H, I]."""
    out, names = {}, {}
    for t in (*spec.globals, *(t for layer in spec.layers for t in layer.tensors)):
        if t.group == ROUTED_EXPERTS:
            stem, part = t.name.split("{e}.")
            names.setdefault(stem, {})[part] = t
            continue
        out[t.name] = t.shape
    for stem, parts in names.items():
        gate, up, down = parts["gate_proj.weight"], parts["up_proj.weight"], parts["down_proj.weight"]
        assert gate.shape == up.shape and gate.experts == up.experts == down.experts
        out[stem + "gate_up_proj"] = (gate.experts, 2 * gate.shape[0], gate.shape[1])
        out[stem + "down_proj"] = (down.experts, *down.shape)
    return out


@pytest.mark.parametrize("change", VARIANTS.values(), ids=VARIANTS.keys())
def test_tensors_and_count_equal_transformers_model(change):
    config = TINY | change
    model = reference(config)
    spec = parse_config(config)
    # parameters plus the persistent router-bias buffers the checkpoint stores; transformers builds a
    # shared expert of width 0 when n_shared_experts is 0 (no tensor) and lists a tied head twice
    state = {name: tuple(v.shape) for name, v in model.state_dict().items() if v.numel()}
    if config["tie_word_embeddings"]:
        assert state.pop("lm_head.weight") == state["model.embed_tokens.weight"]
    assert planned_shapes(spec) == state
    params = sum(p.numel() for p in model.parameters())  # a tied weight once
    bias_buffers = sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    assert bias_buffers == config["n_routed_experts"] * sum(layer.mlp == "moe" for layer in spec.layers)
    assert spec.total_params == params + bias_buffers


def test_layer_kinds_moe_spec_and_float32_router():
    spec = parse_config(TINY)
    assert spec.family == "glm4_moe" and spec.num_layers == 3
    assert [(layer.attention, layer.mlp) for layer in spec.layers] == [("gqa", "dense"), ("gqa", "moe"), ("gqa", "moe")]
    moe = spec.moe
    assert (moe.num_experts, moe.top_k, moe.shared_experts, moe.intermediate_size, moe.shared_intermediate_size) == (
        8, 2, 2, 24, 48)
    assert (moe.routing, moe.n_group, moe.topk_group, moe.norm_topk_prob, moe.routed_scaling_factor) == (
        "sigmoid_grouped", 2, 1, True, 2.5)
    assert ROUTER in spec.float32_groups  # transformers' _keep_in_fp32_modules_strict: gate.weight, the bias


def test_active_count_by_hand():
    """Active per token: everything but the 6 experts of each MoE layer that are not chosen (8 routed,
    top 2), and not the input embedding (a lookup)."""
    spec = parse_config(TINY)
    expert = 3 * 64 * 24
    assert spec.total_params - spec.active_params == 2 * 6 * expert + 320 * 64


def test_mtp_layers_are_not_counted():
    """num_nextn_predict_layers only adds checkpoint layers past the last one, which the planner (like
    transformers and DeepSeek-V3's builder) does not build: the count is the same with 0, 1 or 3."""
    totals = {parse_config(TINY | {"num_nextn_predict_layers": n}).total_params for n in (0, 1, 3)}
    assert totals == {parse_config(TINY).total_params}


def test_partial_rotary_factor_changes_no_size():
    base = parse_config(TINY)
    for factor in (0.25, 1.0):
        other = parse_config(TINY | {"partial_rotary_factor": factor})
        assert other.total_params == base.total_params
        assert other.cache_bytes_per_token(2.0) == base.cache_bytes_per_token(2.0)
    five = parse_config({k: v for k, v in TINY.items() if k != "partial_rotary_factor"}
                        | {"rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.5}})
    assert five.total_params == base.total_params


def test_kv_cache_by_hand():
    """GLM-4.5-Air's shapes: 46 layers, K and V of 8 KV heads of 128 in bf16 (2 bytes) = 188,416 bytes
    a token (the MTP layer's own cache is not counted)."""
    air = TINY | dict(hidden_size=4096, num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
                      head_dim=128, n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, n_group=1,
                      moe_intermediate_size=1408, intermediate_size=10944, vocab_size=151552)
    spec = parse_config(air)
    assert spec.cache_bytes_per_token(2.0) == 46 * 2 * 8 * 128 * 2 == 188_416
    assert spec.cache_bytes(131072, 2.0) == 188_416 * 131072


def attention_and_moe_by_hand(h: int, heads: int, kv: int, hd: int, experts: int, shared: int, inter: int,
                              qk_norm: bool) -> tuple[int, int]:
    """One GLM layer's attention (q, k, v, o, the q/k/v biases, q/k norms over head_dim) and MoE (router and
    its bias, routed and shared experts of gate, up, down) parameters, norms aside."""
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + heads * hd + 2 * kv * hd + (2 * hd if qk_norm else 0)
    return attn, experts * h + experts + (experts + shared) * 3 * h * inter


def test_air_shapes_count_by_hand():
    """GLM-4.5-Air's published shapes (hidden 4096, 46 layers, 96 q / 8 KV heads of 128, q/k/v biases,
    1 dense layer of 10944, 45 MoE layers of 128 experts of 1408 plus one shared, vocabulary 151552,
    untied; built here from TINY: the bundled glm-4.5-air.json is held to its published total below): the count
    by hand, without the MTP layer."""
    h, v, n, heads, kv, hd = 4096, 151552, 46, 96, 8, 128
    air = TINY | dict(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=kv,
                      head_dim=hd, n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, n_group=1,
                      moe_intermediate_size=1408, intermediate_size=10944, vocab_size=v, use_qk_norm=False)
    attn, moe = attention_and_moe_by_hand(h, heads, kv, hd, 128, 1, 1408, qk_norm=False)
    total = 2 * v * h + h + n * (attn + 2 * h) + 3 * h * 10944 + (n - 1) * moe
    spec = parse_config(air)
    assert spec.total_params == total == 106_852_251_264


@pytest.mark.parametrize("key,published", [("glm-4.5", 358_337_791_296), ("glm-4.5-air", 110_468_824_832)])
def test_bundled_files_plus_their_mtp_layer_are_the_published_tensor_counts(key, published):
    """The bundled GLM-4.5 / -Air files: the planner's count (no MTP layer) plus the MTP layer by hand (one MoE
    decoder layer, ``eh_proj`` [h, 2h], three norms, its own embedding and head) equals the tensor count public
    records give for the Hub checkpoints (code index file ids 70911651117, 62221903014)."""
    c = json.loads(resources.files("shardwise.spec.catalog.models").joinpath(f"{key}.json").read_text())
    names = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    h, v, heads, kv, hd = (c[k] for k in names)
    attn, moe = attention_and_moe_by_hand(h, heads, kv, hd, c["n_routed_experts"], c["n_shared_experts"],
                                          c["moe_intermediate_size"], c["use_qk_norm"])
    mtp = attn + 2 * h + moe + 2 * h * h + 3 * h + 2 * v * h
    assert c["num_nextn_predict_layers"] == 1
    assert load_model(key).total_params + mtp == published


def test_runtime_refuses_the_family():
    from shardwise.plan import ParallelPlan
    from shardwise.runtime.model import check_runnable

    with pytest.raises(ShardwiseError, match="'glm4_moe' can be planned but not run") as err:
        check_runnable(parse_config(TINY), ParallelPlan())
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change,field", [
    ({"first_k_dense_replace": 4}, "first_k_dense_replace"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 3}, "topk_group"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"partial_rotary_factor": 0}, "partial_rotary_factor"),
    ({"partial_rotary_factor": "half"}, "partial_rotary_factor"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
    ({"n_routed_experts": None}, "n_routed_experts"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_bad_configs_are_one_line_errors_naming_the_field(change, field):
    with pytest.raises(ShardwiseError, match=f"'{field}'") as err:
        parse_config(TINY | change)
    assert "\n" not in str(err.value)
