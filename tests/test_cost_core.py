"""The one cost core: per-rank cache from the mixer table, the collectives it counts, and the one
validity check that plan, sweep and run share. Expected figures are derived here from the configs'
numbers, not read back from the code."""

import pytest

from conftest import cli_json, run_cli
from shardwise.errors import ShardwiseError
from shardwise.perf import collectives
from shardwise.perf.memory import rank_cache_bytes, rank_weight_bytes
from shardwise.perf.profiles import load_profiles
from shardwise.plan import ParallelPlan, rank_param_counts, shard_slice, valid_tp_degrees, validate_plan
from shardwise.spec.mixers import MIXERS
from shardwise.spec.parse import catalog_models, load_model, parse_config

CTX = 10_000


def test_every_bundled_layer_kind_is_one_mixer_entry():
    kinds = {layer.attention for key in catalog_models() for layer in load_model(key).layers}
    assert kinds <= set(MIXERS)
    assert kinds == {"gqa", "sliding", "mla", "gated_mla", "gated_attention", "gated_deltanet", "kda", "mamba2", "none"}


def test_gqa_cache_per_rank_replicates_kv_heads():
    # Llama 3.1 70B: 80 layers x 8 KV heads x 128; at TP16 each rank holds one KV head (replicated)
    m = load_model("llama-3.1-70b")
    assert rank_cache_bytes(m, ParallelPlan(tp=16), CTX, 2.0, 5) == 80 * 2 * 1 * 128 * 2 * CTX
    assert rank_cache_bytes(m, ParallelPlan(tp=4), CTX, 2.0, 0) == 80 * 2 * 2 * 128 * 2 * CTX


def test_mla_latent_is_replicated_on_every_rank():
    # DeepSeek-V3: 61 layers x (512 + 64) latent elements per token, whole on every TP rank
    m = load_model("deepseek-v3")
    for tp in (1, 8, 16):
        assert rank_cache_bytes(m, ParallelPlan(tp=tp), CTX, 1.0, tp - 1) == 61 * 576 * CTX


def test_kimi_k3_latent_projections_are_whole_on_every_rank():
    # vLLM's K3 (LatentMoERunner) and the other K3 ports hold routed_expert_down_proj / _up_proj
    # replicated: 92 MoE layers x 2 x 7168 x 3584 bf16 on every rank, whatever the tp
    from shardwise.perf.estimate import formats_bits
    from shardwise.perf.memory import rank_group_bytes
    from shardwise.spec.tensors import LATENT_PROJ

    m = load_model("kimi-k3")
    bits = formats_bits(m.group_formats(), m)
    for tp in (1, 8, 16):
        for rank in (0, tp - 1):
            assert rank_group_bytes(m, ParallelPlan(tp=tp, ep=tp), bits, rank)[LATENT_PROJ] == 92 * 2 * 7168 * 3584 * 2
    names = {t.name for layer in m.layers for t in layer.tensors}
    assert "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight" in names
    assert "model.layers.1.block_sparse_moe.routed_expert_norm.weight" in names


def test_sliding_layers_hold_only_their_window():
    # gpt-oss-120b: 18 full + 18 sliding (128-token) layers, 8 KV heads x 64, fp8 KV at TP2
    m = load_model("gpt-oss-120b")
    per_token = 2 * 4 * 64 * 1.0
    assert rank_cache_bytes(m, ParallelPlan(tp=2), CTX, 1.0, 1) == 18 * per_token * CTX + 18 * per_token * 128


def test_linear_state_splits_by_heads_with_pipeline_stages():
    # Qwen3.5-397B: 60 layers, every 4th full attention (2 KV heads x 256), the rest Gated DeltaNet:
    # 64 value heads x 128 x 128 fp32 state + 3 conv positions of (2 x 16 x 128 + 64 x 128) channels
    # in the cache dtype (bf16 here)
    m = load_model("qwen3.5-397b-a17b")
    plan = ParallelPlan(tp=2, pp=2)  # stage 0 = layers 0..29: 23 DeltaNet + 7 full layers
    state = (64 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 64 * 128) * 2) / 2
    kv = 2 * 1 * 256 * 2
    assert rank_cache_bytes(m, plan, CTX, 2.0, 0) == 23 * state + 7 * kv * CTX
    assert rank_cache_bytes(m, plan, CTX, 2.0, 3) == 22 * state + 8 * kv * CTX


def test_collectives_per_step_count_the_embedding_allreduce():
    # Llama 3.1 8B at TP4: 2 all-reduces per layer x 32, one for the vocab-parallel embedding,
    # one all-gather of (value, index) pairs for greedy sampling
    doc = cli_json("plan", "--model", "llama-3.1-8b", "--boxes", "4")
    assert doc["decode"]["collectives_per_step"] == 2 * 32 + 1 + 1
    # Kimi K3 (93 layers) as vLLM runs it: each latent-MoE layer's one all-reduce carries the routed
    # latent beside the shared output, so no collective more than any MoE; on the wire it is longer
    k3 = cli_json("plan")
    assert k3["decode"]["collectives_per_step"] == 2 * 93 + 1 + 1


