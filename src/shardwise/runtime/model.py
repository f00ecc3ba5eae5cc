"""A decoder-only transformer built from a ModelSpec, holding one rank's shard.

Module and parameter names follow the Hugging Face checkpoints (``model.layers.3.self_attn
.q_proj.weight``, ``model.layers.3.mlp.experts.17.down_proj.weight``), so the model file reads
like transformers' and the loader fills parameters by name. Families: ``llama``,
``qwen3_moe``, ``deepseek_v3`` (and Kimi K2, the same architecture), ``gpt_oss`` and
``kimi_linear`` (KDA linear-attention layers, ``runtime.kda``, + NoPE MLA layers + DeepSeek-style
MoE; with Kimi K3's extensions: SiTU-GLU, the latent MoE, the MLA output gate, the full-rank and
lower-bounded KDA gates, and attention residuals, ``DecoderLayer.forward_res``) and ``qwen3_5_moe``
(Gated DeltaNet + gated attention layers, gated shared expert: ``runtime.qwen3_5``, ``runtime.deltanet``).

Per layer and token: one all-reduce after attention and one after the MLP / MoE block
(routed + shared experts + expert biases in the same one; K3's routed latent beside the shared
output, finished after the sum: ``SparseMoE.finish``), both through
``layers.allreduce`` via the layer's ``reduce_attn`` / ``reduce_mlp`` hooks (which
``runtime.trace`` replaces with timed versions while tracing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.plan import ParallelPlan, validate_plan
from shardwise.runtime.attention import GQAttention, MLAttention
from shardwise.runtime.deltanet import GatedDeltaNet
from shardwise.runtime.kda import KimiDeltaAttention
from shardwise.runtime.layers import (
    ReplicatedLinear,
    RotaryEmbedding,
    Shard,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    allreduce,
    rope_parameters,
    stack_inputs,
)
from shardwise.runtime.moe import DenseMLP, GptOssMoE, SparseMoE, activation
from shardwise.runtime.packed_weights import quantization
from shardwise.runtime.qwen3_5 import GatedAttention, OffsetRMSNorm, build_layer, rotary_dim
from shardwise.runtime.rms_norm import RMSNorm
from shardwise.runtime.token_step import token_step
from shardwise.spec.model import EMBEDDING, LM_HEAD, LayerSpec, ModelSpec, TensorSpec

SLOT_MIXERS = (GQAttention, MLAttention, KimiDeltaAttention, GatedDeltaNet, GatedAttention)
"""Mixers that take per-row cache slots and positions (``ShardedCausalLM.forward(ids, start, slots)``)."""

RUNTIME_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "kimi_linear", "qwen3_5_moe")


def kimi_unsupported(cfg) -> list[str]:
    """The settings of a kimi_linear config the runtime cannot run (empty: it runs it). Kimi K3's
    extensions (situ, attention residuals, latent MoE, the MLA output gate, the full-rank and
    lower-bounded KDA gates) it runs, as Moonshot's ``modeling_kimi_linear.py`` defines them."""
    out = []
    if cfg.get("hidden_act", "silu") not in ("silu", "situ"):
        out.append(f"hidden_act '{cfg.get('hidden_act')}'")
    if cfg.get("mla_use_nope", True) is False:
        out.append("mla_use_nope false")
    if cfg.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        out.append(f"moe_router_activation_func '{cfg.get('moe_router_activation_func')}'")
    return out


