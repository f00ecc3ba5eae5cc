"""A box outside the catalog, for ``plan --box-spec FILE`` / ``sweep --box-spec FILE``.

A box spec (``shardwise plan --box-spec FILE``) describes one box outside the catalog with the
field names of a ``hardware.toml`` entry, at the top level or under one ``[key]`` table (a
catalog entry copied whole)::

    name = "My workstation"
    memory_gb = 128                 # required
    memory_bandwidth_gbps = 273     # required, GB/s
    tflops_bf16 = 100               # required, dense
    load_watts = 150                # required, W during decode
    list_price_usd = 4000           # required
    # optional: tflops_fp8, tflops_fp4, nic, nic_gbit_s, idle_watts, rated_watts,
    # builder_price_usd, memory_options, option_* tables (shardwise.spec.box_options),
    # source_<field>, estimates

``load_box_spec`` reads it into a ``Box`` (one-line errors naming the field and the fix).
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any

import msgspec

from shardwise.errors import ShardwiseError, validation_message
from shardwise.spec.box_options import OPTION_FIGURES
from shardwise.spec.hardware import Box, read_toml

BOX_SPEC_REQUIRED = ("memory_gb", "memory_bandwidth_gbps", "tflops_bf16", "load_watts", "list_price_usd")
"""Figures a box spec must give; the other Box figures are optional there."""
_BOX_UNITS = {
    "memory_gb": "GB", "memory_bandwidth_gbps": "GB/s", "tflops_bf16": "dense TFLOPS", "tflops_fp8": "dense TFLOPS",
    "tflops_fp4": "dense TFLOPS", "nic_gbit_s": "Gb/s", "idle_watts": "W", "load_watts": "W", "rated_watts": "W",
    "list_price_usd": "USD", "builder_price_usd": "USD", "memory_options": "GB",
}
_BOX_NUMBERS = tuple(f for f in Box.FIGURES if f not in ("nic", "memory_options", *OPTION_FIGURES))


def _spec_number(where: str, field: str, value: Any) -> float:
    unit = _BOX_UNITS[field]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ShardwiseError(
            f"{where}: {field} must be a number ({unit}), got {value!r}; write it unquoted, e.g. {field} = 100")
    if not math.isfinite(value) or value <= 0:
        raise ShardwiseError(f"{where}: {field} must be a finite number > 0 ({unit}), got {value}; give the real figure")
    return float(value)


def _option_table(where: str, field: str, target: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not value:
        raise ShardwiseError(f'{where}: {field} must be a table keyed by memory option (GB), e.g. {field} = {{ "64" = ... }}')
    if target == "name":
        if not all(isinstance(v, str) and v.strip() for v in value.values()):
            raise ShardwiseError(f'{where}: {field} values must be chip names, e.g. {field} = {{ "36" = "14c CPU / 32c GPU" }}')
        return dict(value)
    return {gb: _spec_number(f"{where}: {field}.{gb}", target, v) for gb, v in value.items()}


def box_from_spec(table: dict[str, Any], key: str, where: str) -> Box:
    """A Box from a box spec's table (the fields of a hardware.toml entry); one-line errors that
    name the field and the fix. Figures without a ``source_<field>`` get the spec as their source;
    optional figures left out get stated defaults, listed in ``estimates``."""
    known = {"name", "nic", "estimates", *Box.FIGURES}
    known |= {f"source_{f}" for f in Box.FIGURES}
    for name in table:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"keys are those of a hardware.toml entry: {', '.join(BOX_SPEC_REQUIRED)}, ..."
            raise ShardwiseError(f"{where}: unknown key '{name}'; {hint}")
    missing = [f for f in BOX_SPEC_REQUIRED if f not in table]
    if missing:
        raise ShardwiseError(
            f"{where}: missing {missing[0]}; add {missing[0]} = <{_BOX_UNITS[missing[0]]}> "
            f"(a box spec needs {', '.join(BOX_SPEC_REQUIRED)})")
    fields: dict[str, Any] = {"key": key, "sources": {}, "estimates": set()}
    for field in _BOX_NUMBERS:
        if field in table:
            fields[field] = _spec_number(where, field, table[field])
    for text_field in ("name", "nic"):
        if text_field in table and (not isinstance(table[text_field], str) or not table[text_field].strip()):
            raise ShardwiseError(f'{where}: {text_field} must be a non-empty string, e.g. {text_field} = "..."')
    if "memory_options" in table:
        options = table["memory_options"]
        if not isinstance(options, list) or not options:
            raise ShardwiseError(f"{where}: memory_options must be a list of GB figures, e.g. memory_options = [64, 128]")
        fields["memory_options"] = tuple(_spec_number(where, "memory_options", v) for v in options)
        if fields["memory_gb"] not in fields["memory_options"]:
            raise ShardwiseError(
                f"{where}: memory_gb = {fields['memory_gb']:g} is not one of memory_options {table['memory_options']}; "
                "list it there or drop memory_options")
    for field, target in OPTION_FIGURES.items():
        if field in table:
            fields[field] = _option_table(where, field, target, table[field])
    fields["name"] = table.get("name", f"{key} (box spec {where})")
    fields["nic"] = table.get("nic", "not given in the box spec")
    defaults = {
        "nic_gbit_s": (10.0, "not given in the box spec; a 10 Gb/s port assumed"),
        "rated_watts": (fields["load_watts"], "not given in the box spec; load_watts used"),
        "idle_watts": (fields["load_watts"], "not given in the box spec; load_watts used"),
    }
    for field, (value, why) in defaults.items():
        if field not in fields:
            fields[field] = value
            fields["sources"][field] = f"estimate ({where}): {why}"
            fields["estimates"].add(field)
    fields["sources"].setdefault("nic", f"box spec {where}")
    estimates = table.get("estimates", [])
    if not isinstance(estimates, list) or not all(isinstance(e, str) for e in estimates):
        raise ShardwiseError(f'{where}: estimates must be a list of field names, e.g. estimates = ["tflops_bf16"]')
    for name, value in table.items():
        if name.startswith("source_"):
            field = name.removeprefix("source_")
            if not isinstance(value, str):
                raise ShardwiseError(f'{where}: {name} must be a string saying where {field} comes from')
            if field not in fields:
                raise ShardwiseError(f"{where}: {name} names {field}, which the spec does not set; set {field} or drop {name}")
            fields["sources"][field] = value
    for field in Box.FIGURES:
        if fields.get(field) is not None:
            fields["sources"].setdefault(field, f"box spec {where}")
    for field in estimates:
        if fields.get(field) is None:
            raise ShardwiseError(f"{where}: estimates lists '{field}', which the spec does not set; drop it from estimates")
    fields["estimates"] = frozenset(fields["estimates"] | set(estimates))
    try:
        return msgspec.convert(fields, Box)
    except msgspec.ValidationError as exc:
        raise ShardwiseError(f"{where}: {validation_message(exc)}") from None


def load_box_spec(path: str | Path) -> Box:
    """A Box from a box-spec TOML file (format in the module docstring): the fields of one
    hardware.toml entry, at the top level or under a single ``[key]`` table. The key is the table's
    name, else the file's stem."""
    where = str(path)
    doc, _ = read_toml(path, "box spec")
    key = Path(path).stem
    if len(doc) == 1 and isinstance(next(iter(doc.values())), dict):
        key, doc = next(iter(doc.items()))
    nested = sorted(k for k, v in doc.items() if isinstance(v, dict) and k not in OPTION_FIGURES)
    if nested:
        raise ShardwiseError(
            f"{where}: [{nested[0]}] is a table; a box spec holds one box: its fields at the top level or under one [key]")
    return box_from_spec(doc, key, where)
