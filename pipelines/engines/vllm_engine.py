"""The vLLM engine (`--engine vllm`; `pip install 'logitstore[vllm]'`, a Linux machine with NVIDIA GPUs).

Written against the documented API of vLLM 0.11 to 0.33 (the `[vllm]` extra's range) and NOT RUN: no
GPU was lent while it was written. Its pure parts are tested on CPU (tests/test_vllm_engine.py): the
conversion of both output forms against a dense reference, the plan of engine and request arguments,
the refusals.

vLLM scores a prompt in one prefill and can return, for every prompt position, the top-K next-token
log-probabilities (`SamplingParams.prompt_logprobs`). This module asks for exactly that and turns
vLLM's output into the arrays the torch engine produces, then selects entries with the same code
(`sparsify.to_samples`): top-k, or top-p capped at k, at temperature 1 (prompt log-probabilities have
no temperature). Sampled entries would need the whole distribution, which vLLM does not return:
`--sample` is refused in one line.

    ids            int32   [T-1, k]  by descending logprob, ties by smaller token id
    logprobs       float32 [T-1, k]  log-softmax over the full vocabulary
    target_logprob float32 [T-1]     logprob of prompt token t+1
    tail           float32 [T-1]     probability mass outside the k kept entries

Memory. Prompt log-probabilities make vLLM hold, per scheduled token, the vocabulary's logits and an
fp32 log-softmax of them, outside its memory profiling (~7.5 GiB for 8,192 tokens at a 152k
vocabulary, read from the 0.33 wheel: 6.5 bytes per token and vocabulary entry). `plan_vllm` therefore
caps the tokens per engine step so that this matrix takes at most `LOGPROB_SHARE` of a GPU,

    max_num_batched_tokens = min(--batch-tokens, LOGPROB_SHARE x GPU bytes / (vocab x PROMPT_LOGPROB_BYTES))

and lowers `gpu_memory_utilization` by the same bytes, so the KV cache leaves them free; `max_num_seqs`
is at most the tokens per step (vLLM refuses more). A request that still runs out of memory is halved
and run again (`engines.halving_on_oom`).

What vLLM documents and this module relies on (vllm/logprobs.py, vllm/v1/engine/logprobs.py,
the SamplingParams and engine-args reference):

- `RequestOutput.prompt_logprobs` is a list with one entry per prompt token. Entry 0 is
  None (nothing predicts the first token). Entry i >= 1 is a dict
  token_id -> `Logprob(logprob, rank, decoded_token)` for the distribution that predicts
  prompt token i, i.e. the prediction made at position i-1.
- Entry i holds the top-K tokens (rank 1..K, by position in vLLM's top-k) and always the
  actual prompt token i, with its vocabulary rank. When that token is already in the
  top-K the dict has K items; otherwise it has K+1 and the extra item has rank > K.
  Ties at the K-th value depend on the version: V1 ranks a token by how many are at
  least as likely (so a tied extra still gets rank > K), V0 by 1 + how many are strictly
  more likely (so a tied extra can get rank <= K and then competes, by token id).
- A request may not ask for more prompt logprobs than the engine's `max_logprobs`
  (default 20; -1 = no cap); vLLM raises "Requested prompt logprobs of N, which is
  greater than max allowed" otherwise.
- Prompt logprobs need every position computed, never read from the prefix cache (V1's
  KV-cache manager skips the cache for such requests); prefix caching is off regardless.
- Logprobs are "raw" by default (`logprobs_mode="raw_logprobs"`): fp32 log-softmax of the
  model's logits before any sampling processor, which is what a distillation target is. Newer
  versions let the engine return logits instead (`raw_logits`, `processed_logits`): the plan pins
  `logprobs_mode="raw_logprobs"` wherever the engine arguments have it.
- With `SamplingParams(flat_logprobs=True)` (where it exists) `prompt_logprobs` is a `FlatLogprobs`:
  flat columns `start_indices`, `end_indices`, `token_ids`, `logprobs`, `ranks`, one span per position,
  the prompt token first (with its vocabulary rank), then the top-K (ranks 1..K), not deduplicated.
  No Python object per position: `flat_prompt_logprobs_to_sparse` converts it without a loop.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import itertools
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from logitstore.errors import LogitstoreError
from logitstore.pipelines.engines import halving_on_oom
from logitstore.pipelines.sparsify import to_samples
from logitstore.pipelines.teacher import SparseBatch, describe_teacher
from logitstore.samples import SparseSamples, concat

_INSTALL_HINT = (
    "--engine vllm needs vLLM: pip install 'logitstore[vllm]' (vLLM 0.11 to 0.33, a Linux machine "
    "with an NVIDIA GPU), or use --engine torch"
)


class VllmEngineError(LogitstoreError):
    """vLLM is missing, misconfigured, or returned prompt logprobs we cannot use."""


# --------------------------------------------------------------------------- conversion


def prompt_logprobs_to_sparse(
    prompt_token_ids: Sequence[int],
    prompt_logprobs: Sequence[Mapping[int, Any] | None],
    *,
    k: int,
    vocab_size: int,
) -> dict[str, np.ndarray]:
    """Convert one vLLM `RequestOutput.prompt_logprobs` to the sparse top-k arrays.

    Position t (0 <= t < T-1) is the prediction for prompt token t+1, read from entry
    t+1. Each entry must hold at least k candidate tokens besides an added target
    (otherwise the engine's `max_logprobs` / the request's `prompt_logprobs` was below k).
    Candidates beyond k are dropped after sorting by (descending logprob, ascending id).

    The tail is 1 - sum(exp(top-k)), because vLLM returns only top-K values and never the
    mass outside them. It is computed in float64 as -expm1(logsumexp(top-k)), so the
    subtraction itself loses nothing, but the inputs are vLLM's fp32 log-probabilities:
    their rounding and fp32 normalisation error (~1e-6 to 1e-5 at large vocabularies) is
    an absolute error on the tail. Tails below ~1e-5 are therefore noise, and clamping
    to [0, 1] hides small negative results. The torch engine sums the tail directly and
    does not have this limit.
    """
    tokens = _check_inputs(prompt_token_ids, prompt_logprobs, k=k, vocab_size=vocab_size)
    targets = tokens[1:]
    flat_ids, flat_lps, counts, target_lp, extra = _flatten(prompt_logprobs, targets, k=k)
    rows = np.repeat(np.arange(len(targets)), counts)
    # Drop the added target where it is not a top-k member, so it can neither be kept
    # nor count towards the k candidates a position must have.
    keep = ~((flat_ids == targets[rows]) & extra[rows])
    flat_ids, flat_lps, rows = flat_ids[keep], flat_lps[keep], rows[keep]
    kept = np.bincount(rows, minlength=len(targets))
    _check_candidates(kept, k=k)
    _check_ids(flat_ids, vocab_size=vocab_size)
    top_ids, top_lps = _top_k_per_row(flat_ids, flat_lps, rows, kept, k=k)
    return {
        "ids": top_ids.astype(np.int32),
        "logprobs": top_lps.astype(np.float32),
        "target_logprob": target_lp.astype(np.float32),
        "tail": _tail(top_lps).astype(np.float32),
    }


def flat_prompt_logprobs_to_sparse(
    prompt_token_ids: Sequence[int], flat, *, k: int, vocab_size: int
) -> dict[str, np.ndarray]:
    """`prompt_logprobs_to_sparse` for a `FlatLogprobs` (`flat_logprobs=True`), without a Python loop.

    Position t's span (entry t+1) is the prompt token t+1 with its vocabulary rank, then the top-K in
    rank order (not deduplicated: a prompt token inside the top-K appears twice). The first k of the
    top-K are kept, sorted by (descending logprob, ascending id) so ties come out as the dict form's.
    """
    tokens = _check_inputs(prompt_token_ids, flat, k=k, vocab_size=vocab_size)
    targets = tokens[1:]
    starts = np.asarray(flat.start_indices, dtype=np.int64)[1:]
    ends = np.asarray(flat.end_indices, dtype=np.int64)[1:]
    ids = np.asarray(flat.token_ids, dtype=np.int64)
    lps = np.asarray(flat.logprobs, dtype=np.float64)
    _check_candidates(ends - starts - 1, k=k)
    if len(targets) and not np.array_equal(ids[starts], targets):
        t = int(np.flatnonzero(ids[starts] != targets)[0])
        raise VllmEngineError(
            f"vLLM prompt logprobs entry {t + 1} does not start with the prompt token "
            f"{int(targets[t])}; prefix caching must be off and prompt_logprobs set"
        )
    take = starts[:, None] + 1 + np.arange(k)
    top_ids, top_lps = ids[take].reshape(-1, k), lps[take].reshape(-1, k)
    _check_ids(top_ids, vocab_size=vocab_size)
    order = np.lexsort((top_ids, -top_lps))  # per row (the last axis): by descending logprob, then id
    top_ids, top_lps = np.take_along_axis(top_ids, order, 1), np.take_along_axis(top_lps, order, 1)
    return {
        "ids": top_ids.astype(np.int32),
        "logprobs": top_lps.astype(np.float32),
        "target_logprob": lps[starts].astype(np.float32),
        "tail": _tail(top_lps).astype(np.float32),
    }


def to_sparse(prompt_token_ids: Sequence[int], prompt_logprobs, *, k: int, vocab_size: int) -> dict[str, np.ndarray]:
    """Either output form of one request: a `FlatLogprobs` or a list of per-position dicts."""
    if hasattr(prompt_logprobs, "start_indices"):
        return flat_prompt_logprobs_to_sparse(prompt_token_ids, prompt_logprobs, k=k, vocab_size=vocab_size)
    return prompt_logprobs_to_sparse(prompt_token_ids, prompt_logprobs, k=k, vocab_size=vocab_size)


def _check_inputs(prompt_token_ids, prompt_logprobs, *, k: int, vocab_size: int) -> np.ndarray:
    if not 1 <= k <= vocab_size:
        raise VllmEngineError(f"k={k} must be between 1 and the vocabulary size {vocab_size}")
    if prompt_logprobs is None:
        raise VllmEngineError("vLLM returned no prompt logprobs; the request needs prompt_logprobs")
    tokens = np.asarray(prompt_token_ids, dtype=np.int64).reshape(-1)
    if tokens.size == 0:
        raise VllmEngineError("an empty prompt has no next-token predictions")
    if len(prompt_logprobs) != tokens.size:
        raise VllmEngineError(
            f"vLLM returned {len(prompt_logprobs)} prompt logprob entries for a "
            f"{tokens.size}-token prompt; was the request sent with prompt_logprobs=k?"
        )
    if not 0 <= tokens.min() <= tokens.max() < vocab_size:
        raise VllmEngineError(f"prompt token ids must be in [0, {vocab_size})")
    return tokens


def _flatten(prompt_logprobs, targets: np.ndarray, *, k: int):
    """One pass over vLLM's per-position dicts into flat arrays.

    vLLM hands back Python dicts of Python objects, so a Python loop over positions is
    unavoidable; it only copies (id, logprob) pairs and reads the target, and everything
    else (dropping, sorting, tail) is vectorised over the flat arrays afterwards.
    """
    n = len(targets)
    flat_ids: list[int] = []
    flat_lps: list[float] = []
    counts = np.empty(n, dtype=np.int64)
    target_lp = np.empty(n, dtype=np.float64)
    extra = np.empty(n, dtype=bool)
    # Entry 0 is None by vLLM's contract (nothing predicts the first token): skip it.
    for t, (entry, target) in enumerate(zip(itertools.islice(prompt_logprobs, 1, None), targets.tolist())):
        found = entry.get(target) if entry is not None else None
        if found is None:
            raise VllmEngineError(
                f"vLLM prompt logprobs entry {t + 1} is missing or lacks the prompt token "
                f"{target}; prefix caching must be off and prompt_logprobs set"
            )
        flat_ids.extend(entry)
        flat_lps.extend([item.logprob for item in entry.values()])
        counts[t] = len(entry)
        target_lp[t] = found.logprob
        extra[t] = _target_rank(entry, found) > k
    return (
        np.fromiter(flat_ids, dtype=np.int64, count=len(flat_ids)),
        np.fromiter(flat_lps, dtype=np.float64, count=len(flat_lps)),
        counts,
        target_lp,
        extra,
    )


def _target_rank(entry: Mapping[int, Any], found) -> int:
    # vLLM sets .rank on every prompt-logprob item; the fallback (V1's convention: items
    # at least as likely, itself included) only guards against a None from elsewhere.
    if found.rank is not None:
        return int(found.rank)
    return sum(item.logprob >= found.logprob for item in entry.values())


def _check_candidates(kept: np.ndarray, *, k: int) -> None:
    short = np.flatnonzero(kept < k)
    if short.size:
        t = int(short[0])
        raise VllmEngineError(
            f"vLLM returned only {int(kept[t])} top tokens for position {t} (and "
            f"{short.size - 1} more positions), fewer than k={k}: raise the engine's "
            f"max_logprobs and the request's prompt_logprobs to at least {k}"
        )


def _check_ids(flat_ids: np.ndarray, *, vocab_size: int) -> None:
    if flat_ids.size and not 0 <= flat_ids.min() <= flat_ids.max() < vocab_size:
        raise VllmEngineError(f"vLLM returned token ids outside [0, {vocab_size}); wrong vocab_size for this model?")


def _top_k_per_row(flat_ids, flat_lps, rows, kept, *, k: int):
    """The first k of each row after sorting by (row, descending logprob, ascending id)."""
    # lexsort: the last key is primary. Sorting by id last makes ties deterministic
    # (vLLM's own top-k order among equal values is whatever torch.topk returned).
    order = np.lexsort((flat_ids, -flat_lps, rows))
    starts = np.cumsum(kept) - kept
    take = order[starts[:, None] + np.arange(k)]
    return flat_ids[take], flat_lps[take]


def _tail(top_lps: np.ndarray) -> np.ndarray:
    # 1 - sum(p) = -expm1(log(sum(p))): no cancellation in the subtraction itself.
    return np.clip(-np.expm1(np.logaddexp.reduce(top_lps, axis=-1)), 0.0, 1.0)


# --------------------------------------------------------------------------- plan

PROMPT_LOGPROB_BYTES = 8  # per scheduled token and vocabulary entry: 6.5 read from the 0.33 wheel, plus headroom
LOGPROB_SHARE = 0.25  # of a GPU's memory, at most, for the prompt log-probability matrices of one step
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default, before the prompt log-probabilities' share is taken off
MAX_NUM_SEQS = 256  # requests per step; vLLM needs at most max_num_batched_tokens (its H100 default is 1,024)
GGUF_PLUGIN = "vllm-gguf-plugin"
GGUF_PLUGIN_SINCE = (0, 24)  # vLLM versions from here load GGUF only through the plugin


@dataclass(frozen=True)
class VllmFeatures:
    """What the installed vLLM accepts, read from its argument classes (`vllm_features`)."""

    logprobs_mode: bool = True  # EngineArgs.logprobs_mode
    flat_logprobs: bool = True  # SamplingParams.flat_logprobs


@dataclass(frozen=True)
class VllmPlan:
    llm: dict  # `vllm.LLM(**llm)`
    sampling: dict  # `vllm.SamplingParams(**sampling)`


def plan_vllm(
    *,
    model: str,
    tokenizer: str | None,
    k: int,
    vocab_size: int,
    batch_tokens: int,
    max_length: int,
    dtype: str,
    tensor_parallel: int,
    gpu_bytes: int,
    features: VllmFeatures = VllmFeatures(),
) -> VllmPlan:
    """vLLM's engine and request arguments for a prompt-logprob build (module docstring: "Memory")."""
    per_token = vocab_size * PROMPT_LOGPROB_BYTES
    tokens = min(batch_tokens, int(LOGPROB_SHARE * gpu_bytes) // per_token)
    if tokens < 1:
        raise VllmEngineError(
            f"a {vocab_size:,}-token vocabulary needs {per_token:,} bytes per token for prompt "
            f"log-probabilities; a GPU of {gpu_bytes:,} bytes cannot hold one step"
        )
    llm = {
        "model": model,
        "tokenizer": tokenizer,
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel,
        "max_logprobs": k,
        "enable_prefix_caching": False,  # every prompt position computed, none read from a cache
        "max_num_batched_tokens": tokens,
        "max_num_seqs": min(MAX_NUM_SEQS, tokens),
        "max_model_len": max_length + 1,  # the prompt and the one token a request must generate
        "gpu_memory_utilization": round(GPU_MEMORY_UTILIZATION - tokens * per_token / gpu_bytes, 3),
        "seed": 0,
    }
    if tokenizer is None:
        llm.pop("tokenizer")
    if features.logprobs_mode:
        llm["logprobs_mode"] = "raw_logprobs"  # log-softmax of the raw logits: never logits, never processed
    sampling = {"max_tokens": 1, "prompt_logprobs": k, "detokenize": False}  # ids only: decoding would dominate
    if features.flat_logprobs:
        sampling["flat_logprobs"] = True
    return VllmPlan(llm=llm, sampling=sampling)


def gguf_problem(*, vllm_version: str | None, plugin_installed: bool) -> str | None:
    """Why a GGUF teacher cannot run on this vLLM, or None."""
    if plugin_installed:
        return None
    if vllm_version is not None and _version_tuple(vllm_version) < GGUF_PLUGIN_SINCE:
        return None  # GGUF still built in
    return (
        f"a GGUF teacher on the vLLM engine needs the {GGUF_PLUGIN} package (pip install {GGUF_PLUGIN}; vLLM "
        f"loads GGUF only through it from 0.24), or a Hugging Face folder teacher, or --engine torch"
    )


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits or 0))
    return tuple(parts)


