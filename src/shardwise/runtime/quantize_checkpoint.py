"""Write MXFP4 and weight-only int8/int4 checkpoints (and their dequantized float references) in
the Hugging Face layouts.

``quantize_checkpoint(src, out)`` reads a float checkpoint tensor by tensor, encodes the
chosen weights with the MXFP4 codec (``shardwise.quant.mxfp4_codec.encode``, OCP or round-up
scales) or the int codec (``shardwise.quant.int_codec``: int8 per output channel, int4 per
group of ``group_size`` inputs, bfloat16 scales) and writes ``model.safetensors`` plus
``config.json`` with a ``quantization_config`` the runtime, transformers and vLLM read:

- gpt_oss: the gpt-oss layout, ``{"quant_method": "mxfp4", "modules_to_not_convert":
  [...]}`` and ``*_blocks`` / ``*_scales`` for the fused expert projections, the layout
  OpenAI ships; only experts are quantized (what that config can express).
- other families: compressed-tensors ``mxfp4-pack-quantized`` (``weight_packed`` +
  ``weight_scale`` per Linear) with ``ignore`` rules for what stays float. By default
  every attention, dense-MLP, shared- and routed-expert Linear whose input width is a
  multiple of 32 is quantized; ``experts_only`` keeps all but the routed experts float.
  Routers, embeddings and norms always stay float, and the LM head unless ``lm_head`` (int formats).
- int8 / int4: compressed-tensors ``pack-quantized`` (``weight_packed`` int32 + ``weight_scale``
  + ``weight_shape`` per Linear, llm-compressor's W8A16 / W4A16 layout) with the same selection
  and ``ignore`` rules; a Linear whose input width is not a multiple of the group (32 for int8)
  stays float. ``lm_head`` quantizes the (untied) LM head in the same scheme too, as llama.cpp's Q8_0 /
  Q4_0 files do theirs (Q8_0 / Q6_K): at batch 1 the head is one of the largest weights a token reads
  (32000 x 2048 bfloat16: 131 MB, a third of an int4 2048 x 10 llama's bytes).

Which tensors end up packed is decided once, written into the config, and then read back
through ``runtime.packed_weights.Quantization`` — the same rules the loader uses — so the file
and the config cannot disagree.

The result records bytes before/after, bits per weight and the relative RMS error per
tensor group, and (for families the runtime runs) the logits of both checkpoints on a
fixed prompt at tp = 1 in this process.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from shardwise.errors import ShardwiseError
from shardwise.plan import ParallelPlan
from shardwise.quant import mxfp4_codec as codec
from shardwise.quant import int_codec
from shardwise.quant.layouts import CT_INT_FORMAT, CT_MXFP4_FORMAT, detect_layout
from shardwise.runtime.checkpoint_files import INDEX_FILE
from shardwise.runtime.loader import Checkpoint, check_checkpoint, load_spec, read_shard, sources
from shardwise.runtime.packed_weights import Quantization, quantization
from shardwise.runtime.stored_names import stored_name
from shardwise.spec.model import MATMUL_GROUPS, ROUTED_EXPERTS, ModelSpec, TensorSpec

FORMATS = ("mxfp4", "int8", "int4")
"""Formats ``quantize`` writes."""
INT_BITS = {"int8": 8, "int4": 4}
DEFAULT_INT4_GROUP = 32
"""int4 inputs per scale by default: 4.5 bits per weight with bfloat16 scales, as llama.cpp's Q4_0."""

GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
"""gpt-oss's own ``modules_to_not_convert`` (openai/gpt-oss-20b config.json)."""

PROMPT_LEN = 16


def fixed_prompt(vocab_size: int) -> list[int]:
    """The fixed prompt the logits comparison uses: 16 ids spread over the vocabulary."""
    return [(7919 * i + 3) % vocab_size for i in range(PROMPT_LEN)]


@dataclass
class GroupStats:
    """One tensor group's bytes and error; ``err_sq`` / ``ref_sq`` sum over its quantized tensors."""

    params: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    quantized_params: int = 0
    err_sq: float = 0.0
    ref_sq: float = 0.0

    @property
    def bits_before(self) -> float:
        """Stored bits per weight in the source checkpoint."""
        return 8 * self.bytes_before / self.params if self.params else 0.0

    @property
    def bits_after(self) -> float:
        """Stored bits per weight in the new checkpoint (scales included)."""
        return 8 * self.bytes_after / self.params if self.params else 0.0

    @property
    def rel_rms(self) -> float:
        """sqrt(Σ(w − ŵ)² / Σw²) over the group's quantized weights (0 when none is)."""
        return math.sqrt(self.err_sq / self.ref_sq) if self.ref_sq else 0.0


