"""Prompts of an exact token length for an OpenAI-compatible server, counted by the server itself.

A server bills ``usage.prompt_tokens`` for what it processed (its own tokenizer, BOS, and for
chat its template). ``counter_for`` finds the cheapest way to learn that number for a text:

- ``tokenize``: a tokenize endpoint (llama.cpp's and vLLM's ``POST /tokenize``, llama-cpp-python's
  ``POST /extras/tokenize``), plus a constant offset measured once against ``usage.prompt_tokens``
  (BOS, chat template), so that a count costs no prefill;
- ``usage``: a ``max_tokens=1`` request per count (a prefill each) when there is no endpoint.

``fit_prompt`` searches the number of words of a deterministic word stream until the count hits the
target, then pads with single-token words. ``variant`` rotates the words after the first so every
request of a benchmark starts differently (no prefix-cache hits) while its count stays the same
under any tokenizer that splits on spaces first (byte-level BPE, SentencePiece).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from shardwise.errors import ShardwiseError

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there had been one all we can their has would when if so no what will more about up out "
    "time them into only some could its other than then now two may after first also made over new through "
    "most where much before between world model cluster token memory layer expert network cache weight rank "
    "split decode prefill batch context window stream answer server request latency speed measure river "
    "mountain garden window kitchen letter morning evening summer winter music paper market station bridge "
    "city village forest ocean island harbor valley meadow library teacher student doctor engineer painter"
).split()
PAD_WORD = " a"
"""Appended to close the last few tokens: one token per copy in byte-level BPE and SentencePiece."""


def word_stream(seed: str, count: int) -> list[str]:
    """``count`` words (each but the first with its leading space, a period every 8 to 15 words)."""
    rng = random.Random(seed)
    out: list[str] = []
    sentence = 0
    for i in range(count):
        word = rng.choice(_WORDS)
        if sentence == 0:
            word = word.capitalize()
        sentence += 1
        if sentence >= rng.randint(8, 15):
            word, sentence = word + ".", 0
        out.append(word if i == 0 else " " + word)
    return out


@dataclass(frozen=True)
class Prompt:
    """A prompt's words (``first`` fixed, ``rest`` rotated by ``variant``), pad words and token count."""

    first: str
    rest: tuple[str, ...]
    pads: int
    tokens: int
    target: int

    def text(self, rotation: int = 0) -> str:
        """The words after the first (pad words included) rotated left by ``rotation``."""
        words = self.rest + (PAD_WORD,) * self.pads
        r = rotation % len(words) if words else 0
        return self.first + "".join(words[r:] + words[:r])

    def variant(self, k: int) -> str:
        """The ``k``-th request's text (k >= 0): the same words in another rotation than ``text()``'s
        (the one counted while fitting), each k its own up to the number of words after the first."""
        n = len(self.rest) + self.pads
        return self.text(1 + k % (n - 1) if n > 1 else 0)

    @property
    def exact(self) -> bool:
        return self.tokens == self.target

    @property
    def words_per_token(self) -> float:
        return (len(self.rest) + 1) / max(self.tokens - self.pads, 1)


Counter = Callable[[str], int]


@dataclass(frozen=True)
class CountMethod:
    """How prompt tokens are counted: ``name`` ("tokenize" or "usage"), the endpoint and the offset."""

    name: str
    endpoint: str | None
    offset: int

    def describe(self) -> str:
        if self.name == "tokenize":
            return (f"server {self.endpoint} + {self.offset} (BOS/template, measured against usage.prompt_tokens)"
                    if self.offset else f"server {self.endpoint}")
        return "server usage.prompt_tokens of a max_tokens=1 request"


def fit_prompt(count: Counter, target: int, seed: str, words_per_token: float = 0.5, max_counts: int = 14) -> Prompt:
    """Words from ``word_stream(seed)`` whose server count is ``target``, or the closest count below
    it found within ``max_counts`` counts (``Prompt.exact`` tells). ``words_per_token`` is the first
    guess (a previous ``Prompt.words_per_token`` saves counts)."""
    if target < 2:
        raise ShardwiseError(f"a prompt needs at least 2 tokens, asked for {target}")
    words = word_stream(seed, target + 16)  # a word is one token or more: ``target`` words are enough
    counts: dict[tuple[int, int], int] = {}

    def counted(n: int, pads: int = 0) -> int:
        if (n, pads) not in counts:
            counts[n, pads] = count("".join(words[:n]) + PAD_WORD * pads)
        return counts[n, pads]

    # the most words whose count is <= target: secant steps on tokens per word, bisection as a fallback
    lo, lo_tokens, hi = 0, 0, len(words) + 1
    n = min(max(1, round(target * words_per_token)), len(words))
    while len(counts) < max_counts - 3:  # keep three counts for the padding
        got = counted(n)
        if got <= target:
            lo, lo_tokens = n, got
        else:
            hi = n
        if got == target or hi - lo <= 1:
            break
        guess = n + round((target - got) * n / max(got, 1))
        n = guess if lo < guess < hi else (lo + hi) // 2
    if lo == 0:
        raise ShardwiseError(f"the server counts {counted(1)} tokens for a one-word prompt, more than {target}")
    best = Prompt(words[0], tuple(words[1:lo]), 0, lo_tokens, target)
    pads = 0
    for _ in range(3):  # close the last tokens with single-token pad words
        if best.tokens == target:
            break
        pads = max(0, pads + target - (counted(lo, pads) if pads else lo_tokens))
        got = counted(lo, pads)
        if best.tokens < got <= target:
            best = Prompt(words[0], best.rest, pads, got, target)
    return best
