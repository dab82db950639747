"""`train`'s and `eval`'s flags (declared by `TrainConfig`) and how a run's configuration is resolved: the
flags over `--config` over, with `--resume`, the configuration the run kept in its folder.
"""

from __future__ import annotations

from typing import Annotated

import typer

from logitstore.cli.flags import Given, pick, resolve
from logitstore.live.config import LIVE
from logitstore.options import declared, from_values
from logitstore.trainer.config import TrainConfig, TrainConfigError, missing_kept, read_kept

TRAIN_FLAGS = declared(TrainConfig)
# live mode as a switch: the teacher is --live-teacher's, else the default one
LiveOpt = Annotated[
    bool,
    typer.Option(
        "--live",
        help="Live mode: --live-teacher's teacher, else the default one (as --live-teacher default).",
        rich_help_panel=LIVE,
    ),
]
EVAL_FLAGS = pick(
    TRAIN_FLAGS,
    {
        "store": dict(panel=None, required=True, help="Store holding the teacher distributions. Required."),
        "student": dict(panel=None, required=True, help="Trained student directory (e.g. OUT/final). Required."),
        "version": dict(panel=None),
        "teacher": dict(panel=None),
        "seq_len": dict(panel=None),
        "eval_fraction": dict(
            panel=None,
            help="Held-out share, as in training (1: every sample, for a store built from held-out text).",
        ),
        "train_on": dict(panel=None, help="Chat data: measure the completion's tokens only, or prompt+completion."),
    },
)


def train_config(given: Given, *, config: str | None, live: bool = False) -> TrainConfig:
    """`train`'s configuration; with --resume, over the configuration the run kept in its folder (so
    resuming needs --out and --resume only; a flag that changes the run's identity is refused).
    A folder that keeps none resumes from the options given, and if they make no run, says so."""
    values = live_switch(resolve(TRAIN_FLAGS, given, config=config, command="train"), live=live)
    if not values["resume"]:
        return from_values(TrainConfig, values)
    kept = read_kept(values["out"])
    if kept is not None:
        kept_values = resolve(TRAIN_FLAGS, given, config=config, command="train", base=kept)
        return from_values(TrainConfig, live_switch(kept_values, live=live))
    try:
        return from_values(TrainConfig, values)
    except TrainConfigError as e:
        raise TrainConfigError(
            f"--out {values['out']} keeps no run configuration to resume from ({missing_kept(values['out'])}); "
            f"give the run's options as at its start: {e}"
        ) from None


def live_switch(values: dict, *, live: bool) -> dict:
    """`--live` is `--live-teacher default` where no --live-teacher is given."""
    if live and values["live_teacher"] is None:
        return {**values, "live_teacher": "default"}
    return values
