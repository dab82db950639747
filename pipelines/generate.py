"""`build --generate N`: prompts in, answers written by a generator, then scored by the teacher.

A prompt (`--prompt-column`: plain text, tokenized as text input is; `--chat-column`: a conversation
that ends with a user turn, rendered by the teacher's chat template with its generation prompt)
becomes `--samples-per-prompt` answers, each a sample `PROMPTID/gN` of the prompt's tokens then the
answer's (`logitstore.store.generation`), whose loss mask marks the answer alone: the teacher's entries are
kept for the answer's positions only, through the chat data's machinery (`TeacherMeta.loss_mask`
"completion").

The generator is the teacher itself (nothing given), or a model (a folder, a Hub id, a `logitstore
train` run's `RUN/final`), run by the build's engine (`engines.generator_class`), or a served model
(`--generator-url`: the server engine's `ServerGenerator`, checked here before anything is written, which
must tokenize as the teacher). A model of another tokenizer than the teacher's takes the prompt in its own
tokens (its own chat template), and its answer reaches the teacher as text (`retokenize`), as it does
every student tokenizer of the build (`--student-tokenizer`). It runs in the planner (`plan.plan_units`), ahead of the teacher, on the answers the branch does
not hold: what is stored, by id, is skipped before anything is generated, so a resumed build
generates no answer twice.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from logitstore.errors import LogitstoreError
from logitstore.pipelines import align
from logitstore.pipelines.config import BuildConfig, BuildError
from logitstore.pipelines.engines import generator_class
from logitstore.pipelines.engines.base import HandOver
from logitstore.pipelines.engines.settings import WorkerSettings
from logitstore.pipelines.inputs import Document
from logitstore.pipelines.retokenize import AnswerText, Prompt, stop_text
from logitstore.store.generation import answer_id, answer_source_hash, generation_id, prompt_record, seed_of
from logitstore.store.meta import RUN_MARKER
from logitstore.text import chat

# Prompts per generator call at most: a larger group lets the generator sort more prompts by length, and
# each answer waits for its group's longest.
PROMPT_GROUP = 64


class GenerationCounts(Protocol):
    """What generation adds to the build's summary."""

    prompts: int
    answers: int
    generated_tokens: int
    answers_cut: int
    answers_retokenized: int
    answers_empty: int


@dataclass
class Generated:
    """What the planner has generated so far and the seconds it took (the progress line's tokens/s)."""

    tokens: int = 0
    seconds: float = 0.0


