"""Weight tensors: the tensor groups, one tensor's declaration (shape and how TP splits it), and
the constructors every model family and mixer kind uses to declare its tensors.

A tensor group is the unit of precision choice (one format per group) and of bytes accounting;
a tensor marked ``keep_float32`` is the one exception: it is held in float32 whatever its group's
format (transformers' ``_keep_in_fp32_modules_strict``), as the runtime holds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EMBEDDING = "embedding"
LM_HEAD = "lm_head"
ATTENTION = "attention"
LINEAR_ATTENTION = "linear_attention"
DENSE_MLP = "dense_mlp"
ROUTER = "router"
SHARED_EXPERTS = "shared_experts"
ROUTED_EXPERTS = "routed_experts"
LATENT_PROJ = "latent_proj"
NORM = "norm"

TENSOR_GROUPS = (
    EMBEDDING,
    ATTENTION,
    LINEAR_ATTENTION,
    DENSE_MLP,
    ROUTER,
    SHARED_EXPERTS,
    ROUTED_EXPERTS,
    LATENT_PROJ,
    NORM,
    LM_HEAD,
)

# Groups that hold matmul weights a quantization scheme may compress (norms, routers and
# biases stay in the model's dtype in every scheme we read).
MATMUL_GROUPS = (ATTENTION, LINEAR_ATTENTION, DENSE_MLP, SHARED_EXPERTS, ROUTED_EXPERTS, LATENT_PROJ)

FLOAT32_BITS = 32.0  # bits per element of a ``keep_float32`` tensor, in any run dtype or format


def unpacked_key(group: str) -> str:
    """Key of a bits-per-weight table for the biases and 1-D parameters of ``group`` when the
    group's format is a packed block format: those stay unpacked (``tensor_bits``)."""
    return f"{group}:unpacked"


