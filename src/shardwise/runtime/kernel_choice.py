"""Choosing between kernels that compute the same product by measuring them on this machine, once.

Which of two decode kernels streams weights faster depends on the CPU (``runtime.gemv``: MKL's float32
GEMV beats the compiled kernel on a Xeon and loses by half on an AMD EPYC; ``runtime.int_matmul``: the
bfloat16 dot-product instruction wins on an EPYC and loses to widening the row to float32 on a Xeon), so
the runtime measures the candidates side by side (``side_by_side``) the first time a process needs the
choice, and keeps the result in a JSON file beside the kernel's build (``stored``) for every later process.

A measurement taken while other work held the cores can be wrong, and a stored one is followed by every
later process: each measurement reports ``cpu_share`` (the process's CPU time over wall time x threads),
and the caller decides which records are kept (``stored``'s ``keep``).
"""

from __future__ import annotations

import fcntl
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = ["CONTENDED_SHARE", "side_by_side", "stored"]

CONTENDED_SHARE = 0.85
"""A measurement whose threads held less than this share of their cores (the process's CPU time over wall time x
threads) was taken beside other work."""


def side_by_side(names: Sequence[str], run: Callable[[str, int], int], count: int, rounds: int = 4) -> dict[str, float]:
    """Best-of-``rounds`` GB/s of each candidate in ``names``, and ``cpu_share``. ``run(name, i)`` runs item ``i``
    (a weight the caller holds; each item its own memory, so none is read from cache) with candidate ``name`` and
    returns the bytes it read. Within a round the candidates take turns item by item, the turn order rotating each
    round, so a noisy neighbour's burst slows them alike: with whole rounds alternating, one round taken while the
    CPU was busy once stored the slower candidate (``runtime.gemv``)."""
    best = dict.fromkeys(names, 0.0)
    wall, cpu = time.perf_counter(), time.process_time()
    for r in range(rounds):
        spent, moved = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
        for i in range(count):
            name = names[(i + r) % len(names)]
            start = time.perf_counter()
            moved[name] += run(name, i)
            spent[name] += time.perf_counter() - start
        for name in names:
            if spent[name] > 0:
                best[name] = max(best[name], moved[name] / spent[name] / 1e9)
    share = (time.process_time() - cpu) / ((time.perf_counter() - wall) * torch.get_num_threads())
    return {**best, "cpu_share": share}


def stored(path: Path, measure: Callable[[], dict[str, float]], decide: Callable[[dict[str, float]], str],
           keep: Callable[[dict], bool], names: Sequence[str] = ()) -> dict:
    """The record at ``path`` (JSON: the measured figures and ``choice``), or a new one: ``measure()``'s figures
    and ``decide(figures)``, written to ``path`` if ``keep(record)``; under a file lock, so processes starting
    together (the ranks of one launch) measure once. Records without ``cpu_share`` (written before it was
    measured) or without a figure for each of ``names`` (the candidates now: a newer runtime may have more) are
    measured again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".flock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            record = json.loads(path.read_text())
            if all(key in record for key in ("cpu_share", "choice", *names)):
                return record
        except (OSError, ValueError):
            pass
        figures = measure()
        record = {**figures, "choice": decide(figures)}
        if keep(record):
            path.write_text(json.dumps(record))
        return record
