"""Load one rank's shard of a Hugging Face safetensors checkpoint.

Each rank opens the checkpoint (one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``) and reads only its slices with
``safe_open(...).get_slice(name)[...]``, so its peak memory is its share plus one slice.
Only safetensors is read (never pickle) and no code from the checkpoint runs.

On-disk layouts handled for routed experts:
- per-expert tensors ``...mlp.experts.{e}.gate_proj.weight`` (what transformers 5
  ``save_pretrained`` writes for qwen3_moe and deepseek_v3, and the original checkpoints);
- fused ``...mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows then up rows) and
  ``...mlp.experts.down_proj [E, H, I]`` (transformers' in-memory layout);
- gpt-oss's fused tensors, which transformers stores (in, out): ``gate_up_proj [E, H, 2I]``
  with gate/up columns interleaved, ``down_proj [E, I, H]``; they are transposed on load to
  the ModelSpec's (out, in) layout.

Names and shapes that differ on disk from the ModelSpec's (Kimi Linear's ``block_sparse_moe.``
MoE block and [1, 1, H, 1] ``A_log``) are resolved by ``runtime.stored_names``.

MXFP4 checkpoints (gpt-oss ``*_blocks`` / ``*_scales``, compressed-tensors
``weight_packed`` / ``weight_scale``; see ``runtime.packed_weights``): a packed parameter
(``param.packed``) gets this rank's slice of the stored uint8 tensor — its experts, and
its rows or whole blocks under expert tensor parallelism — without decoding anything; a
float parameter whose weight is packed on disk (a quantized attention or dense Linear) is
read as its packed slice and decoded once.

Before any weight is read, every file's header is checked against the file
(``runtime.safetensors_header``) and ``check_checkpoint`` checks the tensors against the config
from the headers alone: each expected tensor present, with its shape and dtype (float weights a
float type, packed ones uint8), and no tensor the model does not use (beyond the few that are
rightly left unread, ``_NOT_WEIGHTS``). Each float slice is checked for NaN/Inf as it is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.errors import ShardwiseError
from shardwise.plan import ParallelPlan, local_experts, shard_slice
from shardwise.quant.mxfp4_codec import BLOCK_SIZE
from shardwise.runtime import hugepages
from shardwise.runtime.int_matmul import IntWeight, int_decode, kernel
from shardwise.runtime.mxfp4_matmul import decode
from shardwise.runtime.packed_weights import BLOCKS, SCALES, Quantization, quantization
from shardwise.runtime.checkpoint_files import FLOAT_NAMES, Checkpoint
from shardwise.runtime.safetensors_header import FIX
from shardwise.runtime.stored_names import stored_name
from shardwise.spec.model import ModelSpec, TensorSpec
from shardwise.spec.parse import load_model

def _dims(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


# ---------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Source:
    """Where one parameter's data lives on disk.

    name/shape: the stored tensor and its full stored shape; ``expert``: leading index to
    select (fused expert tensors); ``row_offset``: where this tensor's rows start along
    the split dimension (up_proj inside a fused gate_up); ``transposed``: stored as
    (…, in, out) and swapped on load (gpt-oss).
    """

    name: str
    shape: tuple[int, ...]
    expert: int | None = None
    row_offset: int = 0
    transposed: bool = False


def _fused_name(template: str) -> tuple[str, str] | None:
    """For a per-expert template, the fused tensor holding it and which part it is
    ('gate', 'up' or 'down'); None for names outside the SwiGLU triple."""
    prefix, _, rest = template.partition("{e}.")
    part = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
    kind = part.get(rest.removesuffix(".weight"))
    if kind is None:
        return None
    return prefix + ("down_proj" if kind == "down" else "gate_up_proj"), kind


def sources(spec: ModelSpec, tensor: TensorSpec, ckpt: Checkpoint | None, expert: int | None = None) -> Source:
    """The on-disk source of ``tensor`` (expert ``expert`` of a per-expert template).

    Per-expert names are preferred; when the checkpoint has none for this template but
    has the fused tensor, the fused one is used. Without a checkpoint the layout
    transformers writes is returned (used to make checkpoints).
    """
    if "{e}" not in tensor.name:
        if spec.family == "gpt_oss" and tensor.expert_dim is not None and tensor.name.endswith(("gate_up_proj", "down_proj")):
            e, out, inp = tensor.shape
            return Source(tensor.name, (e, inp, out), transposed=True)
        return Source(stored_name(spec.family, tensor.name, None if ckpt is None else ckpt.__contains__),
                      tensor.shape)
    e = 0 if expert is None else expert
    name = stored_name(spec.family, tensor.name.format(e=e), None if ckpt is None else ckpt.__contains__)
    fused = _fused_name(tensor.name)
    if ckpt is None or name in ckpt or fused is None or fused[0] not in ckpt:
        return Source(name, tensor.shape)
    fused_name, part = fused
    rows, cols = tensor.shape
    shape = (tensor.experts, rows, cols) if part == "down" else (tensor.experts, 2 * rows, cols)
    return Source(fused_name, shape, expert=e, row_offset=rows if part == "up" else 0)


def _expected(spec: ModelSpec, ckpt: Checkpoint, quant: Quantization) -> Iterator[Source]:
    """The float tensors the checkpoint must hold (packed weights are checked apart)."""
    for tensor in spec.tensors():
        if "{e}" in tensor.name:
            seen = set()
            for e in range(tensor.experts):
                if quant.packed(tensor, e):
                    continue
                src = sources(spec, tensor, ckpt, e)
                if src.name not in seen:
                    seen.add(src.name)
                    yield src
        elif not quant.packed(tensor):
            yield sources(spec, tensor, ckpt)


def _expected_packed(spec: ModelSpec, quant: Quantization) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(name, part, stored shape) of every packed tensor the checkpoint must hold."""
    for tensor in spec.tensors():
        experts = range(tensor.experts) if "{e}" in tensor.name else (None,)
        for e in experts:
            if quant.packed(tensor, e):
                for part, name, shape in zip((BLOCKS, SCALES), quant.names(tensor, e), quant.stored_shapes(tensor.shape), strict=True):
                    yield name, part, shape


