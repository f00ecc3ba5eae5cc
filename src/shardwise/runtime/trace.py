"""Per-layer, per-rank timing of a run: compute, waiting for the slowest rank, and collectives.

Where the hooks sit
-------------------
Every ``DecoderLayer`` sums its attention and MLP/MoE partial outputs through two
attributes, ``reduce_attn`` and ``reduce_mlp``, which are the plain ``layers.allreduce``
function. ``Tracer.attach`` replaces them with timed versions and adds a forward
pre-hook on layer 0; ``detach`` puts the plain function back. With tracing off nothing
of this module runs: no clock reads, no extra collectives.

What one traced all-reduce records (rank r, all times on a clock shared by the ranks)::

    mark ──compute──► arrive ──wait──► latest arrival ──sync──► gathered ──comm──► end

- ``arrive``: r reaches the all-reduce (its compute since the previous mark is done).
- The ranks exchange their arrival times: one int64 per rank (``all_gather_single``),
  done only while tracing. ``wait = max(arrivals) − arrive`` is the time r sat idle
  because a slower rank had not arrived yet, measured, not inferred.
- ``sync``: the rest of that exchange (its own latency) — tracing overhead, shown apart.
- ``comm``: the real all-reduce, started after every rank has arrived.

A step (prefill or one decode token) is cut into contiguous segments: ``embed`` (from
the step's start to layer 0: embedding and its all-reduce), per layer and block (attn,
mlp) compute / wait / sync / comm, then ``head`` (final norm, LM head, sampling), so
the segments add up to the step's wall time.

Clocks
------
``time.monotonic_ns`` reads CLOCK_MONOTONIC, which on Linux is one system-wide clock:
ranks on one host compare their stamps directly. Across hosts the clocks have unrelated
origins, so ``clock_offset`` estimates each rank's offset to rank 0 with a ping-pong
through the process group (the round with the smallest round trip; error up to half
that round trip, a few µs over RDMA, tens of µs over TCP, and any drift during the run
is not corrected), which bounds how small a cross-host wait can be resolved.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from shardwise.runtime.layers import allreduce

CLOCK = time.monotonic_ns  # CLOCK_MONOTONIC: system-wide on Linux, comparable across local ranks
PHASES = ("compute", "wait", "comm", "sync")  # per-block phases; "sync" is tracing overhead
_TIDS = {"step": 0, "compute": 1, "wait": 2, "comm": 3, "sync": 4}
_THREAD_NAMES = {0: "step", 1: "compute", 2: "wait for slowest rank", 3: "collective", 4: "trace sync (overhead)"}
_PING_ROUNDS = 16


def clock_offset(device: torch.device | str = "cpu", force_ping_pong: bool = False) -> tuple[int, str]:
    """(this rank's clock minus rank 0's, in ns; how it was found). A collective: every rank calls it.

    Ranks on one host share CLOCK_MONOTONIC: offset 0. Otherwise rank 0 exchanges
    ``_PING_ROUNDS`` ping-pongs with each rank and keeps the round with the smallest round
    trip: offset = peer stamp − midpoint of rank 0's send and receive stamps.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return 0, "single-rank"
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    if len(set(hosts)) == 1 and not force_ping_pong:
        return 0, "same-host"
    rank = dist.get_rank()
    buf = torch.zeros(1, dtype=torch.int64, device=device)
    offsets = torch.zeros(world, dtype=torch.int64, device=device)
    if rank == 0:
        for peer in range(1, world):
            best_rtt, best = None, 0
            for _ in range(_PING_ROUNDS):
                t0 = CLOCK()
                dist.send(buf, peer)
                dist.recv(buf, peer)
                t1 = CLOCK()
                if best_rtt is None or t1 - t0 < best_rtt:
                    best_rtt, best = t1 - t0, int(buf.item()) - (t0 + t1) // 2
            offsets[peer] = best
    else:
        for _ in range(_PING_ROUNDS):
            dist.recv(buf, 0)
            buf.fill_(CLOCK())
            dist.send(buf, 0)
    dist.broadcast(offsets, 0)
    return int(offsets[rank].item()), "ping-pong"


