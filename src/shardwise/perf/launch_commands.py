"""Launch commands for a plan: what ``shardwise plan --emit vllm|shardwise`` prints.

``launch_plan`` takes the plan document (the dict ``perf.estimate.estimate`` returns), its
``Scenario`` and the CLI's model/draft/cluster strings, and returns a ``Launch``: one command per
node (host, node rank, environment, argv) plus comment lines that say what each figure is and what
each ``<placeholder>`` stands for. Node ranks follow the plan's best ring order when a cluster file
gave one (``plan.ring.best_order``); otherwise the hosts are placeholders ``<host0>`` ...

vLLM: the flags, ``--speculative-config`` keys and environment variables come from
``spec/catalog/vllm_cli_flags.toml`` (each with the vLLM version, the source line and the
documentation page it was checked against); printing anything not listed there is refused with a
one-line error. The multi-node form is vLLM's multiprocessing backend (``--nnodes``,
``--node-rank``, ``--master-addr``, ``--headless``), whose node ranks follow the ring order.

shardwise: ``torchrun ... -m shardwise run CHECKPOINT --tp T --ep E ...`` on every host: one prompt on the planned
layout, with the plan's all-reduce (``--cluster``) and speculation (a draft model too, which ``shardwise serve``
does not take yet); the header says how to serve the same layout instead.

Pure Python: never imports torch.
"""

from __future__ import annotations

import functools
import json
import math
import shlex
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError

TARGETS = ("vllm", "shardwise")
FLAGS_FILE = "shardwise/spec/catalog/vllm_cli_flags.toml"
VLLM_MASTER_PORT = 29501  # vLLM 0.33.0's own default (vllm/config/parallel.py:320)
VLLM_API_PORT = 8000  # vLLM 0.33.0's default API port (vllm/entrypoints/common/cli_args.py:295)
TORCHRUN_MASTER_PORT = 29500
MAX_GPU_MEMORY_UTILIZATION = 0.95  # leave the driver and CUDA context room even with no plan reserve
MAX_NUM_SEQS = 1024  # the largest of vLLM 0.33.0's own max_num_seqs defaults (arg_utils.py:2979-3006)
NGRAM_MIN, NGRAM_MAX = 1, 3  # `shardwise run --ngram-min/--ngram-max` defaults, so both runtimes draft alike
INTRA_HOST_KINDS = ("pcie", "nvlink")  # links between GPUs of one host: one node, many GPUs
PLACEHOLDERS = {
    "<ifname>": "the network interface on the link between the boxes (e.g. enp1s0f0np0; `ip -br addr` lists them)",
    "<hca>": "the RDMA device NCCL should use (e.g. mlx5_0; `ibv_devices` lists them)",
    "<prompt>": "the prompt text to generate from",
}


def check_target(target: str | None) -> str | None:
    """``target`` if it is a known --emit value (or None); else a one-line error."""
    if target is not None and target not in TARGETS:
        raise ShardwiseError(f"--emit '{target}' is unknown: use {' or '.join(TARGETS)}")
    return target


@functools.cache
def catalog_toml(name: str) -> dict[str, Any]:
    """A TOML file of spec/catalog: ``vllm_cli_flags.toml`` (tables vllm, flags, speculative_config,
    env) or ``hf_repos.toml`` (catalog model key -> {repo, source})."""
    return tomllib.loads(resources.files("shardwise.spec").joinpath("catalog", name).read_text(encoding="utf-8"))


@dataclass(frozen=True)
class LaunchCommand:
    """One node's command: environment assignments, then argv."""

    host: str
    node_rank: int
    env: dict[str, str]
    argv: list[str]

    def line(self) -> str:
        """The shell line: ``NAME=value ... argv`` with every word quoted as the shell needs."""
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join([*env, shlex.join(self.argv)])


@dataclass(frozen=True)
class Launch:
    """The commands of one --emit target and the comment lines that explain them."""

    target: str
    header: list[str]
    commands: list[LaunchCommand]
    checked_against: dict[str, str] | None = None

    def lines(self) -> list[str]:
        """Comment lines, then for each node a ``# node R: HOST`` line and its command."""
        out = list(self.header)
        for c in self.commands:
            out += [f"# node {c.node_rank}: {c.host}", c.line()]
        return out

    def to_json(self) -> dict[str, Any]:
        """The ``launch`` section of ``shardwise plan --json --emit ...``."""
        return {
            "target": self.target,
            "checked_against": self.checked_against,
            "lines": self.lines(),
            "commands": [{"host": c.host, "node_rank": c.node_rank, "env": c.env, "argv": c.argv} for c in self.commands],
        }


