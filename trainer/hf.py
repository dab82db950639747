"""logitstore inside Hugging Face `transformers.Trainer`: `DistillationTrainer` trains any causal LM from a
store version with the same stream and the same loss code as `logitstore train`, so a Trainer user keeps
its callbacks, logging (`report_to`), checkpointing and accelerate/DeepSpeed/FSDP configurations.

    from transformers import AutoModelForCausalLM, TrainingArguments
    from logitstore.trainer.hf import DistillationTrainer

    model = AutoModelForCausalLM.from_pretrained("path/to/student")
    args = TrainingArguments(output_dir="run", max_steps=100, learning_rate=3e-4, logging_steps=10,
                             per_device_train_batch_size=4)    # rows of seq_len tokens per device
    DistillationTrainer(model, args, store="s3://bucket/distill", version="v1", seq_len=1024).train()

What it does differently from a plain Trainer: the training data is `logitstore.stream(view, ...)`
(packed rows, sharded by `torch.distributed` rank, resumable), handed over whole (no collation, no
accelerate re-sharding); the student runs with the segment attention (`trainer/attention.py`, no L x L
mask) and the loss is `trainer.objective.batch_loss` on its hidden states (the chunked head): `kd` and
`ce` are logged beside `loss`. `args.per_device_train_batch_size` is the micro-batch in rows,
`args.max_steps` is required (the stream is endless), `args.seed` seeds the data order. Chat stores
supervise the assistant's tokens only (`train_on="completion"`, the default) or every token
(`"prompt+completion"`, for a store built with that).

`evaluate()` measures the held-out split (`eval_kl`, `eval_ce`), as `logitstore eval` does. TRL:
`logitstore.trainer.hf_trl.DistillationSFTTrainer` is the same on TRL's `SFTTrainer` (stores only).

Live teacher: `live=LiveConfig(teacher=..., data=...)` instead of `store=` (`live/teacher.py`): the
teacher starts with the first batch and stops on `trainer.close()` (or at the end of a `with` block).

Checkpoints: every Trainer checkpoint also holds `logitstore_stream.json`, the stream's position after
its step (written before Trainer's own files), from which `train(resume_from_checkpoint=...)` continues
the data instead of Trainer's skipping of batches (docs/train.md, "Use it from Python / Trainer / TRL").
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, get_last_checkpoint

import logitstore
from logitstore.errors import LogitstoreError
from logitstore.live.config import LiveConfig
from logitstore.live.stream import live_stream
from logitstore.live.teacher import InRankTeacher, LiveTeacher, plan_live_samples, settle_engine, start_teacher
from logitstore.streaming.spec import StreamSpec
from logitstore.streaming.stream import store_stream
from logitstore.text import TrainOn
from logitstore.trainer.attention import ATTENTION
from logitstore.trainer.attention import register as register_attention
from logitstore.trainer.config import LossConfig, LossName
from logitstore.trainer.objective import batch_loss, held_out_metrics, student_outputs
from logitstore.trainer.run_folder import write_atomic

# The mixin's methods call Trainer's (`self.args`, `super().train`): the type checker sees it as a Trainer,
# while at run time it stays a plain class placed before the Trainer class it is mixed into.
if TYPE_CHECKING:
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class StoreDistillation(_TrainerBase):
    """What `DistillationTrainer` and `DistillationSFTTrainer` add to their Trainer: the store's stream as
    the training data and logitstore's loss; mixed in before the Trainer class."""

    def __init__(
        self,
        model,
        args,
        *,
        store: str | None = None,
        version: str | None = None,
        seq_len: int = 1024,
        loss: LossName | LossConfig = LossConfig.kind,
        teacher: str | None = StreamSpec.teacher,
        eval_fraction: float = StreamSpec.eval_fraction,
        memory_budget: int | str | None = StreamSpec.memory_budget,
        train_on: TrainOn = StreamSpec.train_on,
        live: LiveConfig | None = None,
        **trainer_kwargs,
    ):
        if args.max_steps is None or args.max_steps <= 0:
            raise LogitstoreError("DistillationTrainer needs TrainingArguments(max_steps=N): the stream is endless")
        if (store is None) == (live is None):
            raise LogitstoreError(
                "DistillationTrainer needs exactly one of a store (store=URI) and a live teacher (live=LiveConfig)"
            )
        self.loss_config = loss if isinstance(loss, LossConfig) else LossConfig(kind=loss)
        # The stream's options; micro-batch, seed and split are set per stream from the TrainingArguments.
        self.stream_spec = StreamSpec(
            seq_len=seq_len,
            micro_batch=args.per_device_train_batch_size,
            teacher=teacher,
            eval_fraction=eval_fraction,
            memory_budget=memory_budget,
            train_on=train_on,
        )
        self.signal: LiveData | StoreData
        if live is not None:
            slots = max(args.per_device_train_batch_size, args.per_device_eval_batch_size)
            self.signal = LiveData(live, seq_len=seq_len, micro_batch=slots)
        else:
            assert store is not None  # exactly one of store and live, checked above
            self.signal = StoreData(logitstore.open(store, version))
        register_attention()
        model.config._attn_implementation = ATTENTION  # packed rows: segments attend within themselves
        self._parts: dict[str, list] = {}  # the parts of each micro-batch since the last log, on the device
        self._resume_state: dict | None = None
        self._batches: _Batches | None = None
        super().__init__(model=model, args=args, **trainer_kwargs)

    def close(self) -> None:
        """Stop the live teacher's process (nothing to do for a store). Also when the trainer is used in `with`."""
        self.signal.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> TrainOutput:
        """Trainer's `train`; resuming a checkpoint continues the stream from its `logitstore_stream.json`."""
        if resume_from_checkpoint is True:
            last: str | None = get_last_checkpoint(self.args.output_dir)  # unannotated in transformers
            if last is None:
                raise LogitstoreError(f"no checkpoint to resume in {self.args.output_dir}")
            resume_from_checkpoint = last
        self._resume_state = None
        if resume_from_checkpoint:
            self._resume_state = _read_stream_state(resume_from_checkpoint)
            self.args.ignore_data_skip = True  # the stream resumes itself: Trainer must not skip batches too
        return super().train(resume_from_checkpoint or None, *args, **kwargs)

    def get_train_dataloader(self):
        """The store's stream, one packed micro-batch per item. Not passed through accelerate: the stream
        shards by rank itself, and its batches are whole (a `PackedBatch` is no dict of tensors)."""
        self.stream = self._stream(split="train", micro_batch=self.args.per_device_train_batch_size)
        if self._resume_state is not None:
            self.stream.load_state_dict(self._resume_state)
        self._batches = _Batches(self.stream, steps=self.args.max_steps * self.args.gradient_accumulation_steps)
        return self._batches

    def _stream(self, *, split: str, micro_batch: int):
        spec = dataclasses.replace(self.stream_spec, micro_batch=micro_batch, seed=self.args.seed, split=split)
        return self.signal.stream(spec, args=self.args)

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint plus the stream's position after the step's last batch. The position is
        global (the same on every rank), so the main process writes it."""
        if self.args.should_save and self._batches is not None and self._batches.data_state is not None:
            folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            write_atomic(folder / STREAM_STATE, json.dumps(self._batches.data_state))
        super()._save_checkpoint(model, trial)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        batch = inputs["packed"]
        loss, parts = batch_loss(
            student_outputs(model, batch, self.args.device), batch, self.loss_config, device=self.args.device
        )
        for key in ("kd", "ce"):
            self._parts.setdefault(key, []).append(parts[key])
        return (loss, None) if return_outputs else loss

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """The held-out split (`eval_fraction` of sample ids, as `logitstore train` holds out): the mean
        forward KL to the teacher (`eval_kl`) and CE (`eval_ce`) over its supervised positions, the same
        numbers as `logitstore eval`. Trainer's own evaluation loop and `eval_dataset` are not used."""
        model = self.model
        assert model is not None  # given at construction (no model_init)
        was_training = model.training
        model.eval()
        with self._stream(split="eval", micro_batch=self.args.per_device_eval_batch_size) as batches:
            measured = held_out_metrics(model, batches, self.loss_config, device=self.args.device)
        model.train(was_training)
        metrics = {f"{metric_key_prefix}_{key.removeprefix('eval_')}": value for key, value in measured.items()}
        self.log(metrics)
        return metrics

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "loss" in logs:  # training logs: the mean KD and CE since the last one, beside Trainer's loss
            for key, values in self._parts.items():
                if values:  # read back here, at a logging step, not at every micro-batch
                    logs[key] = float(sum(values) / len(values))
            self._parts = {}
        super().log(logs, *args, **kwargs)


