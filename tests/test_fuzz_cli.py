"""Property-based fuzzing of the planning CLI (issue #18): random values for the flags of `plan`
and `sweep`, and mutated model configs, cluster files, measurement CSVs and plan documents.
Whatever the input, a command ends within LIMIT_S with exit 0, or with exit 2 and one stderr
line `error: ...`: never a traceback, an internal error (exit 1) or a numpy RuntimeWarning
(an overflow or a 0/0 that would print inf or nan).

The CLI runs in this process (``conftest.cli_in_process``) so that its ~220 examples take well
under a minute on two cores; hypothesis's deadline is off (a plan's time varies with the load)
and the time bound is an alarm instead.
"""

from __future__ import annotations

import csv
import io
import json
import signal
import tomllib
import warnings
from pathlib import Path

import pytest
import tomli_w
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import cli_in_process

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "src" / "shardwise" / "spec" / "catalog" / "models"
LIMIT_S = 20  # one command; a plan takes ~0.1-1 s, so only a hang reaches it
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Hung(BaseException):
    """Raised by the alarm in a command past LIMIT_S (not an Exception: ``cli.main`` lets it through)."""


def check(*args: str) -> int:
    """Run ``shardwise ARGS`` and hold it to the contract; the exit code."""
    def alarm(signum, frame):
        raise Hung(f"shardwise {' '.join(args)} ran past {LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, LIMIT_S)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            code, _, err = cli_in_process(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    event(f"exit {code}")  # the share of inputs that plan, in --hypothesis-show-statistics
    assert "Traceback" not in err, err
    assert code in (0, 2), f"shardwise {args}: exit {code}: {err}"
    if code:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), f"shardwise {args}: {err!r}"
    return code


# ---- values --------------------------------------------------------------------------------------

NUMBERS = st.one_of(
    st.integers(min_value=1, max_value=64).map(str),  # plausible values, so that some inputs plan
    st.floats(min_value=0.05, max_value=0.95).map(repr),
    st.integers(min_value=-10**15, max_value=10**15).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "-0", "0", "1", "-1", "1e309", "1e-320", "4096", "1000000000"]),
)
VALUES = st.one_of(NUMBERS, NUMBERS, st.text(max_size=10))
JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                        st.sampled_from([0, -1, 1, 2**31, 10**9]), st.floats(), st.text(max_size=6))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                               st.dictionaries(st.text(max_size=5), kids, max_size=3)),
                           max_leaves=5)


def flags(names: list[str], values=VALUES, most: int = 4):
    """1..``most`` of ``--flag=value`` (the = keeps a value like '-1' the flag's)."""
    return st.lists(st.tuples(st.sampled_from(names), values), min_size=1, max_size=most).map(
        lambda pairs: [f"{flag}={value}" for flag, value in pairs])


def mutate_bytes(data, raw: bytes) -> bytes:
    """``raw`` with a few bytes flipped, cut short, or with bytes that are not UTF-8 put in."""
    how = data.draw(st.sampled_from(["flip", "truncate", "not-utf8"]))
    at = data.draw(st.integers(0, max(len(raw) - 1, 0)))
    if how == "truncate":
        return raw[:at]
    if how == "not-utf8":
        return raw[:at] + data.draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\x80\x80", b"\x00"])) + raw[at:]
    out = bytearray(raw)
    for i in data.draw(st.lists(st.integers(0, max(len(raw) - 1, 0)), min_size=1, max_size=4)):
        out[i] ^= data.draw(st.integers(1, 255))
    return bytes(out)


