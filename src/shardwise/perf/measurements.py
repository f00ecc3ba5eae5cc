"""Published measurements: read ``data/measurements.csv`` rows and resolve them to scenarios.

Free-text model, hardware, link, software and quantization names are resolved through the
alias table ``spec/catalog/aliases.toml``; a row whose text matches no alias (or that the
model does not cover, e.g. batch 32) is returned as unresolved with the reason — never guessed.
"""

from __future__ import annotations

import csv
import math
import re
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

from shardwise.errors import ShardwiseError, shown
from shardwise.perf.speculative import WORKLOADS
from shardwise.plan import ParallelPlan, default_plan, validate_plan
from shardwise.quant.formats import get_format
from shardwise.spec.model import ROUTED_EXPERTS, ModelSpec
from shardwise.spec.parse import load_model

REQUIRED_COLUMNS = (
    "id", "model", "hardware", "num_devices", "interconnect", "software", "parallelism", "quant_format",
    "prompt_tokens", "context_depth_tokens", "gen_tokens", "batch_size", "decode_tok_s", "prefill_tok_s",
    "speculative_decoding", "source",
)


@dataclass(frozen=True)
class Measurement:
    """One published point, as written in the CSV (numbers parsed where they are numbers)."""

    id: str
    model: str
    hardware: str
    num_devices: int
    interconnect: str
    software: str
    parallelism: str
    quant_format: str
    prompt_tokens: int | None
    context_depth_tokens: int | None
    gen_tokens: int | None
    batch_size: str
    decode_tok_s: float | None
    prefill_tok_s: float | None
    speculative_decoding: str
    source: str
    metric_notes: str = ""


@dataclass(frozen=True)
class ResolvedRow:
    """A measurement mapped onto catalog entries and a layout."""

    measurement: Measurement
    model: ModelSpec
    box_key: str
    link_key: str
    plan: ParallelPlan
    formats: dict[str, str]
    profile: str
    context_tokens: int
    spec_tokens: int
    acceptance: float
    notes: tuple[str, ...] = field(default=())
    batch: int = 1  # sequences decoded together
    aggregate: bool = False  # decode_tok_s sums all sequences (else it is per sequence)


def parse_number(text: str) -> float | None:
    """'~70' -> 70, '5-9' -> 7 (midpoint), '1,234' -> 1234, '' / 'not stated' -> None."""
    text = (text or "").strip().replace(",", "")
    numbers = re.findall(r"\d+(?:\.\d+)?", text)
    if not numbers:
        return None
    if re.match(r"^~?\s*\d+(?:\.\d+)?\s*-\s*\d+(?:\.\d+)?$", text):
        lo, hi = float(numbers[0]), float(numbers[1])
        return (lo + hi) / 2
    return float(numbers[0])


POSITIVE_COLUMNS = ("num_devices", "decode_tok_s", "prefill_tok_s")  # a measured 0 (or no device) is impossible
NUMBER_COLUMNS = POSITIVE_COLUMNS + ("prompt_tokens", "context_depth_tokens", "gen_tokens")


def cell_number(text: str | None, where: str, positive: bool) -> float | None:
    """``parse_number`` of a CSV cell, refusing (one line naming ``where``, the file, line and
    column) what no measurement can be: a negative, NaN or infinite figure, or 0 for ``positive``."""
    text = (text or "").strip()
    try:
        value: float | None = float(text.replace(",", ""))  # plain numbers: '-5', 'nan', '1e3' as written
    except ValueError:
        if re.match(r"~?\s*-\s*\d", text):
            raise ShardwiseError(f"{where}: {shown(text)} is negative: fix the cell or leave it empty") from None
        value = parse_number(text)
    if value is not None and not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        need = "a finite number > 0" if positive else "a finite number >= 0"
        raise ShardwiseError(f"{where}: {shown(text)} must be {need}: fix the cell or leave it empty")
    return value


