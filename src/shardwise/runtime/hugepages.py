"""A CPU model's weights in transparent huge pages (Linux, 2 MB pages).

A decode step streams every weight from memory once. In 4 KB pages that is a TLB miss every 64
cache lines and a hardware prefetcher that stops at every page boundary; torch's allocator asks
for huge pages only when ``THP_MEM_ALLOC_ENABLE=1`` is set before the process starts, and a host
whose THP setting is ``madvise`` (the common default) then gives none. ``place(model)`` copies the
model's large weights into one anonymous private mapping advised ``MADV_HUGEPAGE`` and points every
tensor at its copy (``Tensor.set_``: views, stacked projections and tied weights stay what they
were to each other), so the weights are read from 2 MB pages however the process was started.
Measured on an AMD EPYC (Zen 4) VM, two threads, 600 MB of a decoder's bfloat16 weight shapes
cycled, side by side in one process: ``torch.sum`` read 25-27 GB/s in 4 KB pages, 30-31 in huge
pages.

Storages from ``SMALLEST_MOVED`` bytes up move (packed one after another, each 4 KB aligned), not only those
of a huge page or more: an int4 checkpoint's group scales are 11% of its bytes, in stacked storages of 0.26-1.4 MB
on the 2048x10 llama, each read every token beside its weights. Measured there (the 41 products of one int4 decode
token, 0.29 GB, two threads, 40 rounds in shuffled order, two runs): median 13.14 / 12.95 ms with the scales in 4 KB
pages, 12.74 / 12.47 with them in the arena. Smaller storages (norm vectors) stay; so does everything where the
kernel gives no huge pages (``/sys/kernel/mm/transparent_hugepage/enabled`` is ``never`` or absent, or ``madvise``
refuses), and tensors off the CPU.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

__all__ = ["HUGE_PAGE", "SMALLEST_MOVED", "arena", "available", "place"]

HUGE_PAGE = 2 * 1024 * 1024
"""Bytes of one transparent huge page on x86-64 and most arm64 kernels."""
SMALLEST_MOVED = 64 * 1024
"""Bytes of the smallest weight storage ``place`` moves."""
_ALIGN = 4096
"""Bytes each moved storage's start is aligned to in the mapping (a whole number of any element size)."""
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether this kernel hands out transparent huge pages to a mapping that asks (THP ``always`` or
    ``madvise``) and Python can ask (``mmap.MADV_HUGEPAGE``)."""
    try:
        setting = _THP_SETTING.read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in setting


def arena(nbytes: int) -> torch.Tensor | None:
    """A uint8 tensor of ``nbytes`` over a fresh anonymous private mapping advised ``MADV_HUGEPAGE``
    (its pages are mapped on first write), or None where huge pages are not ``available``. The
    mapping lives as long as any tensor over it."""
    if not available() or nbytes <= 0:
        return None
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        memory.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        memory.close()
        return None
    return torch.frombuffer(memory, dtype=torch.uint8)


def _weights(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every weight the model holds: each module's parameters and the weights of stacked projections
    (``layers.Stack``, a plain attribute). Buffers (caches, recurrent state) stay where they are: they
    are written, and a view of one kept elsewhere would go on writing the old copy."""
    for module in model.modules():
        yield from (t for t in module._parameters.values() if t is not None)
        stacked = getattr(getattr(module, "stack", None), "weight", None)
        if isinstance(stacked, torch.Tensor):
            yield stacked
        elif isinstance(stacked, nn.Module):
            yield from stacked.parameters()


def place(model: nn.Module) -> int:
    """Move the storages of ``model``'s CPU weights of at least ``SMALLEST_MOVED`` bytes into huge pages (module
    docstring); returns the bytes moved (0 where nothing could be)."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in _weights(model):
        storage = t.untyped_storage()
        if t.device.type == "cpu" and storage.nbytes() >= SMALLEST_MOVED:
            group = by_storage.setdefault(storage.data_ptr(), [])
            if not any(u is t for u in group):
                group.append(t)
    offsets, total = {}, 0
    for key, group in by_storage.items():
        offsets[key] = total
        total += -(-group[0].untyped_storage().nbytes() // _ALIGN) * _ALIGN
    memory = arena(total) if by_storage else None
    if memory is None:
        return 0
    target = memory.untyped_storage()
    with torch.no_grad():
        for key, group in by_storage.items():
            old = group[0].untyped_storage()
            start = offsets[key]
            memory[start : start + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            for t in group:
                t.set_(target, start // t.element_size() + t.storage_offset(), t.shape, t.stride())
    return total
