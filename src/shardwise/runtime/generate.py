"""Prefill + decode loop over a ShardedCausalLM, run identically on every rank.

Greedy decoding all-gathers one (value, index) pair per rank; sampling all-gathers the
full logits and draws with a ``torch.Generator`` seeded the same on every rank, so every
rank picks the same token without an extra broadcast.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardwise.errors import ShardwiseError
from shardwise.runtime.exact import row_blocked


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; otherwise softmax(logits / T) restricted to the top-p nucleus."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ShardwiseError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ShardwiseError(f"--top-p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationResult:
    """Generated token ids (EOS included when hit) and timings of this rank."""

    tokens: list[int]
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    stopped_by: str  # "eos" or "max_new_tokens"
    step_s: list[float] = field(default_factory=list)

    @property
    def decode_tok_per_s(self) -> float:
        """Decode throughput (tokens after the first, per second)."""
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def eos_ids(config) -> set[int]:
    """EOS token ids from a config (``eos_token_id`` int, list or absent)."""
    value = config.get("eos_token_id")
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the smallest set whose probability reaches ``top_p``
    (transformers' TopPLogitsWarper: the most likely token always stays)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p)
    remove[..., -1:] = False
    return logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))


class _Picker:
    """Turns the last hidden state into the next token id, the same on every rank."""

    def __init__(self, model, params: SamplingParams):
        self.model, self.params = model, params
        self.gen: torch.Generator | None = None

    def __call__(self, hidden: torch.Tensor) -> int:
        head = self.model.lm_head
        if self.params.temperature == 0:
            return int(head.greedy(hidden)[0])
        logits = head.logits(hidden).float()[0] / self.params.temperature
        probs = torch.softmax(top_p_filter(logits, self.params.top_p), dim=-1)
        if self.gen is None:  # on the logits' device, seeded alike on every rank
            self.gen = torch.Generator(device=probs.device).manual_seed(self.params.seed)
        return int(torch.multinomial(probs, 1, generator=self.gen)[0])


def check_prompt(prompt_ids: Sequence[int], max_new_tokens: int, vocab_size: int, max_len: int, limit: str) -> None:
    """Raise a one-line ShardwiseError for an empty prompt, ids outside ``vocab_size``, fewer than one new
    token, or a prompt + new tokens longer than ``max_len`` (0: no limit), which ``limit`` names."""
    if not prompt_ids:
        raise ShardwiseError("the prompt is empty: pass at least one token")
    if max_new_tokens < 1:
        raise ShardwiseError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ShardwiseError(f"prompt token id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}")
    total = len(prompt_ids) + max_new_tokens
    if max_len and total > max_len:
        room = max_len - len(prompt_ids)
        fix = f"pass --max-new-tokens {room} or fewer" if room >= 1 else "shorten the prompt"
        raise ShardwiseError(
            f"prompt ({len(prompt_ids)}) + max new tokens ({max_new_tokens}) = {total} exceeds {max_len} tokens "
            f"({limit}): {fix}"
        )


def max_positions(spec) -> tuple[int, str]:
    """(the most positions ``spec`` is made for, what sets it): ``max_position_embeddings``, or a YaRN
    rope scaling's ``original_max_position_embeddings`` × ``factor`` where that is more (a config
    extended for long context); 0 when the config says neither."""
    from shardwise.runtime.layers import rope_parameters

    limit = (spec.max_position_embeddings, f"{spec.name}'s max_position_embeddings")
    params = rope_parameters(spec.config)
    original, factor = params.get("original_max_position_embeddings"), params.get("factor")
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < 1e9 for x in (original, factor))
    if params["rope_type"] == "yarn" and numbers and int(original * factor) > limit[0]:
        return int(original * factor), f"{spec.name}'s YaRN original_max_position_embeddings {original} × factor {factor}"
    return limit


def check_request(model, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    """``check_prompt`` against ``model``'s vocabulary and KV cache."""
    check_prompt(prompt_ids, max_new_tokens, model.spec.vocab_size, model.max_seq_len, "the KV cache")