# --------------------------------------------------------------------------- the model and the nodes


@dataclass(frozen=True)
class ModelRef:
    """A model as the commands name it: ``value`` for vLLM (repo id, folder or placeholder),
    ``local`` for ``shardwise run`` (a folder or a placeholder)."""

    role: str  # "model" or "draft model"
    value: str
    local: str
    repo: str | None  # the Hugging Face repo id, when the catalog records one
    key: str | None  # the catalog key, when the CLI named one
    config: dict[str, Any] | None  # the config.json, when readable (for auto_map)

    def note(self, target: str) -> str:
        """One comment line that says what the command's model argument is."""
        word = self.value if target == "vllm" else self.local
        if not word.startswith("<"):
            if word == self.repo:
                return (f"# {self.role}: the Hugging Face repo {self.repo} (catalog key {self.key}); vLLM's docs advise "
                        "downloading it to the same path on every node first and passing that path instead")
            return f"# {self.role}: {word}, the folder holding config.json and the weights, the same path on every host"
        if self.repo:
            where = f"a local copy of the Hugging Face repo {self.repo}"
        elif self.key and self.key.endswith(".json"):
            where = f"the checkpoint folder of the model whose config is {self.key}"
        else:
            where = f"a local checkpoint of catalog model '{self.key}', for which the catalog records no Hugging Face repo"
        return f"#   {word}: {where}; safetensors and tokenizer.json, the same path on every host"


def model_ref(arg: str, role: str = "model") -> ModelRef:
    """The model named by the CLI string ``arg`` (catalog key, config.json path or folder)."""
    from shardwise.spec.parse import catalog_models

    path = Path(arg)
    if path.is_dir() or path.suffix == ".json" or path.exists():
        cfg_path = path / "config.json" if path.is_dir() else path
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else None
        if path.is_dir() or path.name == "config.json":
            folder = str(path if path.is_dir() else path.parent)
            return ModelRef(role, folder, folder, None, None, config)
        tag = "<checkpoint-dir>" if role == "model" else "<draft-checkpoint-dir>"  # a config file, not a checkpoint
        return ModelRef(role, tag, tag, None, str(path), config)
    config = None
    if arg in catalog_models():
        config = json.loads(resources.files("shardwise.spec.catalog.models").joinpath(f"{arg}.json").read_text())
    repo = catalog_toml("hf_repos.toml").get(arg, {}).get("repo")
    tag = "<checkpoint-dir>" if role == "model" else "<draft-checkpoint-dir>"
    return ModelRef(role, repo or tag, tag, repo, arg, config)


def _needs_remote_code(config: dict[str, Any] | None) -> bool:
    text = (config or {}).get("text_config")
    return "auto_map" in (config or {}) or (isinstance(text, dict) and "auto_map" in text)


def _intra_host(doc: dict, sc) -> bool:
    return sc.link.kind in INTRA_HOST_KINDS or str(doc["cluster"].get("link_key", "")).startswith("loopback")


def _hosts(doc: dict, n: int) -> tuple[list[str], bool]:
    """(host of node rank 0..n-1, whether they came from the plan's ring order); n = 0: one host, this one."""
    if n == 0:
        return ["localhost"], False
    ring = doc["plan"].get("ring")
    if ring and len(ring.get("best_order") or ()) == n:
        return list(ring["best_order"]), True
    return [f"<host{i}>" for i in range(n)], False


def _is_cuda(sc) -> bool:
    """NVIDIA boxes: the catalog names them 'NVIDIA ...' (hardware.toml)."""
    return sc.box.name.startswith("NVIDIA")


def _network_env(sc, nccl: bool) -> dict[str, str]:
    """Environment for the link between boxes: NCCL over RDMA or TCP sockets, gloo's interface."""
    if not nccl:
        return {"GLOO_SOCKET_IFNAME": "<ifname>"}
    ib = {"NCCL_IB_HCA": "<hca>"} if sc.link.kind == "rdma" else {"NCCL_IB_DISABLE": "1"}
    return {**ib, "NCCL_SOCKET_IFNAME": "<ifname>", "GLOO_SOCKET_IFNAME": "<ifname>"}


def _profile_line(doc: dict, target: str) -> list[str]:
    """A note when the plan's figures are for another runtime's profile than the one launched."""
    used = doc["plan"]["runtime"]
    if used == target:
        return []
    return [f"# the planned figures are for the runtime profile '{used}'; plan with the '{target}' profile for {target}'s own"]