class Tracer:
    """Times every layer of every traced step on this rank; ``export()`` returns the records.

    Build it on every rank (it is a collective: the clock offsets are exchanged), then
    ``attach()``; bracket each step with ``begin_step`` / ``end_step`` (``generate`` does
    when given the tracer). Calls of the model outside a bracketed step pass through.
    """

    def __init__(self, model, device: torch.device | str = "cpu", force_ping_pong: bool = False):
        self.model = model
        self.layers = list(model.model.layers)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device = torch.device(device)
        self.offset_ns, self.clock_method = clock_offset(self.device, force_ping_pong)
        self.steps: list[tuple[str, int, int, int, int]] = []  # (kind, position, tokens, start, end)
        self.rows: list[tuple] = []  # (step, layer, block, mark, arrive, gathered, end, arrivals)
        self._stamp = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._arrivals = torch.zeros(self.world, dtype=torch.int64, device=self.device)
        self._sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        self._open = False
        self._mark = 0
        self._current: tuple[str, int, int, int] | None = None
        self._handle = None

    # ------------------------------------------------------------------ hooks

    def attach(self) -> Tracer:
        """Swap the timed all-reduce hooks into every decoder layer."""
        for index, layer in enumerate(self.layers):
            layer.reduce_attn = self._timed(index, "attn")
            layer.reduce_mlp = self._timed(index, "mlp")
        self._handle = self.layers[0].register_forward_pre_hook(self._layer0_start)
        return self

    def detach(self) -> None:
        """Put the plain ``layers.allreduce`` back (tracing off costs nothing again)."""
        for layer in self.layers:
            layer.reduce_attn = allreduce
            layer.reduce_mlp = allreduce
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _now(self) -> int:
        if self._sync is not None:
            self._sync()
        return CLOCK()

    def _layer0_start(self, module, args) -> None:
        if self._open:  # the embed segment ends, layer 0's compute starts
            self._mark = self._now()

    def _timed(self, layer: int, block: str):
        world, stamp, arrivals, offset = self.world, self._stamp, self._arrivals, self.offset_ns

        def reduce(t: torch.Tensor) -> torch.Tensor:
            if not self._open:
                return allreduce(t)
            arrive = self._now()
            if world > 1:
                stamp.fill_(arrive - offset)
                dist.all_gather_single(arrivals, stamp)
                gathered = self._now()
                out = allreduce(t)
                end = self._now()
                seen = tuple(arrivals.tolist())
            else:
                out, gathered, end, seen = allreduce(t), arrive, arrive, (arrive - offset,)
            self.rows.append((len(self.steps), layer, block, self._mark, arrive, gathered, end, seen))
            self._mark = end
            return out

        return reduce

    # ------------------------------------------------------------------ steps

    def begin_step(self, kind: str, position: int, tokens: int = 1) -> None:
        """Start timing a step of ``tokens`` positions from ``position`` ("prefill" or "decode")."""
        self._current = (kind, position, tokens, self._now())
        self._open = True

    def end_step(self) -> None:
        """Close the step begun last (after its token was picked)."""
        assert self._current is not None, "end_step without begin_step"
        kind, position, tokens, start = self._current
        self.steps.append((kind, position, tokens, start, self._now()))
        self._open, self._current = False, None

    def export(self) -> dict[str, Any]:
        """This rank's records (picklable, in the shared clock) for ``chrome_trace`` / ``summarize``."""
        off = self.offset_ns
        spec = self.model.spec
        return {
            "rank": self.rank,
            "world_size": self.world,
            "clock": {"source": "CLOCK_MONOTONIC", "method": self.clock_method, "offset_ns": off},
            "layer_kinds": [(layer.attention, layer.mlp) for layer in spec.layers],
            "steps": [(k, p, n, s - off, e - off) for k, p, n, s, e in self.steps],
            "rows": [
                (step, layer, block, mark - off, arrive - off, gathered - off, end - off, seen)
                for step, layer, block, mark, arrive, gathered, end, seen in self.rows
            ],
        }


# ---------------------------------------------------------------------- analysis


def _phases(row: tuple) -> tuple[int, int, int, int, int]:
    """(compute, wait, sync, comm, last-arrived rank) in ns of one exported row."""
    _, _, _, mark, arrive, gathered, end, seen = row
    latest = max(seen)
    wait = min(max(latest - arrive, 0), gathered - arrive)
    return arrive - mark, wait, gathered - arrive - wait, end - gathered, seen.index(latest)


