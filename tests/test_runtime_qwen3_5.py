"""Qwen3.5-MoE (``qwen3_5_moe``) on the sharded runtime against transformers.

A small model — Gated DeltaNet and gated full-attention layers (partial rotary), softmax top-k
MoE with a gated shared expert — is built with transformers' ``Qwen3_5MoeForConditionalGeneration``
(the real checkpoint's layout: text model under ``model.language_model.``) in float32 with every
weight randomised, saved with ``save_pretrained`` and run by shardwise at tp 1 (in process) and
tp 2, 4 (real processes over gloo), experts over all ranks and over half of them (ep < tp). Its 2
key heads / 4 value heads make tp 4 replicate key heads. The prompt is longer than one 64-position
chunk, so prefill runs the chunked form over two chunks (the second padded).

Also: the chunked form equals the recurrent form; make-checkpoint's tiny and small checkpoints
load in transformers with the runtime's logits; a text-only checkpoint (``Qwen3_5MoeForCausalLM``,
names under ``model.``) once the ModelSpec names it so; the linear-attention state the runtime
allocates equals the planner's state bytes per layer.
"""

from __future__ import annotations

import pytest
import torch
from runtime_checks import compiled_step_matches_torch_ops

transformers = pytest.importorskip("transformers")

from shardwise.plan import ParallelPlan, rank_param_counts  # noqa: E402
from shardwise.runtime.checkpoint import make_checkpoint  # noqa: E402
from shardwise.runtime.deltanet import chunk_gated_delta_rule, l2norm, recurrent_step  # noqa: E402
from shardwise.runtime.launch import launch_local  # noqa: E402
from shardwise.runtime.loader import load_shard, load_spec  # noqa: E402
from shardwise.runtime.model import ShardedCausalLM  # noqa: E402

PROMPT = [int(t) for t in torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(7))]
NEW_TOKENS = 16
TEXT = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, max_position_embeddings=256,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
              spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16)


def _randomise(model: torch.nn.Module) -> None:
    """Every text-model weight random: zero-centred norms near 0 (the gated norm near 1), A_log =
    log U(1, 16), dt_bias near 1, the rest N(0, 0.08²) (routers and the shared-expert gate too)."""
    with torch.no_grad():
        for name, t in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("norm.weight"):
                t.copy_(0.1 * torch.randn_like(t) + (1.0 if "linear_attn.norm" in name else 0.0))
            elif name.endswith("A_log"):
                t.copy_(torch.empty_like(t).uniform_(1, 16).log())
            elif name.endswith("dt_bias"):
                t.copy_(1 + 0.1 * torch.randn_like(t))
            else:
                t.copy_(0.08 * torch.randn_like(t))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.Qwen3_5MoeConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    _randomise(hf)
    folder = tmp_path_factory.mktemp("qwen3_5")
    hf.save_pretrained(folder)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = hf(ids).logits[0]
        gen = hf.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return dict(folder=str(folder), logits=logits.numpy(), greedy=gen[0, len(PROMPT):].tolist())


def _run_case(rank: int, folder: str, tp: int, ep: int) -> dict:
    from shardwise.runtime.generate import generate

    spec = load_spec(folder)
    plan = ParallelPlan(tp=tp, ep=ep)
    model = ShardedCausalLM(spec, plan, rank, torch.float32, max_seq_len=len(PROMPT) + NEW_TOKENS)
    load_shard(model, folder)
    with torch.no_grad():
        logits = model.logits(torch.tensor([PROMPT]))[0]
    tokens = generate(model, PROMPT, NEW_TOKENS, eos=set()).tokens
    planned = 4 * sum(rank_param_counts(spec, plan, rank).values())
    return dict(logits=logits.numpy(), tokens=tokens, param_bytes=model.param_bytes(), planned_bytes=planned)


def _rank_cases(rank: int, world_size: int, cases: list) -> list[dict]:
    torch.set_num_threads(1)
    return [_run_case(rank, folder, tp, ep) for folder, tp, ep in cases]


def _check(reference, result, label, key_heads_split=True):
    diff = float(abs(result["logits"] - reference["logits"]).max())
    assert diff <= 1e-4, f"{label}: max |Δlogit| = {diff:.3g}"
    assert result["tokens"] == reference["greedy"], f"{label}: greedy tokens differ from transformers"
    if key_heads_split:  # 2 key heads at tp 4 replicate: the planner's plain row split of in_proj_qkv counts less
        assert result["param_bytes"] == result["planned_bytes"], f"{label}: bytes differ from the plan"