def read_measurements(path: str | Path) -> list[Measurement]:
    """Rows of a measurements CSV with the columns of ``data/measurements.csv``; one-line errors
    (naming the line and column) for a file that is not UTF-8 CSV, has no rows, a row short of
    columns, or an impossible figure (negative, NaN, a measured 0)."""
    path = Path(path)
    if not path.is_file():
        raise ShardwiseError(f"measurements file '{path}' is not a file: pass a CSV file")
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            return _rows(csv.DictReader(fh), path)
    except UnicodeDecodeError as exc:
        raise ShardwiseError(f"measurements file '{path}' is not UTF-8 text (byte {exc.start}): save it as UTF-8 CSV") from None
    except csv.Error as exc:
        raise ShardwiseError(f"measurements file '{path}' is not CSV shardwise can read: {exc}") from None
    except OSError as exc:
        raise ShardwiseError(f"measurements file '{path}' cannot be read ({exc.strerror}): check the path") from None


def _rows(reader: csv.DictReader, path: Path) -> list[Measurement]:
    missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise ShardwiseError(f"measurements file '{path}' lacks column(s) {', '.join(missing)}")
    out = []
    for row in reader:
        where = f"measurements file '{path}' line {reader.line_num}"
        short = [c for c in REQUIRED_COLUMNS if row[c] is None]
        if short:
            raise ShardwiseError(f"{where}: the row ends before column {short[0]}: "
                                 f"give every row the header's {len(reader.fieldnames)} columns")
        nums = {c: cell_number(row[c], f"{where}, column {c}", c in POSITIVE_COLUMNS) for c in NUMBER_COLUMNS}

        def whole(key: str) -> int | None:
            return None if nums[key] is None else int(nums[key])

        out.append(
            Measurement(
                id=row["id"], model=row["model"], hardware=row["hardware"],
                num_devices=whole("num_devices") or 1, interconnect=row["interconnect"],
                software=row["software"], parallelism=row["parallelism"], quant_format=row["quant_format"],
                prompt_tokens=whole("prompt_tokens"), context_depth_tokens=whole("context_depth_tokens"),
                gen_tokens=whole("gen_tokens"), batch_size=row["batch_size"],
                decode_tok_s=nums["decode_tok_s"], prefill_tok_s=nums["prefill_tok_s"],
                speculative_decoding=row["speculative_decoding"], source=row["source"],
                metric_notes=row.get("metric_notes") or "",
            )
        )
    if not out:
        raise ShardwiseError(f"measurements file '{path}' has a header but no rows: add measurements")
    return out


@lru_cache(maxsize=1)
def aliases() -> dict[str, list[dict]]:
    """The alias table (regex entries per kind)."""
    text = resources.files("shardwise.spec.catalog").joinpath("aliases.toml").read_text()
    return tomllib.loads(text)


def match_alias(kind: str, text: str) -> dict | None:
    """First alias entry of ``kind`` whose pattern matches ``text`` (case-insensitive)."""
    for entry in aliases()[kind]:
        if re.search(entry["pattern"], text, flags=re.IGNORECASE):
            return entry
    return None