def mutate_tree(data, doc: dict, values=JSON_VALUES) -> dict:
    """``doc`` with 1..3 keys (at any depth of nested tables) set to a random value or deleted."""
    for _ in range(data.draw(st.integers(1, 3))):
        node = doc
        while True:
            keys = sorted(k for k in node if isinstance(k, str))
            if not keys:
                break
            key = data.draw(st.sampled_from(keys))
            child = node[key]
            if isinstance(child, dict) and child and data.draw(st.booleans()):
                node = child
                continue
            tables = [item for item in child if isinstance(item, dict)] if isinstance(child, list) else []
            if tables and data.draw(st.booleans()):
                node = data.draw(st.sampled_from(tables))
                continue
            if data.draw(st.integers(0, 4)) == 0:
                del node[key]
            else:
                node[key] = data.draw(values)
            break
    return doc


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


# ---- flags -----------------------------------------------------------------------------------------

PLAN_NUMERIC = ["--boxes", "--tp", "--ep", "--pp", "--context", "--prompt-tokens", "--spec-tokens", "--acceptance",
                "--batch", "--price"]
PLAN_NAMES = {
    "--model": ["kimi-k3", "qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v2-lite"], "--box": ["dgx-spark", "h100-sxm"],
    "--link": ["100g-roce", "nvlink4"], "--runtime": ["vllm", "ideal"], "--quant": ["fp8", "mxfp4"],
    "--experts": ["mxfp4", "nvfp4"], "--dense": ["fp8", "bf16"], "--kv-dtype": ["fp8", "bf16"],
    "--workload": ["chat", "code-edit"], "--emit": ["vllm", "shardwise"],
}


@FUZZ
@given(numeric=flags(PLAN_NUMERIC), named=st.lists(
    st.sampled_from(sorted(PLAN_NAMES)).flatmap(
        lambda f: st.one_of(st.sampled_from(PLAN_NAMES[f]), st.text(max_size=8)).map(lambda v: f"{f}={v}")),
    max_size=2), extra=st.sampled_from([[], ["--json"], ["--batch-curve"]]))
def test_plan_flags(numeric, named, extra):
    check("plan", *named, *numeric, *extra)


SWEEP_NUMERIC = ["--max-boxes", "--budget", "--max-watts", "--min-tok-per-s", "--users", "--context", "--spec-tokens",
                 "--acceptance", "--prompt-tokens", "--limit"]
COUNTS = st.one_of(st.integers(-3, 10**9).map(str),
                   st.tuples(st.integers(-3, 10**9), st.integers(-3, 10**9)).map(lambda t: f"{t[0]}-{t[1]}"))
BOX_COUNTS = st.one_of(VALUES, st.lists(COUNTS, min_size=1, max_size=3).map(",".join))


@FUZZ
@given(numeric=flags(SWEEP_NUMERIC), boxes=st.one_of(st.none(), BOX_COUNTS),
       explain=st.one_of(st.none(), st.text(max_size=12), NUMBERS.map(lambda n: f"dgx-spark:{n}")),
       extra=st.sampled_from([[], ["--prefill"], ["--json"], ["--csv"], ["--list-prices"]]))
def test_sweep_flags(numeric, boxes, explain, extra):
    """One small model on two boxes: the flags, not the catalog's size, are under test."""
    args = ["sweep", "--model", "qwen3-30b-a3b", "--box", "dgx-spark,h100-sxm", *numeric, *extra]
    args += [f"--boxes={boxes}"] if boxes is not None else []
    args += [f"--explain={explain}"] if explain is not None else []
    check(*args)


# ---- files -----------------------------------------------------------------------------------------

CONFIGS = ["qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v2-lite", "kimi-linear-48b-a3b", "llama-3.1-8b",
           "olmoe-1b-7b-0125-instruct", "kimi-k3"]


@FUZZ
@given(data=st.data(), key=st.sampled_from(CONFIGS), structured=st.booleans(),
       extra=st.sampled_from([[], ["--batch", "8"], ["--spec-tokens", "3"], ["--context", "65536"]]))