_NOT_WEIGHTS = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^(model\.)?visual\.|^mtp\.")
"""Stored tensors that are not the text model's weights and are rightly left unread: rotary
tables older checkpoints saved, a multimodal wrapper's vision tower and Qwen3.5's
multi-token-prediction head (the ModelSpec excludes both)."""


def _not_a_weight(spec: ModelSpec, name: str, expected: set[str]) -> bool:
    """True for a stored tensor the runtime rightly leaves unread (``_NOT_WEIGHTS``, a tied
    ``lm_head.weight``, compressed-tensors' ``weight_shape``, DeepSeek-V3's nextn layers)."""
    if _NOT_WEIGHTS.search(name) or (name == "lm_head.weight" and spec.tie_word_embeddings):
        return True
    if name.endswith(".weight_shape") and name.removesuffix("shape") + "packed" in expected:
        return True
    nextn = spec.config.get("num_nextn_predict_layers")
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return layer is not None and type(nextn) is int and spec.num_layers <= int(layer[1]) < spec.num_layers + nextn


def check_checkpoint(spec: ModelSpec, ckpt: Checkpoint) -> None:
    """Raise ShardwiseError naming the first tensor that is missing, mis-shaped, of the wrong
    dtype (an integer where a float weight belongs; packed MXFP4 tensors not uint8) or not
    part of the model the config describes — headers only."""
    quant = quantization(spec)
    expected: set[str] = set()
    for src in _expected(spec, ckpt, quant):
        if src.name not in ckpt:
            raise ShardwiseError(f"checkpoint tensor '{src.name}' is missing (expected shape {_dims(src.shape)})")
        got = ckpt.shape(src.name)
        if got != src.shape:
            raise ShardwiseError(f"checkpoint tensor '{src.name}' has shape {_dims(got)}, expected {_dims(src.shape)}")
        dtype = ckpt.dtype(src.name)
        if dtype not in FLOAT_NAMES:
            raise ShardwiseError(
                f"checkpoint tensor '{src.name}' has dtype {dtype}, expected a float weight "
                f"({', '.join(FLOAT_NAMES)}): {FIX}"
            )
        expected.add(src.name)
    kind = "int-quantized" if quant.is_int else "MXFP4"
    for name, part, shape in _expected_packed(spec, quant):
        expected_text = f"{quant.dims(part)} = {_dims(shape)}"
        if name not in ckpt:
            raise ShardwiseError(f"{kind} checkpoint tensor '{name}' is missing (expected {expected_text})")
        if ckpt.dtype(name) not in quant.stored_dtypes(part):
            raise ShardwiseError(f"{kind} checkpoint tensor '{name}' has dtype {ckpt.dtype(name)}, expected {expected_text}")
        if ckpt.shape(name) != shape:
            raise ShardwiseError(f"{kind} checkpoint tensor '{name}' has shape {_dims(ckpt.shape(name))}, expected {expected_text}")
        expected.add(name)
    extra = sorted(name for name in ckpt.files if name not in expected and not _not_a_weight(spec, name, expected))
    if extra:
        raise ShardwiseError(
            f"checkpoint tensor '{extra[0]}' is not a weight of the {spec.model_type} model its config.json describes "
            f"({len(extra)} such tensor(s)): the weights and the config disagree, use the config.json they were saved with"
        )


