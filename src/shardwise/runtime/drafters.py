"""Drafters for speculative decoding: prompt lookup and a small draft model.

The interface every drafter implements (``Drafter``), so MTP / EAGLE-style heads can be
added later:

- ``propose(context, k) -> list[int]``: up to ``k`` tokens likely to follow ``context``
  (the prompt plus every accepted token); fewer, or none, when it has no guess.
- ``draft_probs()``: the distributions ``q`` [n, vocab] the last proposal's n tokens were
  drawn from, for the sampling-mode rejection rule; ``None`` means each token is a point
  mass (q = 1 on it), as for prompt lookup or a greedy draft model.
- ``rollback(length)``: only the first ``length`` tokens of the last context plus
  proposal were accepted; forget any state past them (a draft model's KV cache).

**Where the draft model runs.** Replicated: every rank loads the whole draft checkpoint at
tp = 1 and runs it locally, without any collective, on the same context, so every rank
computes the same drafts (and, sampling, draws them with an identically seeded
generator). The alternative — rank 0 drafts and broadcasts — adds a message latency α to
every verify step, the very per-step cost speculative decoding exists to amortise, while
the other ranks would sit idle during drafting anyway. Replication costs each rank the
draft model's memory (small by choice) and relies on every rank computing bit-identical
drafts, the same assumption the runtime already makes for sampling (identical seeded
draws on all-gathered logits) and MLA's replicated latent cache; on mixed hardware a
disagreement shows as ranks ending with different tokens, which ``shardwise run``
reports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import torch

from shardwise.errors import ShardwiseError


class Drafter(ABC):
    """Proposes tokens for the target model to verify (see the module docstring)."""

    @abstractmethod
    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``context``."""

    def draft_probs(self) -> torch.Tensor | None:
        """Distributions [n, vocab] of the last proposal's tokens; None: point masses."""
        return None

    def rollback(self, length: int) -> None:
        """Keep state for the first ``length`` tokens only (nothing to drop by default)."""


class PromptLookup(Drafter):
    """N-gram match in the prompt and the generated text (prompt lookup decoding).

    For n from ``ngram_max`` down to ``ngram_min``: find the most recent earlier place
    where the last n tokens of the context occur, and propose the k tokens that followed
    it. The copy may run into its own proposal (like an LZ77 match), so a period-p
    repetition drafts k tokens even when p < k. No match: no proposal (the step is a
    plain decode step).
    """

    def __init__(self, ngram_min: int = 1, ngram_max: int = 3):
        check_ngram(ngram_min, ngram_max)
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        ids = torch.tensor(list(context), dtype=torch.long)
        size = ids.numel()
        for n in range(min(self.ngram_max, size - 1), self.ngram_min - 1, -1):
            windows = ids[: size - 1].unfold(0, n, 1)  # every n-gram that has a successor
            hits = (windows == ids[size - n :]).all(dim=1).nonzero()
            if hits.numel():
                source = int(hits[-1]) + n  # where the copied continuation starts
                out = list(context)
                for j in range(k):
                    out.append(out[source + j])
                return out[size:]
        return []


class DraftModel(Drafter):
    """A smaller checkpoint with the target's vocabulary, replicated at tp = 1 on each rank.

    ``sampling`` None or temperature 0: greedy drafts (point masses); otherwise drafts
    are drawn from the draft model's own softmax(top-p(logits / T)) with a generator
    seeded ``seed`` on every rank, and ``draft_probs`` returns those distributions.
    """

    def __init__(self, model, sampling=None, seed: int = 0):
        if model.plan.tp != 1:
            raise ShardwiseError(f"the draft model must be built at tp 1, got tp {model.plan.tp}")
        for layer in model.model.layers:  # local: no all-reduce with the target's ranks
            layer.reduce_attn = layer.reduce_mlp = _identity
        self.model = model
        self.sampling = sampling
        self.gen = torch.Generator().manual_seed(seed) if sampling is not None and sampling.temperature > 0 else None
        self.length = 0  # context tokens whose KV is in the draft model's cache
        self._probs: torch.Tensor | None = None

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        from shardwise.runtime.generate import top_p_filter

        self.model.check_step_tokens(k)  # its drafts past the accepted ones are rolled back
        hidden = self.model(torch.tensor([list(context[self.length :])]), self.length)
        tokens, probs = [], []
        for j in range(k):
            last = hidden[:, -1]
            if self.gen is None:
                token = int(self.model.lm_head.greedy(last)[0])
            else:
                logits = self.model.lm_head.logits(last).float()[0] / self.sampling.temperature
                q = torch.softmax(top_p_filter(logits, self.sampling.top_p), dim=-1)
                token = int(torch.multinomial(q, 1, generator=self.gen)[0])
                probs.append(q)
            tokens.append(token)
            if j < k - 1:
                hidden = self.model(torch.tensor([[token]]), len(context) + j)
        self.length = len(context) + k - 1
        self._probs = torch.stack(probs) if probs else None
        return tokens

    def draft_probs(self) -> torch.Tensor | None:
        return self._probs

    def rollback(self, length: int) -> None:
        self.length = min(self.length, length)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def check_ngram(ngram_min: int, ngram_max: int) -> None:
    """Raise a one-line error unless 1 <= ngram_min <= ngram_max."""
    if ngram_min < 1:
        raise ShardwiseError(f"--ngram-min must be >= 1, got {ngram_min}")
    if ngram_max < ngram_min:
        raise ShardwiseError(f"--ngram-max {ngram_max} is below --ngram-min {ngram_min}")


def check_draft(target_folder: str | Path, draft_folder: str | Path) -> None:
    """Raise a one-line error unless the draft checkpoint can draft for the target: the
    same vocabulary size and, where both folders have a tokenizer.json, the same
    token → id map."""
    from shardwise.runtime.generate import load_tokenizer
    from shardwise.runtime.loader import load_spec

    target, draft = load_spec(target_folder), load_spec(draft_folder)
    if draft.vocab_size != target.vocab_size:
        raise ShardwiseError(
            f"draft model '{draft_folder}' has vocab_size {draft.vocab_size}, the target "
            f"{target.vocab_size}: a draft model needs the target's vocabulary"
        )
    mine, theirs = load_tokenizer(draft_folder), load_tokenizer(target_folder)
    if mine is not None and theirs is not None and mine.get_vocab() != theirs.get_vocab():
        raise ShardwiseError(
            f"draft model '{draft_folder}' has a different tokenizer vocabulary than the target: "
            "a draft model needs the target's tokenizer"
        )