@dataclass(frozen=True)
class TensorSpec:
    """One weight tensor (or one per-expert template) of the checkpoint.

    name: checkpoint name; per-expert templates contain ``{e}``.
    shape: logical (unquantized) shape of one tensor, ``[out, in]`` for linear weights.
    group: tensor group (precision and accounting unit).
    tp_dim: dimension split across tensor-parallel ranks, or None if replicated.
    tp_unit: size of the indivisible unit along ``tp_dim`` (a head's width, 2 for interleaved
        gate/up pairs); when there are fewer units than ranks each rank holds one unit (replication).
    tp_pad: the split pads ``tp_dim`` up to a multiple of tp (vocab-parallel embedding and LM
        head, as vLLM's VocabParallelEmbedding): every rank holds ceil(units / tp) units, the
        last rank's slice padded with rows no id maps to.
    experts: number of copies of a per-expert template (1 for ordinary tensors).
    expert_dim: dimension that indexes experts in a fused expert tensor (gpt-oss), else None.
    tp_parts: for a fused tensor, its consecutive parts along ``tp_dim`` as (length, unit) pairs
        (Gated DeltaNet's q|k|v): each part is split on its own (``plan.shard_spans``).
    keep_float32: held in float32 (``FLOAT32_BITS``) in every run dtype and group format, as
        transformers' ``_keep_in_fp32_modules_strict`` and vLLM keep it (Kimi Linear's KDA
        ``dt_bias``); the planner prices it at that (``perf.core``, ``ModelSpec.weight_bytes``), and
        ``tests/test_planner_runtime_bytes.py`` holds the runtime's float32 parameters to these marks.
    """

    name: str
    shape: tuple[int, ...]
    group: str
    tp_dim: int | None = None
    tp_unit: int = 1
    experts: int = 1
    expert_dim: int | None = None
    tp_pad: bool = False
    tp_parts: tuple[tuple[int, int], ...] = ()
    keep_float32: bool = False

    @property
    def numel(self) -> int:
        """Elements of one tensor (one expert's copy for templates)."""
        return math.prod(self.shape)

    @property
    def total_numel(self) -> int:
        """Elements over all expert copies."""
        return self.numel * self.experts

    @property
    def is_routed(self) -> bool:
        """True for routed-expert weights (split by expert parallelism)."""
        return self.group == ROUTED_EXPERTS

    @property
    def num_experts(self) -> int:
        """Experts this tensor covers (templates: copies; fused: the expert dimension)."""
        if self.expert_dim is not None:
            return self.shape[self.expert_dim]
        return self.experts

    @property
    def is_matmul(self) -> bool:
        """True for a weight a token multiplies (2 FLOPs per element): at least two dimensions
        per expert and more than one input; norms, biases and 1-D parameters are not."""
        per_expert = [s for i, s in enumerate(self.shape) if i != self.expert_dim]
        return self.group != NORM and len(per_expert) >= 2 and per_expert[-1] > 1

    def tp_shard_len(self, tp: int) -> int:
        """Length of ``tp_dim`` held by one of ``tp`` ranks (units replicate when tp > units;
        ``tp_pad`` tensors hold ceil(units / tp) units)."""
        if self.tp_dim is None or tp == 1:
            return self.shape[self.tp_dim] if self.tp_dim is not None else 0
        if self.tp_parts:
            return sum(max(length // unit // tp, 1) * unit for length, unit in self.tp_parts)
        units = self.shape[self.tp_dim] // self.tp_unit
        if self.tp_pad:
            return -(-units // tp) * self.tp_unit
        return max(units // tp, 1) * self.tp_unit


# ---- constructors ---------------------------------------------------------------------------------


def norm(name: str, width: int) -> TensorSpec:
    """A norm weight [width], replicated."""
    return TensorSpec(name, (width,), NORM)


def col(name: str, out: int, inp: int, group: str, unit: int = 1) -> TensorSpec:
    """Column-parallel linear weight [out, in], split on out."""
    return TensorSpec(name, (out, inp), group, tp_dim=0, tp_unit=unit)


def row(name: str, out: int, inp: int, group: str, unit: int = 1) -> TensorSpec:
    """Row-parallel linear weight [out, in], split on in."""
    return TensorSpec(name, (out, inp), group, tp_dim=1, tp_unit=unit)


def rep(name: str, shape: tuple[int, ...], group: str) -> TensorSpec:
    """A replicated tensor (every rank holds it whole)."""
    return TensorSpec(name, shape, group)


def swiglu(prefix: str, hidden: int, inter: int, group: str) -> list[TensorSpec]:
    """gate/up column-parallel, down row-parallel."""
    return [
        col(f"{prefix}gate_proj.weight", inter, hidden, group),
        col(f"{prefix}up_proj.weight", inter, hidden, group),
        row(f"{prefix}down_proj.weight", hidden, inter, group),
    ]


def experts(prefix: str, hidden: int, inter: int, n: int, names=("gate_proj", "up_proj", "down_proj")) -> list[TensorSpec]:
    """Per-expert SwiGLU templates ``{prefix}{e}.<name>.weight``."""
    gate, up, down = names
    return [
        TensorSpec(f"{prefix}{{e}}.{gate}.weight", (inter, hidden), ROUTED_EXPERTS, tp_dim=0, experts=n),
        TensorSpec(f"{prefix}{{e}}.{up}.weight", (inter, hidden), ROUTED_EXPERTS, tp_dim=0, experts=n),
        TensorSpec(f"{prefix}{{e}}.{down}.weight", (hidden, inter), ROUTED_EXPERTS, tp_dim=1, experts=n),
    ]


def layer_norms(prefix: str, hidden: int) -> list[TensorSpec]:
    """The pre-attention and pre-MLP norms of a decoder layer."""
    return [norm(f"{prefix}input_layernorm.weight", hidden), norm(f"{prefix}post_attention_layernorm.weight", hidden)]


def tensor_bits(tensor: TensorSpec, formats_bits: dict[str, float]) -> float:
    """Bits per weight ``tensor`` is stored at: its group's, except that ``keep_float32`` tensors
    take ``FLOAT32_BITS`` and the biases and 1-D parameters of a group in a packed block format
    stay unpacked (``unpacked_key``)."""
    if tensor.keep_float32:
        return FLOAT32_BITS
    if tensor.is_matmul:
        return formats_bits[tensor.group]
    return formats_bits.get(unpacked_key(tensor.group), formats_bits[tensor.group])
