"""A safetensors checkpoint folder on disk: one ``model.safetensors`` or the shards that
``model.safetensors.index.json`` lists, opened with every header checked first
(``runtime.safetensors_header``) and read in slices, each float slice checked for NaN/Inf."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from shardwise.errors import ShardwiseError
from shardwise.runtime.safetensors_header import FIX, TensorHeader, read_header

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


_SAFETENSORS_DTYPES = {
    "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32", "I32": "int32", "I64": "int64",
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The stored dtypes a float (not packed) weight may have; the finiteness check covers them."""
FLOAT_NAMES = tuple(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)


class Checkpoint:
    """The tensors of a safetensors checkpoint folder: names, shapes and sliced reads.

    Every file's header is read and checked (``safetensors_header.read_header``) when the
    checkpoint is opened, so shapes and dtypes come from the checked headers and a corrupt
    file is refused before any tensor is read; every float slice read is checked for NaN/Inf.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        single = self.folder / SINGLE_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_bytes())["weight_map"]
                self.files = {name: self.folder / file for name, file in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                raise ShardwiseError(
                    f"'{index}' is not a safetensors index (a JSON object with a 'weight_map' of tensor name "
                    f"to file name): {FIX}"
                ) from None
            self._headers = self._indexed_headers(index)
        elif single.exists():
            self._headers = read_header(single)
            self.files = dict.fromkeys(self._headers, single)
        else:
            raise ShardwiseError(
                f"no {SINGLE_FILE} or {INDEX_FILE} in '{self.folder}': the runtime loads safetensors checkpoints only"
            )
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}

    def _indexed_headers(self, index: Path) -> dict[str, TensorHeader]:
        """The checked header entry of every tensor the index lists, from the file it names."""
        by_file: dict[Path, list[str]] = {}
        for name, path in self.files.items():
            by_file.setdefault(path, []).append(name)
        headers: dict[str, TensorHeader] = {}
        for path, names in sorted(by_file.items()):
            if not path.is_file():
                raise ShardwiseError(f"checkpoint file '{path}' listed in {INDEX_FILE} does not exist")
            header = read_header(path)
            for name in names:
                if name not in header:
                    raise ShardwiseError(f"'{index}' maps tensor '{name}' to '{path}', which does not hold it: {FIX}")
                headers[name] = header[name]
        return headers

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the open safetensors files."""
        self._stack.close()
        self._handles.clear()

    def _handle(self, name: str):
        path = self.files[name]
        if path not in self._handles:
            try:
                self._handles[path] = self._stack.enter_context(safe_open(path, framework="pt"))
            except Exception as exc:  # safetensors raises its own error types for bad headers
                raise ShardwiseError(f"cannot read safetensors file '{path}': {exc}") from None
        return self._handles[path]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` as stored."""
        return self._headers[name].shape

    def dtype(self, name: str) -> str:
        """Stored dtype of tensor ``name`` as a torch name ('uint8', 'bfloat16', ...), from the header."""
        raw = self._headers[name].dtype
        return _SAFETENSORS_DTYPES.get(raw, raw)

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The slice ``index`` (one slice per leading dimension) of tensor ``name``; a one-line
        ShardwiseError when a float slice holds NaN or Inf."""
        data = self._handle(name).get_slice(name)[index]
        # a sum is NaN/Inf when an element is (no temporary as large as the slice); then count them,
        # since a float16 sum can also overflow with every element finite
        bad = int((~torch.isfinite(data)).sum()) if data.dtype in FLOAT_DTYPES and not torch.isfinite(data.sum()) else 0
        if bad:
            raise ShardwiseError(
                f"checkpoint tensor '{name}' in '{self.files[name]}' holds {bad:,} NaN/Inf value(s): the weights are "
                f"corrupt, {FIX}"
            )
        return data