@torch.no_grad()
def generate(
    model,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    eos: set[int] | None = None,
    tracer=None,
    exact: bool = False,
) -> GenerationResult:
    """Prefill ``prompt_ids`` then decode up to ``max_new_tokens`` tokens (stopping after EOS).

    Every rank of the model's group must call this with the same arguments. With an
    attached ``trace.Tracer`` every step (prefill, then each decode token) is timed per
    layer; without one the loop reads no extra clocks. With ``exact`` the linear layers compute
    every row independently of the others (``exact.row_blocked``: compiled row-invariant kernels for
    float32 and bfloat16 on CPU, 16-row blocks otherwise), so each step computes bit for bit what a
    speculative verify pass computes for its position, at nearly the plain path's speed on this VM
    (2.3 GB llama, alternated: float32 9.8-10.6 vs 11.2-11.6 tok/s, bfloat16 18-21 vs 19-21).
    """
    with row_blocked() if exact else contextlib.nullcontext():
        return _generate(model, prompt_ids, max_new_tokens, sampling, eos, tracer)


def prefill(model, prompt_ids: Sequence[int], pick, tracer=None) -> tuple[int, float]:
    """Run the prompt through ``model`` and pick the first new token: (token, seconds)."""
    t0 = time.perf_counter()
    if tracer is not None:
        tracer.begin_step("prefill", 0, len(prompt_ids))
    hidden = model(torch.tensor([list(prompt_ids)]), 0)
    token = pick(hidden[:, -1])
    if tracer is not None:
        tracer.end_step()
    return token, time.perf_counter() - t0


def _generate(model, prompt_ids, max_new_tokens, sampling, eos, tracer) -> GenerationResult:
    check_request(model, prompt_ids, max_new_tokens)
    eos = eos_ids(model.spec.config) if eos is None else eos
    pick = _Picker(model, sampling or SamplingParams())
    token, prefill_s = prefill(model, prompt_ids, pick, tracer)
    tokens, steps = [token], []
    pos = len(prompt_ids)
    t1 = time.perf_counter()
    while token not in eos and len(tokens) < max_new_tokens:
        ts = time.perf_counter()
        if tracer is not None:
            tracer.begin_step("decode", pos)
        hidden = model(torch.tensor([[token]]), pos)
        token = pick(hidden[:, -1])
        if tracer is not None:
            tracer.end_step()
        steps.append(time.perf_counter() - ts)
        tokens.append(token)
        pos += 1
    decode_s = time.perf_counter() - t1
    return GenerationResult(
        tokens=tokens, prompt_tokens=len(prompt_ids), prefill_s=prefill_s, decode_s=decode_s,
        stopped_by="eos" if token in eos else "max_new_tokens", step_s=steps,
    )


def load_tokenizer(folder: str | Path):
    """The checkpoint's ``tokenizer.json`` as a ``tokenizers.Tokenizer``, or None when absent."""
    path = Path(folder) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ShardwiseError(f"cannot read '{path}': {exc}") from None


def encode_prompt(folder: str | Path, text: str) -> list[int]:
    """Token ids of ``text`` with the checkpoint's tokenizer.json."""
    tok = load_tokenizer(folder)
    if tok is None:
        raise ShardwiseError(f"'{folder}' has no tokenizer.json: pass --prompt-ids instead of --prompt")
    ids = tok.encode(text).ids
    if not ids:
        raise ShardwiseError("the prompt text encodes to no tokens: pass a longer --prompt")
    return ids


DEFAULT_PROMPT = "Hello world"
"""Prompt text ``shardwise run`` and ``shardwise bench`` encode when given no prompt."""


def parse_prompt_ids(text: str) -> tuple[int, ...]:
    """Prompt token ids from ``--prompt-ids`` text like ``1,2,3`` (one-line errors)."""
    try:
        ids = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ShardwiseError(f"--prompt-ids '{text}' must be comma-separated integers like 1,2,3") from None
    if not ids:
        raise ShardwiseError("--prompt-ids is empty: pass comma-separated integers like 1,2,3")
    return ids
