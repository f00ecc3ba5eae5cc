"""Rank 0's step loop: takes requests from the HTTP side, runs the scheduler's steps on every
rank, streams tokens back, and ends cleanly on a signal or a failed rank.

The loop runs on rank 0's main thread (torch.distributed calls and signal handlers live there);
the HTTP server runs on another thread and talks to it through ``submit`` / ``cancel``
(a thread-safe inbox read between steps: a request joins, or a disconnected client's slot is
freed, at the next step boundary). States: ``loading`` → ``ready`` → ``draining`` (a signal:
no new requests, in-flight ones finish, at most ``DRAIN_S``) → ``stopped``; or ``failed`` (a
rank died, froze past the collective timeout, or a step raised): in-flight requests get an
error event and the loop raises, which brings every rank down.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

from shardwise.serve.metrics import STATS_S
from shardwise.serve.scheduler import Scheduler, Seq
from shardwise.serve.steps import HEARTBEAT_S, StepRunner, exchange, ping

DRAIN_S = 20.0
"""Seconds in-flight requests may take to finish after SIGTERM/SIGINT before they are cut off."""

STALL_S = 10.0
"""Seconds a step (or idle heartbeat) may run before ``/health`` reports the server unhealthy; the
collective timeout (``--timeout``) later ends it."""

SIGNAL_ECHO_S = 1.0
"""A second signal within this many seconds of the first is the same Ctrl-C (the terminal signals
every process of the group and the launcher forwards it too), not a request to cut off."""

FLUSH_S = 1.0
"""Seconds given to the HTTP side to send error events after a failure, before the process exits."""


class Engine:
    """The scheduler's driver on rank 0; ``state`` and ``reason`` are read by ``/health``."""

    def __init__(self, scheduler: Scheduler, world_size: int, metrics):
        self.scheduler, self.world_size, self.metrics = scheduler, world_size, metrics
        self.runner: StepRunner | None = None
        self.inbox: queue.Queue = queue.Queue()
        self.state, self.reason = "loading", "loading the model"
        self.step_started: float | None = None  # monotonic s of the step in flight, None between steps
        self.drain_deadline: float | None = None
        self._first_signal = 0.0
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- called from other threads
    def submit(self, seq: Seq) -> None:
        self.inbox.put(("add", seq))

    def cancel(self, seq: Seq) -> None:
        self.inbox.put(("cancel", seq))

    def accepting(self) -> bool:
        return self.state == "ready"

    def health(self) -> tuple[bool, str]:
        """(healthy, why not): ready, and no step or heartbeat stuck past ``STALL_S``."""
        started = self.step_started
        if self.state == "ready" and started is not None and time.monotonic() - started > STALL_S:
            return False, f"a step has waited {time.monotonic() - started:.0f} s: a rank may be frozen"
        return self.state == "ready", self.reason

    def fail(self, reason: str) -> None:
        """Mark the server failed and send every in-flight request an error (any thread), those still
        in the inbox too (a step blocked on a frozen rank never takes them)."""
        with self._lock:
            if self.state == "failed":
                return
            self.state, self.reason = "failed", reason
            queued = []
            with contextlib.suppress(queue.Empty):
                while True:
                    kind, seq = self.inbox.get_nowait()
                    if kind == "add":
                        queued.append(seq)
            for seq in [*self.scheduler.in_flight(), *queued]:
                seq.sink(("error", 503, f"the server failed: {reason}"))

    def request_stop(self) -> None:
        """A signal: stop taking requests, let in-flight ones finish (a second signal cuts them off)."""
        now = time.monotonic()
        if self.drain_deadline is None:
            self.state, self.reason, self.drain_deadline = "draining", "shutting down", now + DRAIN_S
            self._first_signal = now
        elif now - self._first_signal > SIGNAL_ECHO_S:
            self.drain_deadline = now

    # ---------------------------------------------------------------- the loop (rank 0's main thread)
    def ready(self, runner: StepRunner) -> None:
        self.runner = runner
        if self.state == "loading":
            self.state, self.reason = "ready", "ready"

    def loop(self) -> int:
        """Run steps until a stop was asked and nothing is left; returns the steps run."""
        steps, last_sent, last_stats = 0, time.monotonic(), time.monotonic()
        sched = self.scheduler
        try:
            while True:
                self._take_inbox(block=not sched.has_work())
                if self.drain_deadline is not None:
                    self._drain_waiting()
                    if not sched.has_work() or time.monotonic() >= self.drain_deadline:
                        break
                if self.state == "failed":
                    raise RuntimeError(self.reason)
                plan = sched.next_step()
                self._gauges()
                now = time.monotonic()
                if plan is None:
                    self.metrics.batch.set(0)
                    if self.world_size > 1 and now - last_sent >= HEARTBEAT_S:
                        self.step_started = now
                        exchange({"op": "idle"}, self.world_size)
                        ping(self.world_size)
                        self.step_started, last_sent = None, time.monotonic()
                    continue
                plan.message["stats"] = now - last_stats >= STATS_S
                self.step_started = now
                exchange(plan.message, self.world_size)
                greedy, logits = self.runner.run(plan.message)
                if plan.message["stats"]:
                    self.metrics.rank_split(self.runner.gather_stats(self.world_size))
                    last_stats = now
                self.step_started, last_sent = None, time.monotonic()
                sched.apply(plan, greedy, logits)
                self._gauges()
                self.metrics.steps.inc()
                self.metrics.batch.set(len(plan.message["decode"]["slots"]) if plan.message["decode"] else 0)
                steps += 1
        except BaseException as exc:
            self.fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            time.sleep(FLUSH_S)
            raise
        for seq in sched.in_flight():  # past the drain deadline
            seq.sink(("error", 503, "the server is shutting down"))
            sched.cancel(seq)
        exchange({"op": "stop"}, self.world_size)
        self.state, self.reason = "stopped", "stopped"
        return steps

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=HEARTBEAT_S / 2) if block else self.inbox.get_nowait()
            while True:
                kind, seq = item
                if kind == "add" and not seq.cancelled:
                    self.metrics.prompt_tokens.inc(len(seq.req.prompt_ids))
                    self.scheduler.add(seq)
                elif kind == "cancel" and not seq.cancelled and seq.finish is None:
                    self.scheduler.cancel(seq)
                    self.metrics.requests.labels(seq.req.kind, "cancelled").inc()
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _drain_waiting(self) -> None:
        """While draining, requests that never started are refused."""
        for seq in list(self.scheduler.waiting):
            seq.sink(("error", 503, "the server is shutting down"))
            self.scheduler.cancel(seq)

    def _gauges(self) -> None:
        self.metrics.queue.set(len(self.scheduler.waiting))
        self.metrics.slots_used.set(self.scheduler.slots_in_use)