def _summary(doc: dict, sc) -> str:
    c, d = doc["cluster"], doc["decode"]
    return (f"{doc['model']['name']}: {doc['plan']['layout']} on {c['boxes']} x {c['box']} over {c['link']}; "
            f"planned {d['tok_per_s']:,.2f} tok/s per sequence at batch {d['batch']} "
            f"(runtime profile {doc['plan']['runtime']}), context {doc['memory']['context_tokens']:,} tokens")


def _model_lines(refs: list[ModelRef | None], target: str, words: list[str], hosts: list[str]) -> list[str]:
    """Comment lines for the model arguments, then the placeholders the commands use."""
    notes = [r.note(target) for r in refs if r is not None]
    text = " ".join(words)
    held = [n for n in notes if n.startswith("#   ")]
    if hosts and hosts[0].startswith("<"):
        held.append(f"#   {hosts[0]}..{hosts[-1]}: the boxes' addresses, node rank i on <host i>; list them in ring "
                    "order (a cluster file that describes the cables gives the plan that order)" if len(hosts) > 1
                    else f"#   {hosts[0]}: the box's address")
    held += [f"#   {k}: {v}" for k, v in PLACEHOLDERS.items() if k in text]
    out = [n for n in notes if not n.startswith("#   ")]
    return out + (["# placeholders (replace them, brackets included):", *held] if held else [])


def _host_lines(hosts: list[str], from_ring: bool, intra: bool) -> list[str]:
    if intra:
        return ["# one host: every rank is a GPU of the same machine"]
    if from_ring:
        return [f"# node ranks follow the plan's best ring order from the cluster file: {' '.join(hosts)}"]
    return []


def _formats_line(doc: dict) -> str:
    by_format: dict[str, list[str]] = {}
    for group, fmt in doc["model"]["formats"].items():
        by_format.setdefault(fmt, []).append(group)
    common = max(by_format, key=lambda f: len(by_format[f]))
    rest = [f"{', '.join(groups)} {fmt}" for fmt, groups in by_format.items() if fmt != common]
    planned = "; ".join([*rest, f"the rest {common}"]) if rest else f"all {common}"
    return f"# weights as planned: {planned} (the checkpoint must store them so)"


# --------------------------------------------------------------------------- vLLM


def gpu_memory_utilization(mem: dict) -> tuple[float, float]:
    """(--gpu-memory-utilization, the fraction the plan's own bytes take): the box less the plan's
    reserve, rounded down to 0.01, at least what the plan uses, at most 0.95."""
    box = mem["box_bytes"]
    used = (mem["weights_bytes"] + mem["kv_bytes"] + mem["workspace_bytes"] + mem["draft_bytes"]) / box
    floor = math.ceil(used * 100 - 1e-9) / 100
    if floor > MAX_GPU_MEMORY_UTILIZATION:
        raise ShardwiseError(
            f"the plan fills {used:.0%} of each box but vLLM should get at most {MAX_GPU_MEMORY_UTILIZATION:.0%} "
            "of a GPU: plan with more boxes or a runtime profile with a reserve"
        )
    usable = math.floor((box - mem["reserve_bytes"]) / box * 100 + 1e-9) / 100
    return min(max(usable, floor), MAX_GPU_MEMORY_UTILIZATION), used


def max_num_seqs(mem: dict) -> int:
    """--max-num-seqs: the most sequences of the plan's context that fit (max_batch), at least the
    plan's --batch, at most vLLM's own largest default (1024)."""
    return max(int(mem["batch"]), min(int(mem["max_batch"]), MAX_NUM_SEQS))


def speculative_config(sc, draft: ModelRef | None) -> dict[str, Any] | None:
    """vLLM's --speculative-config for the plan's --spec-tokens (None when it has none)."""
    if not sc.spec_tokens:
        return None
    if draft is not None:
        return {"method": "draft_model", "model": draft.value, "num_speculative_tokens": sc.spec_tokens,
                "draft_tensor_parallel_size": 1}
    return {"method": "ngram", "num_speculative_tokens": sc.spec_tokens,
            "prompt_lookup_max": NGRAM_MAX, "prompt_lookup_min": NGRAM_MIN}


def _vllm_ep_flag(plan) -> bool:
    if plan.ep == 1:
        return False
    if plan.ep == plan.tp:
        return True
    raise ShardwiseError(
        f"vLLM cannot run EP{plan.ep} inside TP{plan.tp}: with expert parallelism on it shards the experts over "
        f"all {plan.tp} tensor-parallel ranks (EP = TP x DP), without it ep is 1; plan with --ep {plan.tp} or --ep 1"
    )


