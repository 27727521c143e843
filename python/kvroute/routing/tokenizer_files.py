"""Finding and loading the tokenizer at start-up, with one clear line for what is wrong.

``--tokenizer`` names a directory, or a Hugging Face model ID (``Qwen/Qwen3-8B``) as the
engines' ``--model`` and ``--tokenizer`` do. An ID is found in the local Hugging Face
cache (``HF_HUB_CACHE``, or ``HF_HOME``'s ``hub``) without touching the network, so a
router restarts with the Hub unreachable; only when the cache lacks it, and downloads are
allowed (``HF_HUB_OFFLINE`` unset), its tokenizer files alone are downloaded into that
cache (a few MB, never the weights; ``HF_TOKEN`` for gated models).

``kvroute serve`` turns a ``TokenizerLoadError`` into ``kvroute serve: error: ...`` and
exit status 2: a directory that does not exist and an ID neither cached nor downloadable,
a directory without tokenizer files, an unreadable file, a tokenizer transformers cannot
load, a chat template that does not compile.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jinja2

from kvroute.routing.templates import compile_template

log = logging.getLogger("kvroute")


class TokenizerLoadError(ValueError):
    """The tokenizer directory cannot be used; the message says why, in one line."""


# What AutoTokenizer and the chat template read from a model's repository: the
# tokenizer's own files, the chat template (inline or separate), and config.json, which
# names the tokenizer's class when tokenizer_config.json does not. Never the weights.
TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "spiece.model",
    "chat_template.*",
    "config.json",
)


def is_model_id(spec: str) -> bool:
    """Whether ``spec`` (not a directory) reads as a Hugging Face model ID:
    ``NAME`` or ``ORG/NAME`` as the Hub spells them, not a path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id  # type: ignore[attr-defined]

    if spec.startswith(("/", ".", "~")) or spec.count("/") > 1:
        return False
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def cached_snapshot(
    spec: str, revision: str | None = None, *, cache_dir: str | None = None
) -> str | None:
    """The local Hugging Face cache's snapshot of model ``spec`` at ``revision``
    (without the network), or None when the cache has none."""
    from huggingface_hub import snapshot_download

    try:
        return str(
            snapshot_download(
                spec,
                revision=revision,
                cache_dir=cache_dir,
                allow_patterns=list(TOKENIZER_FILES),
                local_files_only=True,
            )
        )
    except Exception:  # not in the cache (the error names no more than that)
        return None


def resolve_tokenizer(
    spec: str, revision: str | None = None, *, cache_dir: str | None = None
) -> str:
    """The directory ``--tokenizer spec`` names: ``spec`` itself when it is a directory,
    else the snapshot of the Hugging Face model ``spec`` at ``revision`` (a branch, tag
    or commit; default ``main``) in the local cache, downloaded there first (tokenizer
    files only) when missing and downloads are allowed (module doc). Raises
    TokenizerLoadError with one line saying what was looked for where."""
    if os.path.isdir(spec):
        if revision is not None:
            raise TokenizerLoadError(
                f"--tokenizer-revision {revision!r} applies to a model ID; "
                f"--tokenizer {spec!r} is a directory"
            )
        return spec
    from huggingface_hub import constants, snapshot_download

    if not is_model_id(spec):
        raise TokenizerLoadError(
            f"--tokenizer {spec!r}: no such directory (nor a Hugging Face model ID)"
        )
    where = cache_dir or constants.HF_HUB_CACHE
    at = f" at revision {revision!r}" if revision else ""
    found = cached_snapshot(spec, revision, cache_dir=cache_dir)
    # A snapshot cached without its tokenizer (weights fetched alone) is completed below.
    if found is not None and (has_tokenizer_files(found) or constants.HF_HUB_OFFLINE):
        return found
    if constants.HF_HUB_OFFLINE:
        include = " ".join(f"'{p}'" for p in TOKENIZER_FILES)
        raise TokenizerLoadError(
            f"--tokenizer {spec!r}: no such directory, and no model {spec!r}{at} in the "
            f"Hugging Face cache {where!r}; downloads are off (HF_HUB_OFFLINE): give the "
            "tokenizer's directory, or fetch it into that cache first "
            f"(hf download {spec} --include {include})"
        )
    from huggingface_hub.utils.tqdm import disable_progress_bars

    disable_progress_bars()  # a bar on stderr has no place in a service's log
    log.info("downloading the tokenizer files of %s%s into %s", spec, at, where)
    try:
        return str(
            snapshot_download(
                spec, revision=revision, cache_dir=cache_dir, allow_patterns=list(TOKENIZER_FILES)
            )
        )
    except Exception as e:
        # huggingface_hub's messages name the URL and repository, never the token.
        detail = " ".join(str(e).split())[:300]
        raise TokenizerLoadError(
            f"--tokenizer {spec!r}: no such directory, no model {spec!r}{at} in the "
            f"Hugging Face cache {where!r}, and its tokenizer could not be downloaded: "
            f"{type(e).__name__}: {detail}"
        ) from None


KNOWN_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def has_tokenizer_files(tokenizer_dir: str) -> bool:
    """Whether ``tokenizer_dir`` holds one of the files a tokenizer loads from."""
    return any(os.path.exists(os.path.join(tokenizer_dir, f)) for f in KNOWN_FILES)


def load_tokenizer(tokenizer_dir: str) -> Any:
    """transformers' AutoTokenizer from ``tokenizer_dir`` (offline); a directory
    without a usable tokenizer raises TokenizerLoadError with one line saying so."""
    if not has_tokenizer_files(tokenizer_dir):
        raise TokenizerLoadError(
            f"--tokenizer {tokenizer_dir!r}: no tokenizer files there "
            f"(expected one of {', '.join(KNOWN_FILES)})"
        )
    files = os.listdir(tokenizer_dir)
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
