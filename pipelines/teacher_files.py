"""Where a teacher's files are and how transformers reads them: `TeacherSpec`, the weights' sha256, and a
GGUF teacher converted once into a plain Hugging Face folder (`loadable`)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

# Where a GGUF teacher's converted folder is kept (`converted_folder`): $LOGITSTORE_CACHE/teachers, else
# ~/.cache/logitstore/teachers.
CACHE_VARIABLE = "LOGITSTORE_CACHE"

_HASH_BLOCK = 8 * 1024 * 1024


@dataclass(frozen=True)
class TeacherSpec:
    """Where a teacher lives. `kind` is one of "builtin", "hf_dir", "gguf"."""

    name: str
    kind: str
    path: Path
    gguf_file: str | None = None


def loadable(spec: TeacherSpec) -> tuple[Path, dict]:
    """Where transformers loads `spec` from, and the arguments that say how. A GGUF teacher loads from its
    converted folder (`converted_folder`), made on first use: transformers reads a GGUF file's tokenizer
    and dequantizes its tensors in Python, ~55 s for the 92 MB default teacher on 2 cores against ~1.3 s
    for the same model as safetensors. Where the cache cannot be written, from the GGUF file itself."""
    if not spec.gguf_file:
        return spec.path, {}
    folder = converted_folder(spec)
    if folder is None:
        return spec.path, {"gguf_file": spec.gguf_file}
    return folder, {}


def converted_folder(spec: TeacherSpec) -> Path | None:
    """The GGUF teacher as a Hugging Face folder (fp32 safetensors, tokenizer, configs) in the cache, keyed
    by the file's sha256 and transformers' version (its dequantization makes the values); None where the
    cache cannot be written. The folder is written beside its place and renamed into it, so a folder there
    is whole, and builds converting at once all end with the same one."""
    assert spec.gguf_file is not None
    root = Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "logitstore") / "teachers"
    folder = root / f"{file_sha256(spec.path / spec.gguf_file)[:32]}-transformers-{transformers.__version__}"
    if (folder / "config.json").is_file():
        return folder
    try:
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=root))
    except OSError:
        return None
    try:
        _convert_gguf(spec, work)
        os.rename(work, folder)
    # OSError: another process renamed its copy first (or the disk is full): that one, or none. The others:
    # the file does not load, and loading it from the file says why in the teacher's own error.
    except (OSError, ValueError, KeyError, RuntimeError):
        shutil.rmtree(work, ignore_errors=True)
        return folder if (folder / "config.json").is_file() else None
    return folder


def _convert_gguf(spec: TeacherSpec, out: Path) -> None:
    """Load the GGUF file as transformers does (dequantized to fp32) and save it as a plain model."""
    with quiet_gguf_bar(gguf=True):
        tokenizer = AutoTokenizer.from_pretrained(spec.path, gguf_file=spec.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(spec.path, gguf_file=spec.gguf_file, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):  # the values are dequantized: saved as the plain model they are
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def quiet_gguf_bar(*, gguf: bool):
    """transformers' GGUF loader draws its "Converting and de-quantizing GGUF tensors" bar with tqdm
    directly (transformers 5: `modeling_gguf_pytorch_utils.tqdm`), past `disable_progress_bar`: in a
    log or a pipe, ~30 lines of it between the build's own progress lines. Off while a load runs there;
    on a terminal the bar stays."""
    if not gguf or sys.stderr.isatty():
        yield
        return
    # here: it imports the gguf package, which only a GGUF teacher needs
    module = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    if not hasattr(module, "tqdm"):  # another transformers: nothing to quiet
        yield
        return
    bar = getattr(module, "tqdm")  # noqa: B009  (an attribute of this transformers only; checked above)
    setattr(module, "tqdm", functools.partial(bar, disable=True))  # noqa: B010
    try:
        yield
    finally:
        setattr(module, "tqdm", bar)  # noqa: B010


def file_sha256(path: Path) -> str:
    """sha256 hex of a file, read in 8 MB blocks and memoized per (path, size, mtime)."""
    stat = Path(path).stat()
    return _file_sha256_cached(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _file_sha256_cached(path: str, size: int, mtime_ns: int) -> str:
    # size and mtime are part of the key so a rewritten file is hashed again.
    digest = hashlib.sha256()
    buffer = bytearray(_HASH_BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while read := handle.readinto(buffer):
            digest.update(view[:read])
    return digest.hexdigest()
