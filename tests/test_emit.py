"""`shardwise plan --emit vllm|shardwise`: the launch commands agree with the plan, every vLLM flag is one
the flags file lists (with its vLLM version and source), and the shardwise commands parse with torchrun's
and `shardwise run`'s own parsers."""

from __future__ import annotations

import json
from pathlib import Path
import shlex
import subprocess
import sys

import pytest

from conftest import SRC, cli_json, run_cli

from shardwise.errors import ShardwiseError
from shardwise.perf import launch_commands as lc

CLUSTER = str(Path(__file__).parent / "data" / "two_switch_8.toml")
CATALOG = Path(SRC) / "shardwise" / "spec" / "catalog"
FLAGS = lc.catalog_toml("vllm_cli_flags.toml")
TCP_DRAFT = ["--model", "llama-3.1-70b", "--box", "rtx-pro-6000", "--boxes", "4", "--link", "10gbe-tcp",
             "--spec-tokens", "4", "--acceptance", "0.6", "--draft-model", "llama-3.1-8b", "--kv-dtype", "fp8"]


def commands(doc: dict) -> list[dict]:
    return doc["launch"]["commands"]


def argv_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def printed_flags(lines: list[str]) -> set[str]:
    """Every word that starts with -- in the output: commands split as the shell does, comments on spaces."""
    words = []
    for line in lines:
        words += line.split() if line.startswith("#") else shlex.split(line)
    return {w.strip(".,;:()'\"").split("=", 1)[0] for w in words if w.strip("'\"(").startswith("--")}


@pytest.fixture(scope="module")
def seed_vllm() -> dict:
    return cli_json("plan", "--spec-tokens", "7", "--workload", "code-edit", "--context", "8192", "--emit", "vllm")


@pytest.fixture(scope="module")
def ring_vllm() -> dict:
    return cli_json("plan", "--cluster", CLUSTER, "--model", "qwen3-30b-a3b", "--emit", "vllm")


@pytest.fixture(scope="module")
def ring_shardwise() -> dict:
    return cli_json("plan", "--cluster", CLUSTER, "--model", "qwen3-30b-a3b", "--emit", "shardwise")


@pytest.fixture(scope="module")
def tcp_draft_vllm() -> dict:
    return cli_json("plan", *TCP_DRAFT, "--emit", "vllm")


# --------------------------------------------------------------------------- the data files


def test_every_flag_file_entry_has_meaning_version_source_and_doc():
    version = FLAGS["vllm"]["version"]
    assert version == "0.33.0" and FLAGS["vllm"]["multi_node_doc"].startswith("https://docs.vllm.ai/")
    for table in ("flags", "speculative_config"):
        for name, entry in FLAGS[table].items():
            assert entry["meaning"] and entry["defined_in"], name
            assert entry["vllm_version"] == version, name
            assert entry["doc_url"].startswith("https://"), name
    assert all(name.startswith("--") for name in FLAGS["flags"])
    for name, entry in FLAGS["env"].items():
        assert entry["meaning"] and entry["doc_url"].startswith("https://") and entry["defined_in"], name


def test_hf_repo_ids_are_catalog_models_with_their_source_row():
    from shardwise.spec.parse import catalog_models

    sources = (CATALOG / "models" / "SOURCES.md").read_text()
    repos = lc.catalog_toml("hf_repos.toml")
    assert "kimi-k3" in repos and "llama-3.1-405b" in repos and "qwen3.5-397b-a17b" in repos  # dotted keys stay whole
    for key, entry in repos.items():
        assert key in catalog_models(), key
        assert f"| {key}.json | {entry['repo']}" in sources, (key, entry["repo"])
        assert entry["source"].startswith("models/SOURCES.md"), key


# --------------------------------------------------------------------------- vLLM


