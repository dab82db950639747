"""Loading the tokenizers that cross-tokenizer distillation names on the command line.

A student tokenizer is given as `--student-tokenizer [NAME=]TOK`, where TOK is a Hugging Face
tokenizer (or model) directory or a `tokenizer.json` file. NAME is the key the store files the
alignment under; it defaults to the directory's name. Only fast (Rust `tokenizers`) tokenizers are
accepted, because the alignment needs their character offsets (see `logitstore.pipelines.align`).

Nothing here downloads: every load is `local_files_only`.
"""

from __future__ import annotations

import hashlib
import os
import re

from tokenizers import Tokenizer

from logitstore.errors import LogitstoreError
from logitstore.text.hub import is_hub_id, local_folder

FLAG = "--student-tokenizer"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class TokenizerError(LogitstoreError, ValueError):
    """A tokenizer that cannot be named, found, loaded or aligned.

    A `ValueError` as well, so callers that validate arguments catch it without knowing logitstore."""


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer's canonical JSON (vocab, merges, normalizer, pre/post-processing): what a
    store records of a teacher's and a student's tokenizer, and what training checks them against."""
    return json_hash(tokenizer_json(tokenizer))


def tokenizer_json(tokenizer) -> str:
    """The tokenizer's canonical JSON, what a store keeps of it. Rendering it holds the GIL (~20 ms for a
    vocabulary of 49k), so a caller that needs it twice keeps it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TokenizerError(f"{type(tokenizer).__name__} is not a fast tokenizer; cannot fingerprint it")
    return backend.to_str()


def json_hash(text: str) -> str:
    """`tokenizer_hash` of a tokenizer whose canonical JSON is `text`."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def parse_tokenizer_spec(spec: str) -> tuple[str, str]:
    """`[NAME=]TOK` -> (NAME, TOK).

    The text before the first `=` is a NAME only if it holds no path separator, so a path that
    happens to contain `=` (in a directory's name, say) still parses as a bare path."""
    if not isinstance(spec, str) or not spec.strip():
        raise TokenizerError(f"{FLAG}: empty value; expected [NAME=]PATH")
    name: str | None
    name, sep, path = spec.partition("=")
    if not sep or "/" in name or os.sep in name:
        name, path = None, spec
    if not path:
        raise TokenizerError(f"{FLAG} {spec!r}: no tokenizer path after {name!r}=")
    if name is None:
        # A tokenizer.json names no model; the folder that holds it does (".../gpt2/tokenizer.json").
        full = os.path.abspath(os.path.expanduser(path))
        name = os.path.basename(os.path.dirname(full) if _looks_like_file(full) else full)
        if not NAME_RE.fullmatch(name):
            raise TokenizerError(
                f"{FLAG} {spec!r}: cannot use {name!r} as the tokenizer's name "
                f"(letters, digits, '.', '_', '-'; at most 128); give one as NAME={path}"
            )
    elif not NAME_RE.fullmatch(name):
        raise TokenizerError(
            f"{FLAG} {spec!r}: bad NAME {name!r} (letters, digits, '.', '_', '-', "
            "starting with a letter or digit; at most 128)"
        )
    return name, path


def _looks_like_file(path: str) -> bool:
    return os.path.isfile(path) or (not os.path.isdir(path) and path.endswith(".json"))


def load_tokenizer(path: str):
    """A fast Hugging Face tokenizer from a directory or a `tokenizer.json`, offline.

    Every failure (missing path, unreadable files, a slow-only tokenizer) is one `TokenizerError`
    line naming the path, since the path came from the user."""
    # transformers (with torch under it) costs 2.9 s to import, and `build` imports this module before its
    # input checks, which should fail in well under that
    from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

    full = str(local_folder(path, flag="--student-tokenizer")) if is_hub_id(path) else os.path.expanduser(path)
    if not os.path.exists(full):
        raise TokenizerError(f"tokenizer {path!r}: no such file or directory")
    tok: PreTrainedTokenizerBase
    try:
        if os.path.isfile(full):
            tok = PreTrainedTokenizerFast(tokenizer_file=full)
        else:
            tok = AutoTokenizer.from_pretrained(full, local_files_only=True)
    except Exception as exc:  # transformers raises many unrelated types for one bad folder
        detail = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise TokenizerError(f"tokenizer {path!r}: cannot load: {detail}") from exc
    require_fast(tok, what=f"tokenizer {path!r}")
    return tok


def require_fast(tokenizer, *, what: str = "tokenizer") -> None:
    """Refuse tokenizers without character offsets (transformers' Python "slow" tokenizers)."""
    if getattr(tokenizer, "is_fast", False) or is_raw_tokenizer(tokenizer):
        return
    raise TokenizerError(
        f"{what} is a slow (Python) tokenizer ({type(tokenizer).__name__}); logitstore needs a "
        "fast tokenizer (a tokenizer.json) for its character offsets"
    )


def is_raw_tokenizer(obj) -> bool:
    """A `tokenizers.Tokenizer` (what a store keeps), not a transformers wrapper around one."""
    return isinstance(obj, Tokenizer)
