"""The sharded runtime against transformers: logits, greedy generations and bytes per rank.

Small models (llama; its dense variants qwen2 with q/k/v biases, qwen3 with q/k norms, mistral with a
sliding window; qwen3_moe, deepseek_v3, gpt_oss) are built with transformers in
float32 with every weight randomised (biases, sinks and the correction bias included), saved
with ``save_pretrained`` and run by shardwise at tp = 1 (in process) and tp = 2, 4 (real
processes over gloo, all models in one launch per world size).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from runtime_checks import randomise  # noqa: E402
from shardwise.plan import ParallelPlan, rank_param_counts  # noqa: E402
from shardwise.runtime.launch import launch_local  # noqa: E402

PROMPT = [3, 17, 101, 42, 7, 250, 11, 64]
NEW_TOKENS = 32


def _configs():
    common = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return {
        "llama": transformers.LlamaConfig(
            **common, num_key_value_heads=2, head_dim=16, intermediate_size=128, num_hidden_layers=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        ),
        "qwen2": transformers.Qwen2Config(
            **common, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=2),
        "qwen3": transformers.Qwen3Config(
            **common, num_key_value_heads=2, head_dim=16, intermediate_size=96, num_hidden_layers=2),
        "mistral": transformers.MistralConfig(
            **common, num_key_value_heads=2, head_dim=16, intermediate_size=96, num_hidden_layers=2, sliding_window=5),
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **common, num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        ),
        "deepseek_v3": transformers.DeepseekV3Config(
            **common, num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
            n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, routed_scaling_factor=2.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 32},
        ),
        "gpt_oss": transformers.GptOssConfig(
            **common, num_key_value_heads=2, head_dim=16, intermediate_size=32, num_hidden_layers=2,
            num_local_experts=8, num_experts_per_tok=2, sliding_window=4, swiglu_limit=0.5,
        ),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    ids = torch.tensor([PROMPT])
    for i, (key, config) in enumerate(_configs().items()):
        torch.manual_seed(100 + i)
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        randomise(hf)
        folder = tmp_path_factory.mktemp(key)
        hf.save_pretrained(folder)
        with torch.no_grad():
            logits = hf(ids).logits[0]
            gen = hf.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        out[key] = dict(folder=str(folder), logits=logits, greedy=gen[0, len(PROMPT):].tolist())
    return out


def _run_case(rank: int, folder: str, tp: int, ep: int) -> dict:
    from shardwise.runtime.generate import generate
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM

    spec = load_spec(folder)
    plan = ParallelPlan(tp=tp, ep=ep)
    model = ShardedCausalLM(spec, plan, rank, torch.float32, max_seq_len=len(PROMPT) + NEW_TOKENS)
    load_shard(model, folder)
    with torch.no_grad():
        logits = model.logits(torch.tensor([PROMPT]))[0]
    tokens = generate(model, PROMPT, NEW_TOKENS, eos=set()).tokens
    by_dtype = sum(
        4 * n for n in rank_param_counts(spec, plan, rank).values()
    )
    return dict(logits=logits.numpy(), tokens=tokens, param_bytes=model.param_bytes(), planned_bytes=by_dtype)


def _rank_cases(rank: int, world_size: int, cases: list) -> list[dict]:
    torch.set_num_threads(1)
    return [_run_case(rank, folder, tp, ep) for folder, tp, ep in cases]


def _check(models, key, result, label):
    ref = models[key]
    diff = float(abs(result["logits"] - ref["logits"].numpy()).max())
    assert diff <= 1e-4, f"{key} {label}: max |Δlogit| = {diff:.3g}"
    assert result["tokens"] == ref["greedy"], f"{key} {label}: greedy tokens differ from transformers"
    assert result["param_bytes"] == result["planned_bytes"], f"{key} {label}: bytes differ from the plan"


def test_tp1_matches_transformers(models):
    for key in models:
        _check(models, key, _run_case(0, models[key]["folder"], 1, 1), "tp1")


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_transformers(models, tp):
    cases = []
    for key, m in models.items():
        moe = key not in ("llama", "qwen2", "qwen3", "mistral")
        cases.append((key, m["folder"], tp, tp if moe else 1))
        if key in ("qwen3_moe", "gpt_oss") and tp == 4:  # each expert split over 2 ranks (etp 2)
            cases.append((key, m["folder"], tp, 2))
    results = launch_local(_rank_cases, tp, args=([c[1:] for c in cases],), timeout_s=120, run_timeout_s=240)
    for i, (key, _, _, ep) in enumerate(cases):
        label = f"tp{tp} ep{ep}"
        for rank in range(tp):
            r = results[rank][i]
            _check(models, key, r, f"{label} rank {rank}")
        assert len({tuple(results[rank][i]["tokens"]) for rank in range(tp)}) == 1
