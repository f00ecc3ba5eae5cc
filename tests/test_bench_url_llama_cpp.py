"""`shardwise bench --url` against llama.cpp's server (llama-cpp-python's OpenAI-compatible
``python -m llama_cpp.server``) on a GGUF converted from a tiny random llama checkpoint made here.

The checkpoint is ``make_checkpoint("llama-3.1-8b", "tiny", ..., seed=1)``; ``shardwise.testing.
llama_gguf`` writes it as GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` does (checked against
that converter: the same tensors bit for bit and the same metadata), and the first test holds
llama.cpp's logits and tokens against transformers' on the same checkpoint. The server listens on
127.0.0.1 on a free port and is always stopped; ``--interrupt_requests False``, because by default
a request that arrives while another streams ends that stream early, and concurrency 2 would
measure cut-off requests.

What this server does that the ``transformers serve`` test (tests/test_bench_url.py) does not see:

- it has a tokenize endpoint, ``POST /extras/tokenize``, and streams no usage: prompts are fitted
  and every request's length counted through the endpoint (exact), plus a constant offset measured
  against the non-streamed ``usage.prompt_tokens`` (0 for completions: the tokenizer adds no BOS;
  the ChatML template's tokens for chat);
- it takes ``ignore_eos`` without error but does not honour it (its request model ignores unknown
  fields): the random model may stop at EOS before ``--tg`` tokens;
- it may generate *more* than ``max_tokens``: while the text so far ends in what looks like an
  unfinished UTF-8 character it skips its ``max_tokens`` check (``Llama._create_completion``,
  0.3.36), and its own ``usage.completion_tokens`` counts the extra tokens too.

llama-cpp-python has no wheel on the package registry: it compiles llama.cpp when installed
(about 13 min on 2 cores), which ``.ci/run`` does; without it (or the ``gguf`` package) this file skips.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (.ci/run installs it)")
pytest.importorskip("gguf", reason="the gguf package is not installed (.ci/run installs it)")
if not all(importlib.util.find_spec(m) for m in ("uvicorn", "fastapi", "sse_starlette", "starlette_context",
                                                   "pydantic_settings")):
    pytest.skip("llama-cpp-python's [server] extra is not installed", allow_module_level=True)

from conftest import cli_json  # noqa: E402
from serve_process import (  # noqa: E402
    assert_point_measured, assert_prediction_is_the_plans, free_port, third_party_server,
)
from shardwise.runtime.checkpoint import make_checkpoint  # noqa: E402
from shardwise.testing.llama_gguf import write_llama_gguf  # noqa: E402

SERVER_START_S = 60
ALIAS = "tiny-llama"
PLAN = ("--plan-model", "llama-3.1-8b", "--box", "dgx-spark", "--boxes", "1")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint("llama-3.1-8b", "tiny", tmp_path_factory.mktemp("llama-cpp") / "tiny-llama", seed=1)


@pytest.fixture(scope="module")
def gguf_file(checkpoint) -> Path:
    return write_llama_gguf(checkpoint, checkpoint.parent / "tiny-llama-f32.gguf")


@pytest.fixture(scope="module")
def server(gguf_file, tmp_path_factory):
    """``python -m llama_cpp.server`` on the GGUF at 127.0.0.1:PORT; yields its base URL; always stopped."""
    port = free_port()
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_file), "--model_alias", ALIAS,
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "512", "--n_threads", "1",
            "--n_threads_batch", "1", "--interrupt_requests", "False"]
    log = tmp_path_factory.mktemp("llama-cpp-log") / "server.log"
    with third_party_server("llama_cpp.server", argv, port, log, {**os.environ, "OMP_NUM_THREADS": "1"},
                            SERVER_START_S) as url:
        yield url


def test_the_gguf_is_the_checkpoint_in_llama_cpp(checkpoint, gguf_file):
    """llama.cpp tokenizes as the checkpoint's tokenizer does and computes transformers' logits."""
    import numpy as np
    import torch
    from llama_cpp import Llama
    from transformers import LlamaForCausalLM

    from shardwise.measure.serving_prompts import word_stream
    from shardwise.runtime.generate import load_tokenizer

    tok = load_tokenizer(checkpoint)
    llm = Llama(str(gguf_file), n_ctx=128, n_threads=1, n_threads_batch=1, logits_all=True, verbose=False)
    for text in ("Hello world. The quick brown fox jumps over the lazy dog.", "".join(word_stream("x", 40)),
                 "<|im_start|>user\n3 33 333 it's\t  tabs<|im_end|>\n"):
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tok.encode(text).ids, text
    ids = [tok.token_to_id("<|bos|>")] + tok.encode("Once upon a time there was a tiny model").ids
    llm.eval(ids)
    got = np.asarray(llm.scores[: llm.n_tokens])
    model = LlamaForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    assert got.shape == want.shape == (len(ids), 512)
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()  # measured: 1.3e-4 of 0.5


def test_points_exact_prompts_and_the_plan_beside_them(server):
    doc = cli_json("bench", "--url", server, "--pp", "32", "--tg", "8", "--depth", "0,32", "--concurrency", "1,2",
                   "--runs", "1", *PLAN, "--timeout", "60")
    assert doc["kind"] == "serving-bench" and doc["model"] == ALIAS and doc["endpoint"] == "completions"
    assert [(p["test"], p["concurrency"]) for p in doc["points"]] == [
        ("pp32 / tg8", 1), ("pp32 / tg8", 2), ("pp32 / tg8 @ d32", 1), ("pp32 / tg8 @ d32", 2)]
    # llama.cpp's tokenize endpoint counts every request's text; no BOS, so no offset; the server
    # bills each fitted text exactly as counted (else the bench notes it)
    assert doc["server"] == {"models": [ALIAS], "stream_usage": False, "ignore_eos_accepted": True,
                             "tokenize_endpoint": "/extras/tokenize"}
    assert doc["prompt_tokens_method"] == "server /extras/tokenize"
    assert doc["prompt_tokens_exact"] is True
    assert doc["prompt_tokens_accuracy"] == ("exact: server /extras/tokenize on every request's text "
                                             "(the server streams no usage)")
    assert not [n for n in doc["notes"] if "billed" in n], doc["notes"]
    for p in doc["points"]:
        target = p["depth"] + 32
        pt = p["prompt_tokens"]
        assert pt["target"] == pt["min"] == pt["max"] == pt["counted_min"] == pt["counted_max"] == target
        assert p["requests"] == p["concurrency"]
        # EOS may come early (ignore_eos is not honoured); a few tokens past max_tokens may come (module doc)
        assert 2 <= p["completion_tokens"]["min"] <= p["completion_tokens"]["max"] <= 2 * 8
        assert p["prefill_total_tok_per_s"] > 0
        assert_point_measured(p)
    assert_prediction_is_the_plans(doc)


def test_chat_counts_the_template_as_an_offset(server):
    """Chat prompts go through the GGUF's ChatML template: the tokens it adds are measured once
    against ``usage.prompt_tokens`` and added to every count, and the prompts are still exact."""
    doc = cli_json("bench", "--url", server, "--endpoint", "chat", "--pp", "40", "--tg", "4", "--runs", "1",
                   "--timeout", "60")
    assert doc["endpoint"] == "chat" and doc["server"]["tokenize_endpoint"] == "/extras/tokenize"
    assert doc["prompt_tokens_method"].startswith("server /extras/tokenize + ")
    assert doc["prompt_tokens_exact"] is True and not [n for n in doc["notes"] if "billed" in n], doc["notes"]
    (point,) = doc["points"]
    assert point["prompt_tokens"]["min"] == point["prompt_tokens"]["max"] == 40
    assert point["decode_tok_per_s"] > 0 and point["prefill_tok_per_s"] > 0
