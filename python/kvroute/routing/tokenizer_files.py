"""Loading the tokenizer directory at start-up, with one clear line for what is wrong.

``kvroute serve`` turns a ``TokenizerLoadError`` into ``kvroute serve: error: ...`` and
exit status 2: a directory without tokenizer files, an unreadable file, a tokenizer
transformers cannot load, a chat template that does not compile.
"""

from __future__ import annotations

import os
from typing import Any

import jinja2

from kvroute.routing.templates import compile_template


class TokenizerLoadError(ValueError):
    """The tokenizer directory cannot be used; the message says why, in one line."""


def load_tokenizer(tokenizer_dir: str) -> Any:
    """transformers' AutoTokenizer from ``tokenizer_dir`` (offline); a directory
    without a usable tokenizer raises TokenizerLoadError with one line saying so."""
    files = os.listdir(tokenizer_dir)
    known = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any(f in files for f in known):
        raise TokenizerLoadError(
            f"--tokenizer {tokenizer_dir!r}: no tokenizer files there "
            f"(expected one of {', '.join(known)})"
        )
    for name in files:
        path = os.path.join(tokenizer_dir, name)
        if os.path.isfile(path) and not os.access(path, os.R_OK):
            raise TokenizerLoadError(f"--tokenizer {tokenizer_dir!r}: cannot read {name}")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except Exception as e:
        detail = " ".join(str(e).split())[:300]
        raise TokenizerLoadError(
            f"--tokenizer {tokenizer_dir!r}: cannot load the tokenizer: "
            f"{type(e).__name__}: {detail}"
        ) from None


def chat_template_source(tok: Any) -> str | None:
    """The tokenizer's chat template text (the default one of named templates)."""
    source = getattr(tok, "chat_template", None)
    if isinstance(source, dict):  # named templates: the default one
        source = source.get("default")
    return source if isinstance(source, str) else None


def load_chat_template(tok: Any, tokenizer_dir: str) -> Any:
    """The tokenizer's chat template compiled in the bounded sandbox, or None when it
    has none. A template that does not compile raises TokenizerLoadError."""
    source = chat_template_source(tok)
    if source is None:
        return None
    try:
        return compile_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerLoadError(
            f"--tokenizer {tokenizer_dir!r}: the chat template does not compile: "
            f"{e.message} (line {e.lineno})"
        ) from None
