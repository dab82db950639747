"""The TRL path: `DistillationSFTTrainer`, TRL's `SFTTrainer` with a store as its data and teacher.

    from trl import SFTConfig
    from logitstore.trainer.hf_trl import DistillationSFTTrainer

    args = SFTConfig(output_dir="run", max_steps=100, per_device_train_batch_size=4, learning_rate=3e-4)
    DistillationSFTTrainer(model, args, store="./chat", seq_len=1024, peft_config=LoraConfig(...)).train()

What TRL brings: `SFTConfig`, PEFT/LoRA (`peft_config` wraps the student), its logging and callbacks,
activation offloading. What logitstore brings, as in `DistillationTrainer`: the training data is the
store's packed stream (chat stores: the completion only, `train_on`), the loss is the sparse KD (+ CE)
of `logitstore train` on the student's hidden states. SFTTrainer insists on a dataset and a tokenizer at
construction: it is given the store's samples as pre-tokenized rows (`input_ids`, read lazily; it reads
one) and, unless `processing_class` is passed, the teacher's tokenizer kept in the store. Its own
dataset preparation, collator and `compute_loss` are then not used for training.

Tested with TRL 1.16.0 (`tests/test_train.py`); TRL's `GKDTrainer` (`trl.experimental.gkd`) and its
own `DistillationTrainer` generate on-policy samples from a live teacher, which a store cannot replace.
"""

from __future__ import annotations

import datasets  # a dependency of TRL
from transformers import PreTrainedTokenizerFast
from trl import SFTTrainer

import logitstore
from logitstore.errors import LogitstoreError
from logitstore.trainer.hf import StoreDistillation


class DistillationSFTTrainer(StoreDistillation, SFTTrainer):
    """TRL's `SFTTrainer` whose training data and loss come from a logitstore store version."""

    def __init__(
        self,
        model,
        args,
        *,
        store: str | None = None,
        version: str | None = None,
        processing_class=None,
        train_dataset=None,
        **kwargs,
    ):
        if store is None:
            raise LogitstoreError(
                "DistillationSFTTrainer reads a store (store=URI); for a live teacher use "
                "logitstore.trainer.hf.DistillationTrainer(live=...)"
            )
        view = logitstore.open(store, version)
        teacher = view.teacher_name(kwargs.get("teacher"))
        if processing_class is None:
            processing_class = _store_tokenizer(view, teacher, eos=_config_eos(model))
        if train_dataset is None:
            train_dataset = _samples_as_rows(store, view.snapshot_id, teacher)
        super().__init__(
            model,
            args,
            store=store,
            version=version,
            processing_class=processing_class,
            train_dataset=train_dataset,
            **kwargs,
        )


def _store_tokenizer(view, teacher: str, *, eos: int | None):
    """The teacher's tokenizer kept in the store, with an end-of-sequence token (SFTTrainer pads with it
    when there is no pad token): the student's own `eos` where the tokenizer has that id, so Trainer,
    which aligns the student's config with the tokenizer, changes nothing (otherwise it would, warning
    `Updated tokens: {'eos_token_id': 0}`); else id 0."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=view.tokenizer(teacher))
    if tokenizer.eos_token is None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(
            eos if eos is not None and 0 <= eos < len(tokenizer) else 0
        )
    return tokenizer


def _config_eos(model) -> int | None:
    """The student's end-of-sequence id (the first, where its config lists several)."""
    eos = getattr(model.config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None


def _samples_as_rows(store: str, snapshot: str, teacher: str):
    """The store's samples as a lazy `datasets.IterableDataset` of `{"input_ids"}` rows."""

    def rows():
        # Imported here: datasets pickles this function (dill) to fingerprint it, and with the module-level
        # name it pickles the package's state too, which holds an Icechunk Storage (TypeError)
        import logitstore

        view = logitstore.open(store, snapshot)
        for sample_id, of in zip(view.index["sample_id"].to_pylist(), view.index["teacher"].to_pylist()):
            if of == teacher:  # one sample per step of this generator: it is read lazily, and only its first row
                yield {"input_ids": view.sample(sample_id, teacher=teacher).input_ids.tolist()}

    return datasets.IterableDataset.from_generator(rows)
