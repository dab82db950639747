"""logitstore inside Hugging Face `transformers.Trainer`: `DistillationTrainer` trains any causal LM from a
store version with the same stream and the same loss code as `logitstore train`, so a Trainer user keeps
its callbacks, logging (`report_to`), checkpointing and accelerate/DeepSpeed/FSDP configurations.

    from transformers import AutoModelForCausalLM, TrainingArguments
    from logitstore.hf import DistillationTrainer

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

`evaluate()` measures the held-out split (`eval_kl`, `eval_ce`), as `logitstore eval` does.

TRL: `DistillationSFTTrainer` (`hf_trl.py`, `pip install 'logitstore[hf]'`) is the same on TRL's
`SFTTrainer`. Not done yet (README): live teachers, resuming a Trainer checkpoint at the same data position.
"""

from __future__ import annotations

from transformers import Trainer

import logitstore
from logitstore.errors import LogitstoreError
from logitstore.trainer.attention import ATTENTION
from logitstore.trainer.attention import register as register_attention
from logitstore.trainer.losses import LossConfig
from logitstore.trainer.objective import batch_loss, held_out_metrics, student_outputs


class StoreDistillation:
    """What `DistillationTrainer` and `DistillationSFTTrainer` add to their Trainer: the store's stream as
    the training data and logitstore's loss; mixed in before the Trainer class."""

    def __init__(self, model, args, *, store: str, version: str | None = None, seq_len: int = 1024,
                 loss: str | LossConfig = "forward_kl", teacher: str | None = None, eval_fraction: float = 0.05,
                 memory_budget: int | str | None = None, train_on: str = "completion", **trainer_kwargs):
        if args.max_steps is None or args.max_steps <= 0:
            raise LogitstoreError("DistillationTrainer needs TrainingArguments(max_steps=N): the stream is endless")
        self.loss_config = loss if isinstance(loss, LossConfig) else LossConfig(kind=loss)
        self.view = logitstore.open(store, version)
        self.stream_options = dict(seq_len=seq_len, teacher=teacher, eval_fraction=eval_fraction,
                                   memory_budget=memory_budget, train_on=train_on)
        register_attention()
        model.config._attn_implementation = ATTENTION  # packed rows: segments attend within themselves
        self._parts: dict[str, list[float]] = {}
        super().__init__(model=model, args=args, **trainer_kwargs)

    def get_train_dataloader(self):
        """The store's stream, one packed micro-batch per item. Not passed through accelerate: the stream
        shards by rank itself, and its batches are whole (a `PackedBatch` is no dict of tensors)."""
        self.stream = logitstore.stream(self.view, micro_batch=self.args.per_device_train_batch_size,
                                        seed=self.args.seed, **self.stream_options)
        return _Batches(self.stream, steps=self.args.max_steps * self.args.gradient_accumulation_steps)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        batch = inputs["packed"]
        loss, parts = batch_loss(student_outputs(model, batch, self.args.device), batch, self.loss_config,
                                 device=self.args.device)
        for key in ("kd", "ce"):
            self._parts.setdefault(key, []).append(parts[key])
        return (loss, None) if return_outputs else loss

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """The held-out split (`eval_fraction` of sample ids, as `logitstore train` holds out): the mean
        forward KL to the teacher (`eval_kl`) and CE (`eval_ce`) over its supervised positions, the same
        numbers as `logitstore eval`. Trainer's own evaluation loop and `eval_dataset` are not used."""
        model = self.model
        was_training = model.training
        model.eval()
        with logitstore.stream(self.view, micro_batch=self.args.per_device_eval_batch_size, seed=self.args.seed,
                               split="eval", **self.stream_options) as batches:
            measured = held_out_metrics(model, batches, self.loss_config, device=self.args.device)
        model.train(was_training)
        metrics = {f"{metric_key_prefix}_{key.removeprefix('eval_')}": value for key, value in measured.items()}
        self.log(metrics)
        return metrics

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "loss" in logs:  # training logs: the mean KD and CE since the last one, beside Trainer's loss
            for key, values in self._parts.items():
                if values:
                    logs[key] = sum(values) / len(values)
            self._parts = {}
        super().log(logs, *args, **kwargs)


class DistillationTrainer(StoreDistillation, Trainer):
    """A `transformers.Trainer` whose training data and loss come from a logitstore store version."""


def __getattr__(name: str):
    """`DistillationSFTTrainer` is made on first use: it needs TRL, which plain Trainer users need not install."""
    if name == "DistillationSFTTrainer":
        from logitstore.hf_trl import DistillationSFTTrainer

        return DistillationSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Batches:
    """What Trainer iterates: `{"packed": PackedBatch}` items, `steps` of them (Trainer asks for a length)."""

    def __init__(self, stream, *, steps: int):
        self.stream, self.steps = stream, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for i, batch in enumerate(self.stream):
            if i >= self.steps:
                return
            yield {"packed": batch}
