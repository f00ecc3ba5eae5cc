"""Speculative decoding on the sharded runtime: draft k tokens, verify k+1 positions in one pass.

Every rank runs the same loop (like ``generate``):

1. Prefill the prompt and pick the first token exactly as ``generate`` does.
2. The drafter (``runtime.drafters``) proposes up to k tokens d1..dk for the context.
3. **Verify**: one forward pass over ``[last token, d1..dk]`` at positions ``p..p+k`` on
   all ranks — the same number of all-reduces as a plain step, with k+1-row messages —
   gives the target's prediction after every prefix. Greedy: one all-gather of (value,
   index) pairs for all k+1 rows; accept the longest prefix of drafts equal to the
   target's argmax, then append the target's own token at the first mismatch (the
   correction), or after the last draft when all were accepted (the bonus).
   Sampling: the standard rejection rule — accept d_i with probability
   min(1, p(d_i) / q(d_i)), else draw from the normalised residual max(0, p − q) and
   stop; all accepted: draw the bonus from p. p is the target's softmax(top-p(logits /
   T)) as in ``generate``; q the drafter's distribution (a point mass for prompt lookup
   or a greedy draft: accept with probability p(d_i), residual = p without d_i). The
   uniform draws come from one generator seeded alike on every rank, so every rank
   accepts the same tokens without a broadcast.
4. **Roll back** the rejected positions: the target's KV cache is static and positional,
   and no query reads keys past its own position (``attention.attend``), so the next
   pass simply starts at the accepted length and overwrites them; the drafter is told
   the accepted length (``rollback``) and drops its own state past it.

Greedy speculative output is token-for-token the plain greedy output of
``generate(..., exact=True)``: the verify pass computes every position's logits bit for bit
as a single-token step would (``runtime.exact``: row-invariant linears in both paths,
attention row by row over each position's own keys). The default plain path runs faster
one-row matmuls, which can differ in the last bits. Sampling output has the plain sampling distribution, not the
same draws.

Metrics (``speculative_summary``): drafted and accepted tokens, acceptance by draft
position, tokens per verify step, time per verify step next to time per plain decode
step (from a plain baseline run) and the resulting speed-up.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardwise.errors import ShardwiseError
from shardwise.runtime.drafters import (
    Drafter,
    DraftModel,
    PromptLookup,
    check_draft,
    check_ngram,
)
from shardwise.runtime.exact import in_row_blocks
from shardwise.runtime.generate import (
    GenerationResult,
    SamplingParams,
    _Picker,
    check_request,
    eos_ids,
    generate,
    prefill,
    top_p_filter,
)

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpecParams:
    """``shardwise run --spec``: the drafter and how many tokens it drafts per step."""

    method: str = "ngram"
    tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 3
    draft: str | None = None  # draft checkpoint folder (method "draft")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ShardwiseError(f"unknown --spec '{self.method}': use ngram (prompt lookup) or draft (--draft CHECKPOINT)")
        if self.tokens < 1:
            raise ShardwiseError(f"--spec-tokens must be >= 1, got {self.tokens}")
        check_ngram(self.ngram_min, self.ngram_max)
        if self.method == "draft" and self.draft is None:
            raise ShardwiseError("--spec draft needs --draft CHECKPOINT (a smaller model with the same vocabulary)")
        if self.method == "ngram" and self.draft is not None:
            raise ShardwiseError("--draft is set but --spec is ngram: use --spec draft, or drop --draft")


def build_drafter(params: SpecParams, model, checkpoint: str | Path, sampling: SamplingParams | None = None) -> Drafter:
    """The drafter ``params`` asks for; a draft model is loaded whole at tp 1 on this rank."""
    if params.method == "ngram":
        return PromptLookup(params.ngram_min, params.ngram_max)
    from shardwise.plan import ParallelPlan
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM

    check_draft(checkpoint, params.draft)
    draft = ShardedCausalLM(load_spec(params.draft), ParallelPlan(), 0, model.dtype, max_seq_len=model.max_seq_len,
                            max_step_tokens=model.max_step_tokens)
    load_shard(draft, Path(params.draft))
    sampling = sampling or SamplingParams()
    return DraftModel(draft, sampling, seed=sampling.seed + 1)


@dataclass
class SpeculativeResult(GenerationResult):
    """A generation plus, per verify step: drafts proposed, drafts accepted, tokens added,
    verify time (target pass + acceptance) and drafting time."""

    spec_tokens: int = 0
    drafts: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    added: list[int] = field(default_factory=list)
    verify_s: list[float] = field(default_factory=list)
    draft_s: list[float] = field(default_factory=list)


def _accept(model, hidden: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
            params: SamplingParams, gen: torch.Generator | None) -> tuple[int, int]:
    """(drafts accepted, the target's next token after them) for one verify pass."""
    if params.temperature == 0:
        targets = model.lm_head.greedy(hidden)[0].tolist()
        m = 0
        while m < len(drafts) and drafts[m] == targets[m]:
            m += 1
        return m, int(targets[m])
    logits = model.lm_head.logits(hidden).float()[0] / params.temperature
    p = torch.softmax(top_p_filter(logits, params.top_p), dim=-1)
    for i, d in enumerate(drafts):
        q_d = q[i, d] if q is not None else 1.0
        if float(torch.rand((), generator=gen)) < float(p[i, d] / q_d):
            continue
        if q is not None:
            residual = (p[i] - q[i]).clamp(min=0)
        else:
            residual = p[i].clone()
            residual[d] = 0.0
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=gen)[0])
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen)[0])