def chrome_trace(ranks: list[dict[str, Any]], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Chrome-trace JSON (opens in Perfetto): pid = rank, tid = phase, "X" events in µs."""
    t0 = min(s[3] for r in ranks for s in r["steps"])

    def us(ns: int) -> float:
        return round((ns - t0) / 1000.0, 3)

    events: list[dict[str, Any]] = []
    for r in ranks:
        pid = r["rank"]
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tid, name in _THREAD_NAMES.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        by_step: dict[int, list[tuple]] = {}
        for row in r["rows"]:
            by_step.setdefault(row[0], []).append(row)
        decode_index = 0
        for i, (kind, position, tokens, start, end) in enumerate(r["steps"]):
            label = "prefill" if kind == "prefill" else f"{kind} {decode_index}"
            decode_index += kind != "prefill"
            step_args = {"step": i, "kind": kind, "position": position, "tokens": tokens}
            events.append({"name": label, "cat": "step", "ph": "X", "pid": pid, "tid": 0, "ts": us(start),
                           "dur": us(end) - us(start), "args": step_args})
            rows = by_step.get(i, [])
            first = rows[0][3] if rows else end
            last = rows[-1][6] if rows else end
            for name, a, b in (("embed", start, first), ("head", last, end)):
                events.append({"name": name, "cat": "compute", "ph": "X", "pid": pid, "tid": _TIDS["compute"],
                               "ts": us(a), "dur": us(b) - us(a), "args": {"step": i, "segment": name}})
            for row in rows:
                _, layer, block, mark, arrive, gathered, end_ns, _ = row
                compute, wait, _sync, _comm, last_rank = _phases(row)
                attention, mlp = r["layer_kinds"][layer]
                args = {"step": i, "layer": layer, "kind": attention, "mlp": mlp, "block": block}
                spans = (
                    ("compute", mark, arrive),
                    ("wait", arrive, arrive + wait),
                    ("sync", arrive + wait, gathered),
                    ("comm", gathered, end_ns),
                )
                for phase, a, b in spans:
                    extra = {"last_arrival_rank": last_rank} if phase == "wait" else {}
                    events.append({
                        "name": f"L{layer} {block} {phase}", "cat": phase, "ph": "X", "pid": pid,
                        "tid": _TIDS[phase], "ts": us(a), "dur": us(b) - us(a), "args": {**args, **extra},
                    })
    doc: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if meta:
        doc["otherData"] = {k: v for k, v in meta.items() if isinstance(v, (str, int, float))}
    return doc


def summarize(
    ranks: list[dict[str, Any]], model: str, tp: int, ep: int, measured_tok_per_s: float
) -> dict[str, Any]:
    """The summary the report reads: per layer and rank, means over the steps after prefill
    (decode steps, and speculative verify steps when there are any), in seconds.

    ``{"kind": "trace", "model", "tp", "ep", "measured_tok_per_s", "decode_steps",
    "layers": [{"layer", "kind", "mlp", "rank", "compute_s", "comm_s", "wait_s", "sync_s",
    "last_arrival_share"}], "ranks": [{"rank", "step_s", "compute_s", "comm_s", "wait_s",
    "sync_s", "other_s", "last_arrival_share"}], "slowest_rank", "clock"}``.
    ``other_s`` is embedding + final norm + LM head + sampling; ``sync_s`` is the tracing
    overhead (the arrival exchange); ``last_arrival_share`` the fraction of this rank's
    collectives at which it was the last to arrive. The slowest rank is the one that
    arrived last most often.
    """
    layers_out: list[dict[str, Any]] = []
    ranks_out: list[dict[str, Any]] = []
    steps_n = 0
    for r in ranks:
        decode = {i for i, s in enumerate(r["steps"]) if s[0] != "prefill"}
        steps_n = len(decode)
        n = max(len(decode), 1)
        acc: dict[int, list[float]] = {}
        lasts: dict[int, list[int]] = {}
        for row in r["rows"]:
            if row[0] not in decode:
                continue
            compute, wait, sync, comm, last_rank = _phases(row)
            a = acc.setdefault(row[1], [0.0, 0.0, 0.0, 0.0])
            a[0] += compute
            a[1] += comm
            a[2] += wait
            a[3] += sync
            lasts.setdefault(row[1], []).append(int(last_rank == r["rank"]))
        step_ns = sum(r["steps"][i][4] - r["steps"][i][3] for i in decode)
        totals = [sum(a[k] for a in acc.values()) for k in range(4)]
        for layer in sorted(acc):
            a = acc[layer]
            attention, mlp = r["layer_kinds"][layer]
            layers_out.append({
                "layer": layer, "kind": attention, "mlp": mlp, "rank": r["rank"],
                "compute_s": a[0] / n / 1e9, "comm_s": a[1] / n / 1e9, "wait_s": a[2] / n / 1e9,
                "sync_s": a[3] / n / 1e9, "last_arrival_share": sum(lasts[layer]) / len(lasts[layer]),
            })
        all_lasts = [x for v in lasts.values() for x in v]
        ranks_out.append({
            "rank": r["rank"],
            "step_s": step_ns / n / 1e9,
            "compute_s": totals[0] / n / 1e9,
            "comm_s": totals[1] / n / 1e9,
            "wait_s": totals[2] / n / 1e9,
            "sync_s": totals[3] / n / 1e9,
            "other_s": (step_ns - sum(totals)) / n / 1e9,
            "last_arrival_share": sum(all_lasts) / len(all_lasts) if all_lasts else 0.0,
        })
    slowest = max(ranks_out, key=lambda x: (x["last_arrival_share"], x["compute_s"]))["rank"] if ranks_out else 0
    return {
        "kind": "trace",
        "model": model,
        "tp": tp,
        "ep": ep,
        "measured_tok_per_s": measured_tok_per_s,
        "decode_steps": steps_n,
        "layers": sorted(layers_out, key=lambda x: (x["layer"], x["rank"])),
        "ranks": ranks_out,
        "slowest_rank": slowest,
        "clock": [r["clock"] | {"rank": r["rank"]} for r in ranks],
    }


def kind_breakdown(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rank and layer type (attention/mlp kind): summed compute/comm/wait seconds per step."""
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for row in summary["layers"]:
        key = (row["rank"], f"{row['kind']}/{row['mlp']}")
        agg = out.setdefault(key, {"rank": key[0], "kind": key[1], "layers": 0, "compute_s": 0.0, "comm_s": 0.0,
                                   "wait_s": 0.0, "sync_s": 0.0})
        agg["layers"] += 1
        for k in ("compute_s", "comm_s", "wait_s", "sync_s"):
            agg[k] += row[k]
    return [out[k] for k in sorted(out)]
