"""Tiny random checkpoints of catalog models, in exactly the Hugging Face layout.

``make_checkpoint("deepseek-v3", "tiny", out_dir)`` takes the real catalog config, shrinks
its widths, layers and experts while keeping every kind of layer (DeepSeek keeps a dense
first layer and a MoE layer; gpt-oss a sliding and a full layer with an 8-token window;
Kimi Linear a dense KDA layer, a MoE NoPE-MLA layer and a MoE KDA layer),
and writes ``config.json``, ``model.safetensors`` (random weights, std 0.02 like HF init,
norms 1) under the names and layouts ``save_pretrained`` uses, and a byte-level BPE
``tokenizer.json`` trained on a short built-in text so text prompts work, with a
``tokenizer_config.json`` that carries a ChatML ``chat_template`` (``<|im_start|>`` /
``<|im_end|>``, the tokenizer's last two ids) so ``AutoTokenizer.from_pretrained(folder)
.apply_chat_template(messages)`` turns chat messages into a prompt.

Qwen3.5-MoE (``qwen3.5-397b-a17b``) keeps its multimodal wrapper — the text model's tensors under
``model.language_model.`` as in the real checkpoint, a one-block vision config and no vision
weights — and has two scales: ``tiny`` (4 layers: three Gated DeltaNet, one gated attention) and
``small`` (8 layers, hidden 256, 16 experts); its norms, ``A_log`` and ``dt_bias`` start as
transformers initialises them (``_qwen3_5_init``). ``overrides`` go into ``text_config``.

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

SCALES = ("tiny", "small")
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
_CHAT_SPECIAL = ("<|im_start|>", "<|im_end|>")
"""ChatML turn markers, added after training (the last ids) so the trained ids stay where they were."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML: each message ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n``, then ``<|im_start|>assistant\\n``
to prompt a reply (content as a string or a list of OpenAI ``{"type": "text"}`` parts)."""

_TINY = dict(hidden_size=64, num_attention_heads=4, head_dim=16, intermediate_size=128, vocab_size=512)


_QWEN3_5 = {  # text_config sizes per scale; layers: three Gated DeltaNet layers, then one full attention
    "tiny": dict(hidden_size=64, num_attention_heads=4, head_dim=16, num_key_value_heads=2, linear_num_key_heads=4,
                 linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, vocab_size=512,
                 num_hidden_layers=4, mrope_section=[1, 1, 0]),
    "small": dict(hidden_size=256, num_attention_heads=8, head_dim=32, num_key_value_heads=2, linear_num_key_heads=4,
                  linear_num_value_heads=16, linear_key_head_dim=32, linear_value_head_dim=32, num_experts=16,
                  num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=128,
                  vocab_size=1024, num_hidden_layers=8, mrope_section=[2, 1, 1]),
}


def _shrink_qwen3_5(config: dict[str, Any], scale: str) -> dict[str, Any]:
    """Qwen3.5-MoE: the multimodal wrapper kept (its text model under ``model.language_model.``, as
    the real checkpoint), ``text_config`` shrunk to ``scale`` keeping the real layer pattern and
    partial rotary factor, a one-block vision config (the runtime reads no vision weights)."""
    sizes = dict(_QWEN3_5[scale])
    section = sizes.pop("mrope_section")
    text = {k: v for k, v in config["text_config"].items() if k not in ("quantization_config", "mtp_num_hidden_layers")}
    interval = int(text.get("full_attention_interval", 4))
    text.update(sizes, torch_dtype="float32", dtype="float32", mtp_num_hidden_layers=0,
                layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                             for i in range(sizes["num_hidden_layers"])],
                rope_parameters={**text.get("rope_parameters", {}), "mrope_section": section})
    vision = dict(config.get("vision_config") or {}, depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                  out_hidden_size=sizes["hidden_size"], num_position_embeddings=16)
    outer = {k: v for k, v in config.items() if k not in ("quantization_config", "text_config", "vision_config")}
    return {**outer, "text_config": text, "vision_config": vision, "torch_dtype": "float32"}


_KIMI_LINEAR = {  # sizes per scale; MLA at the 1-based layers listed (the real model: every 4th), KDA elsewhere
    "tiny": dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=512, num_hidden_layers=3,
                 kda_heads=4, kda_dim=16, full_attn_layers=[2], num_experts=8, num_experts_per_token=2,
                 moe_intermediate_size=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    "small": dict(hidden_size=256, num_attention_heads=8, intermediate_size=512, vocab_size=1024, num_hidden_layers=8,
                  kda_heads=8, kda_dim=32, full_attn_layers=[4, 8], num_experts=16, num_experts_per_token=4,
                  moe_intermediate_size=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
}


def _shrink_kimi_linear(config: dict[str, Any], scale: str) -> dict[str, Any]:
    """Kimi Linear (and Kimi K3's text model, keeping its extra keys): ``scale`` sizes, a dense
    first layer, KDA layers with MLA ones between, one shared expert, no quantization."""
    sizes = dict(_KIMI_LINEAR[scale])
    heads, dim, full = sizes.pop("kda_heads"), sizes.pop("kda_dim"), sizes.pop("full_attn_layers")
    n = sizes["num_hidden_layers"]
    cfg = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")}
    lac = {**cfg["linear_attn_config"], "head_dim": dim, "num_heads": heads, "full_attn_layers": full,
           "kda_layers": [i for i in range(1, n + 1) if i not in full]}
    cfg.update(sizes, num_key_value_heads=sizes["num_attention_heads"], head_dim=dim, linear_attn_config=lac,
               num_shared_experts=1, num_expert_group=1, topk_group=1, first_k_dense_replace=1,
               num_nextn_predict_layers=0, torch_dtype="float32", dtype="float32")
    if cfg.get("q_lora_rank") is not None:
        cfg["q_lora_rank"] = 2 * sizes["kv_lora_rank"]
    if cfg.get("routed_expert_hidden_size") is not None:  # Kimi K3's latent MoE: half the width, as the real one
        cfg["routed_expert_hidden_size"] = sizes["hidden_size"] // 2
    if cfg.get("attn_res_block_size") is not None:  # Kimi K3: several attention-residual blocks even when tiny
        cfg["attn_res_block_size"] = 2 if n < 8 else 4
    return cfg


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's part of a config: ``text_config`` of a multimodal wrapper, else the config."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def shrink_config(config: dict[str, Any], scale: str = "tiny") -> dict[str, Any]:
    """The catalog config with tiny sizes, every layer kind kept, no quantization (``scale``
    "small": a larger one, for qwen3_5_moe and kimi_linear)."""
    if config.get("model_type") == "qwen3_5_moe":
        return _shrink_qwen3_5(config, scale)
    if config.get("model_type") == "kimi_k3" and isinstance(config.get("text_config"), dict):
        config = config["text_config"]  # its text model (a kimi_linear config with K3's extra keys)
    if config.get("model_type") == "kimi_linear":
        return _shrink_kimi_linear(config, scale)
    if scale != "tiny":
        raise ShardwiseError(f"--scale {scale} is available for qwen3_5_moe and kimi_linear models only: use --scale tiny")
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
    elif kind not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ShardwiseError(
            "make-checkpoint supports llama (and mistral, qwen2, qwen3), qwen3_moe, deepseek_v3 / kimi_k2, gpt_oss, "
            f"kimi_linear and qwen3_5_moe models, "
            f"not '{kind}'"
        )
    return cfg


def _tokenizer(vocab_size: int):
    """Byte-level BPE trained on ``_TEXT`` (deterministic), ``_SPECIAL`` first and the ChatML
    markers last, ``vocab_size`` ids at most."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(_CHAT_SPECIAL), special_tokens=list(_SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_TEXT.splitlines(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _CHAT_SPECIAL])
    return tok


def tokenizer_config(max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` for ``_tokenizer``'s ``tokenizer.json``: special tokens and the
    ChatML chat template (``transformers.AutoTokenizer`` loads the pair as a fast tokenizer)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
        "additional_special_tokens": list(_CHAT_SPECIAL),
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(folder: Path, tok, max_length: int) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` into
    ``folder``, each atomically. The generation config lists the chat template's end of turn
    (``<|im_end|>``) beside the EOS token as ids that end a generation, as Qwen's checkpoints do."""
    stops = [tok.token_to_id("<|eos|>"), tok.token_to_id("<|im_end|>")]
    files = {"tokenizer.json": tok.to_str(pretty=True),
             "tokenizer_config.json": json.dumps(tokenizer_config(max_length), indent=2) + "\n",
             "generation_config.json": json.dumps({"eos_token_id": stops}, indent=2) + "\n"}
    for name, text in files.items():
        tmp = folder / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, folder / name)


QUANTS = ("mxfp4",)


def _qwen3_5_init(name: str):
    """transformers' init for Qwen3.5 tensors that are not plain weights (None for the rest):
    zero-centred RMSNorms 0 (the gated DeltaNet norm 1), ``A_log`` = log U(1, 16), ``dt_bias`` 1."""
    if name.endswith("linear_attn.norm.weight"):
        return lambda shape, gen: torch.ones(shape)
    if name.endswith("norm.weight"):
        return lambda shape, gen: torch.zeros(shape)
    if name.endswith(".A_log"):
        return lambda shape, gen: (1 + 15 * torch.rand(shape, generator=gen)).log()
    if name.endswith(".dt_bias"):
        return lambda shape, gen: torch.ones(shape)
    return None


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
    from shardwise.plan import ParallelPlan
    from shardwise.runtime.loader import sources
    from shardwise.runtime.model import check_runnable

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
    config = shrink_config(json.loads(text), scale)
    text_config(config).update(overrides or {})
    tok = _tokenizer(text_config(config)["vocab_size"])
    for part in {id(config): config, id(text_config(config)): text_config(config)}.values():
        part["bos_token_id"] = tok.token_to_id("<|bos|>")
        part["eos_token_id"] = tok.token_to_id("<|eos|>")
        part["pad_token_id"] = tok.token_to_id("<|pad|>")
    spec = parse_config(config, name=f"{scale}-{model_key}")
    check_runnable(spec, ParallelPlan())  # e.g. Kimi K3's keys: one line naming them, nothing written
    gen = torch.Generator().manual_seed(seed)
    std = float(config.get("initializer_range", 0.02))
    tensors: dict[str, torch.Tensor] = {}
    for t in spec.tensors():
        experts = range(t.experts) if "{e}" in t.name else [None]
        names = [sources(spec, t, None, e).name for e in experts]  # the checkpoint's names (save_pretrained's)
        shape = sources(spec, t, None).shape
        for name in names:
            if spec.family == "qwen3_5_moe" and _qwen3_5_init(name) is not None:
                tensors[name] = _qwen3_5_init(name)(shape, gen)
            elif t.group == NORM and len(shape) == 1:  # norm weights start at one (K3's [1, hidden] residual projections do not)
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
    write_tokenizer(out, tok, int(text_config(config).get("max_position_embeddings", 4096)))
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
    """The bundled default: a tiny qwen3_moe checkpoint, created once under ``cache_dir()``.

    A cached one from before the chat template or the generation config (no
    ``generation_config.json``) gets the current tokenizer files written in place: the trained ids are the same, the ChatML markers take the
    last two ids and the weights do not depend on the tokenizer.
    """
    target = cache_dir() / "tiny-qwen3-moe"
    if (target / "model.safetensors").exists() and (target / "config.json").exists():
        if not (target / "generation_config.json").exists():
            config = text_config(json.loads((target / "config.json").read_text()))
            write_tokenizer(target, _tokenizer(config["vocab_size"]), int(config.get("max_position_embeddings", 4096)))
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-qwen3-moe-", dir=target.parent))
    make_checkpoint(DEFAULT_MODEL, "tiny", staging, seed=0)
    try:
        staging.rename(target)  # atomic: a concurrent run sees all files or none
    except OSError:  # another process created it first
        shutil.rmtree(staging, ignore_errors=True)
    return target
