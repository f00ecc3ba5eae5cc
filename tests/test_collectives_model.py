"""α-β collective formulas against hand-computed figures."""

import numpy as np
import pytest

from shardwise.errors import ShardwiseError
from shardwise.perf import collectives as c

N = 14336  # hidden 7168 x 2 bytes
ALPHA = 10e-6
BETA = 12.5e9
WIRE = N / BETA  # 1.14688e-6 s


def test_ring_p16_decode_message():
    # 2*15*10us + 2*15/16 * 14336/12.5e9 = 300us + 1.875*1.14688us
    assert c.ring_allreduce_s(N, 16, ALPHA, BETA) == pytest.approx(300e-6 + 2.1504e-6, rel=1e-12)


def test_recursive_doubling_power_of_two_and_pre_post_steps():
    assert c.recursive_doubling_allreduce_s(N, 16, ALPHA, BETA) == pytest.approx(4 * (ALPHA + WIRE))
    # p = 12: floor(log2 12) = 3 rounds + pre + post = 5
    assert c.recursive_doubling_allreduce_s(N, 12, ALPHA, BETA) == pytest.approx(5 * (ALPHA + WIRE))
    assert c.recursive_doubling_allreduce_s(N, 3, ALPHA, BETA) == pytest.approx(3 * (ALPHA + WIRE))


def test_one_shot_tree_p2p_gather_scatter():
    assert c.one_shot_allreduce_s(N, 16, ALPHA, BETA) == pytest.approx(ALPHA + 15 * WIRE)
    assert c.tree_allreduce_s(N, 16, ALPHA, BETA) == pytest.approx(8 * (ALPHA + WIRE))
    assert c.tree_allreduce_s(N, 5, ALPHA, BETA) == pytest.approx(6 * (ALPHA + WIRE))
    assert c.point_to_point_s(N, ALPHA, BETA) == pytest.approx(ALPHA + WIRE)
    assert c.ring_allgather_s(N, 4, ALPHA, BETA) == pytest.approx(3 * ALPHA + 0.75 * WIRE)
    assert c.ring_reduce_scatter_s(N, 4, ALPHA, BETA) == pytest.approx(3 * ALPHA + 0.75 * WIRE)


@pytest.mark.parametrize("fn", list(c.ALLREDUCE_ALGORITHMS.values()) + [c.ring_allgather_s])
def test_single_rank_costs_nothing(fn):
    assert fn(N, 1, ALPHA, BETA) == 0.0


def test_best_picks_one_shot_for_tiny_and_ring_for_big():
    assert c.best_allreduce(N, 16, ALPHA, BETA) == ("oneshot", pytest.approx(27.2032e-6))
    name, seconds = c.best_allreduce(1e9, 16, ALPHA, BETA)
    assert name == "ring"
    assert seconds == pytest.approx(300e-6 + 1.875 * 0.08)
    # 8 ranks, 1 MB: rd 3*(10us+80us)=270us, one-shot 10us+7*80us=570us, ring 140us+1.75*80us=280us
    assert c.best_allreduce(1e6, 8, ALPHA, BETA)[0] == "rd"


def test_vectorised_over_arrays():
    n = np.array([N, 1e9])
    names, seconds = c.best_allreduce(n, 16, ALPHA, BETA)
    assert list(names) == ["oneshot", "ring"]
    ring = c.ring_allreduce_s(N, np.array([1, 2, 4]), ALPHA, BETA)
    np.testing.assert_allclose(ring, [0.0, 2 * ALPHA + WIRE, 6 * ALPHA + 1.5 * WIRE])


def test_two_level():
    # 8 ranks per host (intra 1us, 300 GB/s), 2 hosts (10us, 12.5 GB/s), ring across:
    # the runtime's reduce to the leader (it receives 7 vectors), then the broadcast back
    intra = 1e-6 + 7 * N / 300e9
    across = 2 * ALPHA + WIRE
    got = c.two_level_allreduce_s(N, 8, 2, 1e-6, 300e9, ALPHA, BETA, inter_algorithm="ring")
    assert got == pytest.approx(2 * intra + across)
    with pytest.raises(ShardwiseError, match="inter_algorithm"):
        c.two_level_allreduce_s(N, 8, 2, 1e-6, 300e9, ALPHA, BETA, inter_algorithm="butterfly")


def test_bad_input_rejected():
    with pytest.raises(ShardwiseError, match="p \\(ranks\\) must be >= 1"):
        c.ring_allreduce_s(N, 0, ALPHA, BETA)
    with pytest.raises(ShardwiseError, match="beta_bytes_per_s must be > 0"):
        c.ring_allreduce_s(N, 4, ALPHA, 0)


def test_auto_allreduce_takes_shared_memory_only_for_gloo_ranks_on_one_host(tmp_path):
    """`run` / `serve --allreduce auto` (their default): gloo ranks all on this x86-64 host reduce through
    shared memory; across hosts, on NCCL, or with a measured cluster file the α-β model picks a TCP
    algorithm the runtime runs."""
    import platform

    from shardwise.perf.allreduce_choice import RUNNABLE_FLAT, choose_for_run

    local = choose_for_run(2048, 2, 2)
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert local.name == "shm" and "one host" in local.describe()
        assert 0 < local.seconds < choose_for_run(2048, 2, 2, backend="nccl").seconds
    else:
        assert local.name in RUNNABLE_FLAT
    assert choose_for_run(2048, 2, 2, backend="nccl").name in RUNNABLE_FLAT
    assert choose_for_run(2048, 2, 4, ranks_per_host=2).name in RUNNABLE_FLAT + ("two-level",)
    assert choose_for_run(2048, 2, 1).name != "shm"  # nothing to reduce
    cluster = tmp_path / "c.toml"
    cluster.write_text('[cluster]\nbox = "cpu-host"\nlink = "loopback-tcp"\nboxes = 2\n')
    assert choose_for_run(2048, 2, 2, cluster_file=str(cluster)).name in RUNNABLE_FLAT
