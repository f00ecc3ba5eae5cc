"""Checkpoints, loader layouts, input errors and the `run` / `make-checkpoint` verbs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import CLI_TIMEOUT_S, cli_argv, cli_env, run_cli
from shardwise.errors import ShardwiseError
from shardwise.plan import ParallelPlan, rank_param_counts
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.generate import SamplingParams, encode_prompt, generate
from shardwise.runtime.loader import Checkpoint, check_checkpoint, load_shard, load_spec
from shardwise.runtime.model import ShardedCausalLM

def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _model(folder: Path, tp: int = 1, ep: int = 1, rank: int = 0) -> ShardedCausalLM:
    model = ShardedCausalLM(load_spec(folder), ParallelPlan(tp=tp, ep=ep), rank, torch.float32, max_seq_len=64)
    load_shard(model, folder)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    keys = ("llama-3.1-8b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-20b")
    return {k: make_checkpoint(k, "tiny", tmp_path_factory.mktemp(k), seed=7) for k in keys}


def test_make_checkpoint_loads_in_transformers(tiny):
    transformers = pytest.importorskip("transformers")
    for key, folder in tiny.items():
        ids = encode_prompt(folder, "The quick brown fox jumps over the lazy dog")
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits
            ours = _model(folder).logits(torch.tensor([ids]))
        assert (ours - ref).abs().max().item() <= 1e-4, key


def test_make_checkpoint_keeps_layer_kinds(tiny):
    ds = load_spec(tiny["deepseek-v3"])
    assert [layer.mlp for layer in ds.layers] == ["dense", "moe"] and ds.moe.num_experts == 8
    oss = load_spec(tiny["gpt-oss-20b"])
    assert [layer.attention for layer in oss.layers] == ["sliding", "gqa"] and oss.sliding_window == 8
    assert load_spec(tiny["qwen3-30b-a3b"]).quant_method is None


def test_fused_and_sharded_layouts_load_the_same(tiny, tmp_path):
    """transformers' fused expert tensors and a sharded index give the same shard as per-expert files."""
    src = tiny["qwen3-30b-a3b"]
    spec = load_spec(src)
    tensors = _tensors(src)
    fused: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".experts." not in name:
            fused[name] = t
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}.mlp.experts."
        e_range = range(spec.moe.num_experts)
        fused[p + "gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{p}{e}.gate_proj.weight"], tensors[f"{p}{e}.up_proj.weight"]]) for e in e_range]
        )
        fused[p + "down_proj"] = torch.stack([tensors[f"{p}{e}.down_proj.weight"] for e in e_range])
    out = tmp_path / "fused"
    out.mkdir()
    names = sorted(fused)
    half = len(names) // 2
    save_file({k: fused[k] for k in names[:half]}, str(out / "model-00001-of-00002.safetensors"))
    save_file({k: fused[k] for k in names[half:]}, str(out / "model-00002-of-00002.safetensors"))
    weight_map = {k: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, k in enumerate(names)}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text((src / "config.json").read_text())
    for tp, ep in ((2, 1), (2, 2)):  # experts split by rows (etp 2) and by owner (ep 2)
        for rank in range(tp):
            a = dict(_model(src, tp, ep, rank).named_parameters())
            b = dict(_model(out, tp, ep, rank).named_parameters())
            assert a.keys() == b.keys()
            for name in a:
                assert torch.equal(a[name], b[name]), (tp, ep, rank, name)


def test_missing_and_misshaped_tensors(tiny, tmp_path):
    src = tiny["qwen3-30b-a3b"]
    tensors = _tensors(src)
    missing = "model.layers.1.mlp.experts.5.up_proj.weight"
    for case, change in (("missing", lambda t: t.pop(missing)), ("bad", lambda t: t.update({missing: torch.zeros(32, 63)}))):
        folder = tmp_path / case
        folder.mkdir()
        t = dict(tensors)
        change(t)
        save_file(t, str(folder / "model.safetensors"))
        (folder / "config.json").write_text((src / "config.json").read_text())
        with pytest.raises(ShardwiseError) as err, Checkpoint(folder) as ckpt:
            check_checkpoint(load_spec(folder), ckpt)
        expected = (
            f"checkpoint tensor '{missing}' is missing (expected shape [32, 64])"
            if case == "missing"
            else f"checkpoint tensor '{missing}' has shape [32, 63], expected [32, 64]"
        )
        assert str(err.value) == expected
        # The CLI stops before starting any rank, with the same one line.
        proc = run_cli("run", str(folder), "--tp", "2", "--prompt-ids", "1,2,3")
        assert proc.returncode == 2
        assert proc.stderr.strip() == f"error: {expected}"


