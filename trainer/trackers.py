"""Where a run's metrics go besides `OUT/metrics.jsonl` (always written): sinks by name, for
`--report-to`. A sink is opened on rank 0 with the run's start record (store, version, teachers,
student) and gets every step record rank 0 logs: every numeric field of it (`loss`, `kd`, `ce`, `lr`,
`grad_norm`, throughput, `eval_*` at an evaluation), at the record's `step`, so a tracker shows the
same numbers as metrics.jsonl. Each sink's package is an optional extra of the same name, imported
only when the sink opens; `check_sinks` refuses a name or a missing package before anything starts
(and before torch is imported: `logitstore train` calls it first)."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import ClassVar

from logitstore.errors import LogitstoreError


class TrackerError(LogitstoreError):
    """A `--report-to` sink that is unknown, whose package is not installed, or that cannot start."""


def scalars(record: dict) -> dict[str, float]:
    """The record's metrics: every numeric field but the step (strings such as `version` are context)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class Sink:
    """One tracker. `package` is what it imports (and `pip install 'logitstore[<name>]'` installs)."""

    package: ClassVar[str]

    @classmethod
    def check(cls, name: str) -> None:
        """Refuse, in one line, what would make the sink fail once training has started."""
        if importlib.util.find_spec(cls.package) is None:
            raise TrackerError(f"--report-to {name} needs the {cls.package} package: pip install 'logitstore[{name}]'")

    def __init__(self, out: Path, *, header: dict):
        raise NotImplementedError

    def write(self, record: dict) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TensorBoard(Sink):
    """Scalars in `OUT/tensorboard/` (`tensorboard --logdir OUT/tensorboard`), one per numeric field."""

    package = "tensorboard"

    def __init__(self, out: Path, *, header: dict):
        from torch.utils.tensorboard import SummaryWriter  # the optional [tensorboard] extra (`check_sinks`)

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))
        self.writer.add_text("run", f"```\n{json.dumps(header, indent=2, default=str)}\n```")

    def write(self, record: dict) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, global_step=record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB(Sink):
    """A Weights & Biases run named after `--out`, its files in `OUT/wandb/`; the project is
    `WANDB_PROJECT` (default logitstore), the start record its config. wandb's own variables apply:
    `WANDB_MODE=offline` writes the run there only (`wandb sync OUT/wandb/offline-run-*` uploads it later);
    online, it needs `wandb login` or `WANDB_API_KEY`."""

    package = "wandb"

    def __init__(self, out: Path, *, header: dict):
        import wandb  # the optional [wandb] extra (`check_sinks`)

        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or "logitstore",
                name=out.resolve().name,
                dir=str(out),
                config=header,
            )
        except wandb.errors.Error as e:  # e.g. no API key online: one line, as any other start-up error
            raise TrackerError(f"--report-to wandb: {e}") from None

    def write(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


class MLflow(Sink):
    """An MLflow run named after `--out` in experiment `MLFLOW_EXPERIMENT_NAME` (default logitstore), on
    the tracking server `MLFLOW_TRACKING_URI` names; the start record becomes its parameters. The extra
    installs the client (mlflow-skinny): a server (`http://...`) needs nothing more, a local
    `sqlite:///path` needs the full mlflow package, and `file:///path` needs `MLFLOW_ALLOW_FILE_STORE=true`
    (mlflow 3 keeps its file store in maintenance)."""

    package = "mlflow"

    @classmethod
    def check(cls, name: str) -> None:
        super().check(name)
        if not os.environ.get("MLFLOW_TRACKING_URI"):  # mlflow's own default, ./mlflow.db, would land in the cwd
            raise TrackerError(
                "--report-to mlflow needs MLFLOW_TRACKING_URI: a tracking server (http://...), "
                "sqlite:///path (full mlflow) or file:///path (with MLFLOW_ALLOW_FILE_STORE=true)"
            )

    def __init__(self, out: Path, *, header: dict):
        # The client, not mlflow's module-level active run: nothing global changes in the training process
        from mlflow.entities import Param  # the optional [mlflow] extra (`check_sinks`)
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            self.client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "logitstore"
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment_id, run_name=out.resolve().name).info.run_id
        except MlflowException as e:
            raise TrackerError(f"--report-to mlflow: {e.message}") from None
        params = [Param(k, v if isinstance(v, str) else json.dumps(v, default=str)) for k, v in header.items()]
        self.client.log_batch(self.run_id, params=params)

    def write(self, record: dict) -> None:
        from mlflow.entities import Metric  # imported once already, by __init__

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, record["step"]) for key, value in scalars(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


SINKS: dict[str, type[Sink]] = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def check_sinks(names) -> None:
    """Refuse an unknown sink, one whose package is missing or one that lacks its settings, before anything
    starts. Imports nothing heavy: the command line calls it before torch."""
    for name in names:
        if name not in SINKS:
            raise TrackerError(f"--report-to {name!r}: one of {', '.join(SINKS)}")
        SINKS[name].check(name)


def open_sinks(names, *, out: Path, header: dict) -> list[Sink]:
    """The sinks, each given the run's start record; if one cannot start, those already open are closed."""
    opened: list[Sink] = []
    try:
        for name in names:
            opened.append(SINKS[name](out, header=header))
    except BaseException:
        for sink in opened:
            sink.close()
        raise
    return opened
