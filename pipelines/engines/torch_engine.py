"""The torch engine: the teacher as a Hugging Face model in this process (CPU or one GPU), the default.

Samples are batched by token budget, longest first (padding stays small); the model body runs once
per batch and the output head in chunks of positions (`teacher.sparse_topk_forward`/`sampled_forward`),
so no [tokens x vocab] matrix of the whole batch is ever held. A batch that runs out of memory is
halved and run again (`halving_on_oom`). Every sparsity is exact here, sampled draws included.

`Selection` is that batching and selection over any `TeacherForward` (a body and an output head): vLLM's
hidden-state mode runs its body through the same object, so both engines batch, draw and select alike.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import transformers

from logitstore.format.samples import SparseSamples, concat
from logitstore.pipelines import sparsify
from logitstore.pipelines.engines.base import Engine, EngineError, Generator, HandOver
from logitstore.pipelines.engines.shared import cut_at_stop, halving_on_oom, stop_token_ids, token_budget_batches
from logitstore.pipelines.teacher import Teacher, TeacherForward, load_teacher


def resolved_device(device: str) -> str:
    return device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def dtype_for(dtype: str, device: str) -> str:
    """`auto`: bfloat16 on a GPU, float32 on CPU (`teacher.load_teacher`'s rule)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if resolved_device(device).startswith("cuda") else "float32"


class TorchEngine(Engine):
    """The torch engine behind the engine interface (`base.Engine`)."""

    name = "torch"
    live = "process"  # live mode: a teacher process per rank holds the model

    @classmethod
    def samples(cls, settings) -> bool:
        return True

    @classmethod
    def check(cls, settings, spec) -> None:
        if resolved_device(settings.device).startswith("cuda") and not torch.cuda.is_available():
            raise EngineError(f"--device {settings.device}: this torch build sees no CUDA device")

    @classmethod
    def resolved_dtype(cls, settings) -> str:
        return dtype_for(settings.dtype, settings.device)

    @classmethod
    def gpus_per_worker(cls, settings) -> int:
        return 1 if resolved_device(settings.device).startswith("cuda") else 0

    @classmethod
    def version(cls) -> str:
        return f"torch {torch.__version__}, transformers {transformers.__version__}"

    def __init__(
        self, settings, *, lock: threading.Lock, hand_over: HandOver | None = None
    ):  # nothing handed over: it scores the answers itself
        self.settings = settings
        self.teacher: Teacher | None = load_teacher_once(
            settings.teacher_spec, resolved_device(settings.device), self.resolved_dtype(settings)
        )
        self.spec, self.vocab_size, self.device = self.teacher.spec, self.teacher.vocab_size, self.teacher.model.device
        self.selection: Selection | None = Selection(
            TeacherForward.of_model(self.teacher.model), settings=settings, lock=lock, device=self.device
        )

    def compute(
        self, sample_ids: list[str], tokens: list[np.ndarray], *, seed: int, keep: list | None = None, on_batch=None
    ) -> SparseSamples:
        """Longest samples first (the part's row order); `on_batch(tokens)` after every batch."""
        assert self.selection is not None, "the engine is closed"
        return self.selection.compute(sample_ids, tokens, seed=seed, keep=keep, on_batch=on_batch)

    def close(self) -> None:
        """Drops this engine's references to the teacher: its memory goes back unless `shared_teachers()`
        keeps it for the next build. Idempotent."""
        self.selection = None
        self.teacher = None
        _free_cache()


class Selection:
    """The torch engine's batches and selection over a `TeacherForward`: samples batched by token budget,
    longest first; one generator per call, seeded, so draws depend on the seed and the batches only; the
    body and the selection in stored types run on the teacher's device under `lock` (the teacher's share),
    and only the selected entries come back (`sparsify.on_device`, `sparsify.to_host`).

    A queue of depth `IN_FLIGHT`: a batch's forward pass and copy to the host are launched before the host
    reads the batches before it, so on a GPU the next forward passes are queued while the host turns the
    last one's entries into samples, and a host held up for a moment (its cores busy compressing other
    units) does not leave the device idle."""

    def __init__(self, forward: TeacherForward, *, settings, lock: threading.Lock, device: torch.device):
        self.forward, self.settings, self.lock, self.device = forward, settings, lock, device
        # One call launches at a time, all its batches; the next call's launches queue behind its last.
        # Calls launching side by side would interleave their batches on the device and finish together,
        # and then write together while the device waits; one after another, each call's host work runs
        # beside the next call's forward passes.
        self.turn = threading.Lock()

    def compute(
        self, sample_ids: list[str], tokens: list[np.ndarray], *, seed: int, keep: list | None = None, on_batch=None
    ) -> SparseSamples:
        lengths = np.array([len(t) for t in tokens])
        order = np.argsort(-lengths, kind="stable")
        generator = None
        if self.settings.stored.sampled:  # one generator per call: draws depend on the seed and the batches only
            generator = torch.Generator(device=self.device).manual_seed(seed)
        run = functools.partial(self._launch, generator=generator)
        launched: deque[_Launched] = deque()
        parts = []
        with self.turn:
            for rows in token_budget_batches(lengths[order], order, budget=self.settings.batch_tokens):
                batch: list[_Launched] = halving_on_oom(
                    run,
                    [sample_ids[i] for i in rows],
                    [tokens[i] for i in rows],
                    None if keep is None else [keep[i] for i in rows],
                    on_oom=_free_cache,
                    join=_joined,
                )
                launched.extend(batch)
                while len(launched) > IN_FLIGHT:  # the batches launched last stay in flight while the host reads older
                    parts.append(self._finish(launched.popleft(), on_batch))
        while launched:
            parts.append(self._finish(launched.popleft(), on_batch))
        return concat(parts)

    def _launch(
        self, sample_ids: list[str], tokens: list[np.ndarray], keep: list | None, *, generator
    ) -> list[_Launched]:
        lengths = np.array([len(t) for t in tokens])
        ids, mask = right_padded(tokens, lengths)
        head_on = None
        if keep is not None:  # chat data: the head runs on the kept positions only
            head_on = torch.zeros((len(tokens), lengths.max() - 1), dtype=torch.bool)
            for row, k in enumerate(keep):
                head_on[row, : len(k)] = torch.from_numpy(k.astype(bool))
        with self.lock:  # the teacher's share: forward, selection and the copy's launch, back to back on its stream
            selected = sparsify.forward_selected(
                self.forward,
                ids,
                mask,
                lengths=lengths,
                sparsity=self.settings.stored,
                generator=generator,
                keep=head_on,
            )
            host = sparsify.to_host(selected)
        return [_Launched(host, sample_ids, lengths, tokens)]

    def _finish(self, launched: _Launched, on_batch) -> SparseSamples:
        samples = launched.host.samples(
            sample_ids=launched.sample_ids,
            lengths=launched.lengths,
            input_ids=launched.tokens,
            sparsity=self.settings.stored,
        )
        if on_batch is not None:
            on_batch(int(launched.lengths.sum()))
        return samples


# Batches launched and not yet read by the host. Two: one batch's wait for the host (a few ms when the
# writer's threads hold the cores) is covered by the other's forward pass; a third would only hold
# another batch's selected entries (pinned, ~0.5 MB at 4096 tokens x 16 entries) on the host.
IN_FLIGHT = 2


@dataclass
class _Launched:
    """A batch whose selection is on its way to the host, and its rows."""

    host: sparsify.HostSelected
    sample_ids: list[str]
    lengths: np.ndarray
    tokens: list[np.ndarray]


def _joined(halves: list[list[_Launched]]) -> list[_Launched]:
    return [launched for half in halves for launched in half]


def right_padded(tokens: list[np.ndarray], lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) int64 [rows, longest] of samples right-padded with zeros: one numpy scatter,
    10 us for 8 rows of ~500 tokens where a torch copy per row took 45."""
    width = int(lengths.max())
    mask = np.arange(width)[None, :] < lengths[:, None]
    ids = np.zeros(mask.shape, dtype=np.int64)
    ids[mask] = np.concatenate(tokens)
    return torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))


def _free_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# Inside `shared_teachers()`: the last teacher loaded, by (spec, device, dtype); None outside.
_shared: dict | None = None


@contextlib.contextmanager
def shared_teachers():
    """Builds and benchmarks inside this block share the teacher they load (teachers are read-only), so
    repeated builds in one process (the tests, a notebook, a benchmark's variants) load it once. One
    teacher at a time: it holds hundreds of MB to GBs. Outside the block every engine loads its own and
    drops it with the engine; the tests run inside one (`tests/conftest.py`)."""
    global _shared
    outer = _shared
    _shared = {} if outer is None else outer
    try:
        yield
    finally:
        _shared = outer


def load_teacher_once(spec, device: str, dtype: str):
    """The teacher, from `shared_teachers()`'s when it holds this one. `dtype` "auto": `load_teacher`'s
    rule (bfloat16 on GPU, float32 on CPU)."""
    dtype = dtype_for(dtype, device)
    key = (spec, device, dtype)
    if _shared is not None and key in _shared:
        return _shared[key]
    teacher = load_teacher(spec, device=device, dtype=getattr(torch, dtype))
    if _shared is not None:
        _shared.clear()
        _shared[key] = teacher
    return teacher


# -- generation (`build --generate`) ----------------------------------------------------------------


class TorchGenerator(Generator):
    """Answers by Hugging Face `generate` on this process's device: prompts left-padded and batched by
    token budget (prompt plus `max_new_tokens` per row), longest first.

    Sampling is the Gumbel-max trick over noise that is a hash of (the answer's seed, the step, the
    token id) (`seeded_uniform`): `generate` runs greedy over the tempered, top-p-cut logits plus that
    noise, which draws from the same distribution as multinomial sampling, with no random state shared
    between rows. So an answer depends on its seed and its prompt only: the same seed gives the same
    answer in any batch, up to the float rounding of the logits themselves, which padding and batch
    shape can move (a near-tie can then flip). Temperature 0 is greedy decoding."""

    def __init__(self, settings, *, spec, shares_teacher: bool, hand_over: HandOver | None = None):
        device, dtype = resolved_device(settings.device), dtype_for(settings.dtype, settings.device)
        if shares_teacher:  # inside `shared_teachers()`, the teacher's engine and this share one load
            self.teacher: Teacher | None = load_teacher_once(spec, device, dtype)
        else:
            self.teacher = load_teacher(spec, device=device, dtype=getattr(torch, dtype))
        model = self.teacher.model
        self.stop_ids = stop_token_ids(model.generation_config, model.config)
        if not self.stop_ids:
            raise EngineError(f"generator {spec.name!r}: its generation config names no eos_token_id to stop at")
        self.batch_tokens = settings.batch_tokens

    def generate(
        self, prompts: list[np.ndarray], seeds: list[int], *, max_new_tokens: int, temperature: float, top_p: float
    ) -> list[np.ndarray]:
        assert self.teacher is not None, "the generator is closed"
        lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        order = np.argsort(-lengths, kind="stable")
        out: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(prompts)
        for rows in token_budget_batches(lengths[order] + max_new_tokens, order, budget=self.batch_tokens):
            answers = self._batch(
                [prompts[i] for i in rows], [seeds[i] for i in rows], max_new_tokens, temperature, top_p
            )
            for i, answer in zip(rows.tolist(), answers):
                out[i] = answer
        return out

    def _batch(self, prompts, seeds, max_new_tokens: int, temperature: float, top_p: float) -> list[np.ndarray]:
        assert self.teacher is not None, "the generator is closed"
        model = self.teacher.model
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.stop_ids[0], dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # one copy per prompt (left padding)
            ids[row, width - len(prompt) :] = torch.from_numpy(np.asarray(prompt, dtype=np.int64))
            mask[row, width - len(prompt) :] = 1
        sampler = SeededSampler(seeds, width=width, temperature=temperature, top_p=top_p, device=model.device)
        config = transformers.GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=self.stop_ids, pad_token_id=self.stop_ids[0]
        )
        with torch.inference_mode():
            generated = model.generate(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                generation_config=config,
                logits_processor=transformers.LogitsProcessorList([sampler]),
            )
        new = generated[:, width:].cpu().numpy()
        return [cut_at_stop(row, self.stop_ids) for row in new]

    def close(self) -> None:
        self.teacher = None
        _free_cache()


class SeededSampler(transformers.LogitsProcessor):
    """Turns greedy decoding into sampling at `temperature` within the top-`top_p` nucleus: the scores
    become tempered logits (outside the nucleus -inf) plus Gumbel noise from each row's seed and the step."""

    def __init__(self, seeds: list[int], *, width: int, temperature: float, top_p: float, device):
        self.seeds = torch.tensor(seeds, dtype=torch.int64, device=device)
        self.width, self.temperature, self.top_p = width, temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0:
            return scores
        logits = scores.float() / self.temperature
        if self.top_p < 1:
            logits = nucleus(logits, top_p=self.top_p)
        step = input_ids.shape[1] - self.width
        uniform = seeded_uniform(self.seeds, step=step, vocab=logits.shape[-1])
        return logits + (-torch.log(-torch.log(uniform))).float()


def nucleus(logits: torch.Tensor, *, top_p: float) -> torch.Tensor:
    """`logits` with every id outside the smallest set whose probability reaches `top_p` at -inf (the
    most likely id always stays)."""
    ordered, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    outside = torch.cumsum(probs, dim=-1) - probs >= top_p  # the mass before an id already reaches top_p
    return logits.scatter(-1, order, ordered.masked_fill(outside, float("-inf")))


_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # a 32-bit integer hash's multiplier: products stay below 2**59, inside int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit values (in int64), each output bit depending on every input bit."""
    x = (((x >> 16) ^ x) * _MIX) & _M32
    x = (((x >> 16) ^ x) * _MIX) & _M32
    return (x >> 16) ^ x


def seeded_uniform(seeds: torch.Tensor, *, step: int, vocab: int) -> torch.Tensor:
    """float64 [rows, vocab] in (0, 1): a hash of (row's seed, step, token id), the same on any device
    and in any batch. 32 bits per draw: each id's Gumbel noise has 2**32 levels."""
    base = _mix32((seeds & _M32) ^ ((step * 0x9E3779B9) & _M32))
    ids = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    x = _mix32(_mix32(base[:, None] ^ ids[None, :]) ^ base[:, None])
    return (x.double() + 0.5) / 2.0**32
