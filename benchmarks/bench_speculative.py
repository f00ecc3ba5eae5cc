"""Speculative decoding: measured speed-up against acceptance, next to the planner's prediction.

Run: PYTHONPATH=src python benchmarks/bench_speculative.py [--tokens N] [--k K] [--layers L]

Controlled acceptance. Random weights do not make drafts that a target accepts for a
reason, so the behaviour is built (``shardwise.testing.controlled``):

- target: a tiny llama checkpoint deepened to ``--layers`` layers whose LM head makes it
  *count* (greedy next token = t+1; the random layers still run and cost what they cost);
- draft: the target's first layer only, LM head plus Gaussian noise of scale s × its RMS.
  With s = 0 the draft agrees with the target almost always; as s grows its argmax
  leaves t+1 for more tokens t, so acceptance falls from ~0.95 to ~0.2 across the sweep.
  The draft runs replicated at tp = 1 on every rank (``runtime.drafters``).

For every s, at tp = 1 and tp = 2 (real processes over gloo), one launch runs a plain
greedy decode (the baseline: time per plain step, tok/s) and a speculative one of the
same prompt, and prints: measured per-token acceptance a (accepted / reached drafts),
tokens per verify step, verify-step and draft times relative to a plain step, the
measured speed-up, and the planner's prediction ``tokens_per_step(k, a)`` (from
``shardwise.perf.speculative``) × plain step / verify step — with the measured step times
— without and with the drafting time (the planner's waterfall charges no drafting cost:
it models prompt lookup).

Then a copy-heavy vs open-ended demonstration with prompt lookup (``--spec ngram``): the
counting target answers a prompt that holds the run 100…227 and ends in 100 by copying
that run, so long drafts are accepted; a prompt of random ids has nothing to copy.

All numbers are wall-clock on whatever CPU runs this (two shared cores when written), so
absolute times are noisy; the ratios are what to read.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from shardwise.perf.speculative import tokens_per_step
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.testing.controlled import counting, derive_checkpoint, perturb_lm_head
from shardwise.runtime.launch import launch_local

NOISE = (0.0, 1.6, 2.0, 2.4, 2.9, 3.5, 4.5)
OPEN = [int(t) for t in torch.randperm(512, generator=torch.Generator().manual_seed(11))[:64]]
COPY = list(range(100, 228)) + OPEN[:16] + [100]


def _rank(rank: int, world: int, target: str, drafts: list[str], k: int, tokens: int) -> list[dict]:
    from shardwise.plan import ParallelPlan
    from shardwise.runtime.generate import generate
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM
    from shardwise.runtime.speculative import (
        SpecParams,
        build_drafter,
        speculative_generate,
        speculative_summary,
    )

    torch.set_num_threads(1)
    model = ShardedCausalLM(load_spec(target), ParallelPlan(tp=world), rank, torch.float32,
                            max_seq_len=len(COPY) + tokens + k + 1, max_step_tokens=max(k, 8) + 1)
    load_shard(model, target)
    generate(model, OPEN, 8, eos=set())  # warm-up
    rows = []
    for label, prompt, params in (
        [(f"draft s={s}", OPEN, SpecParams("draft", k, draft=d)) for s, d in zip(NOISE, drafts)]
        + [("ngram copy-heavy", COPY, SpecParams("ngram", 8)), ("ngram open-ended", OPEN, SpecParams("ngram", 8))]
    ):
        drafter = build_drafter(params, model, target)
        plain = generate(model, prompt, tokens, eos=set())
        spec = speculative_generate(model, prompt, tokens, drafter, params.tokens, eos=set())
        rows.append({"label": label, **speculative_summary(spec, plain)})
    return rows


def _predicted(row: dict) -> tuple[float | None, float | None]:
    a, k = row["acceptance_per_token"], row["spec_tokens"]
    if a is None or row["verify_step_s"] is None:
        return None, None
    a = min(max(a, 1e-6), 1 - 1e-6)  # the planner's formula needs 0 < a < 1
    tps = tokens_per_step(k, a)
    plain, verify, draft = row["plain_step_s"], row["verify_step_s"], row["draft_step_s"] or 0.0
    return tps * plain / verify, tps * plain / (verify + draft)


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return format(x, spec) if x is not None else "-"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per run")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per verify step for the draft-model sweep")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the target (the draft has 1)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw = make_checkpoint("llama-3.1-8b", "tiny", root / "raw", seed=0)
        target = derive_checkpoint(raw, root / "target", layers=args.layers, edit=counting())
        drafts = [str(derive_checkpoint(target, root / f"draft{i}", layers=1, edit=perturb_lm_head(s, seed=i)))
                  for i, s in enumerate(NOISE)]
        for tp in (1, 2):
            rows = launch_local(_rank, tp, args=(str(target), drafts, args.k, args.tokens), run_timeout_s=1800)[0]
            print(f"\ntp={tp}: tiny llama target ({args.layers} layers, counting), 1-layer noisy draft, "
                  f"k={args.k}, {args.tokens} new tokens; prompt lookup rows use k=8")
            print(f"{'drafter':18s} {'accept a':>8s} {'tok/step':>8s} {'plain ms':>8s} {'verify/plain':>12s} "
                  f"{'draft/plain':>11s} {'measured':>8s} {'predicted':>9s} {'pred+draft':>10s} {'exact':>5s}")
            for row in rows:
                pred, pred_draft = _predicted(row)
                ratio = row["verify_cost_ratio"]
                draft = row["draft_step_s"] / row["plain_step_s"] if row["draft_step_s"] is not None else None
                print(f"{row['label']:18s} {_fmt(row['acceptance_per_token']):>8s} {_fmt(row['tokens_per_step']):>8s} "
                      f"{row['plain_step_s'] * 1e3:8.2f} {_fmt(ratio):>12s} {_fmt(draft):>11s} "
                      f"{_fmt(row['speedup']):>7s}x {_fmt(pred):>8s}x {_fmt(pred_draft):>9s}x "
                      f"{'yes' if row['matches_plain'] else 'NO':>5s}")
            sys.stdout.flush()
    print("\naccept a: accepted / reached drafts (the planner's per-token acceptance); measured: speculative vs "
          "plain decode tok/s; predicted: tokens_per_step(k, a) x plain step / verify step (measured step times); "
          "pred+draft: the same with the drafting time added to the verify step; exact: tokens equal plain greedy")


if __name__ == "__main__":
    main()
