"""Speculative decoding: exactness against plain greedy decoding, the sampling distribution,
KV rollback, and bad input.

Checkpoints: tiny random ones of every runtime architecture, plus derived ones with known
behaviour (``testing.controlled``): a *counting* target (greedy next token = t+1) so prompt
lookup drafts are all accepted on a copy-heavy prompt and none on a random one, a draft
that is the target itself (all accepted), an unrelated random draft (none), and a
one-layer draft with a noisy LM head (some). tp = 1 runs in process, tp = 2 in real
processes over gloo, every case of one world size in one launch. The mixed cases (some
drafts accepted, some rejected) run every k in 1..8; the all / none cases run a few k at
tp = 1 and k = 4 at tp = 2, to keep the suite within a few minutes on two shared cores.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from shardwise.errors import ShardwiseError
from shardwise.perf.speculative import tokens_per_step
from shardwise.plan import ParallelPlan
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.testing.controlled import (
    counting,
    derive_checkpoint,
    perturb_lm_head,
    scale_lm_head,
)
from shardwise.runtime.drafters import Drafter, DraftModel, PromptLookup, check_draft
from shardwise.runtime.exact import row_blocked
from shardwise.runtime.generate import SamplingParams
from shardwise.runtime.launch import launch_local
from shardwise.runtime.speculative import (
    SpecParams,
    build_drafter,
    speculative_generate,
    speculative_summary,
)

ARCHS = ("llama-3.1-8b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-20b")
KS = tuple(range(1, 9))
NEW = 16
REPEAT = [5, 9, 33, 100, 7, 8, 200, 3] * 3  # random targets fall into cycles: partial matches
COPY = list(range(100, 140)) + [7, 300, 100]  # a counting target answers 101, 102, … from the prompt
OPEN = [int(t) for t in torch.randperm(512, generator=torch.Generator().manual_seed(3))[:24]]  # nothing to copy


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, dict[str, str]]:
    out = {}
    for key in ARCHS:
        root = tmp_path_factory.mktemp(key)
        raw = make_checkpoint(key, "tiny", root / "raw", seed=0)
        count = derive_checkpoint(raw, root / "count", edit=counting())
        out[key] = {
            "raw": str(raw),
            "other": str(make_checkpoint(key, "tiny", root / "other", seed=1)),
            "count": str(count),
            "partial": str(derive_checkpoint(count, root / "partial", layers=1, edit=perturb_lm_head(1.0))),
        }
    return out


def _cases(ckpts, few: tuple[int, ...]) -> list[tuple]:
    """(arch, label, target, drafter method, draft folder, prompt, expected acceptance, ks)."""
    cases = []
    for key, c in ckpts.items():
        cases += [
            (key, "ngram/repeat", c["raw"], "ngram", None, REPEAT, None, KS),
            (key, "ngram/copy", c["count"], "ngram", None, COPY, "all", few),
            (key, "ngram/open", c["count"], "ngram", None, OPEN, "none", few),
            (key, "draft=target", c["raw"], "draft", c["raw"], REPEAT, "all", few),
            (key, "draft=unrelated", c["raw"], "draft", c["other"], REPEAT, "none", few),
            (key, "draft=noisy", c["count"], "draft", c["partial"], OPEN, None, KS),
        ]
    return cases


class _PoisonRejected(Drafter):
    """Wraps a drafter; on rollback fills the target's KV cache past the accepted length with
    NaN, so any read of a rolled-back position would poison the output."""

    def __init__(self, inner: Drafter, model):
        self.inner, self.model = inner, model

    def propose(self, context, k):
        return self.inner.propose(context, k)

    def draft_probs(self):
        return self.inner.draft_probs()

    def rollback(self, length):
        self.inner.rollback(length)
        for layer in self.model.model.layers:
            attn = layer.self_attn
            if getattr(attn, "window", None) is not None:  # sliding ring: the slots of positions >= length
                stale = torch.arange(max(length, attn.written - attn.cache_len), attn.written) % attn.cache_len
                attn.k_cache[:, :, stale] = float("nan")
                attn.v_cache[:, :, stale] = float("nan")
                continue
            for name, buf in attn.named_buffers():
                if name.endswith(("k_cache", "v_cache")):
                    buf[:, :, length:] = float("nan")
                elif name.endswith("latent_cache"):
                    buf[:, length:] = float("nan")


def _load(folder: str, tp: int, rank: int, max_batch: int = 1, dtype: torch.dtype = torch.float32):
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM

    model = ShardedCausalLM(load_spec(folder), ParallelPlan(tp=tp, ep=1), rank, dtype,
                            max_seq_len=80, max_batch=max_batch, max_step_tokens=max(KS) + 1)
    load_shard(model, folder)
    return model


@torch.no_grad()
def _verify_equals_steps(model) -> bool:
    """Do 9 positions verified in one pass give bit-identical logits to 9 single steps?"""
    with row_blocked():
        model(torch.tensor([REPEAT[:8]]), 0)
        ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18, 19]])
        single = torch.stack([model.logits(ids[:, i : i + 1], 8 + i)[0, 0] for i in range(9)])
        batched = model.logits(ids, 8)[0]
    return bool(torch.equal(single, batched))


def test_verify_equals_steps_in_bfloat16(ckpts):
    """bfloat16 runs (AMX's row-invariant product where the CPU has it, else padded blocks): a 9-position
    verify pass gives every position the bits of its single step, per architecture."""
    for key, c in ckpts.items():
        assert _verify_equals_steps(_load(c["raw"], 1, 0, dtype=torch.bfloat16)), key


def _rank_cases(rank: int, world_size: int, cases: list, poison: bool) -> list[dict]:
    from shardwise.runtime.generate import generate

    torch.set_num_threads(1)
    models: dict[tuple, object] = {}
    plain: dict[tuple, list[int]] = {}
    out = []
    for key, label, target, method, draft, prompt, _, ks in cases:
        if (target, world_size) not in models:
            models[target, world_size] = _load(target, world_size, rank)
        model = models[target, world_size]
        if (target, tuple(prompt)) not in plain:
            plain[target, tuple(prompt)] = generate(model, prompt, NEW, eos=set(), exact=True).tokens
        row = {"bitwise": _verify_equals_steps(model) if label == "ngram/repeat" else True,
               "plain": plain[target, tuple(prompt)], "spec": {}, "acceptance": {}}
        for k in ks:
            if method == "draft":  # the draft model is loaded once and reused (fresh state each run)
                if (draft, 1) not in models:
                    models[draft, 1] = _load(draft, 1, 0)
                drafter = DraftModel(models[draft, 1])
            else:
                drafter = build_drafter(SpecParams(method, k), model, target)
            if poison:
                drafter = _PoisonRejected(drafter, model)
            result = speculative_generate(model, prompt, NEW, drafter, k, eos=set())
            row["spec"][k] = result.tokens
            row["acceptance"][k] = speculative_summary(result)["acceptance_rate"]
        out.append(row)
    return out


def _check(cases, rows, label):
    for (key, name, *_, expect, ks), row in zip(cases, rows):
        where = f"{key} {name} {label}"
        assert row["bitwise"], f"{where}: verify-pass logits differ from single-step logits"
        for k in ks:
            assert row["spec"][k] == row["plain"], f"{where} k={k}: speculative tokens differ from plain greedy"
            rate = row["acceptance"][k]
            if expect == "all":
                assert rate == 1.0, f"{where} k={k}: acceptance {rate}, expected every draft accepted"
            elif expect == "none":
                assert rate is None or rate <= 0.1, f"{where} k={k}: acceptance {rate}, expected ~none"


def test_greedy_exact_tp1(ckpts):
    cases = _cases(ckpts, (2, 5, 8))
    _check(cases, _rank_cases(0, 1, cases, poison=True), "tp1")


def test_greedy_exact_tp2(ckpts):
    """Every k at tp 1 above; across two ranks the ends and a middle of the range."""
    cases = [(*c[:-1], (1, 4, 8) if c[-1] == KS else c[-1]) for c in _cases(ckpts, (4,))]
    results = launch_local(_rank_cases, 2, args=(cases, False), timeout_s=120, run_timeout_s=400)
    for rank in range(2):
        _check(cases, results[rank], f"tp2 rank {rank}")


# ------------------------------------------------------------------------ sampling distribution

V = 8  # tiny vocabulary: the exact distribution of the first tokens can be enumerated
SAMPLES = 500
ALPHA = 1e-3  # chi-square significance level: a p-value below it fails


@torch.no_grad()
def _exact_marginals(model, prompt: list[int], params: SamplingParams, steps: int) -> list[torch.Tensor]:
    """P(token at generated position j) for j = 1..steps, by enumerating every prefix."""
    from shardwise.runtime.generate import top_p_filter

    seqs = torch.cartesian_prod(*[torch.arange(V)] * (steps - 1)).reshape(-1, steps - 1)
    ids = torch.cat([torch.tensor(prompt).expand(seqs.shape[0], -1), seqs], dim=1)
    logits = model.logits(ids, 0)[:, len(prompt) - 1 :].float() / params.temperature
    probs = torch.softmax(top_p_filter(logits, params.top_p), dim=-1).double()  # [N, steps, V]
    joint = torch.ones(seqs.shape[0], dtype=torch.float64)  # P(prefix seqs[:, :j])
    marginals = [probs[0, 0]]
    for j in range(1, steps):
        joint = joint * probs[torch.arange(seqs.shape[0]), j - 1, seqs[:, j - 1]]
        # each prefix of length j appears V^(steps-1-j) times: divide it out
        marginals.append((joint[:, None] * probs[:, j]).sum(0) / V ** (steps - 1 - j))
    return marginals


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson chi-square of ``counts`` against ``probs``; cells expecting < 5 are pooled."""
    from scipy.stats import chisquare

    counts, probs = counts.double(), probs.double() / probs.double().sum()
    n = counts.sum()
    keep = probs * n >= 5
    obs, exp = counts[keep], probs[keep] * n
    if (~keep).any():
        obs = torch.cat([obs, counts[~keep].sum().reshape(1)])
        exp = torch.cat([exp, (n - exp.sum()).reshape(1)])
    stat, p = chisquare(obs.numpy(), exp.numpy())
    return float(stat), float(p)


def test_sampling_matches_plain_distribution(tmp_path, capsys):
    pytest.importorskip("scipy")
    torch.set_num_threads(1)
    raw = make_checkpoint("llama-3.1-8b", "tiny", tmp_path / "raw", seed=0)
    target = derive_checkpoint(raw, tmp_path / "v8", layers=1, vocab=V, edit=scale_lm_head(5.0))
    draft = derive_checkpoint(target, tmp_path / "draft", edit=perturb_lm_head(1.5, seed=5))
    model = _load(str(target), 1, 0, max_batch=V**3)
    params = SamplingParams(temperature=1.0, top_p=1.0, seed=0)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # prompt lookup finds matches, so it drafts
    steps = 4
    exact = _exact_marginals(model, prompt, params, steps)
    model, draft_model = _load(str(target), 1, 0), _load(str(draft), 1, 0)
    lines = []
    for method in ("ngram", "draft"):
        counts = torch.zeros(steps, V)
        drafted = accepted = 0
        for seed in range(SAMPLES):
            sp = SamplingParams(1.0, 1.0, seed)
            drafter = PromptLookup(1, 3) if method == "ngram" else DraftModel(draft_model, sp, seed=seed + 1)
            result = speculative_generate(model, prompt, steps, drafter, 3, sp, eos=set())
            for j, t in enumerate(result.tokens):
                counts[j, t] += 1
            drafted, accepted = drafted + sum(result.drafts), accepted + sum(result.accepted)
        assert 0 < accepted < drafted, f"{method}: the test needs both accepted and rejected drafts"
        for j in range(1, steps):
            stat, p = _chi2(counts[j], exact[j])
            lines.append(f"{method} position {j + 1}: chi2 {stat:.2f}, p {p:.3f} (n {SAMPLES}, drafted "
                         f"{drafted}, accepted {accepted})")
            assert p > ALPHA, lines[-1]
    with capsys.disabled():
        print("\n" + "\n".join(lines))


# ------------------------------------------------------------------------ drafters and bad input


def test_prompt_lookup_proposals():
    lookup = PromptLookup(1, 3)
    assert lookup.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # copies what followed "1 2"
    assert lookup.propose([7, 8, 7, 8], 5) == [7, 8, 7, 8, 7]  # the copy runs into itself
    assert lookup.propose([1, 2, 3, 4], 3) == []  # nothing matches
    assert PromptLookup(2, 2).propose([1, 5, 9, 1], 2) == []  # a 1-gram match is below --ngram-min
    assert lookup.draft_probs() is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tokens": 0}, "--spec-tokens must be >= 1, got 0"),
        ({"tokens": -2}, "--spec-tokens must be >= 1, got -2"),
        ({"ngram_min": 0}, "--ngram-min must be >= 1"),
        ({"ngram_min": 3, "ngram_max": 2}, "--ngram-max 2 is below --ngram-min 3"),
        ({"method": "eagle"}, "unknown --spec 'eagle'"),
        ({"method": "draft"}, "--spec draft needs --draft CHECKPOINT"),
        ({"method": "ngram", "draft": "x"}, "--draft is set but --spec is ngram"),
    ],
)
def test_bad_spec_params(kwargs, message):
    with pytest.raises(ShardwiseError, match=message.replace("(", r"\(")):
        SpecParams(**kwargs)


