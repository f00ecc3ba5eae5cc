"""Speculative decoding on qwen3_5_moe: greedy output equals plain greedy decoding, and the
linear-attention state rolls back with the KV cache.

A verify pass over k + 1 positions leaves every position's Gated DeltaNet state (a
``linear_state.LinearStateCache`` snapshot); the next pass starts at the accepted length and
reads that snapshot, so a rejected draft's state update is never used. Checked here with
make-checkpoint's tiny Qwen3.5 (three DeltaNet layers, one gated attention layer) for prompt
lookup and a draft model, k = 1..6, tp 1 (in process, with every rolled-back snapshot and KV
entry poisoned with NaN) and tp 2 (gloo). A *counting* target (greedy next token t + 1, as in
``testing.controlled``) gives prompt-lookup drafts that are partly accepted; a draft model equal
to the target has all accepted, one with a noisy LM head some.
"""

from __future__ import annotations

import pytest
import torch

from runtime_checks import PoisonRejected
from shardwise.errors import ShardwiseError
from shardwise.plan import ParallelPlan
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.drafters import DraftModel, PromptLookup
from shardwise.runtime.exact import row_blocked
from shardwise.runtime.launch import launch_local
from shardwise.runtime.loader import load_shard, load_spec
from shardwise.runtime.model import ShardedCausalLM
from shardwise.runtime.speculative import speculative_generate, speculative_summary
from shardwise.testing.controlled import derive_checkpoint, perturb_lm_head

KS = tuple(range(1, 7))
NEW = 14
MIXED = list(range(100, 110)) + [40, 41, 42] + list(range(100, 105)) + [7, 100]  # runs that break: partial copies
REPEAT = [5, 9, 33, 100, 7, 8, 200, 3] * 3


def _counting(gain: float = 4.0, embed_scale: float = 10.0):
    """``testing.controlled.counting`` for the multimodal layout's embedding name."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        name = next(k for k in tensors if k.endswith("embed_tokens.weight"))
        embed = tensors[name] * embed_scale
        tensors[name] = embed
        tensors["lm_head.weight"] = gain * torch.roll(embed / embed.norm(dim=-1, keepdim=True), shifts=1, dims=0)

    return edit


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("qwen3_5_spec")
    raw = make_checkpoint("qwen3.5-397b-a17b", "tiny", root / "raw", seed=0)
    count = derive_checkpoint(raw, root / "count", edit=_counting())
    noisy = derive_checkpoint(count, root / "noisy", edit=perturb_lm_head(1.0))
    return {"raw": str(raw), "count": str(count), "noisy": str(noisy)}


def _cases(c: dict[str, str]) -> list[tuple]:
    """(label, target, drafter method, draft folder, prompt, expected acceptance)."""
    return [
        ("ngram/mixed", c["count"], "ngram", None, MIXED, "some"),
        ("ngram/repeat", c["raw"], "ngram", None, REPEAT, None),
        ("draft=target", c["count"], "draft", c["count"], MIXED, "all"),
        ("draft=noisy", c["count"], "draft", c["noisy"], MIXED, "some"),
    ]


def _load(folder: str, tp: int, rank: int, steps: int = max(KS) + 1):
    model = ShardedCausalLM(load_spec(folder), ParallelPlan(tp=tp, ep=tp), rank, torch.float32, max_seq_len=64,
                            max_step_tokens=steps)
    load_shard(model, folder)
    return model


@torch.no_grad()
def _verify_equals_steps(model) -> bool:
    """Do 7 positions verified in one pass give bit-identical logits to 7 single steps?"""
    with row_blocked():
        model(torch.tensor([REPEAT[:8]]), 0)
        ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17]])
        single = torch.stack([model.logits(ids[:, i : i + 1], 8 + i)[0, 0] for i in range(7)])
        batched = model.logits(ids, 8)[0]
    return bool(torch.equal(single, batched))


@torch.no_grad()
def _next_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits of one more step after a generation: the states and KV cache the run left at its
    last position, bit for bit (a rolled-back update left in a state shows here first)."""
    with row_blocked():
        return model.logits(torch.tensor([tokens[-1:]]), len(prompt) + len(tokens) - 1)[0, 0]