@dataclass
class QuantizeResult:
    """What ``quantize_checkpoint`` wrote and the error it introduced."""

    out: Path
    layout: str
    scale_rounding: str
    quantization_config: dict[str, Any]
    groups: dict[str, GroupStats] = field(default_factory=dict)
    quantized_tensors: int = 0
    prompt_ids: list[int] | None = None
    logits_max_abs: float | None = None
    logits_rel_rms: float | None = None
    top1_agreement: float | None = None

    @property
    def bytes_before(self) -> int:
        return sum(g.bytes_before for g in self.groups.values())

    @property
    def bytes_after(self) -> int:
        return sum(g.bytes_after for g in self.groups.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {
            "out": str(self.out),
            "layout": self.layout,
            "scale_rounding": self.scale_rounding,
            "quantized_tensors": self.quantized_tensors,
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "groups": {
                name: {
                    "params": g.params, "quantized_params": g.quantized_params, "bytes_before": g.bytes_before,
                    "bytes_after": g.bytes_after, "bits_before": g.bits_before, "bits_after": g.bits_after,
                    "rel_rms": g.rel_rms,
                }
                for name, g in self.groups.items()
            },
            "prompt_ids": self.prompt_ids,
            "logits_max_abs": self.logits_max_abs,
            "logits_rel_rms": self.logits_rel_rms,
            "top1_agreement": self.top1_agreement,
            "quantization_config": self.quantization_config,
        }


# ---------------------------------------------------------------------------- which tensors


def _names(tensor: TensorSpec) -> list[int | None]:
    return list(range(tensor.experts)) if "{e}" in tensor.name else [None]


def _module(tensor: TensorSpec, expert: int | None, family: str = "") -> str:
    """The checkpoint's module name of ``tensor`` (expert ``expert``): what ``ignore`` rules match."""
    name = tensor.name.format(e=expert) if expert is not None else tensor.name
    return stored_name(family, name).removesuffix(".weight")


def _generic(module: str) -> str:
    """Layer and expert indices replaced by placeholders (the key a regex rule can cover)."""
    return re.sub(r"\.experts\.\d+\.", ".experts.E.", re.sub(r"\.layers\.\d+\.", ".layers.L.", module))


def _rule(generic: str) -> str:
    pattern = re.escape(generic).replace(r"\.layers\.L\.", r"\.layers\.\d+\.").replace(r"\.experts\.E\.", r"\.experts\.\d+\.")
    return f"re:^{pattern}$"


def _compressed_tensors_config(spec: ModelSpec, experts_only: bool, bits: int | None = None,
                               group: int | None = None, lm_head: bool = False) -> dict[str, Any]:
    """compressed-tensors config, ``mxfp4-pack-quantized`` (``bits`` None) or int ``pack-quantized``
    (per channel when ``group`` is None); ``ignore`` lists every Linear kept float (the LM head unless
    ``lm_head``)."""
    unit = codec.BLOCK_SIZE if bits is None else group or int_codec.GROUP_MULTIPLE
    quantize: dict[str, bool] = {}
    for t in spec.tensors():
        if t.group not in MATMUL_GROUPS or len(t.shape) != 2 or not t.name.endswith(".weight"):
            continue
        wanted = t.shape[1] % unit == 0 and (t.group == ROUTED_EXPERTS or not experts_only)
        for e in _names(t):
            quantize[_module(t, e, spec.family)] = wanted
    by_key: dict[str, list[str]] = {}
    for module in quantize:
        by_key.setdefault(_generic(module), []).append(module)
    ignore = ([] if lm_head else ["lm_head"]) + [r"re:.*mlp\.gate$"]
    if spec.family == "kimi_linear":  # its router, under the checkpoint's MoE prefix
        ignore.append(r"re:.*block_sparse_moe\.gate$")
    for key, modules in by_key.items():
        if not any(quantize[m] for m in modules):
            ignore.append(_rule(key))
        else:
            ignore.extend(m for m in modules if not quantize[m])
    weights = {
        "num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": codec.BLOCK_SIZE,
        "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8",
        "zp_dtype": None, "block_structure": None,
    }
    fmt = CT_MXFP4_FORMAT
    if bits is not None:
        weights.update(num_bits=bits, type="int", strategy="group" if group else "channel", group_size=group,
                       scale_dtype="torch.bfloat16")
        fmt = CT_INT_FORMAT
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                        "output_activations": None, "format": fmt},
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def quantization_config(spec: ModelSpec, experts_only: bool = False, fmt: str = "mxfp4",
                        group_size: int | None = None, lm_head: bool = False) -> dict[str, Any]:
    """The ``quantization_config`` ``quantize`` writes for ``spec`` in ``fmt`` (gpt-oss layout for
    gpt_oss MXFP4; ``group_size``: int4 inputs per scale, default 32; int8 is per channel; ``lm_head``:
    the LM head quantized too, int formats only)."""
    if lm_head and fmt not in INT_BITS:
        raise ShardwiseError(f"--lm-head applies to int8/int4: an {fmt} checkpoint keeps its LM head float, drop --lm-head")
    if lm_head and spec.tie_word_embeddings:
        raise ShardwiseError(f"--lm-head: {spec.name}'s LM head is its embedding table (tie_word_embeddings), which "
                             "stays float: drop --lm-head")
    if fmt in INT_BITS:
        if spec.family == "gpt_oss":
            raise ShardwiseError(f"--format {fmt}: gpt_oss experts are fused tensors the int layout cannot express: use mxfp4")
        group = (group_size or DEFAULT_INT4_GROUP) if fmt == "int4" else group_size
        if group is not None:
            int_codec.check_scheme(INT_BITS[fmt], group, group, "--group-size")
        unit = group or int_codec.GROUP_MULTIPLE
        if lm_head and spec.hidden_size % unit:
            raise ShardwiseError(f"--lm-head: the LM head's {spec.hidden_size} inputs are not a multiple of {unit}: "
                                 "pick a --group-size that divides them, or drop --lm-head")
        return _compressed_tensors_config(spec, experts_only, INT_BITS[fmt], group, lm_head)
    if group_size is not None:
        raise ShardwiseError("--group-size applies to int8/int4: MXFP4 blocks are 32 inputs, drop --group-size")
    if spec.family == "gpt_oss":
        return {"quant_method": "mxfp4", "modules_to_not_convert": list(GPT_OSS_NOT_CONVERTED)}
    return _compressed_tensors_config(spec, experts_only)


