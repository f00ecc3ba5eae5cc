"""Kimi K3 — the seed's model — on the sharded runtime: Kimi Linear plus SiTU-GLU, attention
residuals, the latent MoE, the MLA output gate and the full-rank / lower-bounded KDA gates.

No library here defines K3 (Moonshot ships it as trust_remote_code, which cannot be fetched), so
the reference is ``tests/kimi_reference.py``: the whole-sequence forward written plainly from the
public definition, sharing no code with the runtime, and itself held to transformers'
``KimiLinearForCausalLM`` on a plain Kimi Linear checkpoint. Checked, on ``make-checkpoint kimi-k3
--scale tiny`` (the real K3 config shrunk, every K3 key kept, three layers and attention-residual
blocks of two so several blocks form):

- logits within 1e-4 and identical greedy tokens at tp 1, 2 (experts over both ranks, and whole on
  each with ep 1) and 4 (ep 2); the weight and cache bytes per rank equal the planner's;
- speculative greedy decoding (prompt lookup and a draft model, k = 1..6) gives the plain tokens,
  the rejected positions' KDA states poisoned, and a verify pass gives bit-identical logits;
- MXFP4 experts written by ``make-checkpoint --quant mxfp4``: the runtime matches the reference on
  the dequantized weights.
"""

from __future__ import annotations

import pytest
import torch

from kimi_reference import KimiReference
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.launch import launch_local
from shardwise.runtime.quantize_checkpoint import dequantize_checkpoint
from test_runtime_kimi_linear import NEW, PROMPT, _check, _check_spec, _run_case, _spec_cases


def _reference(folder) -> tuple[torch.Tensor, list[int]]:
    """The reference's logits on PROMPT and its NEW greedy tokens."""
    ref = KimiReference(folder)
    logits = ref.logits(PROMPT)
    ids = list(PROMPT)
    for _ in range(NEW):
        ids.append(int(ref.logits(ids)[-1].argmax()))
    return logits, ids[len(PROMPT):]


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    root = tmp_path_factory.mktemp("k3")
    target = make_checkpoint("kimi-k3", "tiny", root / "target", seed=5)
    draft = make_checkpoint("kimi-k3", "tiny", root / "draft", seed=6)
    logits, greedy = _reference(target)
    return {"target": str(target), "draft": str(draft), "logits": logits, "greedy": greedy}


def test_reference_is_transformers_on_kimi_linear(tmp_path):
    """The reference without K3's keys is transformers' Kimi Linear (so its shared parts are right)."""
    transformers = pytest.importorskip("transformers")
    folder = make_checkpoint("kimi-linear-48b-a3b", "tiny", tmp_path / "kl", seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    assert (KimiReference(folder).logits(PROMPT) - want).abs().max() <= 1e-4


def test_every_k3_key_is_in_the_tiny_checkpoint(k3):
    import json
    from pathlib import Path

    cfg = json.loads((Path(k3["target"]) / "config.json").read_text())
    assert cfg["hidden_act"] == "situ" and cfg["activation_situ_linear_beta"] == 25.0
    assert cfg["attn_res_block_size"] == 2 and cfg["latent_moe_use_norm"] and cfg["mla_use_output_gate"]
    assert cfg["routed_expert_hidden_size"] == cfg["hidden_size"] // 2
    assert cfg["linear_attn_config"]["use_full_rank_gate"] and cfg["linear_attn_config"]["gate_lower_bound"] == -5.0


def test_tp1_matches_reference(k3):
    _check(k3["logits"], k3["greedy"], _run_case(0, k3["target"], 1, 1), "k3 tp1")


def _rank_cases(rank: int, world_size: int, cases: list) -> list[dict]:
    torch.set_num_threads(1)
    return [_run_case(rank, folder, world_size, ep) for folder, ep in cases]


@pytest.mark.parametrize("tp, eps", [(2, (2, 1)), (4, (2,))])
def test_tp_matches_reference(k3, tp, eps):
    results = launch_local(_rank_cases, tp, args=([(k3["target"], ep) for ep in eps],), timeout_s=120,
                           run_timeout_s=240)
    for i, ep in enumerate(eps):
        for rank in range(tp):
            _check(k3["logits"], k3["greedy"], results[rank][i], f"k3 tp{tp} ep{ep} rank {rank}")


def test_speculative_greedy_exact(k3):
    _check_spec(_spec_cases(0, 1, k3["target"], k3["draft"], poison=True), "k3 tp1")


def test_mxfp4_experts_match_the_dequantized_reference(tmp_path):
    packed = make_checkpoint("kimi-k3", "tiny", tmp_path / "mxfp4", seed=5, quant="mxfp4")
    dequantize_checkpoint(packed, tmp_path / "ref")
    logits, greedy = _reference(tmp_path / "ref")
    _check(logits, greedy, _run_case(0, str(packed), 1, 1), "k3 mxfp4", bytes_too=False)
