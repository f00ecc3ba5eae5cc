"""`shardwise bench --url`: a real third-party OpenAI-compatible server measured per pp/tg @ depth
point and concurrency, with exact prompt lengths and the plan's prediction beside each point.

The server is ``transformers serve`` (the transformers package's OpenAI-compatible FastAPI server,
``transformers[serving]`` in the test extra) on a tiny random llama checkpoint made here, whose
tokenizer and ChatML template come from ``make_checkpoint``: its answers are the model's real
(random-weight) output. It listens on 127.0.0.1 on a free port and is always stopped.
llama.cpp's own server is measured the same way in ``tests/test_bench_url_llama_cpp.py`` (when
llama-cpp-python is installed: it compiles llama.cpp at install time, so ``.ci/run`` installs it apart
from the test extra), and shardwise's own server in ``tests/test_serve.py``.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import cli_json, run_cli
from serve_process import assert_point_measured, assert_prediction_is_the_plans, free_port, third_party_server
from shardwise.measure.serving_prompts import fit_prompt, word_stream
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.generate import load_tokenizer

SERVER_START_S = 150
PLAN = ("--plan-model", "llama-3.1-8b", "--box", "dgx-spark", "--boxes", "1")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint("llama-3.1-8b", "tiny", tmp_path_factory.mktemp("served") / "tiny-llama", seed=1)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """``transformers serve CHECKPOINT`` on 127.0.0.1:PORT; yields its base URL; always stopped."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    argv = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(checkpoint), "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
    log = tmp_path_factory.mktemp("server-log") / "serve.log"
    with third_party_server("transformers serve", argv, port, log, env, SERVER_START_S) as url:
        yield url


def test_points_exact_prompts_and_the_plan_beside_them(server, checkpoint):
    doc = cli_json("bench", "--url", server, "--pp", "32", "--tg", "8", "--depth", "0,32", "--concurrency", "1,2",
                   "--runs", "2", *PLAN, "--timeout", "60")
    assert doc["kind"] == "serving-bench" and doc["model"] == str(checkpoint) and doc["endpoint"] == "completions"
    assert [(p["test"], p["concurrency"]) for p in doc["points"]] == [
        ("pp32 / tg8", 1), ("pp32 / tg8", 2), ("pp32 / tg8 @ d32", 1), ("pp32 / tg8 @ d32", 2)]
    # transformers serve has no tokenize endpoint but streams usage: prompts fitted by usage, every
    # request's own prompt_tokens is what the server reported, and it is the target exactly
    assert doc["server"]["tokenize_endpoint"] is None and doc["server"]["stream_usage"] is True
    assert doc["prompt_tokens_exact"] is True and doc["prompt_tokens_accuracy"].startswith("exact")
    for p in doc["points"]:
        target = p["depth"] + 32
        assert p["prompt_tokens"]["target"] == p["prompt_tokens"]["min"] == p["prompt_tokens"]["max"] == target
        assert p["requests"] == 2 * p["concurrency"]
        assert 2 <= p["completion_tokens"]["min"] <= p["completion_tokens"]["max"] <= 8
        assert_point_measured(p)
    assert_prediction_is_the_plans(doc)  # the plan's own figure for that context and prompt


def test_chat_endpoint_human_output(server, tmp_path):
    """Chat completions go through the checkpoint's ChatML template; the table names each point."""
    out = tmp_path / "serving.json"
    proc = run_cli("bench", "--url", server + "/", "--endpoint", "chat", "--pp", "40", "--tg", "4", "--runs", "1",
                   *PLAN, "--link", "100g-roce", "--runtime", "llama-cpp", "--out", str(out), "--timeout", "60")
    assert proc.returncode == 0, proc.stderr
    assert "pp40/tg4" in proc.stdout and "plan" in proc.stdout and "exact: server-reported" in proc.stdout
    assert "llama-cpp profile" in proc.stdout and "measuring pp40 / tg4, concurrency 1" in proc.stderr
    doc = json.loads(out.read_text())
    assert doc["endpoint"] == "chat" and doc["points"][0]["prompt_tokens"]["min"] == 40


def test_a_model_the_server_does_not_serve(server):
    proc = run_cli("bench", "--url", server, "--model", "nope", "--pp", "16", "--tg", "4", "--runs", "1", timeout=60)
    _one_line_error(proc, f"{server} does not serve model 'nope': it serves ")


