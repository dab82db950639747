"""The Hugging Face integration is part of the trainer (stage two): `logitstore.trainer.hf`
(`DistillationTrainer`) and `logitstore.trainer.hf_trl` (`DistillationSFTTrainer`). Importing this
module raises an `ImportError` that names them, since the library (logitstore/) imports neither stage."""

raise ImportError(
    "logitstore.hf moved to logitstore.trainer.hf: `from logitstore.trainer.hf import DistillationTrainer` "
    "(TRL: `from logitstore.trainer.hf_trl import DistillationSFTTrainer`)"
)