class Generation:
    """One build's generation: who generates, with which settings (`record`, stored with the answers),
    and the generator itself, loaded on first use (in the planner, before the first unit: a generator
    that cannot load fails the build before anything is written)."""

    def __init__(self, cfg: BuildConfig, *, teacher, settings: WorkerSettings, hand_over: HandOver | None = None):
        assert cfg.generate is not None, "a Generation is made for build --generate"
        self.cfg, self.teacher, self.max_new_tokens = cfg, teacher, cfg.generate
        # the build's settled settings: a generator that is the teacher's server takes its K and check from them
        self.settings = settings
        self.hand_over = hand_over  # what a generator sharing the teacher scores for the build's engine
        # the generator's tokenizer where it is not the teacher's; answers are carried as text then (`text`)
        self.tokenizer = None
        if cfg.generator_urls:  # checked now, before anything is written: one line and exit 2 on failure
            self.spec = teacher.spec
            self.settings, generator = _served_generator(cfg, settings=settings, teacher=teacher)
        else:
            self.spec, generator, self.tokenizer = _describe_generator(cfg.generator, teacher=teacher)
        if self.tokenizer is not None and cfg.chat_column and not getattr(self.tokenizer, "chat_template", None):
            raise BuildError(
                f"--generator {cfg.generator}: its tokenizer is not the teacher's and has no chat template to "
                "render --chat-column prompts with"
            )
        self.record: dict[str, Any] = {
            "generator": generator,
            "engine": settings.engine,
            "max_new_tokens": cfg.generate,
            "temperature": cfg.generation_temperature,
            "top_p": cfg.generation_top_p,
            "seed": cfg.seed,
            "round": cfg.generation_round,
        }
        if self.tokenizer is not None:  # only then: the ids of generations of the teacher's tokenizer stay
            self.record["crosses_tokenizers"] = True
        self.record["id"] = generation_id(self.record)
        self.generated = Generated()
        self._generator = None
        self.text: AnswerText | None = None  # answers carried as text (`carry_as_text`)

    @property
    def id(self) -> str:
        return self.record["id"]

    @property
    def prompts_per_call(self) -> int:
        return prompts_per_call(self.cfg)

    def generator(self):
        if self._generator is None:
            cfg, settings = self.cfg, dataclasses.replace(self.settings, teacher_spec=self.spec)
            engine = "server" if cfg.generator_urls else cfg.engine
            # the teacher's loaded weights (or its server's answers' scores) are shared with an engine in
            # this process only
            shares = cfg.generator is None and not cfg.generator_urls and cfg.workers == 1 and not cfg.ray_address
            try:
                self._generator = generator_class(engine)(
                    settings, spec=self.spec, shares_teacher=shares, hand_over=self.hand_over if shares else None
                )
            except (LogitstoreError, OSError, ValueError, RuntimeError) as e:
                raise BuildError(f"generator {self.spec.name!r} cannot load: {_one_line(e)}") from None
        return self._generator

    def close(self) -> None:
        if self._generator is not None:
            self._generator.close()
            self._generator = None

    # -- prompts ------------------------------------------------------------------------------------

    def carry_as_text(self, tokenizer, students) -> None:
        """Answers go to the teacher (`tokenizer`) and the build's student tokenizers as text
        (`retokenize`) where the generator's tokenizer is not the teacher's or there are students."""
        if self.tokenizer is None and not students:
            return
        stops = [] if self.tokenizer is None else _model_stop_ids(self.teacher.spec)
        self.text = AnswerText(
            teacher=tokenizer,
            generator=self.tokenizer,
            generator_hash=self.record["generator"]["tokenizer_hash"],
            teacher_stop=stop_text(tokenizer, stops),
            students=list(students),
            special_tokens=not self.cfg.chat_column,
        )

    def prompt_tokens(self, tokenizer, docs: list[Document]) -> list[Prompt]:
        """Each prompt's teacher tokens (and the generator's, where its tokenizer is another); a
        conversation that does not end with a user turn, or a prompt with no room for `--generate`
        tokens in `--max-length`, is refused, naming its row."""
        texts = [self._chat_prompt(tokenizer, doc) for doc in docs] if self.cfg.chat_column else None
        if self.text is not None:
            prompts = self.text.prompts(texts or [doc.text or "" for doc in docs], self._generator_prompts(docs))
        elif texts is not None:
            encoded = [ids for ids, _ in align.encode_with_byte_ends(tokenizer, texts, add_special_tokens=False)]
            prompts = [Prompt(ids, ids) for ids in encoded]
        else:  # an empty prompt is refused where it is read (`inputs`: an empty text column)
            encoded = [np.asarray(ids, np.int64) for ids in tokenizer([doc.text for doc in docs])["input_ids"]]
            prompts = [Prompt(ids, ids) for ids in encoded]
        room = self.cfg.max_length - self.max_new_tokens
        for doc, prompt in zip(docs, prompts):
            if len(prompt.ids) > room:
                raise BuildError(
                    f"prompt {doc.id!r} (input row {doc.row}) has {len(prompt.ids)} tokens; with --generate "
                    f"{self.cfg.generate} and --max-length {self.cfg.max_length} a prompt may have {room}"
                )
        return prompts

    def _generator_prompts(self, docs: list[Document]) -> list[np.ndarray] | None:
        """The generator's own tokens of each prompt, where its tokenizer is not the teacher's."""
        if self.tokenizer is None:
            return None
        if self.cfg.chat_column:
            texts = [self._chat_prompt(self.tokenizer, doc) for doc in docs]
            return self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return self.tokenizer([doc.text for doc in docs])["input_ids"]

    def _chat_prompt(self, tokenizer, doc: Document) -> str:
        messages = doc.messages or []
        if not messages or messages[-1]["role"] != "user":
            last = messages[-1]["role"] if messages else "nothing"
            raise BuildError(
                f"prompt {doc.id!r} (input row {doc.row}): a conversation to answer must end with a user "
                f"turn, this one ends with {last}"
            )
        try:
            return chat.render_prompt(tokenizer, messages)
        except chat.ChatError as e:
            raise BuildError(f"prompt {doc.id!r} (input row {doc.row}): {e}") from None

    def prompt_of(self, doc: Document) -> dict:
        """The prompt as given, stored with its answers: the conversation's messages, or the text."""
        return prompt_record(text=doc.text, messages=doc.messages if self.cfg.chat_column else None)

    def answer_documents(self, doc: Document) -> list[Document]:
        """The prompt's answers as documents (id `PROMPTID/gN`, source hash naming this generation),
        before any is generated: what the planner checks against the store."""
        source = answer_source_hash(doc.source_hash, self.id)
        return [
            dataclasses.replace(doc, id=answer_id(doc.id, n), source_hash=source)
            for n in range(self.cfg.samples_per_prompt)
        ]

    # -- answers ------------------------------------------------------------------------------------

    def answer(
        self, wanted: list[tuple[Document, Prompt]], *, counts: GenerationCounts
    ) -> Iterator[tuple[Document, np.ndarray, np.ndarray, dict | None]]:
        """(answer document, prompt + answer tokens, loss mask, the student tokenizers' sides or None)
        for each (answer document, prompt) whose answer holds a token: an empty answer (a served generator
        may send one) would be a sample with nothing supervised; it is counted (`answers_empty`) instead,
        and a resumed build asks for it again."""
        if not wanted:
            return
        cfg = self.cfg
        seeds = [seed_of(cfg.seed, *_prompt_and_sample(doc.id)) for doc, _ in wanted]
        generator = self.generator()  # loaded on first use: not on the clock of tokens/s
        started = time.perf_counter()
        answers = generator.generate(
            [prompt.generator_ids for _, prompt in wanted],
            seeds,
            max_new_tokens=self.max_new_tokens,
            temperature=cfg.generation_temperature,
            top_p=cfg.generation_top_p,
        )
        lengths = np.array([len(a) for a in answers], dtype=np.int64)
        self.generated.tokens += int(lengths.sum())
        self.generated.seconds += time.perf_counter() - started
        counts.answers += len(answers)
        counts.generated_tokens += int(lengths.sum())
        counts.answers_empty += int((lengths == 0).sum())
        wanted, answers = [w for w, n in zip(wanted, lengths) if n], [a for a, n in zip(answers, lengths) if n]
        stop = np.asarray(generator.stop_ids, dtype=np.int64)
        cut_at_n = [_cut(a, stop, self.max_new_tokens) for a in answers]
        counts.answers_cut += sum(cut_at_n)
        if self.text is not None:
            prompts = [prompt for _, prompt in wanted]
            samples = self.text.answers(prompts, answers, stop_ids=generator.stop_ids, max_length=cfg.max_length)
            # an answer whose teacher tokens overflow --max-length is cut there (if not cut at --generate)
            counts.answers_cut += sum(s.cut and not cut for s, cut in zip(samples, cut_at_n))
            counts.answers_retokenized += sum(s.retokenized for s in samples)
            for (doc, _), s in zip(wanted, samples):
                yield doc, s.tokens, s.mask, s.students or None
            return
        for (doc, prompt), answer in zip(wanted, answers):
            mask = np.concatenate([np.zeros(len(prompt.ids), np.uint8), np.ones(len(answer), np.uint8)])
            yield doc, np.concatenate([prompt.ids, np.asarray(answer, dtype=np.int64)]), mask, None


