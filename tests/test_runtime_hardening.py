"""Issue #18, runtime side: corrupt checkpoint files, checkpoint tensors that disagree with the config,
and requests the ranks would refuse are one ``error:`` line with exit 2 and no traceback, from `run`,
`run --draft` and `quantize`, before any rank starts (NaN/Inf weights: as the ranks load them).

Everything refused before a rank starts runs the CLI in this process (``cli_in_process``); the NaN
case runs the real command over two ranks.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import cli_in_process, run_cli
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.loader import Checkpoint, check_checkpoint, load_spec

SINGLE = "model.safetensors"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny qwen3_moe (vocab 512, 40960 positions)."""
    return make_checkpoint("qwen3-30b-a3b", "tiny", tmp_path_factory.mktemp("base") / "q", seed=0)


@pytest.fixture
def copy(base, tmp_path):
    """copy(name) -> a fresh copy of the base checkpoint to corrupt."""
    return lambda name: Path(shutil.copytree(base, tmp_path / name))


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_header(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _one_line_error(code: int, err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def _past_the_end(path: Path) -> None:
    header, data = _header(path)
    size = len(data)
    begin, end = header["lm_head.weight"]["data_offsets"]
    header["lm_head.weight"]["data_offsets"] = [size + begin, size + end]
    _write_header(path, header, data)


def _overlap(path: Path) -> None:
    header, data = _header(path)
    header["model.embed_tokens.weight"]["data_offsets"] = header["lm_head.weight"]["data_offsets"]
    _write_header(path, header, data)


def _wrong_size(path: Path) -> None:
    header, data = _header(path)
    header["lm_head.weight"]["dtype"] = "F16"
    _write_header(path, header, data)


def _huge_length(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**60) + raw[8:])


def _over_the_limit(path: Path) -> None:
    """A 150 MB header length in a (sparse) 200 MB file: past what safetensors reads."""
    raw = path.read_bytes()
    with path.open("wb") as f:
        f.write(struct.pack("<Q", 150_000_000) + raw[8:])
        f.truncate(200_000_000)


def _not_utf8(path: Path) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    path.write_bytes(raw[:8] + b"\xff" * n + raw[8 + n:])


def _not_json(path: Path) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    path.write_bytes(raw[:8] + b"{" + b" " * (n - 1) + raw[8 + n:])


def _too_short(path: Path) -> None:
    path.write_bytes(b"abc")


CORRUPT = {
    "truncated": (_truncate, "(truncated?)"),
    "offsets-past-the-end": (_past_the_end, "tensor 'lm_head.weight' ends at data byte"),
    "offsets-overlap": (_overlap, "overlaps tensor"),
    "size-mismatch": (_wrong_size, "tensor 'lm_head.weight' is F16 [512, 64] (65,536 bytes) but its data_offsets"),
    "huge-header-length": (_huge_length, "declares a 1,152,921,504,606,846,976-byte header, past the end"),
    "header-over-100MB": (_over_the_limit, "over the 100,000,000 bytes safetensors reads"),
    "header-not-utf8": (_not_utf8, "header that is not UTF-8"),
    "header-not-json": (_not_json, "header that is not JSON"),
    "too-short": (_too_short, "is 3 bytes, too short to hold a header"),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupt_safetensors_is_one_line_for_run_draft_and_quantize(case, base, copy, tmp_path):
    corrupt, needle = CORRUPT[case]
    folder = copy(case)
    corrupt(folder / SINGLE)
    where = f"safetensors file '{folder / SINGLE}'"
    fix = "re-download or re-save the checkpoint"
    _one_line_error(*cli_in_process("run", str(folder), "--prompt-ids", "1,2,3")[::2], where, needle, fix)
    _one_line_error(*cli_in_process("run", str(base), "--draft", str(folder), "--prompt-ids", "1,2,3")[::2], where, needle)
    out = tmp_path / "mxfp4"
    _one_line_error(*cli_in_process("quantize", str(folder), "--out", str(out))[::2], where, needle)
    assert not out.exists()


def test_corrupt_index_and_config_are_one_line(base, copy):
    folder = copy("index")
    (folder / SINGLE).rename(folder / "model-00001-of-00001.safetensors")
    index = folder / "model.safetensors.index.json"
    index.write_bytes(b"\xff\xfe{}")
    _one_line_error(*cli_in_process("run", str(folder), "--prompt-ids", "1")[::2], "is not a safetensors index")
    index.write_text(json.dumps({"weight_map": {"model.bogus.weight": "model-00001-of-00001.safetensors"}}))
    _one_line_error(*cli_in_process("run", str(folder), "--prompt-ids", "1")[::2],
                    "maps tensor 'model.bogus.weight' to", "which does not hold it")
    for bad in (b"\xff\xfe{}", b'{"model_type": "qwen3_moe",'):
        (folder / "config.json").write_bytes(bad)
        _one_line_error(*cli_in_process("run", str(folder), "--prompt-ids", "1")[::2], "config.json")
        _one_line_error(*cli_in_process("quantize", str(folder), "--out", str(folder / "out"))[::2], "config.json")


def _retensor(folder: Path, change) -> None:
    tensors = load_file(folder / SINGLE)
    change(tensors)
    save_file(tensors, str(folder / SINGLE), metadata={"format": "pt"})


def test_extra_and_integer_tensors_are_refused_by_name(base, copy, tmp_path):
    extra = copy("extra")
    _retensor(extra, lambda t: t.update({"model.layers.0.mlp.bogus.weight": torch.zeros(3)}))
    ints = copy("int32")
    q = "model.layers.0.self_attn.q_proj.weight"
    _retensor(ints, lambda t: t.update({q: t[q].to(torch.int32)}))
    for folder, needles in ((extra, ("checkpoint tensor 'model.layers.0.mlp.bogus.weight' is not a weight of the "
                                     "qwen3_moe model", "(1 such tensor(s))")),
                            (ints, (f"checkpoint tensor '{q}' has dtype int32, expected a float weight",))):
        _one_line_error(*cli_in_process("run", str(folder), "--prompt-ids", "1,2")[::2], *needles)
        _one_line_error(*cli_in_process("run", str(base), "--draft", str(folder), "--prompt-ids", "1,2")[::2], *needles)
        _one_line_error(*cli_in_process("quantize", str(folder), "--out", str(tmp_path / f"{folder.name}-out"))[::2], *needles)


def test_tensors_that_are_not_weights_are_allowed(base, copy):
    """Rotary tables, a vision tower, an MTP head and a stored copy of a tied LM head are left unread."""
    folder = copy("unread")
    _retensor(folder, lambda t: t.update({
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
        "model.visual.blocks.0.attn.qkv.weight": torch.zeros(4, 4),
        "mtp.fc.weight": torch.zeros(4, 4),
    }))
    with Checkpoint(folder) as ckpt:
        check_checkpoint(load_spec(folder), ckpt)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with Checkpoint(folder) as ckpt:  # lm_head.weight stays in the file
        check_checkpoint(load_spec(folder), ckpt)


def _poison(name: str, value: float):
    def change(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[1] = value
    return change


def test_nan_and_inf_weights_are_refused_naming_the_tensor(copy, tmp_path):
    inf = copy("inf")
    _retensor(inf, _poison("model.norm.weight", float("-inf")))
    _one_line_error(*cli_in_process("quantize", str(inf), "--out", str(tmp_path / "out"))[::2],
                    f"checkpoint tensor 'model.norm.weight' in '{inf / SINGLE}' holds 1 NaN/Inf value(s)")
    folder = copy("nan")
    down = "model.layers.1.mlp.experts.3.down_proj.weight"
    _retensor(folder, _poison(down, float("nan")))
    needle = f"checkpoint tensor '{down}' in '{folder / SINGLE}' holds 1 NaN/Inf value(s)"
    _one_line_error(*cli_in_process("quantize", str(folder), "--out", str(tmp_path / "out"))[::2], needle)
    assert not (tmp_path / "out").exists()
    # in the ranks (which read the weights): the run's last line names the tensor, no traceback
    proc = run_cli("run", str(folder), "--tp", "2", "--ep", "2", "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                   timeout=120)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank ") and needle in last, proc.stderr
    assert "Traceback" not in proc.stderr


def test_requests_the_ranks_would_refuse_are_refused_first(base, copy, tmp_path):
    cases = [
        (("--prompt-ids", "1,2,600"), "prompt token id 600 is outside the vocabulary 0..511"),
        (("--prompt-ids", "1,-3"), "prompt token id -3 is outside the vocabulary 0..511"),
        (("--prompt-ids", "1,2", "--max-new-tokens", "0"), "--max-new-tokens must be >= 1, got 0"),
        (("--prompt-ids", "1,2", "--max-new-tokens", "-5"), "--max-new-tokens must be >= 1, got -5"),
        (("--prompt-ids", "1", "--timeout", "inf"), "--timeout must be at most 604800 seconds"),
        (("--prompt-ids", "1", "--temperature", "nan"), "--temperature must be a finite number >= 0"),
    ]
    if not torch.cuda.is_available():
        cases.append((("--prompt-ids", "1", "--backend", "nccl"), "--backend nccl needs CUDA GPUs but torch sees none"))
    for args, needle in cases:
        _one_line_error(*cli_in_process("run", str(base), *args)[::2], needle)
    short = copy("pos256")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    _one_line_error(*cli_in_process("run", str(short), "--prompt-ids", "1,2", "--max-new-tokens", "1000000")[::2],
                    "prompt (2) + max new tokens (1000000) = 1000002 exceeds 256 tokens (pos256's "
                    "max_position_embeddings): pass --max-new-tokens 254 or fewer")
    _one_line_error(*cli_in_process("run", str(base), "--draft", str(short), "--prompt-ids", "1,2",
                                    "--max-new-tokens", "300")[::2], "exceeds 256 tokens (pos256's max_position_embeddings)")
    # a YaRN-extended config is made for original_max_position_embeddings x factor positions
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256, "rope_scaling": yarn}))
    _one_line_error(*cli_in_process("run", str(short), "--prompt-ids", "1,2", "--max-new-tokens", "1023")[::2],
                    "= 1025 exceeds 1024 tokens (pos256's YaRN original_max_position_embeddings 256 × factor 4.0): "
                    "pass --max-new-tokens 1022 or fewer")


