"""Helpers the runtime tests share: random reference weights, a drafter that poisons what a
rejected speculative draft left behind, and a quantized checkpoint as the compressed-tensors library
decompresses it. Tests import them by name (``from runtime_checks import ...``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shardwise.runtime.drafters import Drafter


def randomise(model: torch.nn.Module, special: Callable[[str, torch.Tensor], bool] | None = None) -> None:
    """Every parameter and buffer of a transformers model random, so biases and sinks matter: norms
    near 1, other 1-D tensors N(0, 0.1²), the rest N(0, 0.08²); rotary ``inv_freq`` kept.
    ``special(name, tensor)`` may fill a tensor itself first (returning True)."""
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name or (special is not None and special(name, t)):
                continue
            if "norm" in name:
                t.copy_(1 + 0.1 * torch.randn_like(t))
            elif t.dim() == 1:
                t.copy_(0.1 * torch.randn_like(t))
            else:
                t.copy_(0.08 * torch.randn_like(t))


def library_and_reference(folder: Path, reference: Path) -> tuple[torch.nn.Module, dict, dict]:
    """(model, its parameters, the reference's parameters): quantized checkpoint ``folder`` loaded by
    transformers with the compressed-tensors library decompressing it, float32, and the float
    ``reference`` checkpoint loaded plainly. Asserts the library left no tensor missing or unexpected
    (a module we packed that its ignore/target matching kept float, or the reverse) and that both hold
    the same parameter names."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
        output_loading_info=True,
    )
    assert not any(info.values()), f"{folder}: {info}"
    theirs = dict(hf.eval().named_parameters())
    ours = dict(transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).named_parameters())
    assert set(ours) == set(theirs)
    return hf, theirs, ours


class PoisonRejected(Drafter):
    """After each rollback, fills with NaN what the rejected positions left in the target: every
    linear-attention state snapshot past the accepted length (the next pass starts from the one *at*
    it), the conv inputs of the positions from it on (``linear_state.LinearStateCache``'s ring) and
    the attention caches (KV or MLA latent) from it on. Reading any of them would poison the output."""

    def __init__(self, inner: Drafter, model):
        self.inner, self.model = inner, model

    def propose(self, context, k):
        return self.inner.propose(context, k)

    def rollback(self, length):
        self.inner.rollback(length)
        for layer in self.model.model.layers:
            mixer = layer.self_attn
            if getattr(mixer, "recurrent", False):
                cache = mixer.state
                for p in range(length + 1, cache.held[0][1] + 1):  # speculative runs in cache slot 0
                    cache.state_cache[:, p % cache.snapshots] = float("nan")
                    cache.conv_cache[:, :, (p - 1) % cache.conv_cache.shape[-1]] = float("nan")
            elif hasattr(mixer, "latent_cache"):
                mixer.latent_cache[:, length:] = float("nan")
            else:
                mixer.k_cache[:, :, length:] = float("nan")
                mixer.v_cache[:, :, length:] = float("nan")


def compiled_step_matches_torch_ops(folder: str, prompt: list[int], monkeypatch) -> dict[str, float]:
    """Per run dtype, max |Δlogit| between decoding ``prompt[8:]`` one position at a time (after an
    8-position prefill) through the compiled linear-attention step (``linear_state.fused_step``) and
    through the torch ops it replaces; asserts the op was built here (else there is nothing to hold)."""
    from shardwise.plan import ParallelPlan
    from shardwise.runtime import linear_state
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM

    assert linear_state.fused_step(torch.device("cpu")) is not None, "the compiled linear-attention step did not build here"
    diffs = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits = []
        for fused in (True, False):
            monkeypatch.setattr(linear_state, "FUSED", fused)
            model = ShardedCausalLM(load_spec(folder), ParallelPlan(), 0, dtype, max_seq_len=len(prompt))
            load_shard(model, folder)
            with torch.no_grad():
                model.logits(torch.tensor([prompt[:8]]))
                logits.append(torch.cat([model.logits(torch.tensor([[t]]), 8 + i)[0] for i, t in enumerate(prompt[8:])]))
        diffs[str(dtype)] = float((logits[0].float() - logits[1].float()).abs().max())
    return diffs
