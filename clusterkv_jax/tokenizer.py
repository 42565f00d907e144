"""Text <-> token ids with HF `tokenizers`, and chat templates rendered with jinja2 as transformers does."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import jinja2
import jinja2.sandbox
import tokenizers


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Wraps `tokenizer.json` plus the special tokens and chat template of `tokenizer_config.json`."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, tokenizer_config: dict[str, Any] | None = None):
        self._tok = tokenizer
        cfg = tokenizer_config or {}
        self.config = cfg
        self.chat_template: str | None = cfg.get("chat_template")
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.pad_token = _token_str(cfg.get("pad_token"))

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        tok_path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise FileNotFoundError(f"no tokenizer.json in {os.fspath(path)!r}")
        cfg: dict[str, Any] = {}
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
        # transformers>=4.43 may keep the template in its own file.
        jinja_path = os.path.join(path, "chat_template.jinja")
        if "chat_template" not in cfg and os.path.isfile(jinja_path):
            with open(jinja_path) as f:
                cfg["chat_template"] = f.read()
        return cls(tokenizers.Tokenizer.from_file(tok_path), cfg)

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
        """Renders `messages` with the checkpoint's chat template (sandboxed jinja2, as in transformers)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template; pass plain text instead of chat=True")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each chat message needs 'role' and 'content', got {m!r}")

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