def _parallelism(text: str, devices: int, model: ModelSpec) -> ParallelPlan:
    t = text.lower()
    if devices <= 1 or t.startswith("single"):
        return ParallelPlan()
    tp = re.search(r"(?:tp=|tensor\s*)(\d+)", t)
    ep = re.search(r"(?:ep=|expert\s*)(\d+)", t)
    if "pipeline" in t or "layer split" in t:
        return ParallelPlan(pp=devices)
    if tp:
        tp_n = int(tp.group(1))
        return ParallelPlan(tp=tp_n, ep=int(ep.group(1)) if ep else 1, pp=max(devices // tp_n, 1))
    return default_plan(model, devices)


def resolve(m: Measurement) -> ResolvedRow | str:
    """A ResolvedRow, or the reason the row cannot be resolved."""
    from shardwise.spec.hardware import get_box, get_link

    if m.decode_tok_s is None:
        return "no decode tok/s"
    batch = batch_of(m)
    if isinstance(batch, str):
        return batch
    batch, aggregate = batch
    notes: list[str] = []
    model_alias = match_alias("models", m.model)
    if model_alias is None:
        return f"model '{m.model}' has no bundled config"
    model = load_model(model_alias["key"])
    if "note" in model_alias:
        notes.append(model_alias["note"])
    box_alias = match_alias("boxes", m.hardware)
    if box_alias is None:
        return f"hardware '{m.hardware}' is not in the catalog"
    try:
        get_box(box_alias["key"])
    except ShardwiseError:
        return f"hardware '{m.hardware}' -> '{box_alias['key']}' is not in the catalog"
    if m.num_devices > 1:
        link_alias = match_alias("links", m.interconnect)
        if link_alias is None:
            return f"interconnect '{m.interconnect}' is not in the catalog"
        link_key = link_alias["key"]
        try:
            get_link(link_key)
        except ShardwiseError:
            return f"interconnect '{m.interconnect}' -> '{link_key}' is not in the catalog"
    else:
        link_key = "pcie4-x16"
    soft = match_alias("software", m.software)
    if soft is None:
        return f"software '{m.software}' has no runtime profile"
    quant = match_alias("quant", m.quant_format)
    if quant is None:
        return f"quantization '{m.quant_format}' is not a known format"
    formats = model.group_formats()
    if quant["format"] != "checkpoint":
        fmt = get_format(quant["format"])
        groups = (ROUTED_EXPERTS,) if quant.get("groups") == "experts" and not fmt.gguf_ftype else fmt.groups
        formats.update({g: fmt.name for g in groups})
    plan = _parallelism(m.parallelism, m.num_devices, model)
    try:
        validate_plan(model, plan)
    except ShardwiseError as exc:
        return f"layout '{m.parallelism}' does not fit the model: {exc}"
    context = (m.prompt_tokens or 0) + (m.context_depth_tokens or 0) + (m.gen_tokens or 0) // 2
    spec_tokens, acceptance = 0, 0.0
    spec = m.speculative_decoding.lower()
    if spec.startswith("yes"):
        k = re.search(r"(\d+)\s*(?:draft tokens|next-n)", spec)
        if k is None and "chat" not in spec:
            return f"speculative decoding '{m.speculative_decoding}' does not say how many tokens are drafted"
        spec_tokens = int(k.group(1)) if k else 7
        workload = "chat" if "chat" in spec else "code-edit"
        acceptance = WORKLOADS[workload].acceptance
        notes.append(f"acceptance {acceptance} assumed ({workload} workload)")
        if k is None:
            notes.append("7 draft tokens assumed (the seed's setting)")
    return ResolvedRow(
        measurement=m, model=model, box_key=box_alias["key"], link_key=link_key, plan=plan, formats=formats,
        profile=soft["key"], context_tokens=context, spec_tokens=spec_tokens, acceptance=acceptance,
        notes=tuple(notes), batch=batch, aggregate=aggregate,
    )


def batch_of(m: Measurement) -> tuple[int, bool] | str:
    """(sequences decoded together, whether decode_tok_s is their aggregate), or why the row's
    batch cannot be read. The batch is the column's leading number; a row measured at more than
    one sequence must say "aggregate" or "per-stream" in its batch or metric notes."""
    number = re.match(r"\s*(\d+)", m.batch_size)
    if number is None or int(number.group(1)) < 1:
        return f"batch '{m.batch_size}' is not a number of sequences"
    batch = int(number.group(1))
    text = f"{m.batch_size} {m.metric_notes}".lower()
    if batch == 1:
        return 1, False
    if "aggregate" in text:
        return batch, True
    if "per-stream" in text or "per stream" in text:
        return batch, False
    return f"batch {batch}: the row does not say whether decode tok/s is the aggregate or per stream"
