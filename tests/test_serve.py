"""`shardwise serve` against the real `openai` client and raw HTTP, on the tiny default at tp 2.

One server (module fixture) answers the API, error, exactness-under-load and disconnect tests;
the fault tests start their own.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import threading
import time
from http.client import HTTPException

import pytest

from conftest import cli_json, run_cli
from serve_process import ServeProcess, http

openai = pytest.importorskip("openai")

MODEL = "tiny-qwen3-moe"
VOCAB = 512
MAX_LEN = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServeProcess("--tp", "2", "--max-batch", "16", "--max-model-len", str(MAX_LEN), "--spec", "ngram",
                      log_dir=tmp_path_factory.mktemp("serve")) as srv:
        yield srv  # test_ctrl_c_drains_in_flight_then_exits_zero, the last test using it, stops it


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def metric(server, name: str, labels: str = "") -> float:
    return server.metric(name, labels)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http(server.url + "/health") == (200, b'{"status":"ok"}')


def test_chat_plain_and_streamed_agree(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_completions_text_and_token_ids(client):
    ids = [5, 17, 99, 200, 3]
    a = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert a.object == "text_completion" and a.usage.prompt_tokens == len(ids)
    assert a.choices[0].finish_reason in ("stop", "length")
    b = client.completions.create(model=MODEL, prompt="The cluster", max_tokens=4, temperature=0)
    assert b.usage.completion_tokens <= 4 and isinstance(b.choices[0].text, str)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=ids, max_tokens=10, temperature=0, stream=True))
    assert streamed == a.choices[0].text
    full = client.completions.create(model=MODEL, prompt=ids, max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True})  # vLLM's extension, for benchmarks
    assert full.usage.completion_tokens == 30 and full.choices[0].finish_reason == "length"


def test_stop_string_is_cut_and_not_emitted(client):
    ids = [7, 8, 9, 10]
    full = client.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0).choices[0].text
    printable = [m for m in re.finditer(r"[A-Za-z]{2,}", full) if m.start() > 0]
    if not printable:
        pytest.skip(f"the tiny model's greedy text has no word to stop on: {full!r}")
    stop = printable[0].group(0)
    cut = client.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=ids, max_tokens=40, temperature=0, stop=stop, stream=True))
    assert streamed == cut.choices[0].text


BAD = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, VOCAB + 5]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * (MAX_LEN + 10)}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{b[2]}-{b[3]}" for b in BAD])
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    code, raw = http(server.url + path, body)
    error = json.loads(raw)["error"]
    assert code == status and error["param"] == param and error["message"] and "\n" not in error["message"]


def test_unknown_route_and_method(server):
    assert http(server.url + "/v2/nothing")[0] == 404
    code, raw = http(server.url + "/v1/models", {"x": 1})
    assert code == 405 and json.loads(raw)["error"]["message"]


def _prompts(n: int) -> list[list[int]]:
    return [[(37 * i + 11 * j) % (VOCAB - 10) + 5 for j in range(3 + i % 9)] for i in range(n)]


async def _load(base_url: str, jobs: list[dict], concurrency: int) -> list[tuple[str, int]]:
    """Every job streamed at ``concurrency``; (text, completion tokens) per job, in order."""
    aclient = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    gate = asyncio.Semaphore(concurrency)

    async def one(job: dict) -> tuple[str, int]:
        async with gate:
            stream = await aclient.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                                      **job)
            text, used = [], None
            async for c in stream:
                text += [ch.text for ch in c.choices]
                used = c.usage or used
            return "".join(text), used.completion_tokens

    try:
        return await asyncio.gather(*(one(j) for j in jobs))
    finally:
        await aclient.close()


def test_200_requests_at_16_exact_under_load(server, client):
    """200 streamed requests, 16 at a time, joining and leaving at different steps: none lost, every
    greedy output equal to the same request served alone, seeded samples reproducible, memory flat.
    Alone, greedy requests speculate (prompt lookup, verified in one pass); in company they decode
    one token per step: the outputs agree token for token."""
    prompts = _prompts(20)
    prompts[:4] = [[11, 12, 13, 14] * 6, [40, 41] * 10, [7, 8, 9] * 5 + [7], [300, 301, 302, 303, 304] * 3]
    jobs = [{"prompt": p, "max_tokens": 4 + i % 13, "temperature": 0} for i, p in enumerate(prompts)]
    jobs += [{"prompt": p, "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": i} for i, p in enumerate(prompts[:5])]
    # prompts longer than the 128-token prefill chunk: read in two chunks between the others' decode steps
    jobs += [{"prompt": [(5 * j + i) % 500 + 5 for j in range(n)], "max_tokens": 6, "temperature": 0}
             for i, n in enumerate((150, 230))]
    accepted = metric(server, "shardwise_spec_accepted_tokens_total")
    solo = asyncio.run(_load(server.base_url, jobs, 1))
    assert metric(server, "shardwise_spec_accepted_tokens_total") > accepted  # the repetitive prompts' drafts hit
    rank0 = server.rank_pid(0)
    rss_before = server.rss_bytes(rank0)
    generated_before = metric(server, "shardwise_generation_tokens_total")
    order = [(7 * k) % len(jobs) for k in range(200)]
    loaded = asyncio.run(_load(server.base_url, [jobs[i] for i in order], 16))
    for k, i in enumerate(order):
        assert loaded[k] == solo[i], f"request {k} (job {i}: {jobs[i]}) differs under load"
    assert metric(server, "shardwise_generation_tokens_total") - generated_before == sum(n for _, n in loaded)
    assert metric(server, "shardwise_kv_slots_in_use") == 0
    assert server.rss_bytes(rank0) - rss_before < 64 * 2**20
    text = http(server.url + "/metrics")[1].decode()
    assert 'shardwise_rank_time_share{part="wait",rank="1"}' in text
    assert "shardwise_time_to_first_token_seconds_count" in text


def test_disconnected_stream_frees_its_slot(server):
    cancelled = metric(server, "shardwise_requests_total", '{endpoint="text",outcome="cancelled"}')
    aclient = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    stream = aclient.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=200, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    for _, _ in zip(range(3), stream):
        pass
    assert metric(server, "shardwise_kv_slots_in_use") == 1
    stream.close()
    deadline = time.monotonic() + 5
    while metric(server, "shardwise_kv_slots_in_use") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "shardwise_kv_slots_in_use") == 0
    assert metric(server, "shardwise_requests_total", '{endpoint="text",outcome="cancelled"}') == cancelled + 1


# ------------------------------------------------------------------------------------------ faults


def _stream_in_background(base_url: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        c = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=90)
        try:
            chunks = list(c.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=max_tokens,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True}))
            out["finish"] = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        except openai.APIError as exc:
            out["error"] = str(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _wait_until_slot_taken(server) -> None:
    deadline = time.monotonic() + 20
    while metric(server, "shardwise_kv_slots_in_use") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_failed_rank_errors_requests_and_exits_nonzero(tmp_path, fault):
    """kill -9 or SIGSTOP a non-leader rank mid-stream: the stream ends in an error, /health turns 503,
    the server exits non-zero well within 60 s, and no process is left; a request that arrives while the
    step waits on the frozen rank gets a 503 naming the failure. The frozen-rank threshold is the
    testing hook's 3 s (tests/test_runtime_failures.py holds the default under 60 s)."""
    with ServeProcess("--tp", "2", "--max-model-len", "256", log_dir=tmp_path,
                      env={"SHARDWISE_TEST_FROZEN_S": "3"}) as srv:
        thread, out = _stream_in_background(srv.base_url, 200)
        _wait_until_slot_taken(srv)
        victim = srv.rank_pid(1)
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        queued: list = []  # a request sent while the step waits on the frozen rank sits in the inbox
        if fault == "freeze":
            body = {"model": MODEL, "prompt": [7, 8], "max_tokens": 4}
            late = threading.Thread(target=lambda: queued.append(http(srv.base_url + "/completions", body)))
            late.start()
        saw_503 = False
        while srv.proc.poll() is None and time.monotonic() - t0 < 60:
            try:
                saw_503 |= http(srv.url + "/health", timeout=2)[0] == 503
            except (OSError, HTTPException):  # the server dies mid-answer
                pass
            time.sleep(0.2)
        assert srv.wait(1) != 0 and time.monotonic() - t0 < 60
        thread.join(10)
        assert "error" in out, out
        assert saw_503 or fault == "kill"  # a killed rank can bring everything down before a poll lands
        assert "rank 1 of 2 failed" in srv.stderr().splitlines()[-2]
        if fault == "freeze":
            assert "no heartbeat" in srv.stderr()
            late.join(10)
            assert queued and queued[0][0] == 503 and b"the server failed" in queued[0][1], queued
        assert srv.leftovers() == []