def check_vllm_words(header: list[str], commands: list[LaunchCommand], spec: dict | None, table: dict) -> None:
    """Refuse (one-line error) any flag, environment variable or --speculative-config key that
    ``vllm_cli_flags.toml`` (``table``) does not list."""
    version = table["vllm"]["version"]
    words = [w for c in commands for w in c.argv] + [w.strip(".,;:()'\"") for h in header for w in h.split()]
    for word in words:
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and flag not in table["flags"]:
            raise ShardwiseError(f"refusing to print vLLM flag {flag}: it is not in {FLAGS_FILE} (checked against vLLM {version})")
    for name in {k for c in commands for k in c.env}:
        if name not in table["env"]:
            raise ShardwiseError(f"refusing to print environment variable {name}: it is not in {FLAGS_FILE}")
    for key in spec or {}:
        if key not in table["speculative_config"]:
            raise ShardwiseError(f"refusing to print --speculative-config key '{key}': it is not in {FLAGS_FILE}")


def vllm_launch(doc: dict, sc, model: ModelRef, draft: ModelRef | None, table: dict | None = None) -> Launch:
    """One ``vllm serve`` per node (one node on a single host)."""
    table = table or catalog_toml("vllm_cli_flags.toml")
    version = table["vllm"]["version"]
    if not _is_cuda(sc):
        raise ShardwiseError(
            f"vLLM's multi-GPU path needs NVIDIA GPUs and {sc.box.name} is not one: emit shardwise commands instead"
        )
    plan, mem = sc.plan, doc["memory"]
    util, used = gpu_memory_utilization(mem)
    seqs = max_num_seqs(mem)
    spec = speculative_config(sc, draft)
    base = ["vllm", "serve", model.value]
    if _needs_remote_code(model.config):
        base.append("--trust-remote-code")
    base += ["--tensor-parallel-size", str(plan.tp), "--pipeline-parallel-size", str(plan.pp)]
    if _vllm_ep_flag(plan):
        base.append("--enable-expert-parallel")
    base += ["--max-model-len", str(mem["context_tokens"]), "--gpu-memory-utilization", f"{util:.2f}",
             "--max-num-seqs", str(seqs)]
    if sc.kv_bytes == 1.0:
        base += ["--kv-cache-dtype", "fp8"]
    if spec is not None:
        base += ["--speculative-config", json.dumps(spec)]
    intra = _intra_host(doc, sc)
    hosts, from_ring = _hosts(doc, 0 if intra else sc.boxes)
    commands: list[LaunchCommand] = []
    if intra:
        commands.append(LaunchCommand(hosts[0], 0, {}, base))
    else:
        env = _network_env(sc, nccl=True)
        for rank, host in enumerate(hosts):
            argv = [*base, "--distributed-executor-backend", "mp", "--nnodes", str(len(hosts)), "--node-rank", str(rank),
                    "--master-addr", hosts[0], "--master-port", str(VLLM_MASTER_PORT)]
            commands.append(LaunchCommand(host, rank, dict(env), argv + (["--headless"] if rank else [])))
    header = [
        f"# vLLM launch for {_summary(doc, sc)}",
        f"# flags checked against vLLM {version} ({FLAGS_FILE}); multi-node form: vLLM's multiprocessing backend, "
        f"{table['vllm']['multi_node_doc']} (older vLLM releases document only a Ray cluster for multi-node)",
    ]
    if not intra:
        header.append(f"# start every node's command at once, each on its own host; node 0 (the head) serves the "
                      f"OpenAI-compatible API on port {VLLM_API_PORT}, the other nodes run --headless")
    header += _host_lines(hosts, from_ring, intra)
    header += _model_lines([model, draft], "vllm", [w for c in commands for w in [*c.env.values(), *c.argv]],
                           [] if intra else hosts)
    header += [
        f"# --gpu-memory-utilization {util:.2f}: the box less the plan's reserve ({mem['reserve_bytes'] / 1e9:,.1f} of "
        f"{mem['box_bytes'] / 1e9:,.1f} GB); the plan's weights, cache{', draft model' if mem['draft_bytes'] else ''} and workspace "
        f"take {used:.2f}, vLLM gives the rest to KV cache",
        f"# --max-num-seqs {seqs}: the most sequences of {mem['context_tokens']:,} tokens that fit is {mem['max_batch']:,} "
        f"(the plan's tok/s is for {mem['batch']} at a time)",
        _formats_line(doc),
        *_profile_line(doc, "vllm"),
    ]
    if sc.kv_bytes == 4.0:
        header.append("# the plan keeps the KV cache in fp32; vLLM keeps it in the model's dtype, which takes less memory")
    if spec is not None:
        kind = "a draft model, one whole copy per GPU" if draft is not None else "prompt lookup (n-grams of the prompt)"
        header.append(f"# --speculative-config: {sc.spec_tokens} tokens drafted per step by {kind}")
    check_vllm_words(header, commands, spec, table)
    return Launch("vllm", header, commands, {"vllm_version": version, "flags_file": FLAGS_FILE,
                                              "multi_node_doc": table["vllm"]["multi_node_doc"]})


