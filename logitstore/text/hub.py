"""Hugging Face Hub ids (`org/name`, optionally `@revision`) as local folders, offline first.

`--teacher`, `--student` and `build --student-tokenizer` take a Hub id where no such local path exists.
The id is looked up in the local Hugging Face cache first (`HF_HUB_CACHE`, or `HF_HOME`/hub), with no
network at all; only when it is not cached and `HF_HUB_OFFLINE` is not set is it downloaded
(`huggingface_hub.snapshot_download`: config, tokenizer and weights, as safetensors where the repository
has them). A local path always wins over a Hub id of the same spelling.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from logitstore.errors import LogitstoreError

# org/name[@revision]: what the Hub accepts as a repository id (one slash), and a revision (a branch,
# a tag or a commit).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}(@[\w./-]{1,128})?")
# The files a model or a tokenizer needs; not the other frameworks' weights, nor the repository's extras.
_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "tokenizer*", "*.py"]


class HubError(LogitstoreError):
    """A Hub id that is neither in the local cache nor downloadable."""


def is_hub_id(spec: str) -> bool:
    """`org/name[@revision]` that names no local file or folder."""
    return bool(HUB_ID.fullmatch(spec)) and not Path(spec).expanduser().exists()


def repo_name(spec: str) -> str:
    """The repository's own name (`name` of `org/name@rev`): what a model from the Hub is called here."""
    return spec.split("@", 1)[0].split("/", 1)[1]


def local_folder(spec: str, *, flag: str) -> Path:
    """The local folder of Hub id `spec`: from the cache, else downloaded (unless offline)."""
    # Here, not at the top: huggingface_hub's download API costs 0.4 s to import (httpx, hf_api), and
    # every `build` imports this module before its input checks; only Hub ids come this way.
    from huggingface_hub import snapshot_download

    repo, _, revision = spec.partition("@")
    cache = os.environ.get("HF_HUB_CACHE") or None  # read now, not at huggingface_hub's import
    try:
        return Path(snapshot_download(repo, revision=revision or None, cache_dir=cache, local_files_only=True))
    except Exception:  # not cached (huggingface_hub raises several types for that); try the network below
        pass
    if _offline():
        raise HubError(
            f"{flag} {spec!r}: not in the local Hugging Face cache ({cache or _default_cache()}), "
            "and HF_HUB_OFFLINE is set; download it first or give a local folder"
        ) from None
    try:
        return Path(snapshot_download(repo, revision=revision or None, cache_dir=cache, allow_patterns=_PATTERNS))
    except Exception as e:  # no network, no such repository or revision, no access
        cause = " ".join(str(e).split())[:200] or type(e).__name__
        raise HubError(f"{flag} {spec!r}: not in the local Hugging Face cache and not downloadable ({cause})") from None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _default_cache() -> str:
    from huggingface_hub import constants  # as in local_folder

    return constants.HF_HUB_CACHE
