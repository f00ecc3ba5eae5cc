"""Packed checkpoints in the runtime (MXFP4, and weight-only int8/int4): which weights are
packed on disk, under which names and shapes, and the packed parameters a rank holds.

Three layouts, detected from ``config.json``'s ``quantization_config``
(``shardwise.quant.layouts.detect_layout``):

- gpt-oss (``quant_method: mxfp4``): the fused expert projections are stored as
  ``{name}_blocks`` uint8 [E, out, in/32, 16] and ``{name}_scales`` uint8 [E, out, in/32]
  (e.g. ``model.layers.0.mlp.experts.gate_up_proj_blocks``, gate/up rows interleaved as
  in the float tensor); every module listed in ``modules_to_not_convert`` stays float.
- compressed-tensors ``mxfp4-pack-quantized``: each quantized Linear ``{module}`` stores
  ``{module}.weight_packed`` uint8 [out, in/2] and ``{module}.weight_scale`` uint8
  [out, in/32]; a Linear is quantized when a config group's ``targets`` hits it
  ("Linear", an exact name or ``re:`` regex) and no ``ignore`` entry does.
- compressed-tensors ``pack-quantized`` (``shardwise.quant.int_codec``): the same names and
  rules, ``weight_packed`` int32 [out, in·bits/32] and ``weight_scale`` [out, in/group] (or
  [out, 1] per channel); every such Linear stays packed in memory and runs through
  ``runtime.int_matmul`` (the loader swaps it in: ``int_matmul.IntWeight``). Here the LM head
  too, when no ``ignore`` rule keeps it float (``quantize --lm-head``; llama.cpp's Q8_0 / Q4_0
  files quantize theirs as well).

Routed-expert weights stay packed in memory (4.25 bits per weight) and are decoded per
use by ``runtime.mxfp4_matmul.mxfp4_matmul``; other quantized Linears (attention, dense MLP,
shared experts of a fully quantized compressed-tensors checkpoint) are decoded once at
load into the run dtype. A rank reads only its slices of the packed tensors: its experts
along E and, under expert tensor parallelism, its rows (output split) or its whole blocks
(input split; the slice must then be a multiple of 32 elements).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.quant.layouts import (
    BYTES_PER_BLOCK,
    LAYOUT_COMPRESSED_TENSORS,
    LAYOUT_CT_INT,
    LAYOUT_GPT_OSS,
    LAYOUT_NONE,
    compressed_tensors_names,
    detect_layout,
    gpt_oss_tensor_names,
    int_scheme,
)
from shardwise.quant.mxfp4_codec import BLOCK_SIZE
from shardwise.runtime.stored_names import stored_name
from shardwise.spec.model import LM_HEAD, MATMUL_GROUPS, ModelSpec, TensorSpec

BLOCKS, SCALES = "blocks", "scales"
"""The two halves of a packed weight (``param.packed`` of a packed parameter)."""

_FUSED_EXPERT_SUFFIXES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _matches(rule: str, module: str) -> bool:
    """compressed-tensors target / ignore rule: ``re:`` regex (re.match) or an exact name."""
    if rule.startswith("re:"):
        return re.match(rule[3:], module) is not None
    return rule == module


@dataclass(frozen=True)
class Quantization:
    """How a checkpoint stores its MXFP4 weights (``layout`` is one of ``quant.layouts.LAYOUTS``;
    ``family``: the model family, for checkpoint names that differ from the ModelSpec's)."""

    layout: str
    config: Mapping[str, Any] = field(default_factory=dict)
    family: str = ""

    @property
    def quantized(self) -> bool:
        """True for a packed (MXFP4 or int) checkpoint."""
        return self.layout != LAYOUT_NONE

    @property
    def is_int(self) -> bool:
        """True for weight-only int8/int4 (``pack-quantized``)."""
        return self.layout == LAYOUT_CT_INT

    @cached_property
    def _int_scheme(self) -> tuple[int, int | None]:
        """(bits, group size or None per channel) of an int layout, read from the config once."""
        return int_scheme(self.config)

    @property
    def bits(self) -> int:
        """Bits per stored element: 4 (MXFP4, int4) or 8."""
        return self._int_scheme[0] if self.is_int else 4

    def group(self, in_features: int) -> int:
        """Inputs sharing one scale: the int group size (``in_features`` per channel), or 32 (MXFP4)."""
        if not self.is_int:
            return BLOCK_SIZE
        return self._int_scheme[1] or in_features

    def packed(self, tensor: TensorSpec, expert: int | None = None) -> bool:
        """True when ``tensor`` (expert ``expert`` of a template) is stored as blocks + scales."""
        if self.layout == LAYOUT_GPT_OSS:
            if not (tensor.is_routed and tensor.expert_dim is not None and tensor.name.endswith(_FUSED_EXPERT_SUFFIXES)):
                return False
            module = tensor.name.rsplit(".", 1)[0]
            keep = self.config.get("modules_to_not_convert") or []
            return not any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(module, p + ".*") for p in keep)
        if self.layout in (LAYOUT_COMPRESSED_TENSORS, LAYOUT_CT_INT):
            int_head = self.is_int and tensor.group == LM_HEAD  # an int LM head runs through the int kernel too
            if not (tensor.group in MATMUL_GROUPS or int_head) or len(tensor.shape) != 2 or not tensor.name.endswith(".weight"):
                return False
            name = tensor.name.format(e=0 if expert is None else expert)
            module = stored_name(self.family, name).removesuffix(".weight")
            groups = (self.config.get("config_groups") or {}).values()
            targeted = any(t == "Linear" or _matches(t, module) for g in groups for t in g.get("targets", ()))
            return targeted and not any(_matches(rule, module) for rule in self.config.get("ignore") or ())
        return False

    def names(self, tensor: TensorSpec, expert: int | None = None) -> tuple[str, str]:
        """(blocks name, scales name) of a packed tensor in the checkpoint."""
        if self.layout == LAYOUT_GPT_OSS:
            return gpt_oss_tensor_names(tensor.name)
        name = tensor.name.format(e=0 if expert is None else expert) if "{e}" in tensor.name else tensor.name
        return compressed_tensors_names(stored_name(self.family, name).removesuffix(".weight"))

    def stored_shapes(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Stored (blocks, scales) shapes of a weight of logical shape [..., out, in]."""
        *lead, inp = shape
        if self.is_int:
            return (*lead, inp * self.bits // 32), (*lead, inp // self.group(inp))
        groups = inp // BLOCK_SIZE
        if self.layout == LAYOUT_GPT_OSS:
            return (*lead, groups, BYTES_PER_BLOCK), (*lead, groups)
        return (*lead, inp // 2), (*lead, groups)

    def dims(self, part: str) -> str:
        """Symbolic stored shape of one half, for error messages."""
        if self.layout == LAYOUT_GPT_OSS:
            return "uint8 [E, out, in/32, 16]" if part == BLOCKS else "uint8 [E, out, in/32]"
        if self.is_int:
            group = self._int_scheme[1]
            return f"int32 [out, in*{self.bits}/32]" if part == BLOCKS else f"float [out, {f'in/{group}' if group else 1}]"
        return "uint8 [out, in/2]" if part == BLOCKS else "uint8 [out, in/32]"

    def stored_dtypes(self, part: str) -> tuple[str, ...]:
        """The dtypes (torch names) one half may be stored in."""
        if not self.is_int:
            return ("uint8",)
        return ("int32",) if part == BLOCKS else ("bfloat16", "float32", "float16")

    def in_divisor(self, part: str) -> int:
        """Input elements per stored unit along the last logical axis of one half (0: the half
        is not cut along the input, a per-channel scale)."""
        if self.is_int:
            if part == BLOCKS:
                return 32 // self.bits
            return self._int_scheme[1] or 0
        if part == SCALES or self.layout == LAYOUT_GPT_OSS:
            return BLOCK_SIZE
        return 2


NONE = Quantization(LAYOUT_NONE)


def quantization(spec: ModelSpec) -> Quantization:
    """The checkpoint's MXFP4 layout; a one-line ShardwiseError for any other quantization."""
    qc = spec.config.get("quantization_config")
    layout = detect_layout(qc)
    if layout == LAYOUT_NONE:
        return NONE
    if layout in (LAYOUT_COMPRESSED_TENSORS, LAYOUT_CT_INT) and spec.family == "gpt_oss":
        raise ShardwiseError(
            "quantization_config of a gpt_oss checkpoint is compressed-tensors: gpt_oss experts are fused tensors, "
            "expected quant_method 'mxfp4' with *_blocks / *_scales (the gpt-oss layout)"
        )
    return Quantization(layout, dict(qc), spec.family)


def packed_param(tensor: TensorSpec, local_shape: tuple[int, ...], part: str, quant: Quantization,
                 expert: int | None = None) -> nn.Parameter:
    """An empty uint8 parameter for one half of a packed weight whose shard is ``local_shape``.

    ``param.spec`` / ``param.expert`` / ``param.packed`` tell the loader what to read.
    """
    blocks, scales = quant.stored_shapes(local_shape)
    p = nn.Parameter(torch.empty(blocks if part == BLOCKS else scales, dtype=torch.uint8), requires_grad=False)
    p.spec = tensor  # type: ignore[attr-defined]
    p.expert = expert  # type: ignore[attr-defined]
    p.packed = part  # type: ignore[attr-defined]
    return p
