"""Where a ModelSpec tensor is stored in a checkpoint, when its name or shape there differs from
the ModelSpec's.

Kimi Linear (``kimi_linear``) checkpoints — Moonshot's and what transformers' ``save_pretrained``
writes (it reverses its load-time conversion) — keep the MoE block under
``model.layers.N.block_sparse_moe.`` (router ``gate``, experts ``experts.E.w1/w3/w2``,
``shared_experts``) and the KDA ``A_log`` as [1, 1, heads, 1]. The dense first layer's MLP is
``mlp.`` in Moonshot's checkpoint but ``block_sparse_moe.`` in one saved by transformers, which
renames every ``.mlp.`` back; reading a checkpoint, whichever of the two it holds is taken.

Every rule is a no-op when the ModelSpec already uses the stored name and shape, so the planner
can adopt the checkpoint's names without a change here.
"""

from __future__ import annotations

from collections.abc import Callable

from shardwise.spec.model import DENSE_MLP, LATENT_PROJ, ROUTED_EXPERTS, ROUTER, SHARED_EXPERTS, TensorSpec

KIMI_MOE = ".block_sparse_moe."
_MOE_GROUPS = (ROUTER, ROUTED_EXPERTS, SHARED_EXPERTS, LATENT_PROJ)


def stored_name(family: str, tensor: TensorSpec, name: str, held: Callable[[str], bool] | None = None) -> str:
    """The checkpoint name of ``name`` (``tensor``'s name, an expert's copy of it, or a name derived
    from it such as ``...weight_packed``); ``held`` says whether a checkpoint has a name."""
    if family != "kimi_linear" or ".mlp." not in name:
        return name
    moe = name.replace(".mlp.", KIMI_MOE, 1)
    preferred, other = (moe, name) if tensor.group in _MOE_GROUPS else (name, moe)
    if held is not None and not held(preferred) and tensor.group in _MOE_GROUPS + (DENSE_MLP,) and held(other):
        return other
    return preferred


def stored_shape(family: str, tensor: TensorSpec, held_shape: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The shape ``tensor`` is stored with (``held_shape``: the checkpoint's, when it has the tensor)."""
    if family == "kimi_linear" and tensor.name.endswith(".A_log") and len(tensor.shape) == 1:
        return tensor.shape if held_shape == tensor.shape else (1, 1, tensor.shape[0], 1)
    return tensor.shape
