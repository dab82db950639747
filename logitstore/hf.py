"""Moved: the Hugging Face integration is part of the trainer (stage two), `logitstore.trainer.hf`
(`DistillationTrainer`) and `logitstore.trainer.hf_trl` (`DistillationSFTTrainer`). This module only
says so: the library (logitstore/) imports neither stage."""

raise ImportError(
    "logitstore.hf moved to logitstore.trainer.hf: `from logitstore.trainer.hf import DistillationTrainer` "
    "(TRL: `from logitstore.trainer.hf_trl import DistillationSFTTrainer`)"
)
