"""Text <-> token ids with HF `tokenizers`, and chat templates rendered with jinja2 as transformers does."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from typing import Any, Sequence

import jinja2
import jinja2.sandbox
import tokenizers

#: A chat template renders one prompt: past these it is a resource bomb, not a prompt (the sandbox stops code
#: execution, not resource use: `('x' * 10**10)|length`, a 10^5 x 10^5-character loop, nested range(10**5) loops).
TEMPLATE_MAX_CHARS = 10_000_000
TEMPLATE_MAX_SECONDS = 5.0


class TemplateLimitError(ValueError):
    """A chat template went past `TEMPLATE_MAX_CHARS` or `TEMPLATE_MAX_SECONDS`."""


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox, with the operators that can build huge values checked before they run."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > TEMPLATE_MAX_CHARS:
                    raise TemplateLimitError(f"the chat template builds a value of {len(seq) * n} items (more than "
                                             f"{TEMPLATE_MAX_CHARS})")
        if op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 64:
            raise TemplateLimitError(f"the chat template computes {left} ** {right}, past 64-bit integers")
        return super().call_binop(context, op, left, right)


@contextlib.contextmanager
def _time_limit(seconds: float):
    """TemplateLimitError after `seconds` of wall time, in the main thread (a timer signal); elsewhere no limit."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expired(signum, frame):
        raise TemplateLimitError(f"the chat template ran past {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template(value: Any, source: str) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {"name", "template"} from which, as
    transformers does, the one named "default" is used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        named = {t["name"]: t["template"] for t in value}
        if "default" in named:
            return named["default"]
        raise ValueError(f"the chat templates in {source} are named {', '.join(named)}; none is named 'default', "
                         "the one chat=True uses")
    raise ValueError(f"chat_template in {source} must be a string or a list of {{'name', 'template'}} objects, "
                     f"got {type(value).__name__}")


class Tokenizer:
    """Wraps `tokenizer.json` plus the special tokens and chat template of `tokenizer_config.json`."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, tokenizer_config: dict[str, Any] | None = None,
                 source: str = "tokenizer_config.json"):
        self._tok = tokenizer
        cfg = tokenizer_config or {}
        self.config = cfg
        #: Where the chat template came from, for errors that name it.
        self.chat_template_source = source
        # A malformed template is reported when chat=True needs it, not when the model loads.
        self._template_error: str | None = None
        try:
            self.chat_template: str | None = _chat_template(cfg.get("chat_template"), source)
        except ValueError as e:
            self.chat_template, self._template_error = None, str(e)
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.pad_token = _token_str(cfg.get("pad_token"))

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        tok_path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise FileNotFoundError(f"no tokenizer.json in {os.fspath(path)!r}")
        cfg: dict[str, Any] = {}
        cfg_path = source = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path, encoding="utf-8") as f:
                    cfg = json.load(f)
            except (ValueError, UnicodeDecodeError) as e:
                raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
            if not isinstance(cfg, dict):
                raise ValueError(f"{cfg_path} must hold a JSON object, got {type(cfg).__name__}")
        # transformers>=4.43 may keep the template in its own file.
        jinja_path = os.path.join(path, "chat_template.jinja")
        if "chat_template" not in cfg and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                cfg["chat_template"], source = f.read(), jinja_path
        try:
            tok = tokenizers.Tokenizer.from_file(tok_path)
        except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception for a damaged file
            raise ValueError(f"{tok_path} cannot be read by the tokenizers library (truncated or not a "
                             f"tokenizer.json): {e}") from None
        return cls(tok, cfg, source)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Renders `messages` with the checkpoint's chat template (sandboxed jinja2, as in transformers), within
        `TEMPLATE_MAX_CHARS` of output and `TEMPLATE_MAX_SECONDS` (TemplateLimitError past either)."""
        if self._template_error:
            raise ValueError(self._template_error)
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template; pass plain text instead of chat=True")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each chat message needs 'role' and 'content', got {m!r}")

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            template = env.from_string(self.chat_template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"the chat template in {self.chat_template_source} does not compile (line {e.lineno}): "
                             f"{e.message}") from None
        parts, size = [], 0
        with _time_limit(TEMPLATE_MAX_SECONDS):
            # Rendered piece by piece, so output past the limit stops the template instead of filling memory.
            for part in template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                          bos_token=self.bos_token or "", eos_token=self.eos_token or ""):
                size += len(part)
                if size > TEMPLATE_MAX_CHARS:
                    raise TemplateLimitError(f"the chat template renders more than {TEMPLATE_MAX_CHARS} characters")
                parts.append(part)
        return "".join(parts)