def test_allreduce_names_are_one_list():
    names = set(collectives.ALLREDUCE_ALGORITHMS)
    for profile in load_profiles().values():
        assert set(profile.allreduce) <= names, profile.name
    assert set(collectives.PLANNER_ALGORITHM) == set(collectives.RUNTIME_ALGORITHMS)
    assert set(collectives.PLANNER_ALGORITHM.values()) <= names


def test_vocabulary_is_padded_not_refused():
    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 1001}
    m = parse_config(cfg, name="odd-vocab")
    plan = ParallelPlan(tp=2)
    validate_plan(m, plan)
    head = next(t for t in m.globals if t.group == "lm_head")
    assert [shard_slice(head, plan, r) for r in (0, 1)] == [(0, 501), (501, 1001)]
    # every rank holds ceil(1001 / 2) = 501 rows of the embedding and of the LM head
    assert rank_param_counts(m, plan, 1)["lm_head"] == 501 * 64
    assert rank_param_counts(m, plan, 1)["embedding"] == 501 * 64
    assert rank_weight_bytes(m, plan, {g: 16.0 for g in m.params_by_group}, 0) == 2 * sum(
        rank_param_counts(m, plan, 0).values())


def test_packed_expert_blocks_are_one_rule_for_plan_and_sweep():
    # gpt-oss-120b experts are MXFP4 (32-element blocks) over an intermediate of 2880: tp/ep = 4 cuts
    # the down projection's inputs into 720-element slices, 22.5 blocks
    m = load_model("gpt-oss-120b")
    with pytest.raises(ShardwiseError, match="whole blocks"):
        validate_plan(m, ParallelPlan(tp=8, ep=2))
    validate_plan(m, ParallelPlan(tp=8, ep=2), {**m.group_formats(), "routed_experts": "bf16"})
    proc = run_cli("plan", "--model", "gpt-oss-120b", "--boxes", "8", "--tp", "8", "--ep", "2")
    assert proc.returncode != 0 and "whole blocks" in proc.stderr and "Traceback" not in proc.stderr


def test_sweep_front_rows_pass_the_runtimes_check():
    """Every front row the sweep proposes at the checkpoint's own formats is a layout ``run`` accepts
    (pipeline stages aside, which the runtime does not run yet)."""
    pytest.importorskip("torch")
    from shardwise.runtime.model import check_runnable

    rows = cli_json("sweep", "--model", "gpt-oss-120b,qwen3-30b-a3b,llama-3.1-8b", "--box", "h100-sxm,dgx-spark",
                    "--boxes", "1,2,4,8", "--link", "nvlink4,100g-roce", "--quant", "native")
    assert {r["model"] for r in rows} == {"gpt-oss-120b", "qwen3-30b-a3b", "llama-3.1-8b"}
    # On 8 Sparks the fastest gpt-oss layout by the cost model alone is TP8 (experts cut 8 ways:
    # 360-element slices of MXFP4 blocks); the front must offer one the runtime can load instead.
    rows += cli_json("sweep", "--model", "gpt-oss-120b", "--box", "dgx-spark", "--boxes", "8",
                     "--link", "100g-roce", "--quant", "native")
    checked = 0
    for r in rows:
        plan = ParallelPlan(tp=r["tp"], ep=r["ep"], pp=r["pp"])
        m = load_model(r["model"])
        validate_plan(m, plan, r["formats"])
        if plan.pp == 1:
            check_runnable(m, plan)
            checked += 1
    assert checked >= 3


def test_every_split_is_whole_units():
    # 12 heads divide by 3, but the MLP's 128 rows do not: refused, not 3 x 42 rows with 2 dropped
    m = parse_config({"model_type": "llama", "hidden_size": 48, "num_attention_heads": 12, "num_key_value_heads": 12,
                      "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 100}, name="uneven")
    with pytest.raises(ShardwiseError, match="128 rows of 'model.layers.0.mlp.gate_proj.weight'.*--tp 4"):
        validate_plan(m, ParallelPlan(tp=3))
    # Kimi K3's latent projections are whole on every rank (as vLLM holds them), so its 96 heads
    # set the degrees: every divisor of 96
    assert valid_tp_degrees(load_model("kimi-k3")) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]


def test_kda_dt_bias_is_float32_in_any_format():
    # Kimi Linear 48B: 20 KDA layers, each with dt_bias [32 heads x 128] held in float32 (as
    # transformers' _keep_in_fp32_modules_strict) whatever the linear-attention group's format;
    # A_log [32] follows its group. Under TP dt_bias splits by heads like the rest.
    m = load_model("kimi-linear-48b-a3b")
    dt_bias = 20 * 32 * 128
    for bits in (16.0, 8.0):
        fmt = {g: bits for g in m.params_by_group}
        assert m.weight_bytes(fmt) == m.total_params * bits / 8 + dt_bias * (4 - bits / 8)
        for tp in (1, 4):
            plan = ParallelPlan(tp=tp, ep=tp)
            held = sum(rank_param_counts(m, plan, 0).values())
            assert rank_weight_bytes(m, plan, fmt, 0) == held * bits / 8 + dt_bias / tp * (4 - bits / 8)
    # Qwen3.5's Gated DeltaNet keeps dt_bias and A_log in the run dtype: nothing float32
    q = load_model("qwen3.5-397b-a17b")
    assert q.weight_bytes({g: 16.0 for g in q.params_by_group}) == q.total_params * 2