def test_prompt_fitting_is_exact_and_rotation_keeps_the_count(checkpoint):
    """Against the checkpoint's own tokenizer (+1 as for a BOS), over lengths from 10 to 3000."""
    tok = load_tokenizer(checkpoint)
    calls = []

    def count(text: str) -> int:
        calls.append(text)
        return len(tok.encode(text).ids) + 1

    for target in (10, 33, 100, 517, 3000):
        calls.clear()
        prompt = fit_prompt(count, target, f"seed-{target}")
        assert prompt.exact and count(prompt.text()) == target, target
        assert len(calls) <= 12, (target, len(calls))
        variants = [prompt.variant(k) for k in range(6)]
        assert {count(v) for v in variants} == {target}
        if target > 30:  # each request starts differently (no prefix cache hit), and not as the counted text
            assert len({v[:40] for v in variants + [prompt.text()]}) == 7
    assert word_stream("a", 50) == word_stream("a", 50) != word_stream("b", 50)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _one_line_error(proc: subprocess.CompletedProcess, expected: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr


def test_bad_servers_and_flags_are_one_line_errors(tmp_path):
    base = ("bench", "--pp", "16", "--tg", "4", "--runs", "1")
    # nothing listens
    _one_line_error(run_cli(*base, "--url", f"http://127.0.0.1:{free_port()}/v1", timeout=60), "cannot reach")
    # a plain web server: /v1/models is missing, or is not JSON
    (tmp_path / "html" / "v1").mkdir(parents=True)
    (tmp_path / "plain").mkdir()
    for folder, expected in ((tmp_path / "plain", "GET /models answered HTTP 404"),
                             (tmp_path / "html", "GET /models did not answer JSON")):
        (tmp_path / "html" / "v1" / "models").write_text("<html>hello</html>")
        handler = lambda *a, folder=folder, **k: _Quiet(*a, directory=str(folder), **k)  # noqa: E731
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            proc = run_cli(*base, "--url", f"http://127.0.0.1:{httpd.server_address[1]}/v1", timeout=60)
        finally:
            httpd.shutdown()
            httpd.server_close()
        _one_line_error(proc, "is not an OpenAI-compatible server")
        _one_line_error(proc, expected)
    # a server that takes the connection and never answers: the timeout ends it
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        start = time.monotonic()
        proc = run_cli(*base, "--url", f"http://127.0.0.1:{silent.getsockname()[1]}/v1", "--timeout", "2", timeout=60)
        assert time.monotonic() - start < 30
    _one_line_error(proc, "did not answer GET /models within 2 s")
    # flags: the CLI's one line and exit 2, then each check in-process
    for args, expected in (
        (("--depth", "0,x", "--url", "http://127.0.0.1:9/v1"), "--depth '0,x' must be comma-separated integers >= 0"),
        (("--depth", "0,4096"), "--depth is for measuring a server: pass --url"),
        (("some/checkpoint", "--url", "http://127.0.0.1:9/v1"), "pass either a CHECKPOINT or --url"),
    ):
        _one_line_error(run_cli("bench", *args, timeout=60), expected)


@pytest.mark.parametrize("change, expected", [
    ({"depth": "-4"}, "--depth '-4' must be comma-separated integers >= 0"),
    ({"concurrency": "0"}, "--concurrency '0' must be comma-separated integers >= 1"),
    ({"concurrency": "1,,2"}, "--concurrency '1,,2' must be"),
    ({"pp": 0}, "--pp must be >= 1"),
    ({"tg": 1}, "--tg must be >= 2"),
    ({"runs": 0}, "--runs must be >= 1"),
    ({"timeout": 0}, "--timeout must be > 0"),
    ({"endpoint": "embeddings"}, "--endpoint 'embeddings' is unknown: use completions or chat"),
    ({"url": "localhost:8080"}, "--url 'localhost:8080' must look like http://HOST:PORT/v1"),
    ({"url": "http://127.0.0.1:99999/v1"}, "has a bad port"),
    ({"plan_model": "llama-3.1-8b"}, "--plan-model needs --box and --boxes"),
    ({"boxes": 2}, "--box, --boxes, --link and --runtime describe the plan: pass --plan-model too"),
])
def test_flag_checks(change, expected):
    from shardwise.errors import ShardwiseError
    from shardwise.measure.serving_bench import serving_inputs

    args = dict(url="http://127.0.0.1:9/v1", model=None, pp=None, tg=None, depth=None, concurrency=None, runs=None,
                endpoint=None, api_key=None, timeout=10.0, plan_model=None, box=None, boxes=None, link=None,
                runtime=None)
    cfg, plan = serving_inputs(**args)
    assert (cfg.pp, cfg.tg, cfg.depths, cfg.concurrency, cfg.runs, plan) == (2048, 128, (0,), (1,), 3, None)
    with pytest.raises(ShardwiseError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        serving_inputs(**{**args, **change})


def test_plan_that_does_not_fit_fails_before_measuring():
    from shardwise.errors import ShardwiseError
    from shardwise.measure.serving_bench import PlanArgs, plan_predictions

    with pytest.raises(ShardwiseError, match="does not fit on 1 x"):
        plan_predictions(PlanArgs("kimi-k3", "dgx-spark", 1, "100g-roce"), 2048, 128, (0,))