def test_bad_layout_names_nearest_valid(tiny):
    proc = run_cli("run", str(tiny["llama-3.1-8b"]), "--tp", "3", "--prompt-ids", "1,2")
    assert proc.returncode == 2
    assert "nearest valid is --tp 4" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("allreduce", ["ring", "shm"])
def test_cli_run_json_tp2_sampling_matches_tp1(tiny, allreduce):
    folder = tiny["qwen3-30b-a3b"]
    proc = run_cli(
        "run", str(folder), "--tp", "2", "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--json",
        "--temperature", "0.8", "--top-p", "0.9", "--seed", "5", "--allreduce", allreduce,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["plan"] == {"tp": 2, "ep": 2, "pp": 1}
    assert len(doc["tokens"]) == 8 and doc["tok_per_s"] > 0
    spec = load_spec(folder)
    for r in doc["ranks"]:
        assert r["param_bytes"] == 4 * sum(rank_param_counts(spec, ParallelPlan(tp=2, ep=2), r["rank"]).values())
    assert doc["ranks"][0]["experts"] == [0, 1, 2, 3] and doc["ranks"][1]["experts"] == [4, 5, 6, 7]
    alone = generate(_model(folder), [1, 2, 3], 8, SamplingParams(0.8, 0.9, 5))
    assert doc["tokens"] == alone.tokens


def test_cli_make_checkpoint(tmp_path):
    out = tmp_path / "ds"
    proc = run_cli("make-checkpoint", "--model", "deepseek-v3", "--scale", "tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    proc = run_cli("make-checkpoint", "--model", "deepseek-v2-lite", "--out", str(tmp_path / "v2"))
    assert proc.returncode == 2 and "make-checkpoint supports" in proc.stderr


@pytest.mark.parametrize("model", ["qwen2.5-0.5b", "qwen3-0.6b", "mistral-7b-v0.1"])
def test_llama_variants_make_checkpoint_and_run_at_tp2(tmp_path, model):
    """The dense llama variants (qwen2: q/k/v biases, qwen3: q/k norms, mistral: sliding window) from their
    bundled configs: make-checkpoint writes one and ``run --tp 2`` gives the tokens a one-process model gives
    (their logits against transformers: test_runtime_model)."""
    out = tmp_path / model
    proc = run_cli("make-checkpoint", "--model", model, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("run", str(out), "--tp", "2", "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["tokens"] == generate(_model(out), [1, 2, 3], 8).tokens


def test_cli_run_ranks_use_the_cores_they_share(tiny):
    """Each local rank runs cores / ranks torch threads (``OMP_NUM_THREADS`` overrides): a run at tp 1 used to pin its
    one rank to a single thread whatever the machine."""
    folder, cores = tiny["llama-3.1-8b"], os.cpu_count() or 1
    unset = {k: v for k, v in cli_env().items() if k != "OMP_NUM_THREADS"}
    for tp, env, expected in ((1, unset, cores), (2, unset, max(1, cores // 2)), (1, {**unset, "OMP_NUM_THREADS": "1"}, 1)):
        proc = subprocess.run(cli_argv("run", str(folder), "--tp", str(tp), "--prompt-ids", "1,2,3", "--max-new-tokens",
                                       "2", "--json"), capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=env)
        assert proc.returncode == 0, proc.stderr
        assert [r["threads"] for r in json.loads(proc.stdout)["ranks"]] == [expected] * tp, (tp, env.get("OMP_NUM_THREADS"))