def test_mutated_model_config(workdir, data, key, structured, extra):
    raw = (MODELS / f"{key}.json").read_bytes()
    if structured:
        doc = json.loads(raw)
        mutate_tree(data, doc["text_config"] if "text_config" in doc and data.draw(st.booleans()) else doc)
        raw = json.dumps(doc).encode()
    else:
        raw = mutate_bytes(data, raw)
    path = workdir / "config.json"
    path.write_bytes(raw)
    check("plan", "--model", str(path), "--boxes", "1", *extra)


CLUSTERS = {
    "two-switch": (REPO / "tests" / "data" / "two_switch_8.toml").read_text(),
    "measured-star": '[cluster]\nbox = "dgx-spark"\nlink = "100g-roce"\nboxes = 4\n'
                     '[cluster.measured]\nsource = "probe"\nmemory_bandwidth_gbps = 250.0\nlink_latency_s = 1e-05\n'
                     '[[switches]]\nname = "sw"\n'
                     + "".join(f'[[hosts]]\nname = "h{i}"\n[[links]]\na = "h{i}"\nb = "sw"\n' for i in range(4)),
}
TOML_VALUES = st.recursive(
    st.one_of(st.booleans(), st.integers(min_value=-2**63, max_value=2**63 - 1), st.floats(), st.text(max_size=6)),
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=5), kids, max_size=3)),
    max_leaves=5)


@FUZZ
@given(data=st.data(), name=st.sampled_from(sorted(CLUSTERS)), structured=st.booleans())
def test_mutated_cluster_file(workdir, data, name, structured):
    text = CLUSTERS[name]
    if structured:
        raw = tomli_w.dumps(mutate_tree(data, tomllib.loads(text), TOML_VALUES)).encode()
    else:
        raw = mutate_bytes(data, text.encode())
    path = workdir / "cluster.toml"
    path.write_bytes(raw)
    check("plan", "--cluster", str(path), "--model", "qwen3-30b-a3b")
    check("ring", "--topology", str(path))


def _measurements() -> tuple[list[str], list[list[str]]]:
    """The bundled CSV's header and four of its rows: two that resolve at batch 1, one batched,
    one that does not resolve."""
    header, *rows = csv.reader((REPO / "data" / "measurements.csv").open(encoding="utf-8"))
    by_id, batch = {r[0]: r for r in rows}, header.index("batch_size")
    return header, [by_id[i] for i in ("28", "30", "2")] + [next(r for r in rows if r[batch].startswith("32"))]


HEADER, ROWS = _measurements()


@FUZZ
@given(data=st.data(), structured=st.booleans())
def test_mutated_measurements_csv(workdir, data, structured):
    rows = [list(r) for r in ROWS]
    if structured:
        for _ in range(data.draw(st.integers(1, 3))):
            row = data.draw(st.sampled_from(rows))
            col = data.draw(st.integers(0, len(HEADER) - 1))
            if data.draw(st.integers(0, 5)) == 0:
                del row[col:]  # a row cut short
            elif col < len(row):
                row[col] = data.draw(st.one_of(VALUES, st.sampled_from(["", "-5", "0", "nan", "~-3", "5-9", "1e400"])))
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([HEADER, *rows])
    raw = buf.getvalue().encode()
    if not structured:
        raw = mutate_bytes(data, raw)
    path = workdir / "measurements.csv"
    path.write_bytes(raw)
    check("validate", str(path))


@pytest.fixture(scope="module")
def plan_doc() -> dict:
    code, out, err = cli_in_process("plan", "--model", "qwen3-30b-a3b", "--boxes", "1", "--batch-curve", "--json")
    assert code == 0, err
    return json.loads(out)


@settings(FUZZ, max_examples=20)
@given(data=st.data())
def test_mutated_plan_document_for_report(workdir, plan_doc, data):
    doc = mutate_tree(data, json.loads(json.dumps(plan_doc)))
    path = workdir / "plan.json"
    path.write_text(json.dumps(doc))
    check("report", str(path), "-o", str(workdir / "report.html"))