def _cut(answer: np.ndarray, stop: np.ndarray, max_new_tokens: int) -> bool:
    """Whether an answer was cut at --generate: as long as allowed, and not ending at a stop token."""
    return len(answer) >= max_new_tokens and not np.isin(answer[-1:], stop).any()


def prompts_per_call(cfg: BuildConfig) -> int:
    """Prompts answered by one generator call: enough for a teacher batch or a unit, whichever is
    larger, at the longest a sample may be (so the first unit comes after one call, and a killed
    build loses at most about a unit of answers); at most `PROMPT_GROUP`. A dry run measures one call."""
    per_prompt = cfg.max_length * cfg.samples_per_prompt
    return max(1, min(PROMPT_GROUP, max(cfg.batch_tokens, cfg.unit_tokens) // per_prompt))


def _prompt_and_sample(sample_id: str) -> tuple[str, int]:
    prompt, _, sample = sample_id.rpartition("/g")
    return prompt, int(sample)


def _describe_generator(generator: str | None, *, teacher) -> tuple:
    """(the generator's `TeacherSpec`, what the store records of it, its tokenizer where it is not the
    teacher's, else None): the teacher's, or the model's."""
    from logitstore.pipelines.teacher import describe_teacher  # torch (2.7 s): build imports this module early

    if generator is None:
        info = teacher
    else:
        try:
            info = describe_teacher(generator)
        except Exception as e:  # a missing folder, a config or tokenizer that does not load: one line, exit 2
            raise BuildError(f"--generator {generator}: cannot load: {_one_line(e)}") from None
    run, step = _run_and_step(Path(info.spec.path)) if generator is not None else (None, None)
    recorded = {
        "name": info.spec.name,
        "source": None if generator is None else str(generator),
        "content_hash": info.content_hash,
        "tokenizer_hash": info.tokenizer_hash,
        "run": run,
        "step": step,
    }
    return info.spec, recorded, None if info.tokenizer_hash == teacher.tokenizer_hash else info.tokenizer


def _model_stop_ids(spec) -> list[int]:
    from logitstore.pipelines.teacher import model_stop_ids  # torch (2.7 s): build imports this module early

    return model_stop_ids(spec)


def _served_generator(cfg: BuildConfig, *, settings: WorkerSettings, teacher) -> tuple[WorkerSettings, dict]:
    """A served generator (`--generator-url`) checked once (its preflight): the settings its `ServerGenerator`
    is built from (the replicas, what the check found), and what the store records of it: the served
    model's name and the server, the URLs without credentials; the key is in no record."""
    # engines load on use (their registry): only a served generator needs this one, with its HTTP clients
    from logitstore.pipelines.engines.server.preflight import generator_preflight

    settings = dataclasses.replace(settings, server_urls=cfg.generator_urls)
    served = generator_preflight(settings, teacher.spec)
    return dataclasses.replace(settings, checked=served), {
        "name": served.model,
        "source": None,
        "content_hash": None,
        "tokenizer_hash": teacher.tokenizer_hash,  # the preflight found the server tokenizes as the teacher
        "run": None,
        "step": None,
        "server": served.record(),
    }


def _run_and_step(folder: Path) -> tuple[str | None, int | None]:
    """A `logitstore train` run's `RUN/final`: the run's folder and the step its final model is from."""
    run = folder.resolve().parent
    if folder.resolve().name != "final" or not (run / RUN_MARKER).is_file():
        return None, None
    try:
        step = json.loads((run / "final_metrics.json").read_text()).get("step")
    except (OSError, ValueError):
        step = None
    return str(run), None if step is None else int(step)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300] or type(error).__name__