# ---------------------------------------------------------------------------- reading a shard


def _block_cut(tensor: TensorSpec, plan: ParallelPlan, tp_rank: int) -> tuple[tuple[int, int] | None, slice]:
    """The rank's tensor-parallel cut widened to whole MXFP4 blocks when it splits the input
    dimension, and where the rank's own slice lies inside the decoded, widened one."""
    cut = shard_slice(tensor, plan, tp_rank)
    if cut is None or tensor.tp_dim != len(tensor.shape) - 1:
        return cut, slice(None)
    start, stop = cut
    first, last = start // BLOCK_SIZE * BLOCK_SIZE, -(-stop // BLOCK_SIZE) * BLOCK_SIZE
    return (first, last), slice(start - first, stop - first)


def read_packed(
    plan: ParallelPlan, tp_rank: int, tensor: TensorSpec, ckpt: Checkpoint, quant: Quantization, part: str,
    expert: int | None = None,
) -> torch.Tensor:
    """This rank's slice of one half (``part``: blocks or scales) of a packed weight, as stored.

    Only the slice is read: the rank's experts along E (fused gpt-oss tensors) and its
    tensor-parallel cut — whole rows, or the whole blocks that cover its share of the input
    dimension (exactly its share for packed parameters: ``plan.validate_plan`` ensures it).
    """
    name = quant.names(tensor, expert)[0 if part == BLOCKS else 1]
    index = [slice(None)] * len(ckpt.shape(name))
    if tensor.expert_dim is not None:
        experts = local_experts(tensor.num_experts, plan, tp_rank)
        index[tensor.expert_dim] = slice(experts.start, experts.stop)
    cut = shard_slice(tensor, plan, tp_rank) if quant.is_int else _block_cut(tensor, plan, tp_rank)[0]
    if cut is not None:
        start, stop = cut
        if tensor.tp_dim == len(tensor.shape) - 1:  # input dimension: whole blocks / packed words / groups
            unit = quant.in_divisor(part)
            if unit == 0:  # a per-channel scale: every rank reads it whole
                return ckpt.read(name, tuple(index))
            if start % unit or stop % unit:
                raise ShardwiseError(
                    f"{tensor.name}: rank {tp_rank}'s inputs [{start}, {stop}) do not fall on whole units of {unit} "
                    f"of the packed tensor '{name}': use a tensor-parallel size that splits it evenly"
                )
            start, stop = start // unit, stop // unit
        index[tensor.tp_dim] = slice(start, stop)
    return ckpt.read(name, tuple(index))


