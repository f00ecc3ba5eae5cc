"""The report's inputs: plan, sweep, bench and trace JSON documents, told apart by their shape.

- **plan**: the object ``shardwise plan --json`` prints (it has ``decode.waterfall``).
- **sweep**: the list ``shardwise sweep --json`` prints (rows with ``model``, ``box``, ``boxes``,
  ``link``, ``tp``, ``ep``, ``pp``, ``tok_per_s``, ``usd``, ``watts``, ``bottleneck``).
- **bench** / **trace**: what ``shardwise bench`` and the runtime's ``--trace`` write, one
  schema (``RunDocument`` below)::

    {
      "kind": "trace",                 # or "bench"
      "model": "kimi-k3",              # the model's catalog key / ModelSpec name
      "predicted_tok_per_s": 6.8,      # the planner's decode tok/s for this run's configuration
      "measured_tok_per_s": 5.9,       # decode tok/s measured on the run
      "source": "spark-01..16, 2026-03-01",          # optional: where and when
      "box": "dgx-spark", "boxes": 16, "link": "100g-roce", "tp": 16, "ep": 16, "pp": 1,  # optional
      "context_tokens": 4096,          # optional
      "layers": [                      # one entry per (layer, rank) of one decode step;
        {"layer": 0, "kind": "attention", "rank": 0,        # may be empty for a bench
         "compute_s": 2.1e-4, "comm_s": 6.0e-5, "wait_s": 1.2e-5,
         "predicted_compute_s": 1.9e-4, "predicted_comm_s": 5.0e-5}
      ]
    }

  ``kind`` is free text for the layer's part (attention, moe, mlp, ...); seconds are one
  decode step's. A trace must list layers; a bench may leave them out. A raw runtime trace
  (``shardwise run --trace``'s ``*.summary.json``) has no ``predicted_*`` fields: the report
  then draws its measured rows only. Other keys (``mlp``, ``sync_s``, ...) are ignored.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from shardwise.errors import ShardwiseError, validation_message
from shardwise.spec.parse import read_json

SWEEP_ROW_KEYS = ("model", "box", "boxes", "link", "tp", "ep", "pp", "tok_per_s", "usd", "watts", "bottleneck")

NonNegative = Annotated[float, Meta(ge=0, le=sys.float_info.max)]  # finite: NaN and inf are refused
Seconds = NonNegative
Positive = Annotated[float, Meta(gt=0, le=sys.float_info.max)]
Count = Annotated[int, Meta(ge=1)]


class LayerTiming(Struct, frozen=True, kw_only=True):
    """One layer on one rank in one decode step (seconds). Extra keys the runtime writes
    (``mlp``, ``sync_s``, per-term errors, ...) are ignored."""

    layer: Annotated[int, Meta(ge=0)]
    kind: str
    rank: Annotated[int, Meta(ge=0)]
    compute_s: Seconds
    comm_s: Seconds
    wait_s: Seconds
    predicted_compute_s: Seconds | None = None
    predicted_comm_s: Seconds | None = None

    @property
    def has_prediction(self) -> bool:
        """True when the entry carries the planner's per-layer terms (a bench, not a raw trace)."""
        return self.predicted_compute_s is not None and self.predicted_comm_s is not None


class RunDocument(Struct, frozen=True, kw_only=True):
    """A bench or trace document (schema in the module docstring; other keys ignored)."""

    kind: Literal["bench", "trace"]
    model: Annotated[str, Meta(min_length=1)]
    predicted_tok_per_s: Positive | None = None
    measured_tok_per_s: Positive
    source: str = ""
    box: str | None = None
    boxes: Count | None = None
    link: str | None = None
    tp: Count | None = None
    ep: Count | None = None
    pp: Count | None = None
    context_tokens: Count | None = None
    layers: tuple[LayerTiming, ...] = ()

    def __post_init__(self) -> None:
        if self.kind == "trace" and not self.layers:
            raise ValueError("a trace needs at least one entry in layers")
        if self.kind == "bench" and self.predicted_tok_per_s is None:
            raise ValueError("a bench needs predicted_tok_per_s")
        seen = set()
        for entry in self.layers:
            key = (entry.layer, entry.rank)
            if key in seen:
                raise ValueError(f"layer {entry.layer} rank {entry.rank} is listed twice")
            seen.add(key)


class SweepRow(Struct, frozen=True):
    """The fields of a ``shardwise sweep --json`` row the report draws (other keys ignored)."""

    model: str
    box: str
    boxes: Count
    link: str
    tp: Count
    ep: Count
    pp: Count
    tok_per_s: Positive
    usd: NonNegative
    watts: Positive
    bottleneck: str


class _Step(Struct, frozen=True):
    step: str
    tok_per_s: Positive
    cause: str


class _CurvePoint(Struct, frozen=True):
    batch: Count
    tok_per_s: Positive
    aggregate_tok_per_s: Positive


