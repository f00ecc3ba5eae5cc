"""Sliding-window layers keep a ring of ``window + max_step_tokens - 1`` positions, exactly.

A tiny gpt-oss (window 16, sliding / full layers alternating) runs a 20-token prompt plus 32
generated tokens (52 positions, over three times the window; the prompt alone overflows the
ring) and must match transformers in float32: every position's logits within 1e-4 (prefill
and each decode step, against transformers' forward over the whole sequence) and the greedy
tokens of ``generate`` token for token, at tp 1 in process and tp 2 over gloo. Speculative
decoding (verify passes of 5 positions, rolled back into the ring) gives the same tokens.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwise.errors import ShardwiseError  # noqa: E402
from shardwise.plan import ParallelPlan  # noqa: E402
from shardwise.runtime.launch import launch_local  # noqa: E402

WINDOW = 16
PROMPT = [int(t) for t in torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1))]
NEW_TOKENS = 32
SPEC_TOKENS = 4


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    config = transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=32, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.5,
        max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(7)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, t in hf.named_parameters():
            t.copy_(1 + 0.1 * torch.randn_like(t) if "norm" in name else (0.1 if t.dim() == 1 else 0.08) * torch.randn_like(t))
    folder = tmp_path_factory.mktemp("gpt_oss_w16")
    hf.save_pretrained(folder)
    with torch.no_grad():
        gen = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        logits = hf(gen[:, :-1]).logits[0]  # every position whose next token was generated
    return dict(folder=str(folder), tokens=gen[0, len(PROMPT):].tolist(), logits=logits)


def _run(rank: int, world_size: int, folder: str, forced: list[int]) -> dict:
    from shardwise.runtime.drafters import PromptLookup
    from shardwise.runtime.generate import generate
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM
    from shardwise.runtime.speculative import speculative_generate

    torch.set_num_threads(1)
    spec = load_spec(folder)
    plan = ParallelPlan(tp=world_size, ep=world_size)
    total = len(PROMPT) + NEW_TOKENS
    model = ShardedCausalLM(spec, plan, rank, torch.float32, max_seq_len=total)
    load_shard(model, folder)
    rings = [layer.self_attn.k_cache.shape[2] for layer in model.model.layers]
    with torch.no_grad():  # prefill, then one token per step (transformers' tokens), logits of each
        steps = [model.logits(torch.tensor([PROMPT]), 0)[0]]
        for i, token in enumerate(forced[:-1]):
            steps.append(model.logits(torch.tensor([[token]]), len(PROMPT) + i)[0])
    logits = torch.cat(steps).numpy()
    tokens = generate(model, PROMPT, NEW_TOKENS, eos=set()).tokens
    exact = generate(model, PROMPT, NEW_TOKENS, eos=set(), exact=True).tokens
    spec_model = ShardedCausalLM(spec, plan, rank, torch.float32, max_seq_len=total, max_step_tokens=SPEC_TOKENS + 1)
    load_shard(spec_model, folder)
    spec_rings = [layer.self_attn.k_cache.shape[2] for layer in spec_model.model.layers]
    result = speculative_generate(spec_model, PROMPT, NEW_TOKENS, PromptLookup(1, 3), SPEC_TOKENS, eos=set())
    refused = None
    try:
        speculative_generate(model, PROMPT, NEW_TOKENS, PromptLookup(1, 3), SPEC_TOKENS, eos=set())
    except ShardwiseError as exc:
        refused = str(exc)
    return dict(logits=logits, tokens=tokens, exact=exact, spec=result.tokens, drafted=sum(result.drafts),
                rejected=sum(result.drafts) - sum(result.accepted), rings=rings, spec_rings=spec_rings,
                cache_bytes=model.cache_bytes(), refused=refused)


def _check(ref, r, label):
    total = len(PROMPT) + NEW_TOKENS
    assert r["rings"][0] == WINDOW and r["rings"][1] == total, f"{label}: cache lengths {r['rings']}"
    assert r["spec_rings"][0] == WINDOW + SPEC_TOKENS, f"{label}: speculative ring {r['spec_rings']}"
    diff = float(abs(r["logits"] - ref["logits"].numpy()).max())
    assert diff <= 1e-4, f"{label}: max |Δlogit| = {diff:.3g}"
    assert r["tokens"] == ref["tokens"], f"{label}: greedy tokens differ from transformers"
    assert r["exact"] == ref["tokens"], f"{label}: exact greedy tokens differ from transformers"
    assert r["spec"] == r["exact"], f"{label}: speculative tokens differ from plain greedy"
    assert r["drafted"] > 0, f"{label}: prompt lookup drafted nothing"
    assert r["refused"] is not None and "max_step_tokens >= 5" in r["refused"], r["refused"]


def test_sliding_ring_matches_transformers_tp1(ref):
    _check(ref, _run(0, 1, ref["folder"], ref["tokens"]), "tp1")


def test_sliding_ring_matches_transformers_tp2(ref):
    results = launch_local(_run, 2, args=(ref["folder"], ref["tokens"]), timeout_s=120, run_timeout_s=300)
    for rank in range(2):
        _check(ref, results[rank], f"tp2 rank {rank}")


def test_rewinding_past_the_ring_is_refused(ref):
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM

    model = ShardedCausalLM(load_spec(ref["folder"]), ParallelPlan(), 0, torch.float32, max_seq_len=64)
    load_shard(model, ref["folder"])
    with torch.no_grad():
        model(torch.tensor([PROMPT]), 0)  # positions 0..19; the ring of 16 holds 4..19
        model(torch.tensor([PROMPT[-1:]]), 19)  # one step back: its window 4..18 is still held
        with pytest.raises(ShardwiseError, match="no longer holds position 3"):
            model(torch.tensor([PROMPT[-2:]]), 18)  # its window starts at 3
