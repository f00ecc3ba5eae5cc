"""Read and check a safetensors file's header before any of its tensors is read.

A safetensors file is an 8-byte little-endian header length N, then N bytes of UTF-8 JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``), then the
data buffer; the offsets count from the buffer's start and the tensors tile it exactly, with no
gap and no overlap. ``read_header`` checks all of that against the file's size, so a truncated
or corrupt file is a one-line ShardwiseError naming the file (and the tensor) instead of the
safetensors library's exception or a crash while a rank reads it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from shardwise.errors import ShardwiseError

MAX_HEADER_BYTES = 100_000_000
"""The largest header the safetensors library reads."""

DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
"""Bits per element of every safetensors dtype."""

FIX = "re-download or re-save the checkpoint"


@dataclass(frozen=True)
class TensorHeader:
    """One tensor's header entry: safetensors dtype name ('F32', 'BF16', 'U8', ...) and shape."""

    dtype: str
    shape: tuple[int, ...]


def _entry(path: Path, name: str, entry: object) -> tuple[TensorHeader, int, int]:
    """One header entry checked: (its TensorHeader, begin, end)."""
    bad = f"safetensors file '{path}': tensor '{name}'"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise ShardwiseError(f"{bad} has a malformed header entry (needs dtype, shape and data_offsets): {FIX}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise ShardwiseError(f"{bad} has unknown dtype {dtype!r}: {FIX}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ShardwiseError(f"{bad} has shape {shape!r}, expected a list of non-negative integers: {FIX}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise ShardwiseError(f"{bad} has data_offsets {offsets!r}, expected [begin, end] with 0 <= begin <= end: {FIX}")
    begin, end = offsets
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits != 8 * (end - begin):
        dims = "[" + ", ".join(map(str, shape)) + "]"
        raise ShardwiseError(
            f"{bad} is {dtype} {dims} ({bits / 8:,g} bytes) but its data_offsets [{begin}, {end}] span "
            f"{end - begin:,} bytes: {FIX}"
        )
    return TensorHeader(dtype, tuple(shape)), begin, end


def read_header(path: str | Path) -> dict[str, TensorHeader]:
    """The tensors of safetensors file ``path`` by name, after checking the header's length, encoding,
    JSON, every entry, and that the tensors tile the data exactly up to the end of the file."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            head = f.read(8)
            if len(head) < 8:
                raise ShardwiseError(f"safetensors file '{path}' is {size} bytes, too short to hold a header: {FIX}")
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, MAX_HEADER_BYTES):
                where = (f"past the end of the {size:,}-byte file (truncated?)" if length > size - 8
                         else f"over the {MAX_HEADER_BYTES:,} bytes safetensors reads")
                raise ShardwiseError(f"safetensors file '{path}' declares a {length:,}-byte header, {where}: {FIX}")
            raw = f.read(length)
    except OSError as exc:
        raise ShardwiseError(f"cannot read safetensors file '{path}' ({exc.strerror}): check the path") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ShardwiseError(f"safetensors file '{path}' has a header that is not UTF-8 (byte {8 + exc.start}): {FIX}") from None
    except json.JSONDecodeError as exc:
        raise ShardwiseError(f"safetensors file '{path}' has a header that is not JSON ({exc.msg} at byte {8 + exc.pos}): {FIX}") from None
    except (ValueError, RecursionError) as exc:
        raise ShardwiseError(f"safetensors file '{path}' has a header shardwise cannot read ({str(exc).splitlines()[0]}): {FIX}") from None
    if not isinstance(header, dict):
        raise ShardwiseError(f"safetensors file '{path}' has a header that is not a JSON object: {FIX}")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ShardwiseError(f"safetensors file '{path}' has __metadata__ that is not a map of strings: {FIX}")
    data = size - 8 - length
    tensors, spans = {}, []
    for name, entry in header.items():
        tensors[name], begin, end = _entry(path, name, entry)
        if end > data:
            raise ShardwiseError(
                f"safetensors file '{path}': tensor '{name}' ends at data byte {end:,} but the file holds "
                f"{data:,} bytes of data (truncated?): {FIX}"
            )
        spans.append((begin, end, name))
    covered, previous = 0, None
    for begin, end, name in sorted(spans):
        if begin < covered:
            raise ShardwiseError(f"safetensors file '{path}': tensor '{name}' overlaps tensor '{previous}' (data byte {begin:,}): {FIX}")
        if begin > covered:
            raise ShardwiseError(f"safetensors file '{path}': data bytes {covered:,}..{begin:,} before tensor '{name}' belong to no tensor: {FIX}")
        covered, previous = end, name
    if covered != data:
        raise ShardwiseError(f"safetensors file '{path}' has {data - covered:,} bytes after its last tensor's data: {FIX}")
    return tensors
