"""Continuous batching on rank 0: which sequences step next, in which KV-cache slot, with which tokens.

Every sequence owns one cache slot (``--max-batch`` slots of ``--max-model-len`` positions)
from admission to finish. Each step is at most two forwards, broadcast to every rank as one
message (``steps``): **decode** — one new token for every sequence whose prompt is in — and
**prefill** — the next chunk (up to ``prefill_chunk`` prompt tokens) of the oldest sequence still
reading its prompt, together with the next chunks of the sequences behind it whose chunks have
the same length, up to ``prefill_chunk`` tokens in all (a forward's rows share one length). So a
long prompt is read chunk by chunk between decode steps and the running streams keep flowing,
and a burst of short prompts is read a few at a time. Chunk boundaries sit at multiples of ``prefill_chunk`` from
position 0 whatever else runs, and every row is computed batch-invariantly (``exact.row_blocked``
and per-row attention), so a greedy sequence gets the tokens it gets when served alone.

Requests join at step boundaries (``add``), leave when they finish or are cancelled; a
cancelled sequence's slot is free for the next step.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from shardwise.runtime.generate import top_p_filter
from shardwise.serve.protocol import GenRequest, usage
from shardwise.serve.text import TextStream


@dataclass(eq=False)
class Seq:
    """One request in flight. ``sink(event)`` receives ``("delta", text)``, ``("done", finish,
    usage)`` or ``("error", status, message)`` on the engine's thread."""

    req: GenRequest
    stream: TextStream
    sink: Callable[[tuple], None]
    slot: int | None = None
    prefilled: int = 0  # prompt tokens already in the cache
    generated: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancelled: bool = False
    finish: str | None = None
    drafter: Any = None  # PromptLookup when the server speculates

    @property
    def context(self) -> list[int]:
        return [*self.req.prompt_ids, *self.generated]

    @property
    def position(self) -> int:
        """Position of the next token this sequence feeds (prompt + generated so far, minus the last)."""
        return len(self.req.prompt_ids) + len(self.generated) - 1


@dataclass
class StepPlan:
    """The message every rank runs, and (rank 0 only) the sequences each picked row belongs to."""

    message: dict[str, Any]
    rows: list[Seq]
    prefill_seqs: list[Seq]


