"""Vocabulary padding: a vocabulary that tensor parallelism does not divide runs anyway.

Each rank holds ``ceil(vocab / tp)`` embedding / LM-head rows (``layers.vocab_rows``), the
last rank's slice padded with zero rows no id maps to; padding logits are -inf, so they
never win greedy or sampling, and ``logits()`` returns exactly ``vocab_size`` columns.
Checked against transformers in float32 (logits within 1e-4, identical greedy tokens) at
tp 3 and 4 (12 heads; widths divisible by 12) for a tied (llama) and an untied (gpt-oss,
sliding window 4, KV head replicated) model, plus a vocabulary so small
that one rank holds no real row. Every LM-head row gets +1 on hidden dimension 0, so a
hidden state of -e0 gives every real token a negative logit: a zero padding row would win
that argmax if it were not masked.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from runtime_checks import randomise  # noqa: E402
from shardwise.plan import ParallelPlan  # noqa: E402
from shardwise.runtime.launch import launch_local  # noqa: E402
from shardwise.runtime.layers import vocab_rows, vocab_span  # noqa: E402

PROMPT = [3, 17, 101, 42, 7, 250, 11, 64]
NEW_TOKENS = 24
VOCAB = 253  # not divisible by 2, 3 or 4


def _configs():
    common = dict(hidden_size=96, num_attention_heads=12, max_position_embeddings=128,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return {
        "llama": (transformers.LlamaConfig(
            **common, vocab_size=VOCAB, num_key_value_heads=12, head_dim=8, intermediate_size=96,
            num_hidden_layers=2, tie_word_embeddings=True,
        ), PROMPT),
        "gpt_oss": (transformers.GptOssConfig(
            **common, vocab_size=VOCAB, num_key_value_heads=1, head_dim=8, intermediate_size=48,
            num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=4, swiglu_limit=0.5,
        ), PROMPT),
        "llama_v9": (transformers.LlamaConfig(  # tp 4: 3 rows per rank, rank 3 holds none
            **common, vocab_size=9, num_key_value_heads=12, head_dim=8, intermediate_size=96,
            num_hidden_layers=1, tie_word_embeddings=False,
        ), [1, 5, 8, 2, 0, 7]),
    }


def _randomise(model: torch.nn.Module) -> None:
    randomise(model)
    with torch.no_grad():
        model.lm_head.weight[:, 0] += 1.0  # tied: the embedding too, harmless


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for i, (key, (config, prompt)) in enumerate(_configs().items()):
        torch.manual_seed(200 + i)
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        _randomise(hf)
        folder = tmp_path_factory.mktemp(key)
        hf.save_pretrained(folder)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            logits = hf(ids).logits[0]
            gen = hf.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            negative = -hf.lm_head.weight[:, 0]  # logits of the hidden state -e0
        assert float(negative.max()) < 0
        out[key] = dict(folder=str(folder), prompt=prompt, logits=logits, greedy=gen[0, len(prompt):].tolist(),
                        negative=negative, vocab=config.vocab_size)
    return out


def _run_case(rank: int, folder: str, tp: int, prompt: list[int]) -> dict:
    from shardwise.runtime.generate import generate
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM

    spec = load_spec(folder)
    model = ShardedCausalLM(spec, ParallelPlan(tp=tp, ep=1), rank, torch.float32, max_seq_len=len(prompt) + NEW_TOKENS)
    load_shard(model, folder)
    hidden = torch.zeros(1, spec.hidden_size)
    hidden[0, 0] = -1.0
    with torch.no_grad():
        logits = model.logits(torch.tensor([prompt]))[0]
        neg_logits = model.lm_head.logits(hidden)[0]
        neg_greedy = int(model.lm_head.greedy(hidden)[0])
    tokens = generate(model, prompt, NEW_TOKENS, eos=set()).tokens
    emb = model.model.embed_tokens
    return dict(logits=logits.numpy(), tokens=tokens, neg_logits=neg_logits.numpy(), neg_greedy=neg_greedy,
                rows=emb.weight.shape[0], span=(emb.start, emb.stop),
                padding_zero=bool((emb.weight[emb.stop - emb.start:] == 0).all()))


def _rank_cases(rank: int, world_size: int, cases: list) -> list[dict]:
    torch.set_num_threads(1)
    return [_run_case(rank, folder, world_size, prompt) for folder, prompt in cases]


def test_vocab_rows_formula():
    assert [vocab_rows(253, tp) for tp in (1, 2, 3, 4)] == [253, 127, 85, 64]
    assert [vocab_span(253, 4, r) for r in range(4)] == [(0, 64), (64, 128), (128, 192), (192, 253)]
    assert [vocab_span(9, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 9)]


def test_check_runnable_accepts_odd_vocab(models):
    from shardwise.runtime.loader import load_spec
    from shardwise.runtime.model import check_runnable

    check_runnable(load_spec(models["llama"]["folder"]), ParallelPlan(tp=3))


@pytest.mark.parametrize("tp", [3, 4])  # tp 2 pads one row: the same path as 3 and 4, not a case of its own
def test_padded_vocab_matches_transformers(models, tp):
    keys = [k for k in models if k != "llama_v9" or tp == 4]
    cases = [(models[k]["folder"], models[k]["prompt"]) for k in keys]
    results = launch_local(_rank_cases, tp, args=(cases,), timeout_s=120, run_timeout_s=300)
    for i, key in enumerate(keys):
        ref = models[key]
        vocab = ref["vocab"]
        for rank in range(tp):
            r = results[rank][i]
            where = f"{key} tp{tp} rank {rank}"
            assert r["rows"] == vocab_rows(vocab, tp), where
            assert r["span"] == vocab_span(vocab, tp, rank), where
            assert r["padding_zero"], f"{where}: padding rows are not zero"
            assert r["logits"].shape == (len(ref["prompt"]), vocab), where
            diff = float(abs(r["logits"] - ref["logits"].numpy()).max())
            assert diff <= 1e-4, f"{where}: max |Δlogit| = {diff:.3g}"
            assert r["tokens"] == ref["greedy"], f"{where}: greedy tokens differ from transformers"
            assert r["neg_logits"].shape == (vocab,), where
            assert float(abs(r["neg_logits"] - ref["negative"].numpy()).max()) <= 1e-6, where
            assert r["neg_greedy"] == int(ref["negative"].argmax()), f"{where}: a padding row won the argmax"
