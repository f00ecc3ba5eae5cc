"""An eager, whole-sequence Kimi Linear / Kimi K3 forward for tests: the model's definition written
out plainly, sharing no code with ``shardwise.runtime`` (no caches, no tensor parallelism, no
stacking, no chunked KDA: the delta rule token by token as flash-linear-attention's
``naive_recurrent_kda``, every expert visited in order).

Kimi K3's extensions follow Moonshot's ``modeling_kimi_linear.py`` as its public transcriptions
give it (vLLM's and SGLang's kimi_k3 models, the MLX and tinygrad ports): SiTU-GLU, the
full-rank KDA output gate, the lower-bounded KDA decay (fla ``naive_kda_lowerbound_gate``), the
MLA output gate, the latent MoE and the attention residuals (``_apply_attn_res``). With none of
them set, ``tests/test_runtime_kimi_k3.py`` holds this forward to transformers'
``KimiLinearForCausalLM``: the reference itself is checked against the library on the part the
library defines.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class KimiReference:
    """Logits of a Kimi Linear / K3 checkpoint folder (float32)."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        self.cfg = json.loads((folder / "config.json").read_text())
        self.w = load_file(str(folder / "model.safetensors"))
        c = self.cfg
        self.eps = c["rms_norm_eps"]
        self.lac = c["linear_attn_config"]
        self.beta, self.linear_beta = c.get("activation_situ_beta") or 1.0, c.get("activation_situ_linear_beta")

    def _p(self, name: str) -> torch.Tensor:
        if name in self.w:
            return self.w[name]
        return self.w[name.replace(".mlp.", ".block_sparse_moe.")]  # save_pretrained's name for every MLP

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.cfg.get("hidden_act") != "situ":
            return F.silu(gate) * up
        g = self.beta * torch.tanh(gate / self.beta) * torch.sigmoid(gate)
        u = up if self.linear_beta is None else self.linear_beta * torch.tanh(up / self.linear_beta)
        return g * u

    def _mlp(self, x: torch.Tensor, p: str, names=("gate_proj", "up_proj", "down_proj")) -> torch.Tensor:
        g, u, d = (self._p(f"{p}{n}.weight") for n in names)
        return self._act(x @ g.T, x @ u.T) @ d.T

    def _conv(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv of x [T, C] with w [C, 1, K], then SiLU."""
        k = w.shape[-1]
        padded = F.pad(x.T, (k - 1, 0))
        return F.silu(F.conv1d(padded[None], w, groups=x.shape[1])[0].T)

    def _kda(self, x: torch.Tensor, p: str) -> torch.Tensor:
        heads, d = self.lac["num_heads"], self.lac["head_dim"]
        t = x.shape[0]
        q, k, v = (self._conv(x @ self._p(f"{p}{n}_proj.weight").T, self._p(f"{p}{n}_conv1d.weight")) for n in "qkv")
        q, k, v = (z.view(t, heads, d) for z in (q, k, v))
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * d**-0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        raw = ((x @ self._p(f"{p}f_a_proj.weight").T) @ self._p(f"{p}f_b_proj.weight").T).view(t, heads, d)
        raw = raw + self._p(f"{p}dt_bias").view(heads, d)
        a = self._p(f"{p}A_log").reshape(heads, 1).exp()
        bound = self.lac.get("gate_lower_bound")
        g = bound * torch.sigmoid(a * raw) if bound is not None else -a * F.softplus(raw)
        beta = torch.sigmoid(x @ self._p(f"{p}b_proj.weight").T)
        state = torch.zeros(heads, d, d)
        outs = []
        for i in range(t):
            state = state * g[i].exp()[..., None]
            state = state + torch.einsum("hk,hv->hkv", beta[i][:, None] * k[i], v[i] - (k[i][..., None] * state).sum(-2))
            outs.append(torch.einsum("hk,hkv->hv", q[i], state))
        o = torch.stack(outs)
        if self.lac.get("use_full_rank_gate"):
            gate = x @ self._p(f"{p}g_proj.weight").T
        else:
            gate = (x @ self._p(f"{p}g_a_proj.weight").T) @ self._p(f"{p}g_b_proj.weight").T
        o = _rms(o, self._p(f"{p}o_norm.weight"), self.eps) * torch.sigmoid(gate.view(t, heads, d))
        return o.reshape(t, -1) @ self._p(f"{p}o_proj.weight").T

    def _mla(self, x: torch.Tensor, p: str) -> torch.Tensor:
        c = self.cfg
        heads, nope, rope, vd, rank = (c[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                                      "v_head_dim", "kv_lora_rank"))
        t = x.shape[0]
        if c.get("q_lora_rank"):
            q = _rms(x @ self._p(f"{p}q_a_proj.weight").T, self._p(f"{p}q_a_layernorm.weight"), 1e-6)
            q = q @ self._p(f"{p}q_b_proj.weight").T
        else:
            q = x @ self._p(f"{p}q_proj.weight").T
        q = q.view(t, heads, nope + rope).transpose(0, 1)
        kv = x @ self._p(f"{p}kv_a_proj_with_mqa.weight").T
        latent, k_rot = kv[:, :rank], kv[:, rank:]
        kv = (_rms(latent, self._p(f"{p}kv_a_layernorm.weight"), 1e-6) @ self._p(f"{p}kv_b_proj.weight").T)
        kv = kv.view(t, heads, nope + vd).transpose(0, 1)
        keys = torch.cat([kv[..., :nope], k_rot[None].expand(heads, -1, -1)], dim=-1)
        scores = (q @ keys.transpose(-1, -2)) * (nope + rope) ** -0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        o = (scores.softmax(-1) @ kv[..., nope:]).transpose(0, 1).reshape(t, -1)
        if c.get("mla_use_output_gate"):
            o = o * torch.sigmoid(x @ self._p(f"{p}g_proj.weight").T)
        return o @ self._p(f"{p}o_proj.weight").T

    def _moe(self, x: torch.Tensor, p: str) -> torch.Tensor:
        c = self.cfg
        scores = torch.sigmoid(x.float() @ self._p(f"{p}gate.weight").float().T)
        choice = scores + self._p(f"{p}gate.e_score_correction_bias")
        n_group, top_group = c.get("num_expert_group", 1), c.get("topk_group", 1)
        if n_group > 1 and n_group > top_group:
            grouped = choice.view(x.shape[0], n_group, -1)
            best = grouped.topk(2, dim=-1)[0].sum(-1).topk(top_group, dim=-1)[1]
            keep = torch.zeros(x.shape[0], n_group, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep[..., None].expand_as(grouped).reshape(choice.shape), float("-inf"))
        idx = choice.topk(c["num_experts_per_token"], dim=-1)[1]
        weight = scores.gather(1, idx)
        if c.get("moe_renormalize", True):
            weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
        weight = weight * c.get("routed_scaling_factor", 1.0)
        latent = c.get("routed_expert_hidden_size") is not None
        h = x @ self._p(f"{p}routed_expert_down_proj.weight").T if latent else x
        out = torch.zeros(h.shape)
        for e in range(c["num_experts"]):
            token, slot = torch.where(idx == e)
            if len(token):
                y = self._mlp(h[token], f"{p}experts.{e}.", ("w1", "w3", "w2")) * weight[token, slot, None]
                out = out.index_add(0, token, y)
        if latent:
            if c.get("latent_moe_use_norm"):
                out = _rms(out, self._p(f"{p}routed_expert_norm.weight"), self.eps)
            out = out @ self._p(f"{p}routed_expert_up_proj.weight").T
        if c.get("num_shared_experts"):
            out = out + self._mlp(x, f"{p}shared_experts.")
        return out

    def _mix(self, prefix: torch.Tensor, blocks: list[torch.Tensor], stem: str) -> torch.Tensor:
        """``_apply_attn_res``: softmax over the snapshots and the running sum of
        (RMSNorm(v) · norm.weight · proj.weight), the candidates mixed by it."""
        v = torch.stack([*blocks, prefix], dim=1)  # [T, n, H]
        k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self._p(f"{stem}_norm.weight") * self._p(f"{stem}_proj.weight").reshape(-1)
        probs = (k * w).sum(-1).softmax(-1)
        return (probs[:, None] @ v)[:, 0]

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        c = self.cfg
        x = self.w["model.embed_tokens.weight"][torch.tensor(ids)]
        kda = set(self.lac["kda_layers"])
        block = c.get("attn_res_block_size")
        blocks: list[torch.Tensor] = []
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            mixer = self._kda if i + 1 in kda else self._mla
            moe = c.get("num_experts") and i >= c.get("first_k_dense_replace", 0)
            mlp = (lambda h, p=p: self._moe(h, p + "block_sparse_moe.")) if moe else (lambda h, p=p: self._mlp(h, p + "mlp."))
            norm_in, norm_post = self._p(p + "input_layernorm.weight"), self._p(p + "post_attention_layernorm.weight")
            if block is None:
                x = x + mixer(_rms(x, norm_in, self.eps), p + "self_attn.")
                x = x + mlp(_rms(x, norm_post, self.eps))
                continue
            prefix = x
            h = self._mix(prefix, blocks, p + "self_attention_res") if blocks else prefix
            running = prefix
            if i % block == 0:
                blocks, running = [*blocks, prefix], None
            a = mixer(_rms(h, norm_in, self.eps), p + "self_attn.")
            running = a if running is None else running + a
            h = self._mix(running, blocks, p + "mlp_res")
            x = running + mlp(_rms(h, norm_post, self.eps))
        if block is not None:
            x = self._mix(x, blocks, "model.output_attn_res")
        x = _rms(x, self.w["model.norm.weight"], self.eps)
        head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        return x @ head.T