def test_bench_refuses_what_run_refuses_before_any_rank(base, copy, tmp_path):
    """`bench CHECKPOINT` runs `run`'s leader-side request checks before the probe or any rank starts."""
    out = ("--out", str(tmp_path / "b.json"), "--trace", str(tmp_path / "b.trace.json"))
    cases = [
        (("--prompt-ids", "1,2,600"), "prompt token id 600 is outside the vocabulary 0..511"),
        (("--prompt-ids", "1", "--timeout", "inf"), "--timeout must be > 0 and at most 604800 seconds"),
    ]
    for args, needle in cases:
        _one_line_error(*cli_in_process("bench", str(base), *args, *out)[::2], needle)
    short = copy("pos16")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))
    _one_line_error(*cli_in_process("bench", str(short), "--prompt-ids", "1,2", "--max-new-tokens", "48", *out)[::2],
                    "= 50 exceeds 16 tokens (pos16's max_position_embeddings): pass --max-new-tokens 14 or fewer")
    assert not list(tmp_path.glob("b*.json"))


def test_unwritable_trace_is_refused_before_generation(base, tmp_path):
    for trace, needle in ((tmp_path, "(Is a directory)"), (Path("/proc/shardwise-trace.json"), "cannot write")):
        _one_line_error(*cli_in_process("run", str(base), "--prompt-ids", "1", "--trace", str(trace))[::2],
                        f"--trace {trace}", needle)
    # a writable path passes the check (a later error follows) and is left as it was: no new file, no
    # truncated old one
    existing = tmp_path / "keep.json"
    existing.write_text("old")
    for trace in (tmp_path / "new.json", existing):
        _one_line_error(*cli_in_process("run", str(base), "--prompt-ids", "1", "--max-new-tokens", "0",
                                        "--trace", str(trace))[::2], "--max-new-tokens must be >= 1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.json"] and existing.read_text() == "old"
