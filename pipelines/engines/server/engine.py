"""The server engine (`ServerEngine`): each sample one request through the replicas' pool, its answer read
into the sparse arrays and selected as the torch engine selects (`row_samples`); refused and too long samples
are left out and counted (`take_skips`). And the served generator (`ServerGenerator`): one request per answer,
whose prompt's and answer's top-K come back with it where the generator is the teacher (the build's
`HandOver`, `base.py`).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections import Counter

import aiohttp
import numpy as np
import orjson

from logitstore.format.samples import SparseSamples, concat
from logitstore.format.sparsity import DEFAULT_K, Sparsity, settle
from logitstore.pipelines.engines.base import Engine, Generator, HandOver, Settled
from logitstore.pipelines.engines.prompt_logprobs import check_ids
from logitstore.pipelines.engines.server.client import Answer, Replicas, ServerError, api_key
from logitstore.pipelines.engines.server.completions import (
    UNUSABLE,
    answer_ids,
    generation_request,
    scored_answer,
    served_to_sparse,
)
from logitstore.pipelines.engines.server.preflight import (
    PROBE_TEXT,
    ServedGenerator,
    ServedTeacher,
    answer_logprobs_are_raw,
    preflight,
    refuse_unservable,
)
from logitstore.pipelines.engines.server.served_json import MalformedResponse
from logitstore.pipelines.engines.shared import cut_at_stop
from logitstore.urls import redacted

SKIP_REASONS = ("refused", "too_long")  # why a sample was not stored: a 4xx for it, longer than the server takes


class ServerEngine(Engine):
    """The server engine behind the engine interface (`base.Engine`)."""

    name = "server"
    live = "rank"  # live mode: the trainer's rank sends the requests itself (no model to hold)

    @classmethod
    def samples(cls, settings) -> bool:
        return False  # top-K prompt log-probabilities only: the default is top-K

    @classmethod
    def check(cls, settings, spec) -> None:
        refuse_unservable(settings)  # the replicas themselves are checked once, by `settle`

    @classmethod
    def resolved_dtype(cls, settings) -> str:
        return "served"  # the server's own; not known to the client

    @classmethod
    def gpus_per_worker(cls, settings) -> int:
        return 0

    @classmethod
    def version(cls) -> str:
        return f"aiohttp {aiohttp.__version__}, orjson {orjson.__version__}"

    @classmethod
    def settle(cls, settings) -> Settled:
        """The replicas checked (`preflight`, once per build: its answer goes on as `settings.checked`), and
        the sparsity at the K they take (module docstring), with the line the build starts with."""
        served = preflight(settings, settings.teacher_spec)
        defaulted = not isinstance(settings.sparsity, Sparsity)
        sparsity = settle(settings.sparsity, default=Sparsity(k=served.k))
        sparsity = dataclasses.replace(sparsity, k=served.k)
        note = (
            f"--engine server: {sparsity.describe()} from {len(served.urls)} replica(s) of {served.model} "
            f"(server {served.version})"
        )
        if defaulted:
            note += f"; no --top-k given: K = min({DEFAULT_K}, the server's maximum) = {served.k}"
        return Settled(dataclasses.replace(settings, sparsity=sparsity, checked=served), note)

    @classmethod
    def recorded(cls, settings, spec) -> dict:
        """The teacher metadata's `server` field (`ServedTeacher.record`: no key, no credentials)."""
        return {"server": served_teacher(settings).record()}

    def __init__(self, settings, *, lock: threading.Lock, hand_over: HandOver | None = None, log=None):
        from logitstore.pipelines.teacher import (
            describe_teacher,
        )  # torch comes with it: the preflight imports this module before a build loads torch

        self.settings, self.spec = settings, settings.teacher_spec
        self.vocab_size = describe_teacher(self.spec).vocab_size
        self.served = served_teacher(settings)
        self.hand_over = hand_over
        log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self.skips: dict[str, str] = {}  # sample id -> a `SKIP_REASONS`, until the worker takes it
        self.replicas: Replicas | None = Replicas(
            urls=self.served.urls,
            key=api_key(settings),
            concurrency=settings.server_concurrency,
            timeout=settings.server_timeout,
            log=log,
        )

    def compute(
        self, sample_ids: list[str], tokens: list[np.ndarray], *, seed: int, keep: list | None = None, on_batch=None
    ) -> SparseSamples:
        """Every position of every sample that the server answers (the worker applies `keep`); refused and
        too long samples are left out, their reasons in `skips`."""
        assert self.replicas is not None, "the engine is closed"
        # torch comes with it: the preflight imports this module before a build loads torch
        from logitstore.pipelines.sparsify import row_samples

        limit = self.served.max_model_len
        sent, parts = [], []
        for sid, row in zip(sample_ids, tokens):
            # scored by the request that generated it (`ServerGenerator`)
            arrays = self.hand_over.take(row) if self.hand_over is not None else None
            if arrays is not None:
                parts.append(row_samples(sid, np.asarray(row), arrays, self.settings.stored))
                if on_batch is not None:
                    on_batch(len(row))
                continue
            if limit is not None and len(row) + 1 > limit:  # the prompt and the one token it generates
                self.skips[sid] = "too_long"
                continue
            body = orjson.dumps(
                {
                    "model": self.served.model,
                    "prompt": np.asarray(row, dtype=np.int64).tolist(),
                    "max_tokens": 1,
                    "prompt_logprobs": self.served.k,
                    "temperature": 1.0,
                }
            )
            sent.append((sid, row, self.replicas.submit(body, tokens=len(row))))
        try:
            for sid, row, future in sent:
                answer = future.result()
                if answer.status != 200:
                    self.skips[sid] = "refused"
                    continue
                try:
                    arrays = served_to_sparse(answer.body, row, k=self.served.k, vocab_size=self.vocab_size)
                except UNUSABLE as error:  # impossible values too: none is stored
                    raise ServerError(
                        f"--server-url {redacted(answer.url)}: malformed answer for sample {sid!r}: {error}"
                    ) from None
                parts.append(row_samples(sid, np.asarray(row), arrays, self.settings.stored))
                if on_batch is not None:
                    on_batch(len(row))
        finally:
            for _, _, future in sent:
                future.cancel()
        return concat(parts) if parts else _empty(self.settings.stored)

    def take_skips(self, sample_ids: list[str]) -> Counter:
        """How many of these samples were skipped, by reason (forgotten here)."""
        return Counter(self.skips.pop(sid) for sid in sample_ids if sid in self.skips)

    def close(self) -> None:
        replicas, self.replicas = self.replicas, None
        if replicas is not None:
            replicas.close()