def _rank_cases(rank: int, world_size: int, cases: list, poison: bool) -> list[dict]:
    from shardwise.runtime.generate import generate

    torch.set_num_threads(1)
    models: dict[tuple, object] = {}
    out = []
    for label, target, method, draft, prompt, _ in cases:
        if (target, world_size) not in models:
            models[target, world_size] = _load(target, world_size, rank)
        model = models[target, world_size]
        plain = generate(model, prompt, NEW, eos=set(), exact=True).tokens
        row = {"plain": plain, "next": _next_logits(model, prompt, plain), "spec": {}, "acceptance": {},
               "same_state": {}}
        row["bitwise"] = _verify_equals_steps(model) if label == "ngram/repeat" else True
        for k in KS:
            if method == "draft":  # its own model (not the target's, even for the same folder), loaded once
                if ("draft", draft) not in models:
                    models["draft", draft] = _load(draft, 1, 0)
                drafter = DraftModel(models["draft", draft])
            else:
                drafter = PromptLookup(1, 3)
            if poison:
                drafter = PoisonRejected(drafter, model)
            result = speculative_generate(model, prompt, NEW, drafter, k, eos=set())
            row["spec"][k] = result.tokens
            row["same_state"][k] = torch.equal(_next_logits(model, prompt, result.tokens), row["next"])
            row["acceptance"][k] = speculative_summary(result)["acceptance_rate"]
        out.append(row)
    return out


def _check(cases, rows, where):
    for (label, *_, expect), row in zip(cases, rows):
        assert row["bitwise"], f"{label} {where}: verify-pass logits differ from single-step logits"
        for k in KS:
            assert row["spec"][k] == row["plain"], f"{label} {where} k={k}: speculative tokens differ from plain greedy"
            assert row["same_state"][k], f"{label} {where} k={k}: the state after the run differs from plain decoding's"
        rates = [row["acceptance"][k] for k in KS]
        if expect == "all":
            assert all(r == 1.0 for r in rates), f"{label} {where}: acceptance {rates}, expected all"
        elif expect == "some":
            assert any(r is not None and 0 < r < 1 for r in rates), f"{label} {where}: acceptance {rates}, expected some"


def test_greedy_exact_tp1(ckpts):
    cases = _cases(ckpts)
    _check(cases, _rank_cases(0, 1, cases, poison=True), "tp1")


def test_greedy_exact_tp2(ckpts):
    cases = _cases(ckpts)
    results = launch_local(_rank_cases, 2, args=(cases, False), timeout_s=120, run_timeout_s=300)
    for rank in range(2):
        _check(cases, results[rank], f"tp2 rank {rank}")


def test_rollback_limits(ckpts):
    """A model built for plain decoding refuses verify passes; a restart past the held snapshots
    is a one-line error instead of a silently wrong state."""
    plain = _load(ckpts["raw"], 1, 0, steps=1)
    assert plain.model.layers[0].self_attn.state.snapshots == 1
    with pytest.raises(ShardwiseError, match="max_step_tokens >= 3"):
        speculative_generate(plain, REPEAT, 4, PromptLookup(1, 3), 2, eos=set())
    model = _load(ckpts["raw"], 1, 0, steps=3)  # 4 snapshots: restarts up to 3 positions back
    with torch.no_grad():
        model(torch.tensor([REPEAT[:8]]), 0)
        model(torch.tensor([[1, 2, 3]]), 8)
        model(torch.tensor([[4, 5, 6]]), 8)  # the whole pass again: allowed
        with pytest.raises(ShardwiseError, match="state at position 7 is no longer held"):
            model(torch.tensor([[1]]), 7)  # inside the prefill
        model(torch.tensor([[1, 2, 3]]), 11)
        with pytest.raises(ShardwiseError, match="state at position 9 is no longer held"):
            model(torch.tensor([[1]]), 9)