class _Decode(Struct, frozen=True):
    waterfall: Annotated[tuple[_Step, ...], Meta(min_length=1)]
    tok_per_s: Positive
    compute_s: Positive
    memory_s: Positive
    step_s: Positive
    collective_s: Seconds
    per_layer_s: tuple[Seconds, ...]
    batch_curve: Annotated[tuple[_CurvePoint, ...], Meta(min_length=1)] | None = None
    compute_bound_from_batch: Count | None = None


class _Memory(Struct, frozen=True):
    weights_bytes: Positive
    kv_bytes: NonNegative
    workspace_bytes: NonNegative
    reserve_bytes: NonNegative
    free_bytes: Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
    box_bytes: Positive
    context_tokens: Count
    max_batch: Annotated[int, Meta(ge=0)]


class _Model(Struct, frozen=True):
    name: str


class _Cluster(Struct, frozen=True):
    box: str
    boxes: Count
    memory_bandwidth_gbps: Positive
    tflops_bf16: Positive | None = None


class _Layout(Struct, frozen=True):
    layout: str
    runtime: str
    tp: Count
    pp: Count


class _Prefill(Struct, frozen=True):
    prompt_tokens: Count
    tok_per_s: Positive


class _Cost(Struct, frozen=True):
    total_usd: NonNegative


class PlanDocument(Struct, frozen=True):
    """The fields of a ``shardwise plan --json`` document the report draws, typed, so that a
    hand-edited one fails in one line (other keys ignored; the report reads the dict)."""

    model: _Model
    cluster: _Cluster
    plan: _Layout
    decode: _Decode
    prefill: _Prefill
    memory: _Memory
    power: dict
    cost: _Cost


@dataclass
class Inputs:
    """What the report draws from; each kind at most once, with the file it came from."""

    plan: dict | None = None
    sweep: list[dict] | None = None
    bench: RunDocument | None = None
    trace: RunDocument | None = None
    sources: dict[str, str] | None = None

    @property
    def run(self) -> RunDocument | None:
        """The measurement to compare against: the bench if given, else the trace."""
        return self.bench or self.trace


def classify(doc, where: str):
    """(kind, validated document) for one parsed JSON document."""
    if isinstance(doc, list):
        if not doc:
            raise ShardwiseError(f"{where}: the sweep is an empty list; run `shardwise sweep --json` with looser constraints")
        for i, row in enumerate(doc):
            missing = [k for k in SWEEP_ROW_KEYS if not isinstance(row, dict) or k not in row]
            if missing:
                raise ShardwiseError(f"{where}: sweep row {i} lacks {', '.join(missing)}; write it with `shardwise sweep --json`")
            try:
                msgspec.convert(row, SweepRow)
            except msgspec.ValidationError as exc:
                raise ShardwiseError(f"{where}: sweep row {i}: {validation_message(exc)}; write it with `shardwise sweep --json`") from None
        return "sweep", doc
    if isinstance(doc, dict) and isinstance(doc.get("decode"), dict) and "waterfall" in doc["decode"]:
        for key in ("model", "cluster", "plan", "memory", "prefill", "power", "cost"):
            if key not in doc:
                raise ShardwiseError(f"{where}: plan document lacks '{key}'; write it with `shardwise plan --json`")
        try:
            msgspec.convert(doc, PlanDocument)
        except msgspec.ValidationError as exc:
            raise ShardwiseError(f"{where}: plan document: {validation_message(exc)}; write it with `shardwise plan --json`") from None
        return "plan", doc
    if isinstance(doc, dict) and doc.get("kind") in ("bench", "trace"):
        try:
            run = msgspec.convert(doc, RunDocument)
        except msgspec.ValidationError as exc:
            raise ShardwiseError(f"{where}: {doc['kind']} document: {validation_message(exc)}") from None
        return run.kind, run
    raise ShardwiseError(
        f"{where}: not a plan (decode.waterfall), sweep (list of rows) or bench/trace (kind: bench|trace) document"
    )


def load_inputs(paths: list[str | Path]) -> Inputs:
    """Read and classify the files; refuse two of a kind and a run whose model is not the plan's."""
    found = Inputs(sources={})
    for path in paths:
        path = Path(path)
        kind, value = classify(read_json(path, "report input"), str(path))
        if getattr(found, kind) is not None:
            raise ShardwiseError(f"two {kind} documents given ({found.sources[kind]}, {path}): pass one")
        setattr(found, kind, value)
        found.sources[kind] = str(path)
    check_models(found)
    return found


def check_models(inputs: Inputs) -> None:
    """A bench or trace must measure the plan's model (and each other's)."""
    named = []
    if inputs.plan is not None:
        named.append(("plan", inputs.plan["model"]["name"]))
    for kind in ("bench", "trace"):
        run = getattr(inputs, kind)
        if run is not None:
            named.append((kind, run.model))
    for (k1, m1), (k2, m2) in zip(named, named[1:]):
        if m1 != m2:
            s1 = (inputs.sources or {}).get(k1, k1)
            s2 = (inputs.sources or {}).get(k2, k2)
            raise ShardwiseError(f"the {k2} ({s2}) is for model '{m2}' but the {k1} ({s1}) is for '{m1}': pass documents of one model")
