"""Tiny random checkpoints of catalog models, in exactly the Hugging Face layout.

``make_checkpoint("deepseek-v3", "tiny", out_dir)`` takes the real catalog config, shrinks
its widths, layers and experts while keeping every kind of layer (DeepSeek keeps a dense
first layer and a MoE layer; gpt-oss a sliding and a full layer with an 8-token window),
and writes ``config.json``, ``model.safetensors`` (random weights, std 0.02 like HF init,
norms 1) under the names and layouts ``save_pretrained`` uses, and a byte-level BPE
``tokenizer.json`` trained on a short built-in text so text prompts work.

``quant="mxfp4"`` writes the experts in MXFP4 instead, through ``runtime.quantize_checkpoint``: the
gpt-oss layout (``*_blocks`` / ``*_scales``) for gpt_oss, compressed-tensors
``mxfp4-pack-quantized`` for the others. ``overrides`` replaces config fields after
shrinking (e.g. a wider expert ``intermediate_size`` so experts split into whole
32-element MXFP4 blocks under expert tensor parallelism).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from shardwise.errors import ShardwiseError, unknown_name
from shardwise.spec.model import NORM
from shardwise.spec.parse import catalog_models, parse_config

SCALES = ("tiny",)
DEFAULT_MODEL = "qwen3-30b-a3b"

_TEXT = """\
Shardwise plans, runs and profiles language model inference split across boxes.
A model is cut by tensor parallelism: every rank holds a slice of each layer, and the
partial results are summed with one all-reduce after attention and one after the MLP.
Mixture-of-experts layers route each token to a few experts; with expert parallelism
every rank owns a group of experts and runs only the ones the router picked.
The key-value cache grows with the context; latent attention keeps it small.
Hello world. The quick brown fox jumps over the lazy dog. Once upon a time there was a
tiny model that ran on two processes and printed a few tokens per second.
"""

_SPECIAL = ("<|bos|>", "<|eos|>", "<|pad|>")

_TINY = dict(hidden_size=64, num_attention_heads=4, head_dim=16, intermediate_size=128, vocab_size=512)


def shrink_config(config: dict[str, Any]) -> dict[str, Any]:
    """The catalog config with tiny sizes, every layer kind kept, no quantization."""
    cfg = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")}
    kind = cfg.get("model_type")
    cfg.update(_TINY)
    cfg["num_key_value_heads"] = 2
    cfg["num_hidden_layers"] = 2
    cfg["torch_dtype"] = "float32"
    if kind == "qwen3_moe":
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[],
                   decoder_sparse_step=1, max_window_layers=2)
    elif kind in ("deepseek_v3", "kimi_k2"):
        cfg.update(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                   moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
                   kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=0)
        cfg.pop("head_dim")
    elif kind == "gpt_oss":
        cfg.update(num_local_experts=8, num_experts_per_tok=2, experts_per_token=2, intermediate_size=32,
                   sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    elif kind != "llama":
        raise ShardwiseError(
            f"make-checkpoint supports llama, qwen3_moe, deepseek_v3 / kimi_k2 and gpt_oss models, not '{kind}'"
        )
    return cfg


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(_SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_TEXT.splitlines(), trainer=trainer)
    return tok


QUANTS = ("mxfp4",)


def make_checkpoint(
    model_key: str,
    scale: str = "tiny",
    out_dir: str | Path | None = None,
    seed: int = 0,
    quant: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny random checkpoint of catalog model ``model_key`` to ``out_dir``; returns it.

    ``quant`` "mxfp4" quantizes the routed experts (OCP scales); ``overrides`` sets config fields.
    """
    from shardwise.runtime.loader import sources

    if quant is not None and quant not in QUANTS:
        raise unknown_name("checkpoint quantization", quant, QUANTS)

    if scale not in SCALES:
        raise unknown_name("scale", scale, SCALES)
    known = catalog_models()
    if model_key not in known:
        raise unknown_name("model", model_key, known)
    if out_dir is None:
        raise ShardwiseError("make-checkpoint needs an output folder: pass --out DIR")
    text = resources.files("shardwise.spec.catalog.models").joinpath(f"{model_key}.json").read_text()
    config = {**shrink_config(json.loads(text)), **(overrides or {})}
    tok = _tokenizer(config["vocab_size"])
    config["bos_token_id"] = tok.token_to_id("<|bos|>")
    config["eos_token_id"] = tok.token_to_id("<|eos|>")
    config["pad_token_id"] = tok.token_to_id("<|pad|>")
    spec = parse_config(config, name=f"{scale}-{model_key}")
    gen = torch.Generator().manual_seed(seed)
    std = float(config.get("initializer_range", 0.02))
    tensors: dict[str, torch.Tensor] = {}
    for t in spec.tensors():
        names = [t.name.format(e=e) for e in range(t.experts)] if "{e}" in t.name else [t.name]
        shape = sources(spec, t, None).shape
        for name in names:
            if t.group == NORM:
                tensors[name] = torch.ones(shape)
            else:
                tensors[name] = torch.randn(shape, generator=gen) * std
    out = Path(out_dir)
    target = out
    if quant is not None:  # write the float model beside, then quantize it into out_dir
        out = Path(tempfile.mkdtemp(prefix=".float-", dir=out.parent if out.parent.exists() else None))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    if quant is not None:
        from shardwise.runtime.quantize_checkpoint import quantize_checkpoint

        try:
            quantize_checkpoint(out, target, quant, experts_only=True, compare=False)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    return target


def cache_dir() -> Path:
    """Where shardwise caches generated checkpoints (``$XDG_CACHE_HOME/shardwise``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardwise"


def default_checkpoint() -> Path:
    """The bundled default: a tiny qwen3_moe checkpoint, created once under ``cache_dir()``."""
    target = cache_dir() / "tiny-qwen3-moe"
    if (target / "model.safetensors").exists() and (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-qwen3-moe-", dir=target.parent))
    make_checkpoint(DEFAULT_MODEL, "tiny", staging, seed=0)
    try:
        staging.rename(target)  # atomic: a concurrent run sees all files or none
    except OSError:  # another process created it first
        shutil.rmtree(staging, ignore_errors=True)
    return target