def test_bench_url_measures_this_server(server):
    """`shardwise bench --url` (llama-benchy style points) against shardwise's own server: exact prompt
    lengths from the streamed usage, every point measured, the plan's batch-1 figure beside it."""
    doc = cli_json("bench", "--url", server.base_url, "--pp", "24", "--tg", "6", "--depth", "0,24",
                   "--concurrency", "1,4", "--runs", "1", "--plan-model", "qwen3-30b-a3b", "--box", "dgx-spark",
                   "--boxes", "1", "--timeout", "60")
    assert doc["model"] == MODEL and doc["server"]["stream_usage"] is True and doc["prompt_tokens_exact"] is True
    assert [(p["test"], p["concurrency"]) for p in doc["points"]] == [
        ("pp24 / tg6", 1), ("pp24 / tg6", 4), ("pp24 / tg6 @ d24", 1), ("pp24 / tg6 @ d24", 4)]
    for p in doc["points"]:
        assert p["prompt_tokens"]["min"] == p["prompt_tokens"]["max"] == p["depth"] + 24
        assert p["requests"] == p["concurrency"] and p["decode_tok_per_s"] > 0
        assert 0 < p["ttft_s"]["p50"] <= p["ttft_s"]["p99"] < 60
        assert p["prediction"]["decode_tok_per_s"] > 0


