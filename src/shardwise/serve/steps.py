"""What every rank runs per server step, and how rank 0 tells the others.

Rank 0 broadcasts one small message per step (``torch.distributed.broadcast_object_list``):
``{"op": "step", "decode": {slots, positions, tokens[, drafts]} | None, "prefill": {slots,
starts, ids: [[chunk], ...], last: [bool]} | None, "greedy": [rows], "sample": [rows], "stats":
bool}``; ``{"op": "idle"}`` and a one-element all-reduce (``ping``) every ``HEARTBEAT_S`` while
nothing runs (so no rank's wait reaches the collective timeout unless a peer is gone or frozen,
and then every rank notices); ``{"op": "stop"}`` to shut down. Every rank runs the same
forwards, so the tensor- and expert-parallel collectives pair up; greedy rows come out of the
vocab-parallel head identical on every rank, sampled rows' full logits too (rank 0 draws from
them).

Every forward runs under ``exact.row_blocked()``: a row's result does not depend on the other
rows of the batch, which is what makes a request's greedy output independent of the load.
Prefill forwards take the padded GEMM where the row-invariant kernel is a vector one
(``vector_kernels=False``: float32, and bfloat16 without AMX; the GEMM is faster at their row counts, and a prompt's rows only ever meet other prompts' rows), decode steps and
verify passes the fixed-order kernel (a verify pass must equal single steps).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from shardwise.runtime.exact import row_blocked
from shardwise.runtime.layers import allreduce

HEARTBEAT_S = 1.0
"""Seconds between idle messages while no request runs."""


def exchange(message: dict[str, Any] | None, world_size: int) -> dict[str, Any]:
    """Rank 0 sends ``message``; every other rank receives and returns it."""
    if world_size == 1:
        assert message is not None
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def ping(world_size: int) -> None:
    """A one-element all-reduce every rank joins after an idle message: rank 0 learns within the
    collective timeout that a peer froze even while no request runs (a broadcast alone completes
    on the sender as soon as the bytes are buffered)."""
    if world_size > 1:
        dist.all_reduce(torch.zeros(1))


class StepRunner:
    """Runs step messages on one rank's model shard and keeps its time split for ``/metrics``:
    seconds in forwards (``step_s``) and inside the layers' all-reduces (``collective_s``)."""

    def __init__(self, model):
        self.model = model
        self.step_s = self.collective_s = 0.0
        for layer in model.model.layers:
            layer.reduce_attn = layer.reduce_mlp = self._timed_allreduce

    def _timed_allreduce(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = allreduce(t)
        self.collective_s += time.perf_counter() - t0
        return out

    @torch.no_grad()
    def run(self, message: dict[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run one step: (greedy token ids of the ``greedy`` rows, float32 logits of the ``sample`` rows)."""
        t0 = time.perf_counter()
        model, rows = self.model, []
        decode, prefill = message["decode"], message["prefill"]
        with row_blocked():
            if decode is not None and decode.get("drafts"):  # one sequence: verify its drafts in one pass
                ids = torch.tensor([decode["tokens"] + decode["drafts"]])
                rows.append(model(ids, decode["positions"][0], slots=decode["slots"])[0])
            elif decode is not None:
                ids = torch.tensor(decode["tokens"]).unsqueeze(1)
                rows.append(model(ids, decode["positions"], slots=decode["slots"])[:, -1])
        if prefill is not None:  # chunks of one length, one row per sequence
            with row_blocked(vector_kernels=False):
                hidden = model(torch.tensor(prefill["ids"]), prefill["starts"], slots=prefill["slots"])
            rows += [hidden[i:i + 1, -1] for i, last in enumerate(prefill["last"]) if last]
        with row_blocked():
            greedy = logits = None
            if rows:
                hidden = torch.cat(rows)
                if message["greedy"]:
                    greedy = model.lm_head.greedy(hidden[message["greedy"]]).cpu()
                if message["sample"]:
                    logits = model.lm_head.logits(hidden[message["sample"]]).float().cpu()
        self.step_s += time.perf_counter() - t0
        return greedy, logits

    def gather_stats(self, world_size: int) -> list[tuple[float, float]]:
        """Every rank's (step_s, collective_s) since the last call; all ranks must call it together."""
        mine = (self.step_s, self.collective_s)
        self.step_s = self.collective_s = 0.0
        if world_size == 1:
            return [mine]
        out: list[Any] = [None] * world_size
        dist.all_gather_object(out, mine)
        return out


def follow(runner: StepRunner, world_size: int) -> int:
    """A rank other than 0: run rank 0's steps until it says stop; returns the steps run."""
    steps = 0
    while True:
        message = exchange(None, world_size)
        if message["op"] == "stop":
            return steps
        if message["op"] == "idle":
            ping(world_size)
        if message["op"] == "step":
            runner.run(message)
            steps += 1
            if message.get("stats"):
                runner.gather_stats(world_size)