def attn_res_mix(prefix: torch.Tensor, blocks: list[torch.Tensor], norm: nn.Module, proj: nn.Module, eps: float) -> torch.Tensor:
    """Kimi K3's attention residual: the running sum ``prefix`` [..., hidden] and the block snapshots
    ``blocks`` mixed by a softmax over the candidates of ``(RMSNorm(v) · norm.weight · proj.weight)``,
    in float32, cast back (Moonshot's ``_apply_attn_res``). The mix is summed candidate by
    candidate, so a row's result does not depend on the other rows in the call."""
    v = [b.float() for b in blocks] + [prefix.float()]
    w = norm.weight.float() * proj.weight.float().reshape(-1)
    scores = torch.stack([(c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps) * w).sum(-1) for c in v], dim=-1)
    probs = scores.softmax(-1)
    out = probs[..., 0:1] * v[0]
    for j in range(1, len(v)):
        out = out + probs[..., j : j + 1] * v[j]
    return out.to(prefix.dtype)


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """torch dtype for 'float32' / 'bfloat16' / 'float16' (or their short names)."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ShardwiseError(f"unknown dtype '{name}': use float32, bfloat16 or float16") from None


def param_dtype(spec: ModelSpec, tensor: TensorSpec, dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of one parameter: the run dtype, except the groups transformers keeps in
    float32 (``ModelSpec.float32_groups``: DeepSeek-V3's router and correction bias, gpt-oss's
    RMSNorm weights; the planner's ``ModelSpec.run_formats`` reads the same field) and single
    tensors marked ``TensorSpec.keep_float32`` (Kimi's ``dt_bias``; the planner prices them so)."""
    return torch.float32 if tensor.keep_float32 or tensor.group in spec.float32_groups else dtype


def check_runnable(spec: ModelSpec, plan: ParallelPlan) -> None:
    """Raise a one-line ShardwiseError when the runtime cannot run ``spec`` under ``plan``."""
    validate_plan(spec, plan)
    if spec.family not in RUNTIME_FAMILIES:
        raise ShardwiseError(
            f"model_type '{spec.model_type}' can be planned but not run: the runtime runs "
            "llama, mistral, qwen2, qwen3, qwen3_moe, deepseek_v3 / kimi_k2, gpt_oss, kimi_linear and qwen3_5_moe"
        )
    if plan.pp != 1:
        raise ShardwiseError(f"--pp {plan.pp}: the runtime does not run pipeline stages yet, use --pp 1")
    quantization(spec)  # a one-line error for quantization layouts the runtime cannot read
    cfg = spec.config
    if spec.family == "kimi_linear" and kimi_unsupported(cfg):
        raise ShardwiseError(
            f"{spec.name} cannot be run: config.json sets {', '.join(kimi_unsupported(cfg))}, which the runtime "
            "does not implement; it can be planned"
        )
    if spec.family not in ("gpt_oss", "kimi_linear") and cfg.get("hidden_act", "silu") != "silu":
        raise ShardwiseError(f"config.json hidden_act '{cfg.get('hidden_act')}' is not supported: the runtime runs silu")
    if spec.family == "qwen3_5_moe" and cfg.get("attention_bias", False):
        raise ShardwiseError("config.json attention_bias true is not supported for qwen3_5_moe: use false")
    if spec.family == "deepseek_v3" and cfg.get("attention_bias", False):
        raise ShardwiseError("config.json attention_bias true is not supported for deepseek_v3: use false")
    if spec.family == "qwen3_moe" and cfg.get("use_sliding_window", False):
        raise ShardwiseError("config.json use_sliding_window true is not supported for qwen3_moe: use false")


def _local(tensors: tuple[TensorSpec, ...], prefix: str) -> dict[str, TensorSpec]:
    """TensorSpecs under ``prefix`` keyed by the rest of their name."""
    return {t.name[len(prefix):]: t for t in tensors if t.name.startswith(prefix)}