def test_tp1_matches_transformers(reference):
    _check(reference, _run_case(0, reference["folder"], 1, 1), "tp1")


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_transformers(reference, tp):
    cases = [(reference["folder"], tp, tp), (reference["folder"], tp, tp // 2)]  # EP over all ranks, then half
    results = launch_local(_rank_cases, tp, args=(cases,), timeout_s=120, run_timeout_s=240)
    for i, (_, _, ep) in enumerate(cases):
        for rank in range(tp):
            _check(reference, results[rank][i], f"tp{tp} ep{ep} rank {rank}", key_heads_split=tp <= 2)


def test_chunked_form_equals_recurrent_form():
    """150 positions (chunks of 64, the last padded) from a non-zero state, grouped value heads."""
    gen = torch.Generator().manual_seed(1)
    b, hk, hv, t, dk, dv = 2, 2, 4, 150, 16, 8
    q = l2norm(torch.randn(b, hk, t, dk, generator=gen)).repeat_interleave(hv // hk, dim=1) * dk**-0.5
    k = l2norm(torch.randn(b, hk, t, dk, generator=gen)).repeat_interleave(hv // hk, dim=1)
    v = torch.randn(b, hv, t, dv, generator=gen)
    g = -torch.rand(b, hv, t, generator=gen)
    beta = torch.rand(b, hv, t, generator=gen)
    state0 = torch.randn(b, hv, dk, dv, generator=gen)
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, state0.clone())
    s, outs = state0.clone(), []
    for i in range(t):
        o, s = recurrent_step(s, q[:, :, i], k[:, :, i], v[:, :, i], g[:, :, i], beta[:, :, i])
        outs.append(o)
    assert torch.allclose(out, torch.stack(outs, dim=2), atol=1e-5, rtol=0)
    assert torch.allclose(state, s, atol=1e-5, rtol=0)


def test_prefill_equals_token_by_token(reference):
    """The model's chunked prefill gives the logits of feeding the prompt one position at a time
    (the recurrent form of every DeltaNet layer)."""
    model = ShardedCausalLM(load_spec(reference["folder"]), ParallelPlan(), 0, torch.float32, max_seq_len=80)
    load_shard(model, reference["folder"])
    with torch.no_grad():
        chunked = model.logits(torch.tensor([PROMPT]))[0]
        steps = torch.cat([model.logits(torch.tensor([[tok]]), i)[0] for i, tok in enumerate(PROMPT)])
    assert float((chunked - steps).abs().max()) <= 1e-5


def test_compiled_step_equals_torch_ops(reference, monkeypatch):
    """Decode through the compiled Gated DeltaNet step equals the torch ops it replaces (float32 to
    rounding; bfloat16, whose roundings the op repeats, within a few bfloat16 steps of the logits)."""
    diffs = compiled_step_matches_torch_ops(reference["folder"], PROMPT[:40], monkeypatch)
    assert diffs["torch.float32"] <= 1e-5 and diffs["torch.bfloat16"] <= 0.05, diffs


def test_text_only_checkpoint(tmp_path):
    """A bare text checkpoint (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text) names its
    tensors model.* where the multimodal wrapper nests them under model.language_model."""
    torch.manual_seed(1)
    hf = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**TEXT)).eval()
    _randomise(hf)
    hf.save_pretrained(tmp_path)
    ids = torch.tensor([PROMPT[:20]])
    model = ShardedCausalLM(load_spec(tmp_path), ParallelPlan(), 0, torch.float32, max_seq_len=32)
    load_shard(model, tmp_path)
    with torch.no_grad():
        assert float((model.logits(ids)[0] - hf(ids).logits[0]).abs().max()) <= 1e-4


@pytest.mark.parametrize("scale", ["tiny", "small"])
def test_make_checkpoint_loads_in_transformers(tmp_path, scale):
    folder = make_checkpoint("qwen3.5-397b-a17b", scale, tmp_path / scale, seed=3)
    spec = load_spec(folder)
    assert spec.family == "qwen3_5_moe"
    assert {layer.attention for layer in spec.layers} == {"gated_deltanet", "gated_attention"}
    model = ShardedCausalLM(spec, ParallelPlan(), 0, torch.float32, max_seq_len=32)
    load_shard(model, folder)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT[:12]])
    with torch.no_grad():
        assert float((model.logits(ids)[0] - hf(ids).logits[0]).abs().max()) <= 1e-4


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_state_bytes_per_layer_equal_the_planner(tmp_path, tp):
    """Each DeltaNet layer's buffers (fp32 state + conv window, float32 run) are the mixer table's
    state bytes on one of tp ranks."""
    spec = load_spec(make_checkpoint("qwen3.5-397b-a17b", "tiny", tmp_path / "t", seed=0))
    for rank in range(tp):
        model = ShardedCausalLM(spec, ParallelPlan(tp=tp, ep=tp), rank, torch.float32, max_seq_len=8)
        for layer, block in zip(spec.layers, model.model.layers):
            if layer.attention != "gated_deltanet":
                continue
            held = sum(b.numel() * b.element_size() for b in block.self_attn.state.buffers())
            assert held == layer.mixer.state_bytes(spec, tp), f"layer {layer.index} rank {rank}"