class Scheduler:
    """Slots, the waiting queue and the step plan; all calls come from the engine's thread.

    With ``spec_tokens`` k > 0 a greedy sequence decoding **alone** (nothing else running or
    waiting) drafts up to k tokens by prompt lookup and verifies them in one k+1-position pass;
    the verify rows are computed like single steps (``attention.attend`` row by row, row-blocked
    linears), so the accepted tokens are exactly the plain greedy ones. With company, sequences
    decode one token per step: a batch already reads each weight once for all of them."""

    def __init__(self, slots: int, prefill_chunk: int, eos: set[int], metrics=None, spec_tokens: int = 0,
                 drafter: Callable[[], Any] | None = None, max_model_len: int = 0):
        self.spec_tokens, self.make_drafter, self.max_model_len = spec_tokens, drafter, max_model_len
        self.free = list(range(slots))
        self.slots = slots
        self.prefill_chunk = prefill_chunk
        self.eos = eos
        self.metrics = metrics
        self.waiting: deque[Seq] = deque()
        self.prefilling: list[Seq] = []
        self.decoding: list[Seq] = []

    # ---------------------------------------------------------------- membership
    def add(self, seq: Seq) -> None:
        if seq.req.temperature > 0:
            seed = seq.req.seed if seq.req.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            seq.generator = torch.Generator().manual_seed(seed)
        elif self.spec_tokens:
            seq.drafter = self.make_drafter()
        self.waiting.append(seq)

    def cancel(self, seq: Seq) -> None:
        """Drop ``seq`` (its client went away) and free its slot now."""
        seq.cancelled = True
        for group in (self.waiting, self.prefilling, self.decoding):
            if seq in group:
                group.remove(seq)
        self._release(seq)

    def _release(self, seq: Seq) -> None:
        if seq.slot is not None:
            self.free.append(seq.slot)
            self.free.sort()
            seq.slot = None

    def in_flight(self) -> list[Seq]:
        return [*self.waiting, *self.prefilling, *self.decoding]

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    @property
    def slots_in_use(self) -> int:
        return self.slots - len(self.free)

    # ---------------------------------------------------------------- steps
    def next_step(self) -> StepPlan | None:
        """The next step's plan, or None when nothing is waiting or running."""
        while self.waiting and self.free:
            seq = self.waiting.popleft()
            seq.slot = self.free.pop(0)
            self.prefilling.append(seq)
        message: dict[str, Any] = {"op": "step", "decode": None, "prefill": None}
        rows: list[Seq] = list(self.decoding)
        if rows:
            message["decode"] = {
                "slots": [s.slot for s in rows], "positions": [s.position for s in rows],
                "tokens": [s.generated[-1] for s in rows],
            }
            drafts = self._drafts(rows)
            if drafts:
                message["decode"]["drafts"] = drafts
                message["greedy"], message["sample"] = list(range(len(drafts) + 1)), []
                return StepPlan(message, rows, [])
        group = self._prefill_group()
        if group:
            chunks = [self._chunk(seq) for seq in group]
            lasts = [seq.prefilled + len(ids) == len(seq.req.prompt_ids) for seq, ids in zip(group, chunks)]
            message["prefill"] = {"slots": [s.slot for s in group], "starts": [s.prefilled for s in group],
                                  "ids": chunks, "last": lasts}
            rows += [seq for seq, last in zip(group, lasts) if last]
        if not rows and not group:
            return None
        message["greedy"] = [i for i, s in enumerate(rows) if s.generator is None]
        message["sample"] = [i for i, s in enumerate(rows) if s.generator is not None]
        return StepPlan(message, rows, group)

    def _chunk(self, seq: Seq) -> list[int]:
        """The next prompt chunk of ``seq``: boundaries at multiples of ``prefill_chunk`` from 0."""
        return seq.req.prompt_ids[seq.prefilled:seq.prefilled + self.prefill_chunk]

    def _prefill_group(self) -> list[Seq]:
        """The oldest prefilling sequence and those behind it whose next chunk has its length, up to
        ``prefill_chunk`` tokens in all."""
        if not self.prefilling:
            return []
        n = len(self._chunk(self.prefilling[0]))
        group = [seq for seq in self.prefilling if len(self._chunk(seq)) == n]
        return group[: max(1, self.prefill_chunk // n)]

    def _drafts(self, rows: list[Seq]) -> list[int]:
        """Prompt-lookup drafts for a greedy sequence decoding alone (none otherwise)."""
        if not self.spec_tokens or len(rows) != 1 or self.prefilling or self.waiting or rows[0].drafter is None:
            return []
        seq = rows[0]
        room = min(seq.req.max_tokens - len(seq.generated), self.max_model_len - seq.position) - 1
        return seq.drafter.propose(seq.context, min(self.spec_tokens, room)) if room > 0 else []

    def apply(self, plan: StepPlan, greedy: torch.Tensor | None, logits: torch.Tensor | None) -> None:
        """Take the step's picked tokens: stream them, finish sequences, free their slots."""
        drafts = (plan.message["decode"] or {}).get("drafts")
        if drafts:
            self._verify(plan.rows[0], drafts, [int(t) for t in greedy])
            return
        if plan.prefill_seqs:
            prefill = plan.message["prefill"]
            for seq, ids, last in zip(plan.prefill_seqs, prefill["ids"], prefill["last"]):
                seq.prefilled += len(ids)
                if last and not seq.cancelled:
                    self.prefilling.remove(seq)
                    self.decoding.append(seq)
        tokens: dict[int, int] = {}
        for j, i in enumerate(plan.message["greedy"]):
            tokens[i] = int(greedy[j])
        for j, i in enumerate(plan.message["sample"]):
            tokens[i] = self._sample(plan.rows[i], logits[j])
        now = time.monotonic()
        for i, seq in enumerate(plan.rows):
            if seq.cancelled:
                continue
            self._take(seq, tokens[i], now)

    def _verify(self, seq: Seq, drafts: list[int], picked: list[int]) -> None:
        """Keep the drafts the model agrees with, then its own next token (the correction or bonus)."""
        accepted = next((i for i, (d, t) in enumerate(zip(drafts, picked)) if d != t), len(drafts))
        if self.metrics is not None:
            self.metrics.spec(len(drafts), accepted)
        now = time.monotonic()
        for token in picked[: accepted + 1]:
            if seq.finish is not None or seq.cancelled:
                break
            self._take(seq, token, now)

    def _sample(self, seq: Seq, logits: torch.Tensor) -> int:
        probs = torch.softmax(top_p_filter(logits / seq.req.temperature, seq.req.top_p), dim=-1)
        return int(torch.multinomial(probs, 1, generator=seq.generator)[0])

    def _take(self, seq: Seq, token: int, now: float) -> None:
        seq.generated.append(token)
        if self.metrics is not None:
            self.metrics.token(seq, now)
        seq.first_token_at = seq.first_token_at or now
        seq.last_token_at = now
        if token in self.eos and not seq.req.ignore_eos:
            text, finish = seq.stream.finish(), "stop"
        else:
            text = seq.stream.push(token)
            finish = "stop" if seq.stream.stopped else None
            if finish is None and len(seq.generated) >= seq.req.max_tokens:
                text, finish = text + seq.stream.finish(), "length"
        if text:
            seq.sink(("delta", text))
        if finish is not None:
            self._finish(seq, finish)

    def _finish(self, seq: Seq, finish: str) -> None:
        seq.finish = finish
        self.decoding.remove(seq)
        self._release(seq)
        if self.metrics is not None:
            self.metrics.finished(seq, finish)
        seq.sink(("done", finish, usage(len(seq.req.prompt_ids), len(seq.generated))))
