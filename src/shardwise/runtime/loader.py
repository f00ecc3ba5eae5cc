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

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from shardwise.errors import ShardwiseError
from shardwise.plan import ParallelPlan, local_experts, shard_slice
from shardwise.quant.mxfp4_codec import BLOCK_SIZE
from shardwise.runtime.mxfp4_matmul import decode
from shardwise.runtime.packed_weights import BLOCKS, SCALES, Quantization, quantization
from shardwise.runtime.safetensors_header import FIX, TensorHeader, read_header
from shardwise.runtime.stored_names import stored_name
from shardwise.spec.model import ModelSpec, TensorSpec
from shardwise.spec.parse import load_model

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _dims(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


_SAFETENSORS_DTYPES = {
    "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32", "I32": "int32", "I64": "int64",
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The stored dtypes a float (not packed) weight may have; the finiteness check covers them."""
_FLOAT_NAMES = tuple(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)


class Checkpoint:
    """The tensors of a safetensors checkpoint folder: names, shapes and sliced reads.

    Every file's header is read and checked (``safetensors_header.read_header``) when the
    checkpoint is opened, so shapes and dtypes come from the checked headers and a corrupt
    file is refused before any tensor is read; every float slice read is checked for NaN/Inf.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        single = self.folder / SINGLE_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_bytes())["weight_map"]
                self.files = {name: self.folder / file for name, file in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                raise ShardwiseError(
                    f"'{index}' is not a safetensors index (a JSON object with a 'weight_map' of tensor name "
                    f"to file name): {FIX}"
                ) from None
            self._headers = self._indexed_headers(index)
        elif single.exists():
            self._headers = read_header(single)
            self.files = dict.fromkeys(self._headers, single)
        else:
            raise ShardwiseError(
                f"no {SINGLE_FILE} or {INDEX_FILE} in '{self.folder}': the runtime loads safetensors checkpoints only"
            )
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}

    def _indexed_headers(self, index: Path) -> dict[str, TensorHeader]:
        """The checked header entry of every tensor the index lists, from the file it names."""
        by_file: dict[Path, list[str]] = {}
        for name, path in self.files.items():
            by_file.setdefault(path, []).append(name)
        headers: dict[str, TensorHeader] = {}
        for path, names in sorted(by_file.items()):
            if not path.is_file():
                raise ShardwiseError(f"checkpoint file '{path}' listed in {INDEX_FILE} does not exist")
            header = read_header(path)
            for name in names:
                if name not in header:
                    raise ShardwiseError(f"'{index}' maps tensor '{name}' to '{path}', which does not hold it: {FIX}")
                headers[name] = header[name]
        return headers

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the open safetensors files."""
        self._stack.close()
        self._handles.clear()

    def _handle(self, name: str):
        path = self.files[name]
        if path not in self._handles:
            try:
                self._handles[path] = self._stack.enter_context(safe_open(path, framework="pt"))
            except Exception as exc:  # safetensors raises its own error types for bad headers
                raise ShardwiseError(f"cannot read safetensors file '{path}': {exc}") from None
        return self._handles[path]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` as stored."""
        return self._headers[name].shape

    def dtype(self, name: str) -> str:
        """Stored dtype of tensor ``name`` as a torch name ('uint8', 'bfloat16', ...), from the header."""
        raw = self._headers[name].dtype
        return _SAFETENSORS_DTYPES.get(raw, raw)

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The slice ``index`` (one slice per leading dimension) of tensor ``name``; a one-line
        ShardwiseError when a float slice holds NaN or Inf."""
        data = self._handle(name).get_slice(name)[index]
        # a sum is NaN/Inf when an element is (no temporary as large as the slice); then count them,
        # since a float16 sum can also overflow with every element finite
        bad = int((~torch.isfinite(data)).sum()) if data.dtype in FLOAT_DTYPES and not torch.isfinite(data.sum()) else 0
        if bad:
            raise ShardwiseError(
                f"checkpoint tensor '{name}' in '{self.files[name]}' holds {bad:,} NaN/Inf value(s): the weights are "
                f"corrupt, {FIX}"
            )
        return data


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
        if dtype not in _FLOAT_NAMES:
            raise ShardwiseError(
                f"checkpoint tensor '{src.name}' has dtype {dtype}, expected a float weight "
                f"({', '.join(_FLOAT_NAMES)}): {FIX}"
            )
        expected.add(src.name)
    for name, part, shape in _expected_packed(spec, quant):
        expected_text = f"uint8 {quant.dims(part)} = {_dims(shape)}"
        if name not in ckpt:
            raise ShardwiseError(f"MXFP4 checkpoint tensor '{name}' is missing (expected {expected_text})")
        dtype = ckpt.dtype(name)
        if dtype != "uint8":
            raise ShardwiseError(f"MXFP4 checkpoint tensor '{name}' has dtype {dtype}, expected {expected_text}")
        got = ckpt.shape(name)
        if got != shape:
            raise ShardwiseError(f"MXFP4 checkpoint tensor '{name}' has shape {_dims(got)}, expected {expected_text}")
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
    cut, _ = _block_cut(tensor, plan, tp_rank)
    if cut is not None:
        start, stop = cut
        if tensor.tp_dim == len(tensor.shape) - 1:  # input dimension: whole blocks / packed bytes
            unit = quant.in_divisor(part)
            start, stop = start // unit, stop // unit
        index[tensor.tp_dim] = slice(start, stop)
    return ckpt.read(name, tuple(index))


def read_shard(spec: ModelSpec, plan: ParallelPlan, tp_rank: int, tensor: TensorSpec, ckpt: Checkpoint, expert: int | None = None) -> torch.Tensor:
    """This rank's slice of ``tensor`` (one expert's for templates), in the (out, in) layout.

    A weight stored packed (MXFP4) is read as its packed slices and decoded to float32.
    """
    quant = quantization(spec)
    if quant.packed(tensor, expert):
        blocks = read_packed(plan, tp_rank, tensor, ckpt, quant, BLOCKS, expert)
        scales = read_packed(plan, tp_rank, tensor, ckpt, quant, SCALES, expert)
        inner = _block_cut(tensor, plan, tp_rank)[1]
        return decode(blocks.reshape(*scales.shape, -1), scales, torch.float32)[..., inner].contiguous()
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
        packed = [torch.cat([ckpt.read(name, (slice(a, b),)) for a, b in spans]) for name in quant.names(tensor, None)]
        blocks, scales = packed
        return decode(blocks.reshape(*scales.shape, -1), scales, torch.float32)
    src = sources(spec, tensor, ckpt)
    lead = (slice(None),) * tensor.tp_dim
    return torch.cat([ckpt.read(src.name, lead + (slice(a, b),)) for a, b in spans], dim=tensor.tp_dim)


def load_shard(model: torch.nn.Module, folder: str | Path, check: bool = True) -> None:
    """Fill every parameter of a ``ShardedCausalLM`` with its slice from checkpoint ``folder``."""
    spec, plan, tp_rank = model.spec, model.plan, model.shard.tp_rank
    quant = quantization(spec)
    with Checkpoint(folder) as ckpt:
        if check:
            check_checkpoint(spec, ckpt)
        with torch.no_grad():
            for _, param in model.named_parameters():
                part = getattr(param, "packed", None)
                rows = getattr(param, "rows", None)  # a vocab-parallel slice, maybe zero-padded
                spans = getattr(param, "spans", None)  # rows from several parts of a fused tensor
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


def load_spec(folder: str | Path) -> ModelSpec:
    """The ModelSpec of a checkpoint folder (its config.json), with a one-line error if absent."""
    path = Path(folder)
    if not path.is_dir():
        raise ShardwiseError(f"checkpoint folder '{path}' does not exist")
    if not (path / "config.json").exists():
        raise ShardwiseError(f"'{path}' has no config.json: pass a Hugging Face checkpoint folder")
    return load_model(path)
