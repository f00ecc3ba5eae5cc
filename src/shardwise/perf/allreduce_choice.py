"""``--allreduce auto``: the runtime algorithm the α-β model says is cheapest for a run.

At batch 1 every decode all-reduce carries one activation vector per position
(``hidden × element bytes × positions``), so the choice depends only on that size, the
rank count and the link's α/β: from a cluster file (``shardwise probe`` writes one)
or, without one, the catalog link for ranks across hosts (10 GbE TCP). Gloo ranks that all run on
one x86-64 host without a cluster file take ``shm`` (``runtime.shm_allreduce``): no TCP at all, as
vLLM's CPU backend and SGLang's CPU kernels reduce ranks on one host. Pure Python + numpy, like
the rest of the planner.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

from shardwise.perf import collectives

RUNNABLE_FLAT = ("ring", "rd", "oneshot")
"""Flat algorithms of ``collectives.ALLREDUCE_ALGORITHMS`` the runtime runs itself."""

LOCAL_LINK = "loopback-tcp"
REMOTE_LINK = "10gbe-tcp"

SHM_ALPHA_S = 30e-6
"""Seconds of one small shared-memory all-reduce between two local ranks (measured on this project's
2-core dev VM, 8 KB: 15-30 µs, against 0.34-1.5 ms through gloo over loopback; ``runtime.shm_allreduce``)."""
SHM_BETA_BYTES_PER_S = 5e9
"""Bytes/s of its copies in and out of the segment (estimate: memcpy-bound, well under a DRAM stream)."""


@dataclass(frozen=True)
class AllreduceChoice:
    """The chosen runtime algorithm and why: message bytes, ranks, α (s), β (B/s), model seconds."""

    name: str
    n_bytes: float
    ranks: int
    alpha_s: float
    beta_bytes_per_s: float
    seconds: float
    link: str

    def describe(self) -> str:
        """One line for the console."""
        return (
            f"all-reduce auto -> {self.name}: {self.seconds * 1e6:.0f} us modelled for {self.n_bytes:.0f} B over "
            f"{self.ranks} ranks (alpha {self.alpha_s * 1e6:.1f} us, beta {self.beta_bytes_per_s / 1e9:.2f} GB/s, {self.link})"
        )


def choose_allreduce(
    n_bytes: float, ranks: int, alpha_s: float, beta_bytes_per_s: float, link: str = "",
    ranks_per_host: int | None = None, intra: tuple[float, float] | None = None,
) -> AllreduceChoice:
    """Cheapest runnable all-reduce for ``n_bytes`` over ``ranks``.

    The flat algorithms are ranked by ``collectives.best_allreduce`` (ties to its order);
    one it names that the runtime lacks (tree) gives way to the cheapest runnable one.
    With ``ranks_per_host`` < ``ranks`` and the ``intra`` (α, β) of the host-local link,
    the two-level algorithm competes too (α/β then describe the link between hosts).
    """
    name, seconds = collectives.best_allreduce(n_bytes, ranks, alpha_s, beta_bytes_per_s)
    if name not in RUNNABLE_FLAT:
        seconds, name = min(
            (float(collectives.ALLREDUCE_ALGORITHMS[a](n_bytes, ranks, alpha_s, beta_bytes_per_s)), a)
            for a in RUNNABLE_FLAT
        )
    if ranks_per_host and intra and 1 < ranks_per_host < ranks and ranks % ranks_per_host == 0:
        two = float(collectives.two_level_allreduce_s(
            n_bytes, ranks_per_host, ranks // ranks_per_host, intra[0], intra[1], alpha_s, beta_bytes_per_s
        ))
        if two < seconds:
            name, seconds = "two-level", two
    return AllreduceChoice(name, float(n_bytes), ranks, alpha_s, beta_bytes_per_s, float(seconds), link)


def choose_for_run(
    hidden_size: int, element_bytes: int, ranks: int, cluster_file: str | None = None,
    ranks_per_host: int | None = None, positions: int = 1, backend: str = "gloo",
) -> AllreduceChoice:
    """``choose_allreduce`` for a run's decode message (``hidden × element_bytes × positions``):
    α/β from ``cluster_file`` when given, else the catalog link for one host or several; gloo ranks
    all on one x86-64 host with no cluster file: ``shm``."""
    from shardwise.spec.hardware import get_link, load_cluster_file

    one_host = ranks_per_host is None or ranks_per_host >= ranks
    n_bytes = hidden_size * element_bytes * positions
    if (one_host and ranks > 1 and backend == "gloo" and not cluster_file
            and platform.machine().lower() in ("x86_64", "amd64")):
        seconds = collectives.ALLREDUCE_ALGORITHMS["oneshot"](n_bytes, ranks, SHM_ALPHA_S, SHM_BETA_BYTES_PER_S)
        return AllreduceChoice("shm", float(n_bytes), ranks, SHM_ALPHA_S, SHM_BETA_BYTES_PER_S, float(seconds),
                               "shared memory, ranks on one host")
    if cluster_file:
        link = load_cluster_file(cluster_file).link
        where = f"{cluster_file}: {link.key}"
    else:
        link = get_link(LOCAL_LINK if one_host else REMOTE_LINK)
        where = f"catalog link {link.key}"
    local = get_link(LOCAL_LINK)
    return choose_allreduce(
        n_bytes, ranks, link.latency_s, link.beta_bytes_per_s, where,
        ranks_per_host=None if one_host else ranks_per_host, intra=(local.latency_s, local.beta_bytes_per_s),
    )
