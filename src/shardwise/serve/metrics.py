"""The server's Prometheus series (``GET /metrics``), on a registry of its own.

Latencies in seconds, token counts in tokens. The per-rank time split comes from every rank's
seconds in forwards and inside the layers' all-reduces (``steps.StepRunner``), gathered every
``STATS_S`` while steps run: the rank that spent least time in all-reduces waited least, so its
all-reduce time is taken as the transfer itself (``comm``); what another rank spent beyond it
is waiting for the slowest rank (``wait``); the rest of the forward is ``compute``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

STATS_S = 2.0
"""Seconds between gathers of the per-rank time split."""

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Counters, histograms and gauges of one server."""

    def __init__(self, slots: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("shardwise_requests", "Requests by endpoint and outcome "
                                "(stop, length, cancelled, error, rejected)", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("shardwise_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("shardwise_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("shardwise_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("shardwise_inter_token_latency_seconds", "Time between a sequence's tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.batch = Gauge("shardwise_running_batch_size", "Sequences decoding in the last step", registry=r)
        self.queue = Gauge("shardwise_queue_depth", "Requests waiting for a KV-cache slot", registry=r)
        self.slots_used = Gauge("shardwise_kv_slots_in_use", "KV-cache slots held by sequences", registry=r)
        self.slots_total = Gauge("shardwise_kv_slots", "KV-cache slots (--max-batch)", registry=r)
        self.steps = Counter("shardwise_steps", "Server steps run (decode and/or prefill chunk)", registry=r)
        self.share = Gauge("shardwise_rank_time_share", "Share of each rank's forward time spent in compute, "
                           "all-reduce transfer (comm) and waiting for the slowest rank (wait)", ["rank", "part"],
                           registry=r)
        self.drafted = Counter("shardwise_spec_draft_tokens", "Prompt-lookup tokens drafted (--spec ngram)", registry=r)
        self.accepted = Counter("shardwise_spec_accepted_tokens", "Drafted tokens the model accepted", registry=r)
        self.slots_total.set(slots)

    def token(self, seq, now: float) -> None:
        """One generated token of ``seq`` at ``now`` (monotonic s)."""
        self.generated_tokens.inc()
        if seq.first_token_at is None:
            self.ttft.observe(now - seq.arrived)
        else:
            self.itl.observe(now - seq.last_token_at)

    def spec(self, drafted: int, accepted: int) -> None:
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)

    def finished(self, seq, outcome: str) -> None:
        self.requests.labels(seq.req.kind, outcome).inc()

    def rank_split(self, stats: list[tuple[float, float]]) -> None:
        """Set the per-rank compute / comm / wait shares from every rank's (step_s, collective_s)."""
        transfer = min(c for _, c in stats)
        for rank, (step, collective) in enumerate(stats):
            if step <= 0:
                continue
            self.share.labels(str(rank), "compute").set(max(0.0, step - collective) / step)
            self.share.labels(str(rank), "comm").set(transfer / step)
            self.share.labels(str(rank), "wait").set(max(0.0, collective - transfer) / step)

    def render(self) -> bytes:
        return generate_latest(self.registry)