def vllm_features() -> VllmFeatures:
    """Read from the installed vLLM's argument classes, so the plan never passes an unknown argument."""
    from vllm import SamplingParams  # the optional [vllm] extra, imported only where it is used
    from vllm.engine.arg_utils import EngineArgs

    return VllmFeatures(
        logprobs_mode=_accepts(EngineArgs, "logprobs_mode"), flat_logprobs=_accepts(SamplingParams, "flat_logprobs")
    )


def _accepts(cls, name: str) -> bool:
    if dataclasses.is_dataclass(cls):
        return name in {f.name for f in dataclasses.fields(cls)}
    fields = getattr(cls, "__struct_fields__", None)  # msgspec structs (SamplingParams)
    if fields is not None:
        return name in fields
    return name in inspect.signature(cls).parameters


# --------------------------------------------------------------------------- engine


class Engine:
    """The vLLM engine behind the engine interface (`pipelines/engines/__init__.py`)."""

    name = "vllm"
    samples = False  # prompt log-probabilities are top-K only: no exact draws from the whole distribution

    @classmethod
    def check(cls, settings, spec) -> None:
        sparsity = settings.sparsity
        if sparsity.sampled:
            raise VllmEngineError(
                "--engine vllm cannot store --sample entries: vLLM returns the top-K prompt "
                "log-probabilities only, not the whole distribution to draw from; use --top-k or "
                "--top-p, or --engine torch"
            )
        if sparsity.temperature != 1:
            raise VllmEngineError(
                "--engine vllm selects entries at --temperature 1 only (vLLM's prompt "
                "log-probabilities have no temperature); use --engine torch"
            )
        vllm_version = _installed_version("vllm")
        if spec.gguf_file:
            problem = gguf_problem(
                vllm_version=vllm_version, plugin_installed=_installed_version(GGUF_PLUGIN) is not None
            )
            if problem:
                raise VllmEngineError(problem)
        if vllm_version is None:
            raise VllmEngineError(_INSTALL_HINT)
        if not torch.cuda.is_available():
            raise VllmEngineError(
                "--engine vllm needs an NVIDIA GPU; torch sees no CUDA device here (use --engine torch)"
            )
        if settings.tensor_parallel > torch.cuda.device_count():
            raise VllmEngineError(
                f"--tensor-parallel {settings.tensor_parallel} needs that many GPUs; "
                f"{torch.cuda.device_count()} are visible"
            )

    @classmethod
    def resolved_dtype(cls, settings) -> str:
        """`auto`: bfloat16 (vLLM's own `auto` follows the model's config, which a store could not repeat)."""
        return "bfloat16" if settings.dtype == "auto" else settings.dtype

    @classmethod
    def gpus_per_worker(cls, settings) -> int:
        return settings.tensor_parallel

    @classmethod
    def version(cls) -> str:
        return f"vllm {_installed_version('vllm')}"

    def __init__(self, settings, *, lock: threading.Lock):
        self.settings, self.lock = settings, lock
        info = describe_teacher(settings.teacher_spec)
        self.spec, self.vocab_size, self.device = settings.teacher_spec, info.vocab_size, torch.device("cuda")
        # The tokenizer the store records, handed to vLLM as a folder: GGUF teachers' own tokenizer
        # conversion in vLLM could differ from it.
        self._tokenizer_dir = tempfile.TemporaryDirectory(prefix="logitstore-tokenizer-")
        info.tokenizer.save_pretrained(self._tokenizer_dir.name)
        spec = settings.teacher_spec
        plan = plan_vllm(
            model=str(spec.path / spec.gguf_file) if spec.gguf_file else str(spec.path),
            tokenizer=self._tokenizer_dir.name,
            k=settings.sparsity.k,
            vocab_size=info.vocab_size,
            batch_tokens=settings.batch_tokens,
            max_length=settings.max_length,
            dtype=self.resolved_dtype(settings),
            tensor_parallel=settings.tensor_parallel,
            gpu_bytes=torch.cuda.get_device_properties(0).total_memory,
            features=vllm_features(),
        )
        self.teacher = VllmTeacher(plan, k=settings.sparsity.k)
        if self.teacher.vocab_size != self.vocab_size:
            raise VllmEngineError(
                f"vLLM's model predicts {self.teacher.vocab_size} tokens, the teacher's config {self.vocab_size}"
            )

    def compute(
        self, sample_ids: list[str], tokens: list[np.ndarray], *, seed: int, keep: list | None = None, on_batch=None
    ) -> SparseSamples:
        """Every position of every sample (vLLM schedules the batch itself; `keep` is applied by the worker)."""
        samples = halving_on_oom(self._run, list(sample_ids), list(tokens), None)
        if on_batch is not None:
            on_batch(int(sum(len(t) for t in tokens)))
        return samples

    def _run(self, sample_ids: list[str], tokens: list[np.ndarray], keep) -> SparseSamples:
        with self.lock:
            rows = self.teacher.forward(tokens)
        return concat(
            [_row_samples(sid, t, row, self.settings.sparsity) for sid, t, row in zip(sample_ids, tokens, rows)]
        )