def test_bad_acceptance_and_vocabulary(tmp_path):
    for a in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(ShardwiseError, match="--acceptance must be in \\(0, 1\\)"):
            tokens_per_step(4, a)
    raw = make_checkpoint("llama-3.1-8b", "tiny", tmp_path / "raw", seed=0)
    small = derive_checkpoint(raw, tmp_path / "small", vocab=256)
    with pytest.raises(ShardwiseError, match="has vocab_size 256, the target 512"):
        check_draft(raw, small)


def test_cli_spec_json_and_errors(ckpts, tmp_path):
    count = ckpts["llama-3.1-8b"]["count"]
    ids = ",".join(map(str, COPY))
    done = run_cli("run", count, "--tp", "2", "--prompt-ids", ids, "--max-new-tokens", "16",
                "--spec", "ngram", "--spec-tokens", "4", "--json")
    assert done.returncode == 0, done.stderr
    spec = json.loads(done.stdout)["speculative"]
    assert spec["method"] == "ngram" and spec["drafted"] > 0 and spec["accepted"] == spec["drafted"]
    assert spec["matches_plain"] is True and len(spec["acceptance_by_position"]) == 4
    assert spec["tokens_per_step"] > 1 and spec["speedup"] > 0 and spec["verify_step_s"] > 0
    small = derive_checkpoint(count, tmp_path / "small", vocab=256)
    for args, message in (
        (("--spec", "ngram", "--spec-tokens", "0"), "--spec-tokens must be >= 1, got 0"),
        (("--draft", str(small)), "has vocab_size 256, the target 512"),
    ):
        bad = run_cli("run", count, "--tp", "1", "--prompt-ids", ids, *args)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr  # a ShardwiseError: one line, exit 2
        assert "Traceback" not in bad.stderr