def _empty(sparsity) -> SparseSamples:
    return SparseSamples(
        sample_ids=[],
        n_tokens=np.zeros(0, dtype=np.int64),
        input_ids=np.zeros(0, dtype=np.int64),
        n_entries=np.zeros(0, dtype=np.int64),
        entry_ids=np.zeros(0, dtype=np.int64),
        entry_logprobs=np.zeros(0, dtype=np.float32),
        tail=np.zeros(0, dtype=np.float32),
        target_logprobs=np.zeros(0, dtype=np.float32),
        entry_counts=None,
    )


def served_teacher(settings) -> ServedTeacher:
    """What `ServerEngine.settle`'s preflight found, carried by the settled settings."""
    served = settings.checked
    assert isinstance(served, ServedTeacher), "ServerEngine.settle runs before an engine is built"
    return served


class ServerGenerator(Generator):
    """Answers from a served model (the generator interface, `base.Generator`): the
    `--generator-url` replicas (`settings.server_urls`), or, with `shares_teacher`, the teacher's own
    replicas, whose generating request also returns the top-K of every position (`scored_answer`),
    handed to the engine's `compute` in this process (the build's `HandOver`) so no second request scores it. One
    request per answer through the engine's `Replicas` (retries, replicas set aside, `ServerOutage`)."""

    def __init__(self, settings, *, spec, shares_teacher: bool, hand_over: HandOver | None = None):
        from logitstore.pipelines.teacher import (
            describe_teacher,
            model_stop_ids,
        )  # torch comes with it: the preflight imports this module before a build loads torch

        self.stop_ids = model_stop_ids(spec)  # the teacher's tokenizer: its stop tokens
        self.vocab_size = describe_teacher(spec).vocab_size  # the generator's tokenizer is the teacher's
        self.k: int | None = None
        self.settings, self.spec, self._checked = settings, spec, True
        self.hand_over = hand_over
        # checked by the build: the teacher's replicas (`ServerEngine.settle`) or a --generator-url's
        served = settings.checked
        assert isinstance(served, ServedTeacher | ServedGenerator), "the build checks the servers before it generates"
        self.model, urls, self.flag = served.model, served.urls, "--generator-url"
        if isinstance(served, ServedTeacher) and shares_teacher and hand_over is not None:
            self.k, self.flag = served.k, "--server-url"  # its answers are scored in their generating request
            self._checked = False  # whether answers' log-probabilities are the model's: at the first answers
        self.replicas: Replicas | None = Replicas(
            urls=urls,
            key=api_key(settings),
            concurrency=settings.server_concurrency,
            timeout=settings.server_timeout,
            log=lambda message: print(message, file=sys.stderr, flush=True),
        )

    def generate(
        self, prompts: list[np.ndarray], seeds: list[int], *, max_new_tokens: int, temperature: float, top_p: float
    ) -> list[np.ndarray]:
        assert self.replicas is not None, "the generator is closed"
        if not self._checked:
            self._check_answer_logprobs(temperature=temperature, top_p=top_p)
        futures = []
        for prompt, seed in zip(prompts, seeds):
            body = generation_request(
                self.model,
                prompt,
                seed=seed,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                stop_ids=self.stop_ids,
                k=self.k,
            )
            futures.append(self.replicas.submit(body, tokens=len(prompt) + max_new_tokens))
        try:
            return [self._answer(np.asarray(prompt), future.result()) for prompt, future in zip(prompts, futures)]
        finally:
            for future in futures:
                future.cancel()

    def _check_answer_logprobs(self, *, temperature: float, top_p: float) -> None:
        """Answers are scored in their request only where the server sends the model's own log-probabilities
        for them; else (vLLM's --logprobs-mode processed_*) a second request scores each, said once."""
        from logitstore.pipelines.teacher import describe_teacher  # torch: loaded by the build by now

        assert self.k is not None, "only the teacher scores its own answers"
        probe = describe_teacher(self.spec).tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
        try:
            raw = answer_logprobs_are_raw(
                self.settings, self.model, probe, k=self.k, temperature=temperature, top_p=top_p
            )
        except MalformedResponse:
            raw = False
        if not raw:
            self.k = None
            print(
                "build: the teacher's server sends processed log-probabilities for answers (vLLM --logprobs-mode "
                "processed_*), not the model's own: each answer is scored by a second request",
                file=sys.stderr,
                flush=True,
            )
        self._checked = True

    def _answer(self, prompt: np.ndarray, answer: Answer) -> np.ndarray:
        shown = redacted(answer.url)
        if answer.status != 200:
            raise ServerError(f"{self.flag} {shown} refused a generation request: {answer.reason}")
        try:
            ids = answer_ids(answer.body)
            check_ids(ids, vocab_size=self.vocab_size)
            cut = cut_at_stop(ids, self.stop_ids)
            if self.k is not None and len(cut) == len(ids):
                assert self.hand_over is not None, "only a generator sharing the teacher scores its answers"
                arrays = scored_answer(answer.body, prompt, ids, k=self.k, vocab_size=self.vocab_size)
                self.hand_over.put(np.concatenate([prompt, ids]), arrays)
        except UNUSABLE as error:
            raise ServerError(f"{self.flag} {shown}: malformed generation answer: {error}") from None
        return cut

    def close(self) -> None:
        replicas, self.replicas = self.replicas, None
        if replicas is not None:
            replicas.close()