def _row_samples(sample_id: str, tokens: np.ndarray, row: dict, sparsity) -> SparseSamples:
    """One request's arrays through the torch engine's selection (`to_samples`): top-k or top-p."""
    batch = SparseBatch(**{name: torch.from_numpy(array[None]) for name, array in row.items()})
    return to_samples(
        batch, sample_ids=[sample_id], lengths=np.array([len(tokens)]), input_ids=[tokens], sparsity=sparsity
    )


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


class VllmTeacher:
    """A teacher run by vLLM: prompt token ids in, sparse top-k arrays out, as `plan` says."""

    def __init__(self, plan: VllmPlan, *, k: int) -> None:
        LLM, SamplingParams, TokensPrompt = _import_vllm()
        self.k = k
        self._tokens_prompt = TokensPrompt
        self._llm = LLM(**plan.llm)
        self._params = SamplingParams(**plan.sampling)
        self._vocab_size = _model_vocab_size(self._llm)
        if k > self._vocab_size:
            raise VllmEngineError(f"k={k} exceeds the vocabulary size {self._vocab_size}")

    @property
    def tokenizer(self):
        """The tokenizer vLLM loaded with the model."""
        return self._llm.get_tokenizer()

    @property
    def vocab_size(self) -> int:
        """Rows of the model's output layer (what token ids index), as the torch engine."""
        return self._vocab_size

    def forward(self, batch: Sequence[np.ndarray]) -> list[dict[str, np.ndarray]]:
        """Sparse top-k arrays for each unpadded 1-D row of prompt token ids, in order."""
        prompts = [self._tokens_prompt(prompt_token_ids=_row_ids(row)) for row in batch]
        # LLM.generate returns outputs in the order of the prompts.
        outputs = self._llm.generate(prompts, self._params, use_tqdm=False)
        return [
            to_sparse(prompt["prompt_token_ids"], output.prompt_logprobs, k=self.k, vocab_size=self._vocab_size)
            for prompt, output in zip(prompts, outputs, strict=True)
        ]


def _import_vllm():
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as exc:
        raise VllmEngineError(_INSTALL_HINT) from exc
    return LLM, SamplingParams, TokensPrompt


def _model_vocab_size(llm) -> int:
    # The model config's vocab size is the lm_head width (vLLM trims padded rows to it);
    # len(tokenizer) can be smaller, and top-k ids may index past it.
    config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    if config is not None:
        return int(config.get_vocab_size())
    return len(llm.get_tokenizer())


def _row_ids(row) -> list[int]:
    row = np.asarray(row)
    if row.ndim != 1 or row.size == 0 or not np.issubdtype(row.dtype, np.integer):
        raise VllmEngineError("each batch row must be a non-empty 1-D array of token ids")
    return row.tolist()