class StoreData:
    """The teacher signal from a store version: its stream, sharded by torch.distributed's rank."""

    def __init__(self, view):
        self.view = view

    def stream(self, spec: StreamSpec, *, args):
        return store_stream(self.view, spec)

    def close(self) -> None:
        pass


class LiveData:
    """The teacher signal from a live teacher (`live/teacher.py`): the data is planned as a build would
    (at construction: it tokenizes the whole data), the teacher process starts on the first stream and
    serves this rank until `close()`. Same order and batches as a store built from the same data."""

    def __init__(self, live: LiveConfig, *, seq_len: int, micro_batch: int):
        self.live, self.seq_len, self.micro_batch = settle_engine(live), seq_len, micro_batch
        self.samples = plan_live_samples(self.live)
        self.client: LiveTeacher | InRankTeacher | None = None

    def stream(self, spec: StreamSpec, *, args):
        if self.client is None:  # slots sized for the larger of the train and eval micro-batches
            self.client = start_teacher(self.live, micro_batch=self.micro_batch, seq_len=self.seq_len)
        placed = dataclasses.replace(spec, rank=args.process_index, world_size=args.world_size)
        return live_stream(self.samples, self.client, placed)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


class DistillationTrainer(StoreDistillation, Trainer):
    """A `transformers.Trainer` whose training data and loss come from a logitstore store version."""


STREAM_STATE = "logitstore_stream.json"


def _read_stream_state(checkpoint: str) -> dict:
    path = os.path.join(checkpoint, STREAM_STATE)
    if not os.path.isfile(path):
        raise LogitstoreError(
            f"{checkpoint} has no {STREAM_STATE}: it was not written by a logitstore trainer, "
            "so the data position to resume from is unknown"
        )
    with open(path) as file:
        return json.load(file)


class _Batches:
    """What Trainer iterates: `{"packed": PackedBatch}` items, `steps` of them (Trainer asks for a length);
    `data_state` is the stream's position after the last batch handed out."""

    def __init__(self, stream, *, steps: int):
        self.stream, self.steps = stream, steps
        self.data_state: dict | None = None

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for i, batch in enumerate(self.stream):
            if i >= self.steps:
                return
            self.data_state = batch.data_state
            yield {"packed": batch}
