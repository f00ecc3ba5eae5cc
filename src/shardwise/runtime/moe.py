"""MLP blocks: the dense SwiGLU MLP and the mixture-of-experts blocks of each family.

Every block returns this rank's **partial** output; the decoder layer sums the partial
outputs of all ranks with one all-reduce. Under expert parallelism a rank holds the
experts ``plan.local_experts`` gives it and runs only those the router picked for each
token; the routed sum, the shared experts' row-parallel partial sum and the expert
biases (added by one rank of each expert's group) all travel in that one all-reduce.

Routing, as in transformers:
- ``softmax_topk`` (Qwen3-MoE): softmax over all experts, top-k, optional renormalisation.
- ``sigmoid_grouped`` (DeepSeek-V3 / Kimi K2): sigmoid scores; the correction bias is added
  for *selection only*; top-k inside the ``topk_group`` best of ``n_group`` groups (a
  group scores the sum of its two best); weights are the un-biased scores, optionally
  renormalised, times ``routed_scaling_factor``. Computed in float32.
- ``topk_softmax`` (gpt-oss): top-k on the router logits (with bias), softmax over the k.

MXFP4 checkpoints (``runtime.packed_weights``): routed-expert weights stay packed (uint8
blocks + E8M0 scales, 4.25 bits per weight) and each picked expert's weights are decoded
to the activation dtype for that one matmul (``runtime.mxfp4_matmul.mxfp4_matmul``), so nothing
dequantized outlives the call. A one-row step runs the picked experts in one compiled call: float ones through
``gemv.experts_kernel``, packed ones (MXFP4, int8 / int4) through ``runtime.packed_experts``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.plan import local_experts
from shardwise.quant.layouts import BYTES_PER_BLOCK
from shardwise.runtime import gemv, packed_experts
from shardwise.runtime.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    Shard,
    linear,
    project_inputs,
    shard_param,
)
from shardwise.runtime.mxfp4_matmul import mxfp4_matmul, packed_kernel
from shardwise.runtime.packed_weights import BLOCKS, NONE, SCALES, Quantization, packed_param
from shardwise.runtime.rms_norm import RMSNorm
from shardwise.spec.model import MoESpec, TensorSpec


Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A gated MLP's activation of its (gate, up) products."""


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) · up``."""
    return F.silu(gate) * up


def situ_and_mul(beta: float, linear_beta: float | None) -> Activation:
    """Kimi K3's SiTU-GLU (``hidden_act: situ``): ``β tanh(gate/β) · sigmoid(gate) · up``, ``up``
    first squashed to ``β_l tanh(up/β_l)`` when ``activation_situ_linear_beta`` is set; in float32,
    cast back. The definition: Moonshot's ``modeling_kimi_linear.py`` ``SituAndMul`` (as transcribed
    in vLLM's and SGLang's kimi_k3 models)."""

    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g, u = gate.float(), up.float()
        g = beta * torch.tanh(g / beta) * torch.sigmoid(g)
        if linear_beta is not None:
            u = linear_beta * torch.tanh(u / linear_beta)
        return (g * u).to(gate.dtype)

    act.situ = (beta, linear_beta)  # what a compiled expert call needs to compute it (act_args)
    return act


def act_args(act: Activation) -> tuple[int, float, float] | None:
    """``act`` as ``packed_experts.kernel`` takes it: (0, 0, 0) SiLU, (1, β, β_l or 0) SiTU; None for any other."""
    if act is silu_and_mul:
        return 0, 0.0, 0.0
    situ = getattr(act, "situ", None)
    return None if situ is None else (1, float(situ[0]), float(situ[1] or 0.0))


def activation(config) -> Activation:
    """The gated activation a config's ``hidden_act`` names (silu, or Kimi K3's situ)."""
    if config.get("hidden_act", "silu") == "situ":
        return situ_and_mul(float(config.get("activation_situ_beta") or 1.0), config.get("activation_situ_linear_beta"))
    return silu_and_mul


class DenseMLP(nn.Module):
    """Gated MLP ``down(act(gate(x), up(x)))`` (SwiGLU unless ``act`` says otherwise): gate/up
    column-parallel, down row-parallel."""

    input_projections = ("gate_proj", "up_proj")  # read the layer input: one product once stacked (layers.stack_inputs)

    def __init__(self, tensors: dict[str, TensorSpec], shard: Shard, dtype: torch.dtype, act: Activation = silu_and_mul):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(tensors["gate_proj.weight"], shard, dtype)
        self.up_proj = ColumnParallelLinear(tensors["up_proj.weight"], shard, dtype)
        self.down_proj = RowParallelLinear(tensors["down_proj.weight"], shard, dtype)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project_inputs(self, x)
        return self.down_proj(self.act(gate, up))


class ExpertLinear(nn.Module):
    """One expert projection ``x Wᵀ``: a float ``weight``, or MXFP4 ``weight_packed`` [out, in/2]
    + ``weight_scale`` [out, in/32] (compressed-tensors names) decoded per call."""

    def __init__(self, tensor: TensorSpec, e: int, shard: Shard, dtype: torch.dtype, quant: Quantization):
        super().__init__()
        self.packed = quant.packed(tensor, e) and not quant.is_int  # int weights: the loader swaps in an IntWeight
        if self.packed:
            local = shard.shape(tensor)
            self.weight_packed = packed_param(tensor, local, BLOCKS, quant, expert=e)
            self.weight_scale = packed_param(tensor, local, SCALES, quant, expert=e)
        else:
            self.weight = shard_param(tensor, shard, dtype, expert=e)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            blocks = self.weight_packed.view(self.weight_scale.shape[0], self.weight_scale.shape[1], BYTES_PER_BLOCK)
            return mxfp4_matmul(x, blocks, self.weight_scale)
        return linear(x, self.weight)


EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
"""(gate, up, down) projection names of a routed expert: transformers' / Kimi Linear's (Mixtral's)."""


class Expert(nn.Module):
    """One routed SwiGLU expert (this rank's slice of it when experts are tensor-split), its
    projections named as in the checkpoint (``EXPERT_NAMES``)."""

    def __init__(self, tensors: dict[str, TensorSpec], e: int, shard: Shard, dtype: torch.dtype,
                 quant: Quantization = NONE, act: Activation = silu_and_mul):
        super().__init__()
        self.parts = next(names for names in EXPERT_NAMES if f"{names[0]}.weight" in tensors)
        for name in self.parts:
            setattr(self, name, ExpertLinear(tensors[f"{name}.weight"], e, shard, dtype, quant))
        self.input_projections = self.parts[:2]  # gate, up: one product once stacked (MXFP4 experts keep their blocks)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project_inputs(self, x)
        return getattr(self, self.parts[2])(self.act(gate, up))


class Router(nn.Module):
    """Picks ``top_k`` experts per token and their weights: (indices [N, k], weights [N, k])."""

    def __init__(self, tensors: dict[str, TensorSpec], prefix: str, moe: MoESpec, shard: Shard, dtype: torch.dtype):
        super().__init__()
        self.moe = moe
        self.weight = shard_param(tensors[f"{prefix}.weight"], shard, dtype)
        bias = tensors.get(f"{prefix}.bias")
        self.bias = shard_param(bias, shard, dtype) if bias is not None else None
        correction = tensors.get(f"{prefix}.e_score_correction_bias")
        self.e_score_correction_bias = shard_param(correction, shard, dtype) if correction is not None else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        if moe.routing == "softmax_topk":
            logits = linear(x, self.weight)  # a one-row step: gemv's product (torch's bfloat16 GEMM costs ~40 us here)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights, index = torch.topk(probs, moe.top_k, dim=-1)
            if moe.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return index, weights.to(logits.dtype)
        if moe.routing == "topk_softmax":
            logits = F.linear(x, self.weight, self.bias)
            top, index = torch.topk(logits, moe.top_k, dim=-1)
            return index, torch.softmax(top, dim=1, dtype=top.dtype)
        # sigmoid_grouped (DeepSeek-V3): float32 throughout, bias for selection only
        scores = linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        n, per_group = moe.n_group, moe.num_experts // moe.n_group
        if n > moe.topk_group:  # groups to choose from (Kimi's one group, or all groups kept: nothing to mask)
            group_scores = choice.view(-1, n, per_group).topk(2, dim=-1)[0].sum(dim=-1)
            groups = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
            keep = group_mask.unsqueeze(-1).expand(-1, n, per_group).reshape(-1, moe.num_experts).bool()
            choice = choice.masked_fill(~keep, float("-inf"))
        index = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return index, weights * moe.routed_scaling_factor


def _kernel_weights(mlp: nn.Module | None, dtype: torch.dtype, down: nn.Module | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(stacked gate|up weight, down weight) of a SwiGLU ``mlp`` (an expert, or the shared experts'
    ``DenseMLP``; ``down`` its down projection, ``mlp.down_proj`` unless given) as
    ``gemv.experts_kernel`` takes them, or None where it cannot run it: another activation, gate|up
    not stacked, a bias, int / MXFP4 weights, another dtype, a non-contiguous weight."""
    if mlp is None:
        return None
    stack, down = getattr(mlp, "stack", None), down if down is not None else getattr(mlp, "down_proj", None)
    weight = getattr(down, "weight", None)
    if (mlp.act is not silu_and_mul or stack is None or getattr(down, "bias", None) is not None
            or not isinstance(stack.weight, torch.Tensor) or not isinstance(weight, torch.Tensor)
            or stack.weight.dtype != dtype or weight.dtype != dtype
            or not (stack.weight.is_contiguous() and weight.is_contiguous())):
        return None
    return stack.weight, weight


def row_picks(index: torch.Tensor, experts) -> list[tuple[int, int]]:
    """(expert, slot) of a one-row step's picks (``index`` [1, k]) among ``experts``, ascending by expert."""
    return sorted((e, slot) for slot, e in enumerate(index[0].tolist()) if e in experts)


def add_experts(out: torch.Tensor, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, experts,
                run: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``out`` plus, for each of ``experts`` the rows ``x`` picked (``index`` [rows, k]), in ascending
    expert order, ``run(expert, its rows)`` times its router weight. Only the picked experts are
    visited (a decode step's top-k, not all local ones); a one-row step skips the unique / where
    lookups (the same experts, order and sums)."""
    if x.shape[0] == 1:
        for e, slot in row_picks(index, experts):
            out.add_((run(e, x) * weights[:, slot, None]).to(out.dtype))
        return out
    for e in torch.unique(index).tolist():
        if e in experts:
            token, slot = torch.where(index == e)
            out.index_add_(0, token, (run(e, x[token]) * weights[token, slot, None]).to(out.dtype))
    return out


class SparseMoE(nn.Module):
    """Routed experts stored one module per expert (Qwen3-MoE, DeepSeek-V3, Kimi), optional shared experts.

    ``experts`` is keyed by the global expert id, so parameter names equal the
    checkpoint's ``mlp.experts.{e}.gate_proj.weight``; this rank holds only its own.

    Kimi K3's latent MoE (``routed_expert_down_proj`` in ``tensors``): the routed experts work on
    ``down(x)`` (``routed_expert_hidden_size`` wide), their weighted sum is taken in float32, RMS-
    normalised (``routed_expert_norm``) and projected back by ``up``; the shared experts read x.
    The norm needs the sum over every expert, so ``forward`` returns this rank's partial routed
    latent beside its partial shared output (one all-reduce carries both, as vLLM's kimi_k3
    LatentMoERunner does) and ``finish`` turns the reduced pair into the block's output; down, up
    and the norm are whole on every rank. Moonshot's ``modeling_kimi_linear.py``
    ``KimiSparseMoeBlock`` defines the math.
    """

    def __init__(
        self, tensors: dict[str, TensorSpec], moe: MoESpec, shard: Shard, dtype: torch.dtype, router_dtype: torch.dtype,
        quant: Quantization = NONE, act: Activation = silu_and_mul, eps: float = 1e-6,
    ):
        super().__init__()
        self.gate = Router(tensors, "gate", moe, shard, router_dtype)
        templates = {k.removeprefix("experts.{e}."): v for k, v in tensors.items() if k.startswith("experts.{e}.")}
        self.local = local_experts(moe.num_experts, shard.plan, shard.tp_rank)
        self.experts = nn.ModuleDict({str(e): Expert(templates, e, shard, dtype, quant, act) for e in self.local})
        shared = {k.removeprefix("shared_experts."): v for k, v in tensors.items() if k.startswith("shared_experts.")}
        self.shared_experts = DenseMLP(shared, shard, dtype, act) if shared else None
        self.latent = "routed_expert_down_proj.weight" in tensors
        if self.latent:
            self.routed_expert_down_proj = ReplicatedLinear(tensors["routed_expert_down_proj.weight"], shard, dtype)
            self.routed_expert_up_proj = ReplicatedLinear(tensors["routed_expert_up_proj.weight"], shard, dtype)
            norm = tensors.get("routed_expert_norm.weight")
            self.routed_expert_norm = RMSNorm(norm, shard, dtype, eps) if norm is not None else None

    def _routed(self, flat: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                shared: bool = False) -> tuple[torch.Tensor, bool]:
        """(``out`` plus this rank's experts' outputs for rows ``flat``, each times its router weight;
        whether the shared experts' output, times ``shared_gate``, was added too). A one-row step runs
        in one compiled call where ``_row_weights`` allows it, the shared experts (if ``shared`` and
        ``_row_shared`` has them) as its last expert — the order ``forward``'s ``out + shared`` adds
        them in; else expert by expert, the shared experts left to the caller."""
        row = self._row_weights(flat, out) if flat.shape[0] == 1 else None
        if row is None:
            return add_experts(out, flat, index, weights, self.local, lambda e, rows: self.experts[str(e)](rows)), False
        picks = row_picks(index, row)
        if self._row_packed is not None:  # int / MXFP4 experts (runtime.packed_experts); shared experts: the caller's
            if picks:
                self._row_packed(flat[0].contiguous(), [row[e] for e, _ in picks], weights[0], [s for _, s in picks], out[0])
            return out, False
        gate_up, down = [row[e][0] for e, _ in picks], [row[e][1] for e, _ in picks]
        slots, scales = [s for _, s in picks], weights[0]
        fold = shared and self._row_shared is not None
        if fold:  # the shared experts' multiplier joins the router weights, in float32 (as the kernel reads them)
            gate_up.append(self._row_shared[0])
            down.append(self._row_shared[1])
            slots.append(scales.numel())
            gate = self.shared_gate(flat)
            scales = torch.cat([scales.float(), torch.ones(1) if gate is None else gate[0].float()])
        if gate_up:  # the same experts, order and roundings as add_experts' one-row loop
            gemv.experts_kernel(flat.dtype)(flat[0].contiguous(), gate_up, down, scales, slots, out[0])
        return out, fold

    def shared_module(self) -> DenseMLP | None:
        """The shared experts (one gated MLP), or None."""
        return self.shared_experts

    def shared_gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """The multiplier of the shared experts' output for ``x`` ([..., 1], in the run dtype), or None: 1."""
        return None

    def shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """What the shared experts add to the routed sum for ``x`` (their output times ``shared_gate``), or None."""
        mlp = self.shared_module()
        if mlp is None:
            return None
        gate = self.shared_gate(x)
        return mlp(x) if gate is None else gate * mlp(x)

    def _row_weights(self, x: torch.Tensor, out: torch.Tensor) -> dict | None:
        """{expert: (gate|up weight, down weight)} for ``gemv.experts_kernel``, or {expert: its packed (gate, up,
        down)} for ``packed_experts.kernel`` (int8 / int4 / MXFP4 experts: ``self._row_packed``), or None where a
        one-row step runs expert by expert: no kernel for this dtype, not on CPU, inside ``exact.row_blocked()``
        (every product row-invariant there), or experts that are not SwiGLU with stacked gate|up float weights or
        packed ones the int kernel runs (SiLU or SiTU; another activation, biases); ``out`` must be in x's dtype (or,
        packed experts, float32: a latent MoE's sum). Decided at the first one-row step (after loading) and kept."""
        if not gemv.applies(x) or out.dtype not in (x.dtype, torch.float32):
            return None
        if not hasattr(self, "_row"):
            experts = [(e, self.experts[str(e)]) for e in self.local]
            self._row = self._row_shared = self._row_packed = None
            if gemv.experts_kernel(x.dtype) is not None:
                row = {e: _kernel_weights(expert, x.dtype, getattr(expert, expert.parts[2])) for e, expert in experts}
                if all(w is not None for w in row.values()):
                    self._row, self._row_shared = row, _kernel_weights(self.shared_module(), x.dtype)
            acts = {act_args(ex.act) if isinstance(ex, Expert) else None for _, ex in experts}
            if self._row is None and len(acts) == 1 and None not in acts:
                row = {e: packed_experts.expert_parts(expert, x) for e, expert in experts}
                if all(p is not None for p in row.values()):
                    self._row_packed = packed_experts.kernel(x.dtype, *acts)
                    self._row = row if self._row_packed is not None else None
        return self._row if self._row_packed is not None or out.dtype == x.dtype else None  # float: out in x's dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        index, weights = self.gate(flat)
        if self.latent:
            lat = self.routed_expert_down_proj(flat)
            parts = [self._routed(lat, index, weights, torch.zeros(lat.shape, dtype=torch.float32))[0].to(x.dtype)]
            if self.shared_experts is not None:
                parts.append(self.shared_experts(flat))
            return torch.cat(parts, dim=-1).view(*shape[:-1], -1)
        out, shared_added = self._routed(flat, index, weights, torch.zeros_like(flat), shared=True)
        out = out.view(shape)
        shared = None if shared_added else self.shared_output(x)
        return out if shared is None else out + shared

    def finish(self, reduced: torch.Tensor) -> torch.Tensor:
        """The latent block's output from the all-reduced ``forward``: ``up(norm(routed)) + shared``."""
        width = self.routed_expert_down_proj.weight.shape[0]
        routed, shared = reduced[..., :width], reduced[..., width:]
        if self.routed_expert_norm is not None:
            routed = self.routed_expert_norm(routed)
        out = self.routed_expert_up_proj(routed)
        return out + shared if self.shared_experts is not None else out


class FusedExperts(nn.Module):
    """gpt-oss experts as fused tensors of this rank's experts, stored [E_local, out, in].

    gate/up rows are interleaved (gate_j, up_j); the activation is the clamped SwiGLU
    ``(clamp(up, ±limit) + 1) · g · sigmoid(α g)`` with ``g = min(gate, limit)``. The down
    bias is added by the first rank of each expert's tensor-parallel group only.

    From an MXFP4 checkpoint the projections are ``gate_up_proj_blocks`` [E_local, out,
    in/32, 16] + ``gate_up_proj_scales`` [E_local, out, in/32] (likewise ``down_proj_*``),
    the gpt-oss names; biases stay float.
    """

    def __init__(self, tensors: dict[str, TensorSpec], shard: Shard, dtype: torch.dtype, alpha: float, limit: float,
                 first: int, quant: Quantization = NONE):
        super().__init__()
        for name in ("gate_up_proj", "down_proj"):
            tensor = tensors[name]
            if quant.packed(tensor):
                local = shard.shape(tensor)
                setattr(self, f"{name}_blocks", packed_param(tensor, local, BLOCKS, quant))
                setattr(self, f"{name}_scales", packed_param(tensor, local, SCALES, quant))
            else:
                setattr(self, name, shard_param(tensor, shard, dtype))
            setattr(self, f"{name}_bias", shard_param(tensors[f"{name}_bias"], shard, dtype))
        self.count = shard.shape(tensors["gate_up_proj"])[0]
        self.alpha, self.limit, self.first = alpha, limit, first
        self.add_down_bias = shard.etp_rank == 0

    def _project(self, name: str, x: torch.Tensor, i: int, bias: torch.Tensor | None) -> torch.Tensor:
        if name in self._parameters:
            return linear(x, self._parameters[name][i], bias)
        return mxfp4_matmul(x, self._parameters[f"{name}_blocks"][i], self._parameters[f"{name}_scales"][i], bias)

    def _expert(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Local expert ``i``'s output for rows ``x`` (its down bias only on the first rank of its group)."""
        gate_up = self._project("gate_up_proj", x, i, self.gate_up_proj_bias[i])
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return self._project("down_proj", h, i, self.down_proj_bias[i] if self.add_down_bias else None)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        local = range(self.first, self.first + self.count)
        row = self._row_kernel(x) if x.shape[0] == 1 else None
        if row is None:
            return add_experts(torch.zeros_like(x), x, index, weights, local, lambda e, rows: self._expert(rows, e - self.first))
        out, picks = torch.zeros_like(x), row_picks(index, local)  # one call (runtime.packed_experts), as add_experts sums
        if picks:
            i = [e - self.first for e, _ in picks]
            biases = ([self.gate_up_proj_bias[k] for k in i], [self.down_proj_bias[k] for k in i] if self.add_down_bias else [])
            row(x[0].contiguous(), [self._row[k] for k in i], weights[0], [s for _, s in picks], out[0], biases=biases)
        return out

    def _row_kernel(self, x: torch.Tensor):
        """``packed_experts.kernel`` for a one-row step of MXFP4 experts (``self._row``: each expert's packed gate|up
        and down), or None: float experts, inside ``exact.row_blocked()``, no kernel here. Decided once."""
        if not gemv.applies(x):
            return None
        if not hasattr(self, "_row"):
            self._row, self._row_run = None, None
            blocks = self._parameters.get("gate_up_proj_blocks")
            if blocks is not None and packed_kernel(x, blocks) is not None:
                self._row_run = packed_experts.kernel(x.dtype, (2, float(self.alpha), float(self.limit)))
                self._row = [(packed_experts.mxfp4(self.gate_up_proj_blocks[k], self.gate_up_proj_scales[k]), None,
                              packed_experts.mxfp4(self.down_proj_blocks[k], self.down_proj_scales[k])) for k in range(self.count)]
        return self._row_run


class GptOssMoE(nn.Module):
    """gpt-oss MLP: router (with bias) over fused experts."""

    def __init__(self, tensors: dict[str, TensorSpec], moe: MoESpec, shard: Shard, dtype: torch.dtype, alpha: float,
                 limit: float, quant: Quantization = NONE):
        super().__init__()
        self.router = Router(tensors, "router", moe, shard, dtype)
        fused = {k.removeprefix("experts."): v for k, v in tensors.items() if k.startswith("experts.")}
        first = local_experts(moe.num_experts, shard.plan, shard.tp_rank).start
        self.experts = FusedExperts(fused, shard, dtype, alpha, limit, first, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        index, weights = self.router(flat)
        return self.experts(flat, index, weights).view(shape)