# ---------------------------------------------------------------------------- writing


def _copy_side_files(src: Path, out: Path) -> None:
    """Tokenizer and generation files next to the weights (everything but weights, index and config)."""
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", INDEX_FILE):
            shutil.copy2(path, out / path.name)


def _write(out: Path, src: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != src.resolve():
        _copy_side_files(src, out)
    for stale in (out / INDEX_FILE, *out.glob("*.safetensors")):
        stale.unlink(missing_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _stored(spec: ModelSpec, tensor: TensorSpec, expert: int | None, data: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Name and on-disk layout (transformers') of a float tensor given in the (out, in) layout."""
    src = sources(spec, tensor, None, expert)
    if src.transposed:
        data = data.transpose(1, 2)
    return src.name, data.contiguous()


def _src_config(src: Path) -> dict[str, Any]:
    return json.loads((src / "config.json").read_text())


def quantize_checkpoint(
    src: str | Path,
    out: str | Path,
    fmt: str = "mxfp4",
    experts_only: bool = False,
    scale_rounding: str = "ocp",
    compare: bool = True,
    progress: Callable[[str], None] | None = None,
    group_size: int | None = None,
    lm_head: bool = False,
) -> QuantizeResult:
    """Write an MXFP4 / int8 / int4 copy of float checkpoint ``src`` to ``out``; see the module docstring.

    ``progress`` is called with each tensor's name after it is written; ``compare`` runs
    both checkpoints on ``fixed_prompt`` (runtime families only).
    """
    src, out = Path(src), Path(out)
    if fmt not in FORMATS:
        raise ShardwiseError(f"--format {fmt} cannot be written yet: quantize writes {', '.join(FORMATS)}")
    codec.check_scale_rounding(scale_rounding)
    if out.exists() and out.resolve() == src.resolve():
        raise ShardwiseError(f"--out '{out}' is the source checkpoint: pick a new folder")
    spec = load_spec(src)
    if spec.quant_method is not None:
        raise ShardwiseError(
            f"checkpoint '{src}' is already quantized ({spec.quant_method}): quantize a float32/bfloat16 checkpoint"
        )
    if spec.moe is None and experts_only:
        raise ShardwiseError(f"--experts-only needs routed experts but {spec.name} is dense: drop --experts-only")
    qc = quantization_config(spec, experts_only, fmt, group_size, lm_head)
    config = {**_src_config(src), "quantization_config": qc}
    quant = Quantization(detect_layout(qc), qc, spec.family)
    result = QuantizeResult(out, quant.layout, scale_rounding, qc)
    plan = ParallelPlan()
    tensors: dict[str, torch.Tensor] = {}
    with Checkpoint(src) as ckpt:
        check_checkpoint(spec, ckpt)
        for t in spec.tensors():
            stats = result.groups.setdefault(t.group, GroupStats())
            for e in _names(t):
                data = read_shard(spec, plan, 0, t, ckpt, e)
                stats.params += data.numel()
                stats.bytes_before += data.numel() * data.element_size()
                if quant.packed(t, e) and quant.is_int:
                    stats.bytes_after += _write_int(tensors, quant, t, e, data.float().numpy(), stats)
                    result.quantized_tensors += 1
                    if progress is not None:
                        progress(quant.names(t, e)[0])
                elif quant.packed(t, e):
                    if t.shape[-1] % codec.BLOCK_SIZE:
                        raise ShardwiseError(
                            f"tensor '{t.name}' has {t.shape[-1]} inputs, expected a multiple of {codec.BLOCK_SIZE} "
                            "to quantize it to MXFP4: keep it float"
                        )
                    weight = data.float().numpy()
                    blocks, scales = codec.encode(weight, scale_rounding)
                    err = codec.decode(blocks, scales, np.float64) - weight
                    stats.err_sq += float(np.sum(err * err))
                    stats.ref_sq += float(np.sum(weight.astype(np.float64) ** 2))
                    stats.quantized_params += data.numel()
                    blocks_name, scales_name = quant.names(t, e)
                    blocks_shape, _ = quant.stored_shapes(t.shape)
                    tensors[blocks_name] = torch.from_numpy(np.ascontiguousarray(blocks.reshape(blocks_shape)))
                    tensors[scales_name] = torch.from_numpy(np.ascontiguousarray(scales))
                    stats.bytes_after += blocks.nbytes + scales.nbytes
                    result.quantized_tensors += 1
                    if progress is not None:
                        progress(blocks_name)
                else:
                    name, stored = _stored(spec, t, e, data)
                    tensors[name] = stored
                    stats.bytes_after += stored.numel() * stored.element_size()
                    if progress is not None:
                        progress(name)
    _write(out, src, config, tensors)
    if compare:
        _compare(src, out, result)
    return result


def _write_int(tensors: dict[str, torch.Tensor], quant: Quantization, t: TensorSpec, e: int | None,
               weight: np.ndarray, stats: GroupStats) -> int:
    """Encode one float weight [out, in] as int8/int4 into ``tensors`` (packed words, bfloat16
    scales, shape); adds its error to ``stats`` and returns the bytes written."""
    q, scale = int_codec.encode(weight, quant.bits, quant.group(weight.shape[1]))
    err = int_codec.decode(q, scale, np.float64) - weight
    stats.err_sq += float(np.sum(err * err))
    stats.ref_sq += float(np.sum(weight.astype(np.float64) ** 2))
    stats.quantized_params += weight.size
    packed_name, scale_name = quant.names(t, e)
    tensors[packed_name] = torch.from_numpy(int_codec.pack(q, quant.bits))
    tensors[scale_name] = torch.from_numpy(scale).to(torch.bfloat16)  # exact: the scales are bfloat16 values
    tensors[packed_name.removesuffix("packed") + "shape"] = torch.tensor(weight.shape, dtype=torch.int64)
    return sum(tensors[n].numel() * tensors[n].element_size() for n in (packed_name, scale_name))


def _compare(src: Path, out: Path, result: QuantizeResult) -> None:
    """Logits of both checkpoints on the fixed prompt, float32, tp = 1, in this process."""
    from shardwise.runtime.loader import load_shard
    from shardwise.runtime.model import RUNTIME_FAMILIES, ShardedCausalLM

    spec = load_spec(src)
    if spec.family not in RUNTIME_FAMILIES:
        return
    ids = fixed_prompt(spec.vocab_size)
    logits = []
    for folder in (src, out):
        model = ShardedCausalLM(load_spec(folder), ParallelPlan(), 0, torch.float32, max_seq_len=len(ids))
        load_shard(model, folder)
        with torch.no_grad():
            logits.append(model.logits(torch.tensor([ids]))[0].double())
        del model
    before, after = logits
    result.prompt_ids = ids
    result.logits_max_abs = float((after - before).abs().max())
    result.logits_rel_rms = float((after - before).norm() / before.norm())
    result.top1_agreement = float((after.argmax(-1) == before.argmax(-1)).double().mean())


def dequantize_checkpoint(src: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write a float copy of MXFP4 checkpoint ``src`` whose weights equal decode(blocks, scales) exactly
    (float32; bfloat16 holds them exactly too unless a scale leaves bfloat16's range), without
    ``quantization_config`` — the reference a quantized run must match."""
    src, out = Path(src), Path(out)
    spec = load_spec(src)
    quantization(spec)
    config = {k: v for k, v in _src_config(src).items() if k != "quantization_config"}
    plan = ParallelPlan()
    tensors: dict[str, torch.Tensor] = {}
    with Checkpoint(src) as ckpt:
        check_checkpoint(spec, ckpt)
        for t in spec.tensors():
            for e in _names(t):
                name, stored = _stored(spec, t, e, read_shard(spec, plan, 0, t, ckpt, e).to(dtype))
                tensors[name] = stored
    _write(out, src, config, tensors)
    return out