def _decode_packed(quant: Quantization, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A packed weight's stored halves (MXFP4 blocks or int words, and their scales) as float32."""
    if quant.is_int:
        return int_decode(blocks, scales, quant.bits)
    return decode(blocks.reshape(*scales.shape, -1), scales, torch.float32)


def read_shard(spec: ModelSpec, plan: ParallelPlan, tp_rank: int, tensor: TensorSpec, ckpt: Checkpoint, expert: int | None = None) -> torch.Tensor:
    """This rank's slice of ``tensor`` (one expert's for templates), in the (out, in) layout.

    A weight stored packed (MXFP4, int) is read as its packed slices and decoded to float32.
    """
    quant = quantization(spec)
    if quant.packed(tensor, expert):
        blocks = read_packed(plan, tp_rank, tensor, ckpt, quant, BLOCKS, expert)
        scales = read_packed(plan, tp_rank, tensor, ckpt, quant, SCALES, expert)
        inner = slice(None) if quant.is_int else _block_cut(tensor, plan, tp_rank)[1]  # int cuts are exact
        return _decode_packed(quant, blocks, scales)[..., inner].contiguous()
    src = sources(spec, tensor, ckpt, expert)
    cut = shard_slice(tensor, plan, tp_rank)
    if src.transposed:  # gpt-oss fused experts stored [E, in, out]
        experts = local_experts(tensor.num_experts, plan, tp_rank)
        index = [slice(experts.start, experts.stop), slice(None), slice(None)]
        if cut is not None:  # tp_dim is in the (out, in) layout: 1 → stored 2, 2 → stored 1
            index[3 - tensor.tp_dim] = slice(*cut)
        return ckpt.read(src.name, tuple(index)).transpose(1, 2).contiguous()
    index = [slice(None)] * len(tensor.shape)
    if tensor.expert_dim is not None:
        experts = local_experts(tensor.num_experts, plan, tp_rank)
        index[tensor.expert_dim] = slice(experts.start, experts.stop)
    if cut is not None:
        start, stop = cut
        index[tensor.tp_dim] = slice(start + src.row_offset, stop + src.row_offset)
    elif src.expert is not None:  # gate or up half of a fused gate_up, whole rows
        index[0] = slice(src.row_offset, src.row_offset + tensor.shape[0])
    if src.expert is not None:  # one expert out of a fused [E, ...] tensor
        index = [slice(src.expert, src.expert + 1), *index]
        return ckpt.read(src.name, tuple(index))[0]
    return ckpt.read(src.name, tuple(index))


def read_vocab_rows(spec: ModelSpec, tensor: TensorSpec, ckpt: Checkpoint, rows: tuple[int, int]) -> torch.Tensor:
    """Rows ``[start, stop)`` of an embedding / LM-head tensor: a rank's vocabulary slice
    (``layers.vocab_span``), of which the last rank reads only the rows that exist."""
    src = sources(spec, tensor, ckpt)
    return ckpt.read(src.name, (slice(*rows),))


def read_spans(spec: ModelSpec, tensor: TensorSpec, ckpt: Checkpoint, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Ranges ``spans`` of ``tensor`` along its ``tp_dim``, concatenated: a rank's share of a fused
    tensor whose parts are each split on their own (Gated DeltaNet's q|k|v ``in_proj_qkv`` and
    ``conv1d``: ``plan.shard_spans``). Stored packed (MXFP4, whole rows), the rows are read packed
    and decoded to float32."""
    quant = quantization(spec)
    if quant.packed(tensor):
        if tensor.tp_dim != 0:
            raise ShardwiseError(f"{tensor.name}: a packed fused tensor must be split by rows (tp_dim 0)")
        return _decode_packed(quant, *read_packed_spans(tensor, ckpt, quant, spans))
    src = sources(spec, tensor, ckpt)
    lead = (slice(None),) * tensor.tp_dim
    return torch.cat([ckpt.read(src.name, lead + (slice(a, b),)) for a, b in spans], dim=tensor.tp_dim)


def read_packed_spans(tensor: TensorSpec, ckpt: Checkpoint, quant: Quantization,
                      spans: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) rows ``spans`` of a packed fused tensor split by rows, as stored."""
    return tuple(torch.cat([ckpt.read(name, (slice(a, b),)) for a, b in spans]) for name in quant.names(tensor, None))


def load_int_weight(model: torch.nn.Module, name: str, param: torch.nn.Parameter, ckpt: Checkpoint,
                    quant: Quantization) -> None:
    """Put an ``IntWeight`` holding this rank's packed slices (int8/int4 as stored) where float
    parameter ``name`` of a Linear (or of the LM head) was, and build the kernel it runs on (once per
    process). A vocabulary-parallel head's rows past the vocabulary get zero scales (zero logits,
    which the head then masks to -inf)."""
    tensor, spans, rows = param.spec, getattr(param, "spans", None), getattr(param, "rows", None)
    if spans is not None:
        blocks, scales = read_packed_spans(tensor, ckpt, quant, spans)
    elif rows is not None:
        blocks, scales = (torch.nn.functional.pad(part, (0, 0, 0, param.shape[0] - part.shape[0]))
                          for part in read_packed_spans(tensor, ckpt, quant, [rows]))
    else:
        blocks, scales = (read_packed(model.plan, model.shard.tp_rank, tensor, ckpt, quant, part, param.expert)
                          for part in (BLOCKS, SCALES))
    weight = IntWeight.from_stored(blocks, scales, quant.bits)
    if (weight.q.shape[0], weight.in_features) != tuple(param.shape):
        raise ShardwiseError(
            f"checkpoint tensor '{tensor.name}' gives a packed slice of {weight.q.shape[0]}x{weight.in_features} "
            f"weights for rank {model.shard.rank}, expected {_dims(param.shape)}"
        )
    kernel()
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    delattr(module, attr)
    setattr(module, attr, weight)


def load_shard(model: torch.nn.Module, folder: str | Path, check: bool = True) -> None:
    """Fill every parameter of a ``ShardedCausalLM`` with its slice from checkpoint ``folder``, then
    stack the weights of projections that share an input (``ShardedCausalLM.stack_projections``) and
    move the weights into huge pages where the host gives them (``hugepages.place``)."""
    spec, plan, tp_rank = model.spec, model.plan, model.shard.tp_rank
    quant = quantization(spec)
    with Checkpoint(folder) as ckpt:
        if check:
            check_checkpoint(spec, ckpt)
        with torch.no_grad():
            for name, param in list(model.named_parameters()):
                part = getattr(param, "packed", None)
                rows = getattr(param, "rows", None)  # a vocab-parallel slice, maybe zero-padded
                spans = getattr(param, "spans", None)  # rows from several parts of a fused tensor
                if part is None and quant.is_int and quant.packed(param.spec, param.expert):
                    load_int_weight(model, name, param, ckpt, quant)
                    continue
                if part is not None:
                    data = read_packed(plan, tp_rank, param.spec, ckpt, quant, part, param.expert)
                elif spans is not None:
                    data = read_spans(spec, param.spec, ckpt, spans)
                elif rows is not None:
                    data = read_vocab_rows(spec, param.spec, ckpt, rows)
                else:
                    data = read_shard(spec, plan, tp_rank, param.spec, ckpt, param.expert)
                target = param if rows is None else param[: rows[1] - rows[0]]
                if tuple(data.shape) != tuple(target.shape):
                    raise ShardwiseError(
                        f"checkpoint tensor '{param.spec.name}' gives a slice of shape {_dims(data.shape)} "
                        f"for rank {model.shard.rank}, expected {_dims(target.shape)}"
                    )
                if rows is not None:
                    param.zero_()  # padding rows past the vocabulary stay zero
                target.copy_(data)
    model.stack_projections()
    hugepages.place(model)


def load_spec(folder: str | Path) -> ModelSpec:
    """The ModelSpec of a checkpoint folder (its config.json), with a one-line error if absent."""
    path = Path(folder)
    if not path.is_dir():
        raise ShardwiseError(f"checkpoint folder '{path}' does not exist")
    if not (path / "config.json").exists():
        raise ShardwiseError(f"'{path}' has no config.json: pass a Hugging Face checkpoint folder")
    return load_model(path)