def test_every_printed_vllm_flag_is_in_the_flags_file(seed_vllm, ring_vllm, tcp_draft_vllm):
    for doc in (seed_vllm, ring_vllm, tcp_draft_vllm):
        lines = doc["launch"]["lines"]
        flags = printed_flags(lines)
        assert {"--tensor-parallel-size", "--max-model-len", "--nnodes", "--headless"} <= flags
        assert flags <= set(FLAGS["flags"]), flags - set(FLAGS["flags"])
        assert {k for c in commands(doc) for k in c["env"]} <= set(FLAGS["env"])
        assert doc["launch"]["checked_against"]["vllm_version"] == FLAGS["vllm"]["version"]
        assert any(FLAGS["vllm"]["version"] in line and line.startswith("#") for line in lines)


def test_vllm_parallel_sizes_context_and_nodes_follow_the_plan(seed_vllm):
    plan, cmds = seed_vllm["plan"], commands(seed_vllm)
    assert (plan["tp"], plan["ep"], plan["pp"]) == (16, 16, 1)
    assert len(cmds) == seed_vllm["cluster"]["boxes"] == 16
    for rank, c in enumerate(cmds):
        argv = c["argv"]
        assert argv[:3] == ["vllm", "serve", "moonshotai/Kimi-K3"]
        assert int(argv_value(argv, "--tensor-parallel-size")) == plan["tp"]
        assert int(argv_value(argv, "--pipeline-parallel-size")) == plan["pp"]
        assert "--enable-expert-parallel" in argv  # vLLM's EP size is TP x DP = tp = the plan's ep
        assert int(argv_value(argv, "--max-model-len")) == 8192 == seed_vllm["memory"]["context_tokens"]
        assert int(argv_value(argv, "--node-rank")) == rank and c["node_rank"] == rank
        assert int(argv_value(argv, "--nnodes")) == 16
        assert argv_value(argv, "--master-addr") == "<host0>" and c["host"] == f"<host{rank}>"
        assert ("--headless" in argv) == (rank > 0)
        assert "--trust-remote-code" in argv  # kimi-k3's config.json has auto_map
        assert c["env"]["NCCL_IB_HCA"] == "<hca>" and c["env"]["NCCL_SOCKET_IFNAME"] == "<ifname>"  # RoCE
    lines = seed_vllm["launch"]["lines"]
    assert any("<ifname>:" in line for line in lines) and any("<hca>:" in line for line in lines)


def test_vllm_memory_and_batch_flags_come_from_the_plan_memory(seed_vllm):
    mem, argv = seed_vllm["memory"], commands(seed_vllm)[0]["argv"]
    util = float(argv_value(argv, "--gpu-memory-utilization"))
    used = (mem["weights_bytes"] + mem["kv_bytes"] + mem["workspace_bytes"] + mem["draft_bytes"]) / mem["box_bytes"]
    assert used <= util <= 0.95
    assert util == pytest.approx(1 - mem["reserve_bytes"] / mem["box_bytes"])  # the box less the plan's reserve
    assert int(argv_value(argv, "--max-num-seqs")) == min(mem["max_batch"], 1024) >= mem["batch"]


def test_vllm_speculative_config_parses_and_carries_the_spec_tokens(seed_vllm, tcp_draft_vllm):
    ngram = json.loads(argv_value(commands(seed_vllm)[0]["argv"], "--speculative-config"))
    assert ngram["method"] == "ngram" and ngram["num_speculative_tokens"] == 7
    draft = json.loads(argv_value(commands(tcp_draft_vllm)[0]["argv"], "--speculative-config"))
    assert draft == {"method": "draft_model", "model": "meta-llama/Llama-3.1-8B", "num_speculative_tokens": 4,
                     "draft_tensor_parallel_size": 1}
    for spec in (ngram, draft):
        assert set(spec) <= set(FLAGS["speculative_config"])
    # the line a user copies carries the same JSON, quoted for the shell
    line = tcp_draft_vllm["launch"]["lines"][-1]
    assert json.loads(argv_value(shlex.split(line), "--speculative-config")) == draft


