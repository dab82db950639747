"""Where a run's metrics go besides `OUT/metrics.jsonl` (always written): sinks by name, for
`--report-to`. A sink gets every record rank 0 logs (`step`, the loss parts, throughput, eval numbers)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from logitstore.errors import LogitstoreError


class ReportError(LogitstoreError):
    """A `--report-to` sink that is unknown or whose package is not installed."""


class TensorBoard:
    """Scalars in `OUT/tensorboard/` (`tensorboard --logdir OUT/tensorboard`), one per numeric field."""

    package = "tensorboard"

    def __init__(self, out: Path):
        from torch.utils.tensorboard import SummaryWriter  # the optional [tensorboard] extra (`check_sinks`)

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))

    def write(self, record: dict) -> None:
        if "step" not in record:
            return
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


SINKS = {"tensorboard": TensorBoard}


def check_sinks(names) -> None:
    """Refuse an unknown sink or one whose package is missing, before anything starts."""
    for name in names:
        if name not in SINKS:
            raise ReportError(f"--report-to {name!r}: one of {', '.join(SINKS)}")
        if importlib.util.find_spec(SINKS[name].package) is None:
            raise ReportError(
                f"--report-to {name} needs the {SINKS[name].package} package: pip install 'logitstore[{name}]'"
            )


def open_sinks(names, *, out: Path) -> list:
    return [SINKS[name](out) for name in names]