# --------------------------------------------------------------------------- shardwise


def _allreduce_args(doc: dict, cluster: str | None) -> list[str]:
    if cluster:
        return ["--allreduce", "auto", "--cluster", cluster]
    algorithm = doc["decode"].get("allreduce_algorithm")
    return ["--allreduce", algorithm if algorithm in ("ring", "rd", "oneshot") else "builtin"]


def shardwise_launch(doc: dict, sc, model: ModelRef, draft: ModelRef | None, cluster: str | None = None) -> Launch:
    """``torchrun ... -m shardwise run`` per host (one torchrun with a rank per GPU on a single host)."""
    plan = sc.plan
    if plan.pp > 1:
        raise ShardwiseError(
            f"shardwise run has no pipeline stages yet and the plan has PP{plan.pp}: plan with --pp 1, or emit vllm commands"
        )
    nccl = _is_cuda(sc)
    intra = _intra_host(doc, sc)
    hosts, from_ring = _hosts(doc, 0 if intra else sc.boxes)
    per_node = plan.world_size if intra else 1
    master = "127.0.0.1" if intra else hosts[0]
    mem = doc["memory"]
    new_tokens = max(mem["context_tokens"] - doc["prefill"]["prompt_tokens"], 1)
    run = ["-m", "shardwise", "run", model.local, "--tp", str(plan.tp), "--ep", str(plan.ep),
           "--backend", "nccl" if nccl else "gloo"]
    if nccl:
        run += ["--dtype", "bfloat16"]
    run += _allreduce_args(doc, cluster)
    if sc.spec_tokens:
        run += ["--spec", "draft" if draft is not None else "ngram", "--spec-tokens", str(sc.spec_tokens)]
        if draft is not None:
            run += ["--draft", draft.local]
    run += ["--prompt", "<prompt>", "--max-new-tokens", str(new_tokens)]
    env = {} if intra else _network_env(sc, nccl)
    commands = [
        LaunchCommand(host, rank, dict(env), [
            "torchrun", "--nnodes", str(len(hosts)), "--node-rank", str(rank), "--nproc-per-node", str(per_node),
            "--master-addr", master, "--master-port", str(TORCHRUN_MASTER_PORT), *run])
        for rank, host in enumerate(hosts)
    ]
    header = [
        f"# shardwise launch for {_summary(doc, sc)}",
        "# each command runs `shardwise run` on the planned layout "
        f"(prefill <prompt>, decode up to {new_tokens:,} tokens, print the result on node 0, exit); to serve it "
        "instead (an OpenAI-compatible API on node 0), put `serve` in place of `run` and --host / --port / "
        "--max-batch / --max-model-len in place of --prompt / --max-new-tokens (`serve` takes no --draft yet: "
        "its speculation is ngram)",
        f"# torchrun starts {per_node} rank(s) on this host, rendezvous at {master}:{TORCHRUN_MASTER_PORT}" if intra else
        f"# torchrun starts one rank per node; rendezvous at node 0 ({master}:{TORCHRUN_MASTER_PORT}); "
        "start every node's command at once, each on its own host",
        *_host_lines(hosts, from_ring, intra),
    ]
    header += _model_lines([model, draft], "shardwise", [w for c in commands for w in [*c.env.values(), *c.argv]],
                           [] if intra else hosts)
    if cluster:
        header.append(f"# --allreduce auto picks the all-reduce from the cluster file's α/β; {cluster} must exist on every host")
    if sc.kv_bytes != 2.0:
        header.append("# the runtime keeps the KV cache in the model's dtype, not the plan's --kv-dtype")
    header += [_formats_line(doc), *_profile_line(doc, "shardwise")]
    return Launch("shardwise", header, commands)


def launch_plan(target: str, doc: dict, sc, model: str, draft_model: str | None = None,
                cluster: str | None = None) -> Launch:
    """The ``target`` (vllm or shardwise) commands that run the plan ``doc`` of scenario ``sc``;
    ``model`` / ``draft_model`` / ``cluster`` are the CLI strings the plan was made from."""
    check_target(target)
    ref = model_ref(model)
    draft = model_ref(draft_model, role="draft model") if draft_model else None
    if target == "vllm":
        return vllm_launch(doc, sc, ref, draft)
    return shardwise_launch(doc, sc, ref, draft, cluster)
