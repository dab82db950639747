"""The vLLM teacher engine (optional: `pip install logitstore[vllm]`, needs a GPU).

vLLM scores a prompt in one prefill and can return, for every prompt position, the
top-K next-token log-probabilities (`SamplingParams.prompt_logprobs`). This module asks
for exactly that and turns vLLM's output into the same per-row arrays the torch engine
produces (the required fields of `logitstore.pipelines.teacher.SparseBatch`, one row at
a time; its optional tempered `selection_logprobs` has no vLLM counterpart):

    ids            int32   [T-1, k]  by descending logprob, ties by smaller token id
    logprobs       float32 [T-1, k]  log-softmax over the full vocabulary
    target_logprob float32 [T-1]     logprob of prompt token t+1
    tail           float32 [T-1]     probability mass outside the k kept entries

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
  model's logits before any sampling processor, which is what a distillation target is.
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Mapping, Sequence

import numpy as np

from logitstore.errors import LogitstoreError

_INSTALL_HINT = "the vLLM engine needs `pip install logitstore[vllm]` and a GPU"


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
    for t, (entry, target) in enumerate(zip(islice(prompt_logprobs, 1, None), targets.tolist())):
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
        raise VllmEngineError(
            f"vLLM returned token ids outside [0, {vocab_size}); wrong vocab_size for this model?"
        )


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


# --------------------------------------------------------------------------- engine


class VllmTeacher:
    """A teacher run by vLLM: prompt token ids in, sparse top-k arrays out.

    `k` fixes both the engine's `max_logprobs` (k+1: the cap applies to the requested
    count, which is k, so +1 is only slack) and every request's `prompt_logprobs`.
    `max_num_batched_tokens` bounds the prefill batch, because prompt logprobs
    materialise an fp32 [tokens x vocab] matrix per step. Other keyword arguments go to
    `vllm.LLM` unchanged.
    """

    def __init__(
        self,
        model: str,
        *,
        k: int,
        max_num_batched_tokens: int = 8192,
        dtype: str = "bfloat16",
        **llm_kwargs: Any,
    ) -> None:
        if k < 1:
            raise VllmEngineError(f"k={k} must be at least 1")
        fixed = {"model", "max_logprobs", "enable_prefix_caching"} & set(llm_kwargs)
        if fixed:
            # These decide whether prompt logprobs come back at all; not user-tunable.
            raise VllmEngineError(f"VllmTeacher sets {', '.join(sorted(fixed))} itself")
        LLM, SamplingParams, TokensPrompt = _import_vllm()
        self.k = k
        self._tokens_prompt = TokensPrompt
        self._llm = LLM(
            model=model,
            max_logprobs=k + 1,
            enable_prefix_caching=False,
            max_num_batched_tokens=max_num_batched_tokens,
            dtype=dtype,
            **llm_kwargs,
        )
        # detokenize=False: the store keeps ids only; decoding K+1 strings per position
        # would dominate the run time.
        self._params = SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False)
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
            prompt_logprobs_to_sparse(
                prompt["prompt_token_ids"],
                output.prompt_logprobs,
                k=self.k,
                vocab_size=self._vocab_size,
            )
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