@torch.no_grad()
@in_row_blocks
def speculative_generate(
    model,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    drafter: Drafter,
    spec_tokens: int,
    sampling: SamplingParams | None = None,
    eos: set[int] | None = None,
    tracer=None,
) -> SpeculativeResult:
    """``generate`` with drafts of up to ``spec_tokens`` tokens verified per forward pass.

    Every rank of the model's group must call this with the same arguments (and an
    equivalent drafter). Steps with no draft are plain decode steps. A ``trace.Tracer``
    records each pass as a "verify" step of k+1 tokens ("decode" when nothing was drafted).
    """
    check_request(model, prompt_ids, max_new_tokens)
    if spec_tokens < 1:
        raise ShardwiseError(f"--spec-tokens must be >= 1, got {spec_tokens}")
    model.check_step_tokens(spec_tokens + 1)
    params = sampling or SamplingParams()
    eos = eos_ids(model.spec.config) if eos is None else eos
    pick = _Picker(model, params)
    token, prefill_s = prefill(model, prompt_ids, pick, tracer)
    out = SpeculativeResult(tokens=[token], prompt_tokens=len(prompt_ids), prefill_s=prefill_s, decode_s=0.0,
                            stopped_by="max_new_tokens", spec_tokens=spec_tokens)
    context = list(prompt_ids) + [token]
    t1 = time.perf_counter()
    while token not in eos and len(out.tokens) < max_new_tokens:
        ts = time.perf_counter()
        k = min(spec_tokens, max_new_tokens - len(out.tokens) - 1)
        drafts = drafter.propose(context, k) if k > 0 else []
        q = drafter.draft_probs() if drafts and params.temperature > 0 else None
        tv = time.perf_counter()
        pos = len(context) - 1
        if tracer is not None:
            tracer.begin_step("verify" if drafts else "decode", pos, len(drafts) + 1)
        hidden = model(torch.tensor([[context[-1]] + drafts]), pos)
        m, nxt = _accept(model, hidden, drafts, q, params, pick.gen)
        if tracer is not None:
            tracer.end_step()
        drafter.rollback(len(context) + m)
        added = 0
        for token in drafts[:m] + [nxt]:
            out.tokens.append(token)
            context.append(token)
            added += 1
            if token in eos:
                break
        te = time.perf_counter()
        out.step_s.append(te - ts)
        out.verify_s.append(te - tv)
        out.draft_s.append(tv - ts)
        out.drafts.append(len(drafts))
        out.accepted.append(m)
        out.added.append(added)
    out.decode_s = time.perf_counter() - t1
    out.stopped_by = "eos" if token in eos else "max_new_tokens"
    return out


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def speculative_summary(
    result: SpeculativeResult, plain: GenerationResult | None = None, sampling: SamplingParams | None = None
) -> dict[str, Any]:
    """The run summary's "speculative" block (JSON-ready; seconds, rates in 0..1).

    ``acceptance_rate``: accepted / drafted tokens. ``acceptance_by_position[i]``: the
    share of steps that drafted an (i+1)-th token in which it was accepted.
    ``acceptance_per_token``: accepted / drafts that were reached (all earlier drafts of
    their step accepted) — the per-token acceptance ``a`` of the planner's
    ``tokens_per_step(k, a)``. ``plain_step_s`` and ``speedup`` need the ``plain``
    baseline run (same prompt and length); ``speedup`` compares decode tok/s, and
    ``matches_plain`` (greedy only) says whether the tokens equal the baseline's.
    """
    k = result.spec_tokens
    drafted_at = [sum(1 for n in result.drafts if n > i) for i in range(k)]
    accepted_at = [sum(1 for m in result.accepted if m > i) for i in range(k)]
    drafted, accepted = sum(result.drafts), sum(result.accepted)
    reached = sum(m + (1 if m < n else 0) for n, m in zip(result.drafts, result.accepted))
    verify = [s for s, n in zip(result.verify_s, result.drafts) if n]
    plain_step = _mean(plain.step_s) if plain is not None else None
    verify_step = _mean(verify)
    return {
        "spec_tokens": k,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "acceptance_per_token": accepted / reached if reached else None,
        "acceptance_by_position": [a / d if d else None for a, d in zip(accepted_at, drafted_at)],
        "drafted_by_position": drafted_at,
        "verify_steps": len(verify),
        "steps": len(result.drafts),
        "tokens_per_step": _mean([a for a, n in zip(result.added, result.drafts) if n]),
        "verify_step_s": verify_step,
        "draft_step_s": _mean([s for s, n in zip(result.draft_s, result.drafts) if n]),
        "plain_step_s": plain_step,
        "verify_cost_ratio": verify_step / plain_step if verify_step and plain_step else None,
        "plain_tok_per_s": plain.decode_tok_per_s if plain is not None else None,
        "tok_per_s": result.decode_tok_per_s,
        "speedup": result.decode_tok_per_s / plain.decode_tok_per_s
        if plain is not None and plain.decode_tok_per_s > 0 else None,
        "matches_plain": result.tokens == plain.tokens
        if plain is not None and (sampling is None or sampling.temperature == 0) else None,
    }


def run_speculative(model, request, sampling: SamplingParams, tracer=None) -> tuple[SpeculativeResult, dict[str, Any]]:
    """What ``run_rank`` does for ``request.spec``: a plain baseline decode (the step time
    and tok/s the speed-up is measured against), then the speculative decode of the same
    prompt; returns the speculative result and ``speculative_summary``."""
    params: SpecParams = request.spec
    drafter = build_drafter(params, model, request.checkpoint, sampling)
    plain = generate(model, request.prompt_ids, request.max_new_tokens, sampling)
    result = speculative_generate(
        model, request.prompt_ids, request.max_new_tokens, drafter, params.tokens, sampling, tracer=tracer
    )
    return result, {"method": params.method, **speculative_summary(result, plain, sampling)}
