"""The teachers' signal, as the training loop takes it: which teachers (`plan_sources`), and how their
distributions reach the student, from a store version (`StoreSignal`) or from a live teacher beside the rank
(`LiveSignal`, live/). Both give the loop the same things (version id, sources, the stream, the final
tokenizer), so everything after the hand-over is one path.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from logitstore.live.stream import live_stream
from logitstore.live.teacher import InRankTeacher, LiveTeacher, plan_live_samples, start_teacher
from logitstore.store.store import Store
from logitstore.streaming.mixing import WeightedTeacher, resolve_sources, student_vocabulary
from logitstore.streaming.stream import store_stream
from logitstore.streaming.version_mix import WeightedVersion, mix_version, shown, snapshot_weights
from logitstore.trainer.config import TrainConfig, TrainConfigError
from logitstore.trainer.losses import DIVERGENCES
from logitstore.trainer.model import student_tokenizer_hash


def plan_sources(view, cfg: TrainConfig):
    """The run's teacher sources and the student's vocabulary (see `logitstore/streaming/mixing.py`)."""

    weights = cfg.data.teacher_weights or {view.teacher_name(cfg.data.teacher): 1.0}
    vocab = student_vocabulary(
        view,
        teachers=list(weights),
        student_tokenizer=cfg.data.student_tokenizer,
        student_hash=student_tokenizer_hash(cfg.student.student),
    )
    sources = resolve_sources(view, weights=weights, vocab=vocab)
    if any(s.cross for s in sources) and not (DIVERGENCES[cfg.loss.kind].cross_tokenizer and cfg.loss.temperature == 1):
        crossing = ", ".join(name for name, d in DIVERGENCES.items() if d.cross_tokenizer)
        raise TrainConfigError(f"a cross-tokenizer teacher supports --loss {crossing} at --kd-temperature 1 only")
    return sources, vocab


class StoreSignal:
    """The teachers' signal from a store version."""

    kind = "store"

    def __init__(self, cfg: TrainConfig):
        assert cfg.data.store is not None  # TrainConfig: a store, or else live mode
        store = Store.open(cfg.data.store)
        # A weighted mix of versions (`--version-weight`): its first version's teachers and tokenizer.
        weights = cfg.data.version_weights
        mix = snapshot_weights(store, weights) if weights else {}
        self.mix = [WeightedVersion(store.read(v), w) for v, w in mix.items()] or None
        self.view = store.read(cfg.data.version) if self.mix is None else self.mix[0].view
        if sum(w.view.index.num_rows for w in self.mix or [WeightedVersion(self.view, 1)]) == 0:
            raise TrainConfigError(f"version {shown(self._pinned())} of {cfg.data.store} holds no samples")
        self.sources, self.vocab = plan_sources(self.view, cfg)
        self.teacher, self.vocab_size = self.sources[0].name, self.vocab.vocab_size
        self.version = self.snapshot = self._pinned()  # what a resumed run reads again

    def _pinned(self) -> str | dict[str, float]:
        """The snapshot id, or for a mix {snapshot id: weight}."""
        return self.view.snapshot_id if self.mix is None else mix_version(self.mix)

    def start(self, cfg: TrainConfig) -> None:
        pass

    def header(self) -> dict:
        return {}

    def stream(self, cfg: TrainConfig, *, rank: int, world_size: int, split: str):
        return make_stream(
            self.view, self.sources, cfg=cfg, rank=rank, world_size=world_size, split=split, versions=self.mix
        )

    def tokenizer(self):
        """The student's tokenizer to save with the final model (a `tokenizers.Tokenizer`), or None."""
        if self.vocab.tokenizer_json is not None:  # a cross-tokenizer student: the store's copy of its tokenizer
            return Tokenizer.from_str(self.vocab.tokenizer_json)
        return self.view.tokenizer(self.teacher)

    def close(self) -> None:
        pass


class LiveSignal:
    """Live mode (`--live-teacher`): a teacher process beside this rank, handing over by shared memory, or
    for a teacher behind a server the rank's own requests (`live.start_teacher`)."""

    kind = "live"

    def __init__(self, cfg: TrainConfig):
        assert cfg.live is not None  # chosen for live mode only
        self.samples = plan_live_samples(cfg.live)
        student_hash = student_tokenizer_hash(cfg.student.student)
        if student_hash is not None and student_hash != self.samples.tokenizer_hash:
            raise TrainConfigError(
                "--live-teacher: the student's tokenizer differs from the teacher's; live mode "
                "needs the same tokenizer (cross-tokenizer students train from a store)"
            )
        self.teacher, self.version, self.vocab_size = (
            self.samples.teacher_name,
            self.samples.fingerprint,
            self.samples.vocab_size,
        )
        self.snapshot = None  # no store: nothing to pin
        self.sources = [WeightedTeacher(self.teacher, 1.0, None)]
        self.engine = cfg.live.engine_options.engine
        self.client: LiveTeacher | InRankTeacher | None = None

    def start(self, cfg: TrainConfig) -> None:
        assert cfg.live is not None  # chosen for live mode only
        self.client = start_teacher(cfg.live, micro_batch=cfg.data.micro_batch, seq_len=cfg.data.seq_len)

    def header(self) -> dict:
        if self.client is None:
            return {"live_teacher_pid": None, "live_engine": self.engine}
        return {
            "live_teacher_pid": self.client.pid,
            "live_transport": self.client.transport,
            "live_engine": self.engine,
        }

    def stream(self, cfg: TrainConfig, *, rank: int, world_size: int, split: str):
        """The live stream; before `start` (no teacher yet), one that checks sizes and cannot be iterated."""
        return live_stream(self.samples, self.client, cfg.stream_spec(rank=rank, world_size=world_size, split=split))

    def tokenizer(self):
        return self.samples.tokenizer.backend_tokenizer

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def make_stream(view, sources, *, cfg: TrainConfig, rank: int, world_size: int, split: str, versions=None):
    """The stream engine over the store: one teacher, several or cross-tokenizer teachers, or a mix of versions."""
    spec = cfg.stream_spec(rank=rank, world_size=world_size, split=split)
    return store_stream(view, spec, sources=sources, versions=versions)