def test_vllm_tcp_link_disables_ib_and_fp8_cache_prints_its_dtype(tcp_draft_vllm):
    c = commands(tcp_draft_vllm)[0]
    assert c["env"] == {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "<ifname>", "GLOO_SOCKET_IFNAME": "<ifname>"}
    assert argv_value(c["argv"], "--kv-cache-dtype") == "fp8"
    assert "--enable-expert-parallel" not in c["argv"]  # dense model, ep 1


def test_vllm_hosts_follow_the_plans_best_ring_order(ring_vllm):
    order = ring_vllm["plan"]["ring"]["best_order"]
    assert order != ring_vllm["plan"]["ring"]["listed_order"]  # the cluster file lists them interleaved
    cmds = commands(ring_vllm)
    assert [c["host"] for c in cmds] == order
    assert [int(argv_value(c["argv"], "--node-rank")) for c in cmds] == list(range(len(order)))
    assert {argv_value(c["argv"], "--master-addr") for c in cmds} == {order[0]}
    assert not any("<host" in line for line in ring_vllm["launch"]["lines"])


def test_vllm_pipeline_stages_and_single_host():
    pp = cli_json("plan", "--model", "llama-3.1-405b", "--boxes", "16", "--tp", "8", "--pp", "2", "--emit", "vllm")
    argv = commands(pp)[0]["argv"]
    assert argv[2] == "meta-llama/Llama-3.1-405B" and "--trust-remote-code" not in argv
    assert (argv_value(argv, "--tensor-parallel-size"), argv_value(argv, "--pipeline-parallel-size")) == ("8", "2")
    one = cli_json("plan", "--model", "qwen3-30b-a3b", "--box", "h100-sxm", "--boxes", "4", "--link", "nvlink4",
                   "--emit", "vllm")
    (c,) = commands(one)
    assert c["env"] == {} and "--nnodes" not in c["argv"] and argv_value(c["argv"], "--tensor-parallel-size") == "4"


def test_model_argument_is_the_repo_id_the_checkpoint_folder_or_a_placeholder(tmp_path):
    config = (CATALOG / "models" / "deepseek-v2-lite.json").read_text()
    (tmp_path / "config.json").write_text(config)
    for arg in (str(tmp_path), str(tmp_path / "config.json")):
        ref = lc.model_ref(arg)
        assert ref.value == ref.local == str(tmp_path) and ref.repo is None and "auto_map" in ref.config
    named = lc.model_ref(str(CATALOG / "models" / "qwen3-30b-a3b.json"))  # a config file, not a checkpoint folder
    assert named.value == "<checkpoint-dir>" and "qwen3-30b-a3b.json" in named.note("vllm")
    key = lc.model_ref("gpt-oss-20b", role="draft model")
    assert (key.value, key.local, key.repo) == ("openai/gpt-oss-20b", "<draft-checkpoint-dir>", "openai/gpt-oss-20b")
    assert key.note("vllm").startswith("# draft model: the Hugging Face repo openai/gpt-oss-20b")


def test_the_emitter_refuses_a_flag_the_flags_file_does_not_list():
    from shardwise.perf.estimate import estimate
    from shardwise.perf.scenario import build_scenario

    sc = build_scenario("qwen3-30b-a3b", "dgx-spark", 8, "100g-roce", None, None, None, 4096, 2048, 0, None, None,
                        "vllm", None, None, None, None, "bf16")
    doc = estimate(sc)
    table = {**FLAGS, "flags": {k: v for k, v in FLAGS["flags"].items() if k != "--max-model-len"}}
    with pytest.raises(ShardwiseError, match="--max-model-len") as err:
        lc.vllm_launch(doc, sc, lc.model_ref("qwen3-30b-a3b"), None, table=table)
    assert "\n" not in str(err.value)
    no_env = {**FLAGS, "env": {k: v for k, v in FLAGS["env"].items() if k != "NCCL_IB_HCA"}}
    with pytest.raises(ShardwiseError, match="NCCL_IB_HCA"):
        lc.vllm_launch(doc, sc, lc.model_ref("qwen3-30b-a3b"), None, table=no_env)
    assert lc.vllm_launch(doc, sc, lc.model_ref("qwen3-30b-a3b"), None).commands  # the real table passes