def test_ctrl_c_drains_in_flight_then_exits_zero(server):
    """The module's server, last: Ctrl-C (SIGINT to the whole process group: the launcher forwards it to
    rank 0, which also gets it itself, and the other ranks ignore it) lets the stream in flight finish,
    refuses new requests with 503 meanwhile, then every process exits (the launcher with 0). SIGTERM to
    the launcher alone takes the same path (tests/test_serve_chat_page.py's server ends that way)."""
    srv = server
    thread, out = _stream_in_background(srv.base_url, 200)
    _wait_until_slot_taken(srv)
    os.killpg(srv.proc.pid, signal.SIGINT)
    time.sleep(0.3)
    assert http(srv.url + "/health")[0] == 503
    code, raw = http(srv.base_url + "/completions", {"model": MODEL, "prompt": [1], "max_tokens": 2})
    assert code == 503 and "shutting down" in json.loads(raw)["error"]["message"]
    assert srv.wait(30) == 0, srv.stderr()
    thread.join(10)
    assert out == {"finish": "length"}
    assert srv.leftovers() == []


@pytest.mark.parametrize("args,expected", [
    (("--max-model-len", "100000"), "--max-model-len must be in 2..40960"),
    (("--max-batch", "0"), "--max-batch must be in 1..256"),
    (("--spec", "draft"), "serve drafts by prompt lookup only"),
    (("--port", "BUSY"), "cannot listen on 127.0.0.1:"),
])
def test_bad_serve_flags_are_one_line_before_any_rank(args, expected):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        argv = [str(busy.getsockname()[1]) if a == "BUSY" else a for a in args]
        proc = run_cli("serve", *argv, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {expected}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
