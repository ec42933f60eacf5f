"""Text in and out: the checkpoint directory's ``tokenizers`` tokenizer, its chat template, its end-of-sequence
tokens, and the incremental detokenizer that turns a stream of token ids into text deltas and finds stop strings.

Files read, as Hugging Face writes them: ``tokenizer.json`` (required), ``tokenizer_config.json``
(``chat_template``, ``bos_token``, ``eos_token``), ``generation_config.json`` then ``config.json``
(``eos_token_id``: an id or a list). The chat template is rendered the way transformers does it: a sandboxed
jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, ``tojson`` and ``raise_exception``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class TemplateError(ValueError):
    """A chat the template refuses (its ``raise_exception``), or a checkpoint without a chat template."""


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(value: Any) -> str | None:
    """``"<|eos|>"`` or an AddedToken-style ``{"content": "<|eos|>", ...}``."""
    return value.get("content") if isinstance(value, dict) else value


class TextCodec:
    """A checkpoint's tokenizer, chat template and EOS ids. Thread-safe for reads (``tokenizers`` releases the
    GIL and keeps no per-call state)."""

    def __init__(self, path: str | Path, chat_template: str | None = None) -> None:
        """``chat_template``: a template (jinja2 text, or a file holding one) in place of the checkpoint's."""
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"{path}: no tokenizer.json (kvtier-engine make-checkpoint writes one)")
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        self.bos_token, self.eos_token = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        eos: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            value = _read_json(path / name).get("eos_token_id")
            if value is not None:
                eos.update(value if isinstance(value, list) else [value])
                break
        if self.eos_token is not None and (tid := self.tokenizer.token_to_id(self.eos_token)) is not None:
            eos.add(tid)
        self.eos_token_ids = frozenset(eos)
        # the most characters one token stands for: a text longer than the context times this cannot fit it
        vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.max_token_chars = max(len(self.tokenizer.id_to_token(i) or "") for i in range(vocab)) or 1
        template = chat_template if chat_template is not None else config.get("chat_template")
        if chat_template is not None and "{" not in chat_template:  # a file, as vLLM's --chat-template takes either
            template = Path(chat_template).read_text()
        if isinstance(template, list):  # several named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.template: jinja2.Template | None = None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = _raise
            self.template = env.from_string(template)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token text in it (``<|im_start|>``) becomes those tokens, as in HF."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` without special tokens (EOS and chat markers are not text)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """The text of one token as logprobs show it (special tokens are '')."""
        return self.tokenizer.decode([token], skip_special_tokens=True)

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, extra: dict[str, Any] | None = None
    ) -> str:
        """The prompt text of a conversation, ending where the assistant's answer begins (unless
        ``add_generation_prompt`` is False); ``extra``: more variables for the template (``chat_template_kwargs``)."""
        if self.template is None:
            raise TemplateError("this checkpoint has no chat template (tokenizer_config.json chat_template)")
        try:
            return self.template.render(
                **(extra or {}),
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template refused this conversation: {e}") from None


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class Detokenizer:
    """Token ids in, text deltas out, for one answer; stops at the first of ``stops`` (the text before it is
    the answer's end, the stop string itself is not sent), looked for once ``min_tokens`` tokens are in.

    Text that might still change is held back: a trailing incomplete UTF-8 sequence (decoded as U+FFFD) and a
    tail that could be the start of a stop string. ``stopped`` is True once a stop string was found; ``flush``
    gives what was held back when the answer ends for another reason."""

    def __init__(self, codec: TextCodec, stops: list[str], min_tokens: int = 0) -> None:
        self.codec, self.stops, self.min_tokens = codec, [s for s in stops if s], min_tokens
        self.ids: list[int] = []
        self.sent = 0  # characters of the answer's text already given out
        self.stopped = False
        self._text = ""

    def add(self, token: int) -> str:
        """The new text that ``token`` makes safe to send ('' while held back or after a stop)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        self._text = self.codec.decode(self.ids)
        text = self._text
        if len(self.ids) < self.min_tokens:  # (as vLLM: no stop before min_tokens)
            return self._give(len(text) - 1 if text.endswith("\ufffd") else len(text))
        start = max(0, self.sent - max((len(s) for s in self.stops), default=0))
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return self._give(min(hits))
        safe = len(text) - 1 if text.endswith("\ufffd") else len(text)
        for s in self.stops:  # hold back a tail that may grow into a stop string
            for k in range(min(len(s) - 1, safe - self.sent), 0, -1):
                if text[safe - k : safe] == s[:k]:
                    safe -= k
                    break
        return self._give(safe)

    def flush(self) -> str:
        """Everything not yet sent (the answer ended without a stop string)."""
        return "" if self.stopped else self._give(len(self._text))

    def _give(self, upto: int) -> str:
        out = self._text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out
