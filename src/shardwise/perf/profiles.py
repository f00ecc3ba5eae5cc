"""Runtime profiles: the named efficiency factors that turn a roofline into an estimate.

Pure rooflines over-predict real systems by 1.5–3×. Each profile keeps its factors explicit:
- ``mem_efficiency``: fraction of the box's peak memory bandwidth achieved on weight reads;
- ``compute_efficiency``: fraction of peak matmul throughput achieved;
- ``step_overhead_s``: host time per decode step (sampling, scheduling, the step's fixed launches), seconds;
- ``layer_overhead_s``: time per decoder layer per step that scales with the layer count, not
  bytes: the launches and synchronisations of the layer's kernels (a graph-captured GPU runtime
  pays little, an eager or Metal/Vulkan one more), seconds per layer;
- ``collective_overhead_s``: software time per collective on top of the link's α, seconds;
- ``tcp_message_overhead_s``: extra time per message (every ring/tree step) on a TCP link for a
  runtime whose tensors sit in accelerator memory: the host bounce buffers and proxy-thread
  hand-offs of a socket transport, which RDMA skips by letting the NIC read and write device
  memory; seconds, added to the link's α (:func:`message_latency_s`);
- ``allreduce``: the all-reduce algorithms that runtime can use (the planner picks the cheapest).

``ideal`` is the pure roofline. The others are fitted to ``data/measurements.csv`` by
``shardwise.perf.calibrate`` and stored in ``spec/catalog/profiles.toml`` together with the
rows, the fit's median APE and the date; a test re-fits and checks the stored values.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from shardwise.errors import ShardwiseError, unknown_name


@dataclass(frozen=True)
class RuntimeProfile:
    """Efficiency factors of one inference runtime (see module docstring for units)."""

    name: str
    description: str
    mem_efficiency: float
    compute_efficiency: float
    step_overhead_s: float
    collective_overhead_s: float
    allreduce: tuple[str, ...]
    layer_overhead_s: float = 0.0
    tcp_message_overhead_s: float = 0.0
    source_tcp_message_overhead_s: str = ""
    fitted_rows: int = 0
    fit_median_ape: float | None = None
    source: str = ""


@lru_cache(maxsize=1)
def load_profiles() -> dict[str, RuntimeProfile]:
    """Profiles from the bundled profiles.toml, by name."""
    text = resources.files("shardwise.spec.catalog").joinpath("profiles.toml").read_text()
    data = tomllib.loads(text)
    out = {}
    for name, entry in data.items():
        try:
            out[name] = RuntimeProfile(
                name=name,
                description=entry["description"],
                mem_efficiency=float(entry["mem_efficiency"]),
                compute_efficiency=float(entry["compute_efficiency"]),
                step_overhead_s=float(entry["step_overhead_s"]),
                collective_overhead_s=float(entry["collective_overhead_s"]),
                allreduce=tuple(entry["allreduce"]),
                layer_overhead_s=float(entry.get("layer_overhead_s", 0.0)),
                tcp_message_overhead_s=float(entry.get("tcp_message_overhead_s", 0.0)),
                source_tcp_message_overhead_s=entry.get("source_tcp_message_overhead_s", ""),
                fitted_rows=int(entry.get("fitted_rows", 0)),
                fit_median_ape=entry.get("fit_median_ape"),
                source=entry.get("source", ""),
            )
        except KeyError as exc:
            raise ShardwiseError(f"profiles.toml [{name}] is missing field {exc.args[0]}") from None
    return out


def get_profile(name: str) -> RuntimeProfile:
    """A runtime profile by name (unknown names suggest the closest)."""
    profiles = load_profiles()
    if name not in profiles:
        raise unknown_name("runtime profile", name, profiles)
    return profiles[name]


def message_latency_s(link, profile: RuntimeProfile) -> float:
    """Seconds per message (one step of a collective) on ``link`` as ``profile``'s runtime sees it:
    the link's α plus the profile's TCP per-message overhead on TCP links."""
    return link.latency_s + (profile.tcp_message_overhead_s if link.kind == "tcp" else 0.0)
