"""ParallelPlan validation and the shard layout the planner and runtime share."""

import pytest

from shardwise.errors import ShardwiseError
from shardwise.plan import (
    ParallelPlan,
    default_plan,
    local_experts,
    rank_param_counts,
    shard_slice,
    validate_plan,
    valid_tp_degrees,
)
from shardwise.spec.parse import load_model


def test_tp_not_dividing_heads_names_nearest_valid():
    m = load_model("llama-3.1-8b")  # 32 heads, 8 KV heads
    with pytest.raises(ShardwiseError, match=r"--tp 6 .* nearest valid is --tp (4|8)"):
        validate_plan(m, ParallelPlan(tp=6))


def test_kv_heads_replicate_when_tp_exceeds_them():
    m = load_model("llama-3.1-8b")
    validate_plan(m, ParallelPlan(tp=16))
    k = next(t for t in m.layers[0].tensors if t.name.endswith("k_proj.weight"))
    # 8 KV heads over 16 ranks: each rank holds one head, ranks 2i and 2i+1 share head i.
    assert shard_slice(k, ParallelPlan(tp=16), 0) == (0, 128)
    assert shard_slice(k, ParallelPlan(tp=16), 1) == (0, 128)
    assert shard_slice(k, ParallelPlan(tp=16), 15) == (7 * 128, 8 * 128)


def test_ep_errors():
    m = load_model("qwen3-30b-a3b")
    with pytest.raises(ShardwiseError, match="--ep 3 must divide --tp 4"):
        validate_plan(m, ParallelPlan(tp=4, ep=3))
    with pytest.raises(ShardwiseError, match="dense"):
        validate_plan(load_model("llama-3.1-8b"), ParallelPlan(tp=2, ep=2))
    with pytest.raises(ShardwiseError, match="permutation"):
        validate_plan(m, ParallelPlan(tp=2, rank_order=(0, 0)))


def test_split_tensors_partition_exactly_across_ranks():
    m = load_model("qwen3-30b-a3b")
    plan = ParallelPlan(tp=4, ep=4)
    totals = [sum(rank_param_counts(m, plan, r).values()) for r in range(4)]
    replicated = sum(t.total_numel for t in m.tensors() if t.tp_dim is None and not t.is_routed)
    # Each rank holds a quarter of everything split, plus every replicated tensor.
    assert sum(totals) == m.total_params - replicated + 4 * replicated
    assert len(set(totals)) == 1


def test_experts_partition_over_ep_groups():
    plan = ParallelPlan(tp=4, ep=2)
    assert list(local_experts(8, plan, 0)) == [0, 1, 2, 3]
    assert list(local_experts(8, plan, 1)) == [0, 1, 2, 3]
    assert list(local_experts(8, plan, 3)) == [4, 5, 6, 7]


def test_pipeline_stages_cover_every_layer_once():
    plan = ParallelPlan(tp=2, pp=3)
    layers = [i for s in range(3) for i in plan.stage_layers(61, s)]
    assert layers == list(range(61))


def test_default_plan_for_the_seed_case():
    assert default_plan(load_model("kimi-k3"), 16) == ParallelPlan(tp=16, ep=16, pp=1)
    assert 16 in valid_tp_degrees(load_model("kimi-k3"))


def test_rank_counts_sum_to_total_for_pure_pipeline():
    m = load_model("llama-3.1-8b")
    plan = ParallelPlan(pp=4)
    assert sum(sum(rank_param_counts(m, plan, r).values()) for r in range(4)) == m.total_params
    assert "embedding" in rank_param_counts(m, plan, 0) and "lm_head" not in rank_param_counts(m, plan, 0)
    assert "lm_head" in rank_param_counts(m, plan, 3) and "embedding" not in rank_param_counts(m, plan, 3)
    layer_params = sum(t.numel for t in m.layers[0].tensors)
    assert rank_param_counts(m, plan, 1)["attention"] + rank_param_counts(m, plan, 1)["dense_mlp"] + \
        rank_param_counts(m, plan, 1)["norm"] == 8 * layer_params
