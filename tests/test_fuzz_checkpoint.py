"""Property-based fuzzing of checkpoint files (issue #18): a tiny checkpoint's model.safetensors
mutated (bytes flipped in the header or the data, truncated, extended, the header length
rewritten) and its config.json mutated, then checked and loaded in this process the way every
rank loads its shard. Whatever the bytes, the outcome is a loaded model (a flip inside the data
that leaves every weight finite) or one ShardwiseError naming the file: never another
exception, never NaN/Inf weights accepted."""

from __future__ import annotations

import shutil
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise.errors import ShardwiseError
from shardwise.plan import ParallelPlan
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.loader import Checkpoint, check_checkpoint, load_shard, load_spec
from shardwise.runtime.model import ShardedCausalLM

FUZZ = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_checkpoint("qwen3-30b-a3b", "tiny", tmp_path_factory.mktemp("fuzz") / "q", seed=2)


def _load(folder) -> ShardedCausalLM:
    """What `shardwise run` does before generating, at tp 1 in this process."""
    spec = load_spec(folder)
    with Checkpoint(folder) as ckpt:
        check_checkpoint(spec, ckpt)
    model = ShardedCausalLM(spec, ParallelPlan(), 0, "float32", max_seq_len=8)
    load_shard(model, folder)
    return model


def _holds_the_contract(folder) -> None:
    try:
        model = _load(folder)
    except ShardwiseError as exc:
        text = str(exc)
        assert "\n" not in text and text, text
        return
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


mutations = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("extend"), st.integers(1, 4096), st.just(0)),
    st.tuples(st.just("header_length"), st.integers(0, 2**64 - 1), st.just(0)),
)


@FUZZ
@given(mutation=mutations)
def test_mutated_safetensors_load_or_fail_in_one_line(pristine, tmp_path_factory, mutation):
    folder = tmp_path_factory.mktemp("m") / "q"
    shutil.copytree(pristine, folder)
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    kind, at, value = mutation
    header_len = struct.unpack("<Q", data[:8])[0]
    if kind == "flip":  # half the flips land in the header (the JSON), half in the tensors
        at = at % (header_len + 8) if at % 2 else at % len(data)
        data[at] ^= value
    elif kind == "truncate":
        del data[at % len(data):]
    elif kind == "extend":
        data += bytes(at)
    else:
        data[:8] = struct.pack("<Q", at)
    path.write_bytes(bytes(data))
    _holds_the_contract(folder)


@FUZZ
@given(at=st.integers(0, 10**6), value=st.integers(1, 255))
def test_mutated_config_loads_or_fails_in_one_line(pristine, tmp_path_factory, at, value):
    folder = tmp_path_factory.mktemp("c") / "q"
    shutil.copytree(pristine, folder)
    path = folder / "config.json"
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= value
    path.write_bytes(bytes(data))
    _holds_the_contract(folder)
