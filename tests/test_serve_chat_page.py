"""The chat page (`GET /` of `shardwise serve`) in a real headless Chromium against a real server.

One `shardwise serve --tp 2` (the tiny random model: the replies are gibberish) answers a page
that streams a reply, stops a long one, carries the conversation into the next turn and shows
errors inline. Debian's /usr/bin/chromium driven by playwright (no browser download); the module
is skipped only when either is missing.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from serve_process import ServeProcess

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is not installed", allow_module_level=True)
try:
    from playwright.sync_api import sync_playwright
except ImportError:
    pytest.skip("the playwright package is not installed", allow_module_level=True)

MODEL = "tiny-qwen3-moe"
READY_S = 90.0
TIMEOUT_MS = 20_000
DONE = """n => document.querySelectorAll('.msg.assistant').length === n
          && !document.querySelector('.msg.streaming') && document.getElementById('stop').disabled"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server; SIGTERM at the end must stop it cleanly within 30 s."""
    with ServeProcess("--tp", "2", "--max-model-len", "512", log_dir=tmp_path_factory.mktemp("chat")) as srv:
        yield srv
        assert srv.stop(signal.SIGTERM, timeout=30) == 0, srv.stderr()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    """The chat page loaded (model id shown), every request it makes in ``page.requests``."""
    context = browser.new_context()
    pg = context.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    pg.requests = []
    pg.on("request", lambda r: pg.requests.append(r))
    pg.goto(server.url + "/")
    pg.wait_for_function("m => document.getElementById('model').textContent === m", arg=MODEL)
    yield pg
    context.close()


CANCELLED = ('shardwise_requests_total', '{endpoint="chat",outcome="cancelled"}')


def ask(page, text: str, max_tokens: int | None = None, temperature: float | None = 0, enter: bool = False) -> None:
    page.fill("#max-tokens", "" if max_tokens is None else str(max_tokens))
    page.fill("#temperature", "" if temperature is None else str(temperature))
    page.fill("#prompt", text)
    if enter:
        page.press("#prompt", "Enter")
    else:
        page.click("#send")


def bubbles(page, kind: str) -> list[str]:
    return page.locator(f".msg.{kind}").all_text_contents()


def test_streams_a_reply_with_its_rate(page, server):
    page.evaluate("""() => {  // every length the assistant bubble goes through
        window.lengths = [];
        new MutationObserver(() => {
            const b = document.querySelector('.msg.assistant');
            if (b) window.lengths.push(b.textContent.length);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")
    ask(page, "Hello there", max_tokens=32)
    page.wait_for_function(DONE, arg=1)
    assert bubbles(page, "user") == ["Hello there"]
    reply = bubbles(page, "assistant")[0]
    assert reply.strip()
    assert len({n for n in page.evaluate("window.lengths") if n}) >= 3  # it arrived in pieces
    status = page.text_content("#status")
    assert re.search(r"\b32 tokens · [\d.]+ tok/s · TTFT \d+ ms · prompt \d+ tokens · finish: length$", status), status
    assert float(re.search(r"([\d.]+) tok/s", status).group(1)) > 0
    assert not page.locator(".msg.error").count()
    origin = server.url + "/"
    outside = [r.url for r in page.requests if not r.url.startswith(origin)]
    assert outside == [], outside
    assert {r.url for r in page.requests} >= {origin, origin + "v1/models", origin + "v1/chat/completions"}


def test_stop_frees_the_slot(page, server):
    cancelled = server.metric(*CANCELLED)
    ask(page, "Hello there", max_tokens=400)  # greedy: 400 tokens, no early end of sequence
    page.wait_for_function("() => document.querySelector('.msg.assistant').textContent.length > 0")
    assert page.is_enabled("#stop") and page.is_disabled("#send")
    page.click("#stop")
    page.wait_for_function(DONE, arg=1)
    status = page.text_content("#status")
    assert "stopped" in status
    received = re.search(r"~?(\d+) tokens", status)
    assert received and int(received.group(1)) < 400, status  # stopped before the reply's end, whatever its characters
    stopped_at = bubbles(page, "assistant")[0]
    assert stopped_at and stopped_at != "(stopped)"
    deadline = time.monotonic() + 5
    while not (server.metric("shardwise_kv_slots_in_use") == 0.0 and server.metric(*CANCELLED) > cancelled):
        assert time.monotonic() < deadline, (server.metric("shardwise_kv_slots_in_use"), server.metric(*CANCELLED))
        time.sleep(0.1)
    time.sleep(0.5)
    assert bubbles(page, "assistant")[0] == stopped_at  # nothing arrived after Stop
    assert page.is_enabled("#send")


def test_second_turn_sends_the_whole_conversation(page):
    bodies = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/chat/completions") else None)
    ask(page, "first question", max_tokens=12, enter=True)
    page.wait_for_function(DONE, arg=1)
    first_reply = bubbles(page, "assistant")[0]
    prompt1 = int(re.search(r"prompt (\d+) tokens", page.text_content("#status")).group(1))
    ask(page, "second question\nwith two lines", max_tokens=12, enter=True)
    page.wait_for_function(DONE, arg=2)
    prompt2 = int(re.search(r"prompt (\d+) tokens", page.text_content("#status")).group(1))
    assert [b["messages"] for b in bodies] == [
        [{"role": "user", "content": "first question"}],
        [{"role": "user", "content": "first question"}, {"role": "assistant", "content": first_reply},
         {"role": "user", "content": "second question\nwith two lines"}],
    ]
    assert all(b["stream"] and b["model"] == MODEL and b["max_tokens"] == 12 and b["temperature"] == 0 for b in bodies)
    assert prompt2 > prompt1 + 8
    assert bubbles(page, "user") == ["first question", "second question\nwith two lines"]


def test_shift_enter_is_a_newline_and_errors_show_inline(page):
    page.fill("#prompt", "line one")
    page.press("#prompt", "Shift+Enter")
    page.type("#prompt", "line two")
    assert page.input_value("#prompt") == "line one\nline two" and not bubbles(page, "user")
    ask(page, "too long", max_tokens=600)  # past --max-model-len 512: HTTP 400
    page.wait_for_selector(".msg.error")
    assert "--max-model-len 512" in page.text_content(".msg.error")
    assert page.locator(".msg.user.dropped").count() == 1 and not bubbles(page, "assistant")
    assert "error" in page.text_content("#status") and page.is_enabled("#send")


def test_sse_parsing_across_chunk_boundaries(page):
    """The page's SSE reader fed 1..7-byte pieces (split lines, split UTF-8 characters, CRLF)."""
    events = page.evaluate("""async () => {
        const text = 'data: {"a": "h\\u00e9llo \\u20ac"}\\r\\n\\r\\n: comment\\n\\ndata:{"b":1}\\n\\n'
                   + 'data: line one\\ndata: line two\\n\\ndata: [DONE]';
        const bytes = new TextEncoder().encode(text), sizes = [1, 2, 3, 5, 7];
        const out = [];
        for (const size of sizes) {
            const body = new ReadableStream({start(c) {
                for (let i = 0; i < bytes.length; i += size) c.enqueue(bytes.slice(i, i + size));
                c.close();
            }});
            const got = [];
            await readSSE(body, (d) => got.push(d));
            out.push(got);
        }
        return out;
    }""")
    assert all(got == ['{"a": "h\u00e9llo \u20ac"}', '{"b":1}', "line one\nline two", "[DONE]"] for got in events), events
