"""NVIDIA Nemotron-H (model_type nemotron_h): the bundled configs parse into Mamba-2 / attention /
MLP / MoE blocks, their parameter counts match the published totals, the Mamba-2 state is priced as
vLLM sizes it (hand arithmetic below, from the config values), plans run, a TP degree the Mamba
heads or groups refuse is a one-line error naming the field, and the runtime refuses the family."""

import json
from importlib import resources

import pytest

from conftest import plan_json, run_cli
from shardwise.errors import ShardwiseError
from shardwise.perf import core
from shardwise.perf.estimate import formats_bits
from shardwise.plan import ParallelPlan, valid_tp_degrees, validate_plan
from shardwise.spec.parse import load_model, parse_config
from shardwise.spec.tensors import EMBEDDING, LATENT_PROJ, ROUTED_EXPERTS

KEYS = ("nemotron-3-nano-30b-a3b", "nemotron-3-super-120b-a12b", "nemotron-h-56b-base-8k")
MODELS = resources.files("shardwise.spec.catalog.models")


def config(key: str) -> dict:
    return json.loads(MODELS.joinpath(f"{key}.json").read_text())


@pytest.mark.parametrize("key", KEYS)
def test_blocks_follow_the_pattern(key):
    cfg = config(key)
    m = load_model(key)
    kinds = {"M": ("mamba2", "none"), "*": ("gqa", "none"), "-": ("none", "dense"), "E": ("none", "moe")}
    assert [(layer.attention, layer.mlp) for layer in m.layers] == [kinds[c] for c in cfg["hybrid_override_pattern"]]
    assert m.num_layers == cfg["num_hidden_layers"] and m.family == "nemotron_h"
    names = {t.name for t in m.tensors()}
    assert {"backbone.embeddings.weight", "backbone.norm_f.weight", "lm_head.weight"} <= names


def test_nano_counts_match_the_published_31_6b_total_and_3_2b_active():
    m = load_model("nemotron-3-nano-30b-a3b")
    # hand count from the config: hidden 2688, vocab 131072, 23 Mamba, 6 attention, 23 MoE blocks
    h, v = 2688, 131072
    inner, bc, heads = 64 * 64, 8 * 128, 64
    conv = inner + 2 * bc
    mamba = (2 * inner + 2 * bc + heads) * h + conv * 4 + conv + 3 * heads + inner + h * inner + h
    attention = (32 * 128 + 2 * 2 * 128) * h + h * 32 * 128 + h
    routed = 128 * 2 * 1856 * h
    moe_rest = 128 * h + 128 + 2 * 3712 * h + h  # router, correction bias, shared expert, block norm
    assert m.total_params == 2 * v * h + h + 23 * mamba + 6 * attention + 23 * (routed + moe_rest)
    assert round(m.total_params / 1e9, 1) == 31.6
    assert m.active_params == m.total_params - v * h - 23 * routed + 23 * 6 * 2 * 1856 * h
    assert round(m.active_params / 1e9, 1) == 3.2  # input embedding excluded; with it 3.6 B, as NVIDIA gives
    assert round((m.active_params + m.params_by_group[EMBEDDING]) / 1e9, 1) == 3.6


def test_super_is_a_latent_moe_with_its_mtp_block_left_out():
    m = load_model("nemotron-3-super-120b-a12b")
    assert m.moe.latent_size == 1024 and m.moe.top_k == 22 and m.moe.num_experts == 512
    up = next(t for t in m.layers[1].tensors if t.group == ROUTED_EXPERTS)
    assert up.shape == (2688, 1024)  # experts work in the latent width
    assert m.params_by_group[LATENT_PROJ] == 40 * 2 * 1024 * 4096
    assert not any("mtp" in t.name for t in m.tensors())
    # HF card: "Total Parameters 120B (12B active)"; the planner's count, MTP block excluded
    assert round(m.total_params / 1e9) == 121 and round(m.active_params / 1e9) == 12


def test_56b_is_dense_and_rounds_to_its_56b():
    m = load_model("nemotron-h-56b-base-8k")
    assert m.moe is None and m.head_dim == 128  # attention_head_dim
    assert round(m.total_params / 1e9) == 56