# --------------------------------------------------------------------------- shardwise


def parse_shardwise(c: dict):
    """The command through torchrun's own parser, then `shardwise run`'s (typer/click) parser, without running."""
    import click
    import typer
    from torch.distributed.run import get_args_parser

    from shardwise.cli import build_app

    assert c["argv"][0] == "torchrun"
    args = get_args_parser().parse_args(c["argv"][1:])
    assert args.module and args.training_script == "shardwise" and args.training_script_args[0] == "run"
    group = typer.main.get_command(build_app("run"))
    run = group.get_command(click.Context(group), "run")
    return args, run.make_context("run", list(args.training_script_args[1:])).params


def test_shardwise_commands_parse_with_torchrun_and_shardwise_run(ring_shardwise):
    order, plan = ring_shardwise["plan"]["ring"]["best_order"], ring_shardwise["plan"]
    cmds = commands(ring_shardwise)
    assert [c["host"] for c in cmds] == order
    for rank, c in enumerate(cmds):
        args, params = parse_shardwise(c)
        assert (int(args.nnodes), args.node_rank, int(args.nproc_per_node)) == (len(order), rank, 1)
        assert (args.master_addr, args.master_port) == (order[0], 29500)
        assert (params["tp"], params["ep"]) == (plan["tp"], plan["ep"])
        assert params["backend"] == "nccl" and params["dtype"] == "bfloat16"
        assert params["allreduce"] == "auto" and params["cluster"] == CLUSTER
        assert params["max_new_tokens"] == 4096 - 2048
    assert any("put `serve` in place of `run`" in line for line in ring_shardwise["launch"]["lines"])


def test_shardwise_speculation_draft_and_cpu_boxes():
    spec = cli_json("plan", *TCP_DRAFT, "--emit", "shardwise")
    _, params = parse_shardwise(commands(spec)[0])
    assert (params["spec_method"], params["spec_tokens"], str(params["draft"])) == ("draft", 4, "<draft-checkpoint-dir>")
    ngram = cli_json("plan", "--spec-tokens", "7", "--workload", "code-edit", "--emit", "shardwise")
    _, params = parse_shardwise(commands(ngram)[0])
    assert (params["spec_method"], params["spec_tokens"], params["tp"], params["ep"]) == ("ngram", 7, 16, 16)
    mac = cli_json("plan", "--model", "qwen3-235b-a22b", "--box", "mac-studio-m3-ultra-512", "--boxes", "2",
                   "--link", "tb5-rdma", "--emit", "shardwise")
    c = commands(mac)[0]
    _, params = parse_shardwise(c)
    assert params["backend"] == "gloo" and c["env"] == {"GLOO_SOCKET_IFNAME": "<ifname>"}


# --------------------------------------------------------------------------- errors and output


@pytest.mark.parametrize("args, words", [
    (["--emit", "bogus"], "--emit 'bogus' is unknown"),
    (["--tp", "16", "--ep", "4", "--emit", "vllm"], "EP4 inside TP16"),
    (["--model", "llama-3.1-405b", "--boxes", "16", "--tp", "8", "--pp", "2", "--emit", "shardwise"], "PP2"),
    (["--model", "qwen3-235b-a22b", "--box", "mac-studio-m3-ultra-512", "--boxes", "2", "--link", "tb5-rdma",
      "--emit", "vllm"], "needs NVIDIA GPUs"),
])
def test_bad_emit_is_a_one_line_error_exit_2(args, words):
    proc = run_cli("plan", *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and words in proc.stderr
    assert proc.stdout == ""


def test_text_output_is_the_commands_only_and_never_imports_torch():
    code = ("import sys\nsys.argv = ['shardwise', 'plan', '--emit', 'vllm']\nfrom shardwise.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# vLLM launch for kimi-k3") and "Memory per box" not in proc.stdout
    run_lines = [line for line in lines if not line.startswith("#")]
    assert len(run_lines) == 16 and all(" vllm serve " in line for line in run_lines)
