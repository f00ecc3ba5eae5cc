"""Where a ModelSpec tensor is stored in a checkpoint, when its name there can differ from the
ModelSpec's.

Kimi Linear (``kimi_linear``): the ModelSpec names the MoE block ``block_sparse_moe.`` and the dense
first layer's MLP ``mlp.``, as Moonshot's checkpoint does; one saved by transformers'
``save_pretrained`` renames every ``.mlp.`` to ``.block_sparse_moe.``, the dense layer's too.
Reading a checkpoint, whichever of the two it holds is taken.
"""

from __future__ import annotations

from collections.abc import Callable

KIMI_MOE = ".block_sparse_moe."


def stored_name(family: str, name: str, held: Callable[[str], bool] | None = None) -> str:
    """The checkpoint name of ``name`` (a tensor's name, an expert's copy of it, or a name derived
    from it such as ``...weight_packed``); ``held`` says whether a checkpoint has a name (None:
    writing one, in Moonshot's naming)."""
    if family != "kimi_linear" or ".mlp." not in name:
        return name
    saved = name.replace(".mlp.", KIMI_MOE, 1)  # a dense MLP as transformers' save_pretrained names it
    return saved if held is not None and not held(name) and held(saved) else name