def test_mamba_state_bytes_per_sequence_by_hand():
    """Nano: 23 Mamba blocks, each an fp32 SSM state heads x head_dim x ssm_state_size and a conv
    window of (conv_kernel - 1) positions of x | B | C channels in the cache dtype (bf16: 2 bytes)."""
    cfg = config("nemotron-3-nano-30b-a3b")
    blocks = cfg["hybrid_override_pattern"].count("M")
    heads, hd, n, groups, k = (cfg[f] for f in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
                                                "conv_kernel"))
    assert (blocks, heads, hd, n, groups, k) == (23, 64, 64, 128, 8, 4)
    tp1 = blocks * (64 * 64 * 128 * 4 + 3 * (64 * 64 + 2 * 8 * 128) * 2)
    tp2 = blocks * (32 * 64 * 128 * 4 + 3 * (32 * 64 + 2 * 4 * 128) * 2)  # heads and groups halved
    assert tp1 == 49_082_368 and tp2 == 24_541_184
    m = load_model("nemotron-3-nano-30b-a3b")
    assert m.linear_state_bytes(2.0) == tp1
    assert m.cache_bytes(4096, 2.0) == tp1 + 6 * 2 * 2 * 128 * 2 * 4096  # + the 6 attention blocks' KV
    table = core.build_layout_table(m, [ParallelPlan(tp=1), ParallelPlan(tp=2)], formats_bits(m.group_formats(), m))
    _, cache = core.stage_bytes(table, 4096)
    kv = 6 * 2 * 2 * 128 * 2 * 4096  # K and V of 2 KV heads, one per rank under tp 2
    assert cache[:, 0].tolist() == [tp1 + kv, tp2 + kv // 2]


def test_decode_reads_and_writes_the_mamba_state():
    m = load_model("nemotron-3-nano-30b-a3b")
    table = core.build_layout_table(m, [ParallelPlan(tp=1)], formats_bits(m.group_formats(), m))
    step = core.step_figures(m, table, 4096)
    mamba = [i for i, layer in enumerate(m.layers) if layer.attention == "mamba2"]
    state = 64 * 64 * 128 * 4  # one fp32 SSM state: read once, written once per position
    for i in mamba:
        assert step.nbytes[0, i] - table.dense_bytes[0, i] == 2 * state
    moe = [i for i, layer in enumerate(m.layers) if layer.mlp == "moe"]
    assert table.counts.allreduces.tolist() == [1] * len(m.layers) and len(moe) == 23


@pytest.mark.parametrize("key", KEYS)
def test_plan_runs(key):
    doc = plan_json("--model", key, "--boxes", "4")
    assert doc["model"]["total_params"] == load_model(key).total_params
    assert doc["decode"]["tok_per_s"] > 0


@pytest.mark.parametrize("key", KEYS)
def test_vllm_tp_degrees(key):
    assert valid_tp_degrees(load_model(key)) == [1, 2, 4, 8]  # n_groups 8: divided, never replicated


def test_tp_that_splits_a_mamba_group_is_refused_naming_the_field():
    with pytest.raises(ShardwiseError, match=r"8 Mamba groups \(config.json field 'n_groups'\)") as err:
        validate_plan(load_model("nemotron-3-nano-30b-a3b"), ParallelPlan(tp=16))
    assert "\n" not in str(err.value)


def test_tp_that_does_not_divide_the_mamba_heads_is_refused_naming_the_field():
    cfg = config("nemotron-3-nano-30b-a3b") | {"mamba_num_heads": 48, "n_groups": 1}
    m = parse_config(cfg, "nano-48")
    validate_plan(m, ParallelPlan(tp=16))  # 32 attention heads, 48 Mamba heads: 16 divides both
    with pytest.raises(ShardwiseError, match=r"48 Mamba heads \(config.json field 'mamba_num_heads'\)") as err:
        validate_plan(m, ParallelPlan(tp=32))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change,field", [
    ({"hybrid_override_pattern": "MEX"}, "hybrid_override_pattern"),
    ({"num_hidden_layers": 51}, "hybrid_override_pattern"),
    ({"hybrid_override_pattern": "M" * 2000, "num_hidden_layers": None}, "hybrid_override_pattern"),
    ({"n_groups": 3}, "n_groups"),
    ({"mamba_num_heads": 0}, "mamba_num_heads"),
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}}, "quantization_config"),
])
def test_bad_configs_are_one_line_errors_naming_the_field(change, field):
    with pytest.raises(ShardwiseError, match=f"'{field}'") as err:
        parse_config(config("nemotron-3-nano-30b-a3b") | change)
    assert "\n" not in str(err.value)


def test_layers_block_type_spells_the_same_blocks():
    cfg = config("nemotron-3-nano-30b-a3b")
    names = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    listed = {k: v for k, v in cfg.items() if k not in ("hybrid_override_pattern", "num_hidden_layers")}
    listed["layers_block_type"] = [names[c] for c in cfg["hybrid_override_pattern"]]
    assert parse_config(listed).total_params == load_model("nemotron-3-nano-30b-a3b").total_params


def test_runtime_refuses_the_family(tmp_path):
    (tmp_path / "config.json").write_bytes(MODELS.joinpath("nemotron-3-nano-30b-a3b.json").read_bytes())
    run = run_cli("run", str(tmp_path))
    assert run.returncode != 0 and "'nemotron_h' can be planned but not run" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    make = run_cli("make-checkpoint", "--model", "nemotron-3-nano-30b-a3b", "--out", str(tmp_path / "ck"))
    assert make.returncode != 0 and "not 'nemotron_h'" in make.stderr
    assert len(make.stderr.strip().splitlines()) == 1 and not (tmp_path / "ck").exists()


def test_each_block_counts_half_a_layer_of_launch_overhead():
    """A Nemotron-H block runs one mixer or one MLP: half a decoder layer's kernels, so the per-layer
    launch overhead counts it as 1/2 (a llama layer counts 1)."""
    nano, llama = load_model("nemotron-3-nano-30b-a3b"), load_model("llama-3.1-8b")
    assert nano.num_layers == 52 and nano.launch_layers == 26.0
    assert llama.launch_layers == llama.num_layers == 32
    doc = plan_json("--model", "nemotron-3-nano-30b-a3b", "--boxes", "1", "--runtime", "vllm")
    host = next(s for s in doc["decode"]["waterfall"] if s["step"] == "host overhead")
    assert "x 26 layers (52 single-mixer or MLP blocks" in host["cause"]
