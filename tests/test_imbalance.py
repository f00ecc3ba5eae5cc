"""Expert-parallel imbalance: closed forms against brute force and the seeded Monte-Carlo."""

import itertools

import numpy as np

import pytest

from shardwise.perf.imbalance import (
    distinct_experts,
    expected_max_load,
    expected_max_load_tokens,
    load_percentiles,
    max_load_pmf,
)


@pytest.mark.parametrize("experts,k,ep", [(8, 2, 4), (8, 3, 2), (12, 4, 3), (16, 4, 4)])
def test_exact_pmf_equals_enumeration(experts, k, ep):
    per = experts // ep
    counts = {}
    combos = list(itertools.combinations(range(experts), k))
    for combo in combos:
        loads = [0] * ep
        for e in combo:
            loads[e // per] += 1
        counts[max(loads)] = counts.get(max(loads), 0) + 1
    pmf = max_load_pmf(experts, k, ep)
    for c, p in enumerate(pmf):
        assert p == pytest.approx(counts.get(c, 0) / len(combos), abs=1e-12)


def test_closed_form_matches_monte_carlo():
    for experts, k, ep in [(8, 2, 4), (64, 8, 8), (896, 16, 16)]:
        mc = load_percentiles(experts, k, ep, samples=20000, seed=1)["mean"]
        assert mc == pytest.approx(expected_max_load(experts, k, ep), rel=0.02)


def test_seed_case_busiest_rank_holds_about_three_experts():
    # 16 of 896 experts over 16 ranks: average 1 per rank, busiest ~3.
    assert 2.9 < expected_max_load(896, 16, 16) < 3.2
    assert expected_max_load(896, 16, 1) == 16


def test_multi_token_form_matches_monte_carlo():
    for tokens in (2, 4, 8):
        closed = expected_max_load_tokens(896, 16, 16, tokens)
        mc = load_percentiles(896, 16, 16, tokens=tokens, samples=4000, seed=2)["mean"]
        assert closed == pytest.approx(mc, rel=0.05)


def test_distinct_experts_formula():
    assert distinct_experts(896, 16, 1) == pytest.approx(16)
    assert distinct_experts(896, 16, 8) == pytest.approx(896 * (1 - (1 - 16 / 896) ** 8))


def test_monte_carlo_is_seeded():
    assert load_percentiles(64, 8, 8, samples=500, seed=3) == load_percentiles(64, 8, 8, samples=500, seed=3)


def test_quantile_matches_numpy_percentile():
    from shardwise.perf.imbalance import _quantile

    rng = np.random.default_rng(5)
    for n in (1, 2, 7, 2000):
        draws = np.sort(rng.integers(0, 9, n))
        for q in (0.0, 0.5, 0.99, 1.0):
            assert _quantile(draws, q) == pytest.approx(np.percentile(draws, 100 * q), abs=1e-12)


def test_large_batches_and_wide_picks_stay_bounded():
    """Issue #18: `plan --batch 1000` held samples x tokens x k picks (0.9 GB, 9 s; 1e6 never ended);
    64 of 256 experts redrew rows forever (almost every row repeats an expert); C(4096, 2048) is
    past the float range. Past E picks in all the draw is per-group binomial, near the closed form."""
    import time

    start = time.monotonic()
    for tokens in (200, 10**6):
        mc = load_percentiles(896, 16, 16, tokens=tokens, samples=2000, seed=4)["mean"]
        assert mc == pytest.approx(expected_max_load_tokens(896, 16, 16, tokens), rel=0.02)
    assert load_percentiles(256, 64, 1, samples=2000)["p50"] == 64
    assert distinct_experts(65536, 64, 8) / 16 < expected_max_load_tokens(65536, 64, 16, 8) < 65536 / 16
    assert time.monotonic() - start < 5
