"""Memory options of a catalog box: ``mac-studio-m4-max-64`` from ``[mac-studio-m4-max-128]``.

A ``hardware.toml`` entry whose ``memory_options`` lists the memory sizes (GB) sold for its chip
in its machine offers each size as a box of its own, named ``<entry key without its trailing
memory>-<GB>``. Per-option figures are TOML tables keyed by the size (a string) and override the
entry's figure for that size::

    memory_options = [36, 48, 64, 128]                       # GB, every size sold
    option_memory_bandwidth_gbps = { "36" = 410 }            # GB/s, a size sold with a binned chip
    option_tflops_bf16 = { "36" = 13.6 }                     # dense TFLOPS, likewise
    option_chip = { "36" = "14c CPU / 32c GPU" }             # replaces the "(...)" in the entry's name
    option_list_price_usd = { "36" = 1999, "48" = 2499 }     # USD; every size but memory_gb has one

each with its ``source_option_<field>``; an ``option_<field>`` listed in ``estimates`` makes that
figure an estimate for every option. A size without its own bandwidth, TFLOPS or chip keeps the
entry's (the same chip); the entry's own size is the entry itself.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import msgspec

from shardwise.errors import ShardwiseError

if TYPE_CHECKING:
    from shardwise.spec.hardware import Box

OPTION_FIGURES: dict[str, str] = {
    "option_memory_bandwidth_gbps": "memory_bandwidth_gbps",
    "option_tflops_bf16": "tflops_bf16",
    "option_list_price_usd": "list_price_usd",
    "option_chip": "name",
}
"""Each per-option table and the Box field it overrides for its size."""


def size_label(gb: float) -> str:
    """A memory size in GB as option keys and tables write it (``36``, ``24``)."""
    return f"{gb:g}"


def check_option_tables(box: Box) -> None:
    """Raise ValueError when an ``option_*`` table needs ``memory_options`` or names a size that is
    not one of them (or is ``memory_gb``, which the entry's own figures describe)."""
    for field in OPTION_FIGURES:
        table = getattr(box, field)
        if table is None:
            continue
        if box.memory_options is None:
            raise ValueError(f"{field} needs memory_options (the GB sizes it is keyed by)")
        others = {size_label(gb) for gb in box.memory_options} - {size_label(box.memory_gb)}
        wrong = sorted(set(table) - others)
        if wrong:
            raise ValueError(f'{field} names "{wrong[0]}" GB; its keys must be memory_options other than memory_gb')


def option_index(boxes: dict[str, Box]) -> dict[str, Box]:
    """``{prefix: entry}`` for each catalog entry with ``memory_options`` (``mac-studio-m4-max`` →
    ``[mac-studio-m4-max-128]``); ShardwiseError when an entry cannot offer its options by name."""
    index: dict[str, Box] = {}
    for key, box in boxes.items():
        if box.memory_options is None:
            continue
        own = size_label(box.memory_gb)
        if not key.endswith(f"-{own}") or not box.name.endswith(f", {own} GB"):
            raise ShardwiseError(
                f"hardware.toml: [{key}] has memory_options, so its key must end in -{own} and its name in ', {own} GB'")
        unpriced = sorted({size_label(gb) for gb in box.memory_options} - {own} - set(box.option_list_price_usd or {}))
        if unpriced:
            raise ShardwiseError(
                f'hardware.toml: [{key}] option_list_price_usd has no "{unpriced[0]}"; '
                "give every option's price (listing option_list_price_usd in estimates where estimated)")
        if box.option_chip and "(" not in box.name:
            raise ShardwiseError(f"hardware.toml: [{key}] option_chip needs a '(...)' chip part in the name to replace")
        prefix = key.removesuffix(f"-{own}")
        if prefix in index:
            raise ShardwiseError(
                f"hardware.toml: [{index[prefix].key}] and [{key}] both offer {prefix}-<GB>; keep memory_options on one")
        index[prefix] = box
    return index


def option_names(entry: Box) -> list[str]:
    """``<prefix>-<GB>`` for each of ``entry``'s memory options (its own key included), smallest first."""
    prefix = entry.key.removesuffix(f"-{size_label(entry.memory_gb)}")
    return [f"{prefix}-{size_label(gb)}" for gb in sorted(entry.memory_options or ())]


def option_keys(index: dict[str, Box]) -> list[str]:
    """Every name an option of an ``option_index`` entry resolves under."""
    return [name for box in index.values() for name in option_names(box)]


def option_box(index: dict[str, Box], name: str) -> Box | None:
    """The box ``name`` (``<prefix>-<GB>``) names through a memory option; None when no entry
    offers options under that prefix; ShardwiseError when the size is not one of its options."""
    match = re.fullmatch(r"(.+)-(\d+(?:\.\d+)?)", name)
    if match is None or match[1] not in index:
        return None
    entry = index[match[1]]
    labels = [size_label(gb) for gb in sorted(entry.memory_options or ())]
    if match[2] not in labels:
        sizes = f"{', '.join(labels[:-1])} or {labels[-1]}" if len(labels) > 1 else labels[0]
        raise ShardwiseError(f"{name}: this box comes with {sizes} GB; use {match[1]}-<GB> with one of them")
    return with_option(entry, float(match[2]), name)


def with_option(entry: Box, gb: float, key: str) -> Box:
    """``entry`` as its ``gb`` GB option, named ``key``: the option's memory (GB), bandwidth (GB/s),
    dense TFLOPS and list price (USD), each sourced; the option tables themselves dropped."""
    label, own = size_label(gb), size_label(entry.memory_gb)
    if label == own:
        return entry
    dropped = {"memory_options", *OPTION_FIGURES}
    sources = {f: s for f, s in entry.sources.items() if f not in dropped}
    estimates = set(entry.estimates) - dropped
    sources["memory_gb"] = f"{label} GB option of [{entry.key}]: {entry.sources['memory_options']}"
    (estimates.add if "memory_options" in entry.estimates else estimates.discard)("memory_gb")
    changes: dict = {"key": key, "memory_gb": gb, "memory_options": None, **dict.fromkeys(OPTION_FIGURES)}
    for field, target in OPTION_FIGURES.items():
        table = getattr(entry, field) or {}
        if label not in table or target == "name":
            continue
        changes[target] = table[label]
        sources[target] = f"{label} GB option: {entry.sources[field]}"
        (estimates.add if field in entry.estimates else estimates.discard)(target)
    base = entry.name.removesuffix(f", {own} GB")
    chip = (entry.option_chip or {}).get(label)
    if chip:
        base = re.sub(r"\([^)]*\)", f"({chip})", base, count=1)
    changes["name"] = f"{base}, {label} GB"
    return msgspec.structs.replace(entry, **changes, sources=sources, estimates=frozenset(estimates))
