"""Token ids ↔ text for the server: the checkpoint's own tokenizer and chat template, and a
``TextStream`` that turns generated ids into streamed text deltas with stop strings.

``ServeTokenizer`` wraps transformers' tokenizer for the checkpoint folder, so prompts are
rendered exactly as the model's authors render them (``apply_chat_template`` with the
``chat_template`` of ``tokenizer_config.json``). The end-of-sequence ids a request stops on are
the union of ``config.json``'s and ``generation_config.json``'s ``eos_token_id`` and the
tokenizer's ``eos_token`` (a chat template may close turns with a token that is not the
config's EOS, as Qwen's ``<|im_end|>``; its checkpoints list it in ``generation_config.json``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from shardwise.errors import ShardwiseError


class ServeTokenizer:
    """Encode prompts, render chats and decode generated ids with a checkpoint's tokenizer."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        if not (folder / "tokenizer.json").exists():
            raise ShardwiseError(f"'{folder}' has no tokenizer.json: `shardwise serve` needs the checkpoint's tokenizer")
        from transformers import AutoTokenizer

        try:
            with warnings.catch_warnings():  # transformers warns about config fields it renamed, e.g. rope_scaling
                warnings.simplefilter("ignore")
                self.tok = AutoTokenizer.from_pretrained(str(folder))
        except Exception as exc:  # transformers raises many kinds for broken tokenizer files
            raise ShardwiseError(f"cannot load the tokenizer of '{folder}': {str(exc).splitlines()[0]}") from None
        self.has_chat_template = bool(getattr(self.tok, "chat_template", None))
        self.eos = self._eos(folder)

    def _eos(self, folder: Path) -> set[int]:
        from shardwise.runtime.generate import eos_ids

        ids: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            path = folder / name
            if path.exists():
                ids |= eos_ids(json.loads(path.read_text()))
        if self.tok.eos_token_id is not None:
            ids.add(int(self.tok.eos_token_id))
        return ids

    def encode(self, text: str) -> list[int]:
        """Ids of a completion prompt (special tokens as the tokenizer config adds them)."""
        return list(self.tok.encode(text))

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Ids of a chat rendered by the checkpoint's template, ending with the assistant's turn opening."""
        from shardwise.serve.protocol import RequestError

        if not self.has_chat_template:
            raise RequestError("this checkpoint's tokenizer_config.json has no chat_template: use /v1/completions",
                               "messages")
        try:
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # jinja2 template errors (e.g. a template that raises on a role order)
            raise RequestError(f"the chat template rejected the messages: {str(exc).splitlines()[0]}",
                               "messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


class TextStream:
    """Generated ids → text deltas, holding back bytes of an unfinished character and any tail
    that may still become a stop string; the stop string itself is never emitted."""

    def __init__(self, tokenizer: ServeTokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of ``text`` already emitted
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one generated id; return the text that is now safe to emit ('' when none)."""
        self.ids.append(token)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset:self.read_offset])
        after = decode(self.ids[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The held-back tail once generation ended without a stop string."""
        return "" if self.stopped else self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop:
            longest = max(len(s) for s in self.stop)
            start = max(0, self.sent - longest + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                end = min(hits)
                self.stopped = True
                out, self.sent = self.text[self.sent:end], max(self.sent, end)
                return out
        end = len(self.text) if final else len(self.text) - self._held_back()
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def _held_back(self) -> int:
        """Characters at the end of ``text`` that begin some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
