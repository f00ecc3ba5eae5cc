"""Checkpoints with controlled behaviour, derived from tiny random ones, for speculative decoding.

Random-weight models do not behave like trained ones: their drafts are accepted by
chance. These helpers rewrite a ``make_checkpoint`` folder so behaviour is known by
construction (``derive_checkpoint`` + an edit of the tensors):

- ``counting``: scales the input embedding by ``embed_scale`` so it dominates the
  residual stream, and sets LM-head row (t+1) mod V to ``gain`` × embedding row t. The
  final hidden state of a token t then points along embedding row t, so the greedy next
  token is t+1: the model *counts*, whatever the (still random, still computed) layers
  add. A prompt holding the run ``a, a+1, …, b`` and ending in ``a`` is answered by
  copying that run — the copy-heavy case where prompt lookup drafts are accepted; a
  prompt of random ids is not (the open-ended case).
- ``perturb_lm_head``: adds Gaussian noise of ``noise`` × the LM head's RMS to every LM-head
  weight. A draft that is the target (or its first layers) with a perturbed head agrees
  with the target's argmax less often as ``noise`` grows: acceptance under control.
- ``layers``: keep the first n decoder layers (a cheap draft), or repeat the checkpoint's
  layers to deepen a homogeneous (llama / qwen3_moe) model.
- ``vocab``: keep the first V token ids (a tiny-vocabulary model for distribution tests;
  the tokenizer is dropped and BOS/EOS/PAD ids cleared).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shardwise.errors import ShardwiseError

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def derive_checkpoint(
    src: str | Path,
    out: str | Path,
    *,
    layers: int | None = None,
    vocab: int | None = None,
    edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """Write a copy of checkpoint ``src`` (one model.safetensors) to ``out`` with the
    changes asked for; ``edit`` changes the tensor dict in place last. Returns ``out``."""
    src, out = Path(src), Path(out)
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    if HEAD not in tensors:
        raise ShardwiseError(f"'{src}' ties its LM head to the embedding: derived checkpoints need lm_head.weight")
    if layers is not None:
        tensors = _relayer(tensors, config, layers)
    if vocab is not None:
        if not 2 <= vocab <= config["vocab_size"]:
            raise ShardwiseError(f"vocab {vocab} must be in 2..{config['vocab_size']}")
        for name in (EMBED, HEAD):
            tensors[name] = tensors[name][:vocab].clone()
        config.update(vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if edit is not None:
        edit(tensors)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if vocab is None and (src / "tokenizer.json").exists():
        (out / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    return out


def _relayer(tensors: dict[str, torch.Tensor], config: dict, n: int) -> dict[str, torch.Tensor]:
    have = config["num_hidden_layers"]
    if n < 1:
        raise ShardwiseError(f"layers must be >= 1, got {n}")
    if n > have and config.get("model_type") not in ("llama", "qwen3_moe"):
        raise ShardwiseError(f"deepening is for llama and qwen3_moe, not '{config.get('model_type')}'")
    out = {k: v for k, v in tensors.items() if not _LAYER.match(k)}
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        m = _LAYER.match(k)
        if m:
            by_layer.setdefault(int(m.group(1)), {})[m.group(2)] = v
    for i in range(n):
        for rest, v in by_layer[i % have].items():
            out[f"model.layers.{i}.{rest}"] = v.clone()
    config["num_hidden_layers"] = n
    if "layer_types" in config:
        config["layer_types"] = [config["layer_types"][i % have] for i in range(n)]
    return out


def counting(gain: float = 4.0, embed_scale: float = 10.0) -> Callable[[dict[str, torch.Tensor]], None]:
    """Edit: the greedy next token after t is t+1 (mod vocab); see the module docstring."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        embed = tensors[EMBED] * embed_scale
        tensors[EMBED] = embed
        unit = embed / embed.norm(dim=-1, keepdim=True)
        tensors[HEAD] = gain * torch.roll(unit, shifts=1, dims=0).to(tensors[HEAD].dtype)

    return edit


def perturb_lm_head(noise: float, seed: int = 0) -> Callable[[dict[str, torch.Tensor]], None]:
    """Edit: LM head += N(0, 1) · ``noise`` · RMS(LM head), drawn with ``seed``."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        head = tensors[HEAD]
        gen = torch.Generator().manual_seed(seed)
        rms = head.float().pow(2).mean().sqrt()
        tensors[HEAD] = head + (torch.randn(head.shape, generator=gen) * noise * rms).to(head.dtype)

    return edit


def scale_lm_head(factor: float) -> Callable[[dict[str, torch.Tensor]], None]:
    """Edit: LM head × ``factor`` (sharper or flatter next-token distributions)."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[HEAD] = tensors[HEAD] * factor

    return edit
