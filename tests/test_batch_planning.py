"""Planning for many users: batch > 1 decode. Expected figures are derived here independently:
the closed form for the average union of experts, a Monte-Carlo of uniform routing for the
busiest rank, the cache arithmetic for the most sequences that fit."""

import numpy as np
import pytest

from conftest import cli_json, run_cli

E, K, EP = 896, 16, 16  # Kimi K3's routed experts, experts per token, and the seed's EP16


def _busiest_rank_monte_carlo(tokens: int, samples: int = 4000, seed: int = 1) -> float:
    """Mean over samples of the most distinct picked experts on one of EP ranks, when ``tokens``
    tokens each pick K distinct experts uniformly (experts e on rank e // (E / EP))."""
    rng = np.random.default_rng(seed)
    most = np.empty(samples)
    for s in range(samples):
        touched = np.zeros(E, dtype=bool)
        for _ in range(tokens):
            touched[rng.choice(E, size=K, replace=False)] = True
        most[s] = touched.reshape(EP, E // EP).sum(axis=1).max()
    return float(most.mean())


@pytest.fixture(scope="module")
def seed_batches():
    return {b: cli_json("plan", "--batch", str(b)) for b in (1, 8)}


def test_union_of_experts_at_batch_8(seed_batches):
    one, eight = seed_batches[1]["decode"], seed_batches[8]["decode"]
    assert one["batching"] is None and one["batch"] == 1
    figures = eight["batching"]["experts_busiest_rank"]
    # average over ranks: E (1 - (1 - K/E)^B) / EP
    assert figures["average"] == pytest.approx(E * (1 - (1 - K / E) ** 8) / EP, rel=1e-12)
    # busiest rank: the brief's ~3.05 at B = 1 and ~12.3 at B = 8, held against our own simulation
    assert one["expert_imbalance"]["expected_busiest"] == pytest.approx(3.05, abs=0.01)
    assert figures["expected"] == pytest.approx(12.3, abs=0.05)
    assert figures["expected"] == pytest.approx(_busiest_rank_monte_carlo(8, samples=1500), rel=0.02)
    assert figures["p99"] >= figures["expected"]


def test_aggregate_rises_while_each_user_slows(seed_batches):
    one, eight = seed_batches[1]["decode"], seed_batches[8]["decode"]
    assert eight["tok_per_s"] < one["tok_per_s"]
    assert eight["aggregate_tok_per_s"] == pytest.approx(8 * eight["tok_per_s"])
    assert eight["aggregate_tok_per_s"] > 3 * one["aggregate_tok_per_s"]
    steps = eight["waterfall"]
    assert steps[-1]["step"] == "batch" and steps[-1]["tok_per_s"] == pytest.approx(eight["tok_per_s"])
    assert [s["step"] for s in steps[:-1]] == [s["step"] for s in one["waterfall"]]  # batch 1 unchanged before it


def test_max_batch_is_the_cache_arithmetic(seed_batches):
    mem = seed_batches[1]["memory"]
    per_sequence = mem["kv_bytes"]  # one sequence's cache on the fullest rank at --context
    room = mem["box_bytes"] - mem["reserve_bytes"] - mem["workspace_bytes"] - mem["weights_bytes"]
    assert mem["max_batch"] == int(room // per_sequence) > 8
    # one more sequence than that does not fit; exactly that many does
    at_max = run_cli("plan", "--batch", str(mem["max_batch"]), "--json")
    assert at_max.returncode == 0, at_max.stderr
    over = run_cli("plan", "--batch", str(mem["max_batch"] + 1))
    assert over.returncode == 2 and f"it holds {mem['max_batch']} sequences" in over.stderr


def test_crossover_is_where_compute_overtakes_memory():
    """A model whose cache is small against its weights turns compute-bound at some batch: the
    step at the reported batch is compute-bound and the one before it is not."""
    doc = cli_json("plan", "--model", "llama-3.1-8b", "--boxes", "1", "--box", "h100-sxm", "--context", "256",
                   "--batch-curve")
    cross = doc["decode"]["compute_bound_from_batch"]
    assert cross is not None and 1 < cross <= doc["memory"]["max_batch"]
    bound = {r["batch"]: r["compute_bound"] for r in doc["decode"]["batch_curve"]}
    curve = doc["decode"]["batch_curve"]
    assert [r["batch"] for r in curve][:3] == [1, 2, 3] and curve[-1]["batch"] == doc["memory"]["max_batch"]
    for b, compute in bound.items():
        assert compute == (b >= cross), b
    aggregate = [r["aggregate_tok_per_s"] for r in curve]
    assert aggregate[-1] > aggregate[0] and all(r["tok_per_s"] <= curve[0]["tok_per_s"] for r in curve)


def test_batch_one_is_todays_plan():
    assert cli_json("plan", "--batch", "1") == cli_json("plan")


def test_sweep_serves_users_at_a_speed_each():
    rows = cli_json("sweep", "--model", "qwen3-30b-a3b", "--box", "dgx-spark,h100-sxm", "--boxes", "1,2,4",
                    "--users", "16", "--min-tok-per-s", "20")
    assert rows and all(r["users"] == 16 and r["tok_per_s"] >= 20 for r in rows)
    assert all(r["aggregate_tok_per_s"] == pytest.approx(16 * r["tok_per_s"]) for r in rows)
    # the same configuration planned alone at --batch 16 gives the same per-user speed
    r = rows[0]
    args = ["plan", "--model", "qwen3-30b-a3b", "--box", r["box"], "--boxes", str(r["boxes"]), "--batch", "16",
            "--tp", str(r["tp"]), "--ep", str(r["ep"]), "--pp", str(r["pp"])]
    if r["link"] != "none":
        args += ["--link", r["link"]]
    if r["quant"] != "native":
        args += ["--quant", r["quant"]]
    assert cli_json(*args)["decode"]["tok_per_s"] == pytest.approx(r["tok_per_s"], rel=1e-9)


@pytest.mark.parametrize("flag", ["--batch", "--users"])
def test_bad_batch_is_one_line(flag):
    verb = "plan" if flag == "--batch" else "sweep"
    proc = run_cli(verb, flag, "0")
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and len(proc.stderr.strip().splitlines()) == 1


def test_core_takes_batch_as_a_dimension():
    """A sequence of batch sizes adds a leading axis whose rows equal one evaluation per size."""
    from shardwise.perf import core, grid
    from shardwise.perf.configurations import enumerate_layouts
    from shardwise.perf.estimate import formats_bits
    from shardwise.perf.profiles import get_profile
    from shardwise.spec.parse import load_model

    model = load_model("qwen3-30b-a3b")
    plans = enumerate_layouts(model, (1, 2, 4, 8))
    table = core.build_layout_table(model, plans, formats_bits(model.group_formats(), model))
    hw = core.Hardware(np.array([273e9, 3.35e12])[None, :], np.array([1e14, 9.9e14])[None, :], 5e-6, 12.5e9)
    layout = np.arange(len(plans))[:, None]
    prof = get_profile("vllm")
    stacked = grid.evaluate(model, table, layout, hw, 128e9, 4096, profile=prof, batch=[1, 8, 64])
    assert stacked["tok_per_s"].shape == (3, len(plans), 2)
    for i, b in enumerate((1, 8, 64)):
        one = grid.evaluate(model, table, layout, hw, 128e9, 4096, profile=prof, batch=b)
        np.testing.assert_array_equal(stacked["tok_per_s"][i], one["tok_per_s"])
        np.testing.assert_array_equal(stacked["fits"][i], one["fits"])
    assert (stacked["aggregate_tok_per_s"][2] > stacked["aggregate_tok_per_s"][0]).all()