class _Dtyped:
    """Picks each parameter's storage dtype while the modules are built."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        self.spec, self.dtype = spec, dtype

    def of(self, tensor: TensorSpec) -> torch.dtype:
        return param_dtype(self.spec, tensor, self.dtype)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + Σ attn(norm(x))``; ``out = h + Σ mlp(norm(h))``."""

    def __init__(
        self, spec: ModelSpec, layer: LayerSpec, shard: Shard, dtype: torch.dtype, max_seq_len: int, max_batch: int,
        max_step_tokens: int = 1,
    ):
        super().__init__()
        if spec.family == "qwen3_5_moe":  # Gated DeltaNet / gated attention + gated shared expert: runtime.qwen3_5
            build_layer(self, spec, layer, shard, dtype, max_seq_len=max_seq_len, max_batch=max_batch,
                        max_step_tokens=max_step_tokens)
            return
        t = _local(layer.tensors, f"model.layers.{layer.index}.")
        dt = _Dtyped(spec, dtype)
        eps, gpt_oss = spec.rms_norm_eps, spec.family == "gpt_oss"
        self.input_layernorm = RMSNorm(t["input_layernorm.weight"], shard, dt.of(t["input_layernorm.weight"]), eps, gpt_oss)
        self.post_attention_layernorm = RMSNorm(
            t["post_attention_layernorm.weight"], shard, dt.of(t["post_attention_layernorm.weight"]), eps, gpt_oss
        )
        attn = _local(layer.tensors, f"model.layers.{layer.index}.self_attn.")
        cfg = spec.config
        if layer.attention == "kda":
            la = spec.linear_attention
            assert la is not None
            bound = (cfg.get("linear_attn_config") or {}).get("gate_lower_bound")
            self.self_attn = KimiDeltaAttention(
                attn, shard, dtype, head_dim=la.key_head_dim, kernel=la.conv_kernel, eps=eps, max_batch=max_batch,
                max_step_tokens=max_step_tokens, lower_bound=None if bound is None else float(bound),
            )
        elif layer.attention in ("mla", "gated_mla"):
            mla = spec.mla
            assert mla is not None
            scaling = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
            rope = rope_parameters(cfg)
            if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
                factor = rope["factor"]
                m = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
                scaling = scaling * m * m
            self.self_attn = MLAttention(
                attn, shard, dtype, kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
                qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim, scaling=scaling,
                interleaved_rope=bool(cfg.get("rope_interleave", True)), eps=1e-6,
                max_seq_len=max_seq_len, max_batch=max_batch, rope=spec.family != "kimi_linear",  # Kimi: NoPE
            )
        else:
            self.self_attn = GQAttention(
                attn, shard, dtype, head_dim=spec.head_dim, eps=eps, max_seq_len=max_seq_len,
                max_batch=max_batch, window=layer.window if layer.attention == "sliding" else None,
                max_step_tokens=max_step_tokens,
            )
        mlp = _local(layer.tensors, f"model.layers.{layer.index}.mlp.") or _local(
            layer.tensors, f"model.layers.{layer.index}.block_sparse_moe."  # Kimi Linear's checkpoint name
        )
        act = activation(cfg)
        if layer.mlp == "dense":
            self.mlp = DenseMLP(mlp, shard, dtype, act)
        elif gpt_oss:
            assert spec.moe is not None
            alpha, limit = float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))
            self.mlp = GptOssMoE(mlp, spec.moe, shard, dtype, alpha, limit, quantization(spec))
        else:
            assert spec.moe is not None
            router_dtype = dt.of(mlp["gate.weight"])
            self.mlp = SparseMoE(mlp, spec.moe, shard, dtype, router_dtype, quantization(spec), act, eps)
        self.attn_res_block = cfg.get("attn_res_block_size")  # Kimi K3's attention residuals (forward_res)
        if self.attn_res_block is not None:
            self.index, self.eps = layer.index, eps
            for stem in ("self_attention_res", "mlp_res"):
                setattr(self, f"{stem}_norm", RMSNorm(t[f"{stem}_norm.weight"], shard, dtype, eps))
                setattr(self, f"{stem}_proj", ReplicatedLinear(t[f"{stem}_proj.weight"], shard, dtype))

        # The two all-reduce hooks: the plain ``layers.allreduce`` unless a ``trace.Tracer``
        # swaps in timed versions (and puts these back when it detaches).
        self.reduce_attn = allreduce
        self.reduce_mlp = allreduce

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
        slots: list[int] | None = None,
    ) -> torch.Tensor:
        """x [B, T, hidden] at ``positions`` [T], or with ``slots`` (``ShardedCausalLM.supports_slots``
        models only) at ``positions`` [B, T] in those cache slots."""
        h = x + self.attention_out(x, positions, rope, slots)
        return h + self.mlp_out(h)

    def attention_out(self, x: torch.Tensor, positions: torch.Tensor, rope, slots: list[int] | None) -> torch.Tensor:
        """The token mixer's output on ``norm(x)``, summed over the ranks."""
        per_row = () if slots is None else (slots,)
        return self.reduce_attn(self.self_attn(self.input_layernorm(x), positions, rope, *per_row).contiguous())

    def mlp_out(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP / MoE output on ``norm(h)``, summed over the ranks (a latent MoE finishes after the sum)."""
        out = self.reduce_mlp(self.mlp(self.post_attention_layernorm(h)).contiguous())
        return self.mlp.finish(out) if getattr(self.mlp, "latent", False) else out

    def forward_res(
        self, prefix: torch.Tensor, blocks: list[torch.Tensor], positions: torch.Tensor, rope,
        slots: list[int] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Kimi K3's layer with attention residuals (Moonshot's ``_forward_attn_residual``): the input
        of each block is a learned mix of the block snapshots and the running sum ``prefix``; a layer
        opening a block of ``attn_res_block_size`` snapshots ``prefix`` and restarts the sum.
        Returns (the running sum after this layer, the snapshots)."""
        h = attn_res_mix(prefix, blocks, self.self_attention_res_norm, self.self_attention_res_proj, self.eps) if blocks else prefix
        running: torch.Tensor | None = prefix
        if self.index % self.attn_res_block == 0:
            blocks, running = [*blocks, prefix], None
        a = self.attention_out(h, positions, rope, slots)
        running = a if running is None else running + a
        h = attn_res_mix(running, blocks, self.mlp_res_norm, self.mlp_res_proj, self.eps)
        return running + self.mlp_out(h), blocks


class ShardedCausalLM(nn.Module):
    """One rank's shard of a causal LM.

    ``forward(ids, start)`` runs tokens ``ids [B, T]`` at positions ``start..start+T-1``
    through the model, writing the static KV cache (rows 0..B-1), and returns the final hidden
    states [B, T, hidden]; ``lm_head.greedy`` / ``lm_head.logits`` turn them into tokens or
    full-vocabulary logits. Parameters are allocated empty: fill them with ``loader.load_shard``.

    ``forward(ids, start, slots)`` (continuous batching) runs B sequences at once, each in its
    own cache slot (``slots[i]``, one of the ``max_batch`` built: ``0..max_batch-1``) at its own
    positions (``start[i]..start[i]+T-1``, ``start`` an int or one per row). Each row's
    attention runs alone, as a one-row call would; under ``exact.row_blocked()`` the
    projections and experts are row-invariant too, so row i is bit-identical to
    ``forward(ids[i:i+1], start[i], [slots[i]])`` and a sequence decodes to the same bits
    whichever others share its steps. A slot restarted at position 0 reads nothing of what it
    held before. Linear-attention layers (KDA, Gated DeltaNet) keep their recurrent state and
    conv window per slot (``linear_state.LinearStateCache``) and run each row's recurrence alone:
    the chunked form for a row at position 0, the recurrent form position by position otherwise,
    as that row's one-row call does.

    Full-attention caches hold ``max_seq_len`` positions. Sliding-window layers hold a ring
    of ``min(max_seq_len, window + max_step_tokens - 1)`` positions, where
    ``max_step_tokens`` is the most positions a decode / verify call writes that a later
    call may roll back (1 for plain decoding, k + 1 for speculative decoding with k drafts):
    enough for any later call to find its window however far back it restarts within that
    step. Prefill may write any number of positions from 0.
    """

    def __init__(
        self,
        spec: ModelSpec,
        plan: ParallelPlan,
        rank: int = 0,
        dtype: torch.dtype | str = torch.float32,
        max_seq_len: int = 256,
        max_batch: int = 1,
        max_step_tokens: int = 1,
    ):
        super().__init__()
        check_runnable(spec, plan)
        if max_step_tokens < 1:
            raise ShardwiseError(f"max_step_tokens must be >= 1, got {max_step_tokens}")
        dtype = torch_dtype(dtype)
        self.spec, self.plan, self.dtype, self.max_seq_len = spec, plan, dtype, max_seq_len
        self.max_batch, self.max_step_tokens = max_batch, max_step_tokens
        shard = self.shard = Shard(plan, rank)
        dt = _Dtyped(spec, dtype)
        glob = {t.group: t for t in spec.globals if t.group in (EMBEDDING, LM_HEAD)}
        norm = next(t for t in spec.globals if t.name.endswith(".norm.weight"))  # the final norm
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(glob[EMBEDDING], shard, dtype)
        self.model.layers = nn.ModuleList(
            DecoderLayer(spec, layer, shard, dtype, max_seq_len, max_batch, max_step_tokens) for layer in spec.layers
        )
        self.model.norm = (OffsetRMSNorm if spec.family == "qwen3_5_moe" else RMSNorm)(
            norm, shard, dt.of(norm), spec.rms_norm_eps, spec.family == "gpt_oss"
        )
        self.attn_res = spec.config.get("attn_res_block_size") is not None
        if self.attn_res:  # Kimi K3: the last mix of the snapshots and the running sum, before the norm
            out = {t.name.removeprefix("model."): t for t in spec.globals if "output_attn_res" in t.name}
            self.model.output_attn_res_norm = RMSNorm(out["output_attn_res_norm.weight"], shard, dtype, spec.rms_norm_eps)
            self.model.output_attn_res_proj = ReplicatedLinear(out["output_attn_res_proj.weight"], shard, dtype)
        self.lm_head = VocabParallelLMHead(glob.get(LM_HEAD), shard, dtype, tied=self.model.embed_tokens)
        rope_dim = spec.mla.qk_rope_head_dim if spec.mla is not None else rotary_dim(spec)  # partial rotary
        self.rotary = RotaryEmbedding(rope_parameters(spec.config), rope_dim, max_seq_len, spec.max_position_embeddings)

    @property
    def supports_slots(self) -> bool:
        """Whether ``forward`` takes any batch of cache slots: every layer's mixer keeps its cache or
        state per slot (``SLOT_MIXERS``; true of every runtime family)."""
        return all(isinstance(layer.self_attn, SLOT_MIXERS) for layer in self.model.layers)

    def forward(
        self, ids: torch.Tensor, start: int | Sequence[int] = 0, slots: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Hidden states [B, T, hidden] of tokens ``ids`` [B, T]; see the class docstring for
        ``start`` (first position, counted in tokens from 0) and ``slots``."""
        n = ids.shape[1]
        if slots is not None:
            slots, starts = self._check_slots(ids, start, slots)
            step = token_step(self, slots[0]) if ids.shape == (1, 1) else None
            if step is not None:  # one token of one sequence: the layers as bound calls (runtime.token_step)
                positions = torch.arange(starts[0], starts[0] + 1)
                return step(self.model.embed_tokens(ids), positions, self.rotary(positions, self.dtype), slots[0])
            positions = torch.tensor(starts)[:, None] + torch.arange(n)  # [B, T]
            cos, sin = self.rotary(positions, self.dtype)
            return self._run(ids, positions, (cos.unsqueeze(1), sin.unsqueeze(1)), slots)
        if isinstance(start, Sequence):
            raise ShardwiseError("a start per row needs slots: pass the cache slot of each row")
        if start + n > self.max_seq_len:
            raise ShardwiseError(
                f"sequence of {start + n} tokens exceeds the KV cache of {self.max_seq_len}: raise max_seq_len"
            )
        positions = torch.arange(start, start + n)
        return self._run(ids, positions, self.rotary(positions, self.dtype), None)

    def stack_projections(self) -> None:
        """Once the weights are loaded: each block's projections of its input (its
        ``input_projections``: q|k|v, gate|up, ...) that can share one product get their weights
        stacked (``layers.stack_inputs``)."""
        for module in self.modules():
            if hasattr(module, "input_projections"):
                stack_inputs(module)
        self.__dict__.pop("_token_step", None)  # it bound the weights as they were

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
             slots: list[int] | None) -> torch.Tensor:
        """Embedding, the layers and the final norm of ``ids`` at ``positions`` (in ``slots``)."""
        h = self.model.embed_tokens(ids)
        if self.attn_res:
            blocks: list[torch.Tensor] = []
            for layer in self.model.layers:
                h, blocks = layer.forward_res(h, blocks, positions, rope, slots)
            m = self.model
            h = attn_res_mix(h, blocks, m.output_attn_res_norm, m.output_attn_res_proj, self.spec.rms_norm_eps)
            return m.norm(h)
        step = token_step(self) if slots is None and h.shape[:2] == (1, 1) else None
        if step is not None:  # one token of one sequence: the layers as bound calls (runtime.token_step)
            return step(h, positions, rope)
        for layer in self.model.layers:
            h = layer(h, positions, rope, slots)
        return self.model.norm(h)

    def _check_slots(
        self, ids: torch.Tensor, start: int | Sequence[int], slots: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """(slots, each row's first position) as ints; a one-line ShardwiseError for a bad slot or start."""
        b, n = ids.shape
        slots = [int(s) for s in slots]
        starts = [int(p) for p in start] if isinstance(start, Sequence) else [int(start)] * b
        if len(slots) != b or len(starts) != b:
            raise ShardwiseError(
                f"{b} rows need one slot and one start each: got {len(slots)} slots and {len(starts)} starts"
            )
        if not self.supports_slots:
            raise ShardwiseError(f"{self.spec.name} takes no cache slots: a layer's mixer keeps one cache for all rows")
        for i, (slot, first) in enumerate(zip(slots, starts)):
            if not 0 <= slot < self.max_batch:
                raise ShardwiseError(f"slot {slot} is out of range: the model holds cache slots 0..{self.max_batch - 1}")
            if slots.count(slot) > 1:
                raise ShardwiseError(f"slot {slot} appears more than once in slots: each row needs its own cache slot")
            if first < 0 or first + n > self.max_seq_len:
                raise ShardwiseError(
                    f"row {i} (slot {slot}) covers positions {first}..{first + n - 1}, outside the KV cache's "
                    f"0..{self.max_seq_len - 1}: raise max_seq_len"
                )
        return slots, starts

    def logits(
        self, ids: torch.Tensor, start: int | Sequence[int] = 0, slots: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Full-vocabulary logits [B, T, vocab] for ``ids`` at ``start`` (in ``slots``; every rank gets them)."""
        return self.lm_head.logits(self(ids, start, slots))

    def check_step_tokens(self, n: int) -> None:
        """Raise a one-line ShardwiseError unless passes of ``n`` positions may be rolled back
        (speculative verify): the sliding-window rings and the linear-attention state snapshots
        (``linear_state.LinearStateCache``) were sized for ``max_step_tokens``."""
        if n <= self.max_step_tokens:
            return
        if any(getattr(layer.self_attn, "recurrent", False) for layer in self.model.layers):
            raise ShardwiseError(
                f"passes of {n} positions need the model built with max_step_tokens >= {n} (it has "
                f"{self.max_step_tokens}): its linear-attention layers keep the states of that many positions"
            )
        rings = [
            layer.self_attn.cache_len for layer in self.model.layers
            if getattr(layer.self_attn, "window", None) is not None and layer.self_attn.cache_len < self.max_seq_len
        ]
        if rings:
            raise ShardwiseError(
                f"passes of {n} positions need the model built with max_step_tokens >= {n} (it has "
                f"{self.max_step_tokens}): its sliding-window caches hold {min(rings)} positions"
            )

    def param_bytes(self) -> int:
        """Bytes of parameters this rank holds (tied weights counted once)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def cache_bytes(self) -> int:
        """Bytes of this rank's static KV / latent cache (sliding layers: their rings; linear-attention
        layers: their recurrent and conv states)."""
        return sum(b.numel() * b.element_size() for name, b in self.named_buffers() if "cache" in name)
