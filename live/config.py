"""`LiveConfig`: what `logitstore train --live-teacher` needs from stage one, its teacher, input, sparsity
and engine options, declared once as build declares them (`pipelines/config.py`) and offered on
`logitstore train`'s "Live mode" panel. `TrainConfig.live` holds one; `live/teacher.py` runs it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from logitstore.errors import LogitstoreError
from logitstore.format.sparsity import Sparsity, SparsityFlags, flags_of, requested
from logitstore.options import declared, from_values, group, option, option_of, refuse_failed, to_values
from logitstore.pipelines.config import BATCH_TOKENS, DataSource, EngineOptions, PlanConfig
from logitstore.pipelines.engines.settings import Dtype

LIVE = "Live mode (instead of --store)"  # the panel of `train --help` that lists live mode's flags


class LiveTeacherError(LogitstoreError):
    """The live teacher cannot start, or stopped during the run."""


def _live_flag(d, *, help: str | None = None):
    """A build flag (input, sparsity, engine) as `train --live-teacher` offers it: build's meaning, None
    when not given."""
    default = f" (default {d.default})" if d.default not in (None, ()) else ""
    flag = dataclasses.replace(d.flag, panel=LIVE, help=help or f"Live mode: as build {d.dashed}{default}.")
    return dataclasses.replace(d, flag=flag, default=None)


@dataclass
class LiveConfig:
    """What `--live-teacher` needs: build's teacher, input, sparsity and engine options."""

    teacher: str | None = option(  # None or "default": the default teacher
        None,
        name="live_teacher",
        panel=LIVE,
        help="Live mode instead of --store: run this teacher (what build --teacher takes, or 'default') beside the trainer, handing over by shared memory (with --engine server: the teacher a server serves, asked by each rank).",
    )
    # build's input flags, declared in `pipelines/config.py` (`DataSource`, `PlanConfig`)
    data: str | None = option_of(
        DataSource,
        "data",
        adjust=partial(_live_flag, help="Live mode: the data, as build --data (default: the shipped corpus)."),
    )
    text_column: str = option_of(PlanConfig, "text_column", adjust=_live_flag)
    id_column: str | None = option_of(PlanConfig, "id_column", adjust=_live_flag)
    max_length: int = option_of(PlanConfig, "max_length", adjust=_live_flag)
    # as asked (`sparsity.requested`): the `Sparsity` the flags name, or the flags (none of --top-k/--top-p/
    # --sample given), which the engine settles (`live.teacher.settle_engine`: sampled 16 for the torch
    # engine, top-K at the server's K for a served teacher), as in build
    sparsity: Sparsity | SparsityFlags = group(
        SparsityFlags, default_factory=SparsityFlags, adjust=_live_flag, exclude=("value_grid",)
    )
    # build's --engine and the server engine's flags: which engine runs the teacher, and where live mode runs
    # it (`live/teacher.py`: a teacher process per rank, or the rank itself for a teacher behind a server)
    engine_options: EngineOptions = group(EngineOptions, default_factory=EngineOptions, adjust=_live_flag)
    batch_tokens: int = BATCH_TOKENS
    device: str = "auto"
    dtype: Dtype = "auto"
    quantize: bool = True
    # what the engine's `settle` found (`WorkerSettings.checked`: a served teacher's preflight), for this
    # process's engines; not a flag, never written
    checked: object = field(default=None, repr=False, compare=False)

    @classmethod
    def from_flags(cls, live_teacher: str | None, **flags: Any) -> LiveConfig | None:
        """`train --live-teacher` and its flags (by name; None: not given); None without --live-teacher,
        where any of these flags is refused (with --store the build fixed them: they would be silently
        ignored)."""
        known = {d.name for d in declared(cls)} - {"live_teacher"}
        assert set(flags) <= known, f"not a live flag: {set(flags) - known}"
        given = {name: value for name, value in flags.items() if value is not None}
        if live_teacher is None:
            if given:
                named = ", ".join(f"--{name.replace('_', '-')}" for name in flags if name in given)
                raise LiveTeacherError(f"{named} only apply with --live-teacher (a store's build fixed them)")
            return None
        sparsity_flags = {
            name: given.pop(name) for name in ("top_k", "top_p", "sample", "temperature") if name in given
        }
        engine_flags = {d.name: given.pop(d.name) for d in declared(EngineOptions) if d.name in given}
        return cls(
            teacher=live_teacher,
            sparsity=SparsityFlags(**sparsity_flags),
            engine_options=from_values(EngineOptions, engine_flags),
            **given,
        )

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> LiveConfig | None:
        """The `live` group of `TrainConfig`, from its flags' values."""
        values = dict(values)
        return cls.from_flags(values.pop("live_teacher", None), **values)

    @staticmethod
    def values_of(live: LiveConfig | None) -> dict[str, Any]:
        """The flags that make `live` (None: no live mode, every live flag not given)."""
        if live is None:
            return {d.name: None for d in declared(LiveConfig)}
        values = to_values(live)
        values.update(dataclasses.asdict(flags_of(live.sparsity)))
        values.pop("value_grid")
        return {**values, "live_teacher": live.teacher or "default"}

    def __post_init__(self) -> None:
        if self.teacher == "default":
            self.teacher = None
        self.sparsity = requested(self.sparsity)
        if self.max_length < 2:
            raise LiveTeacherError(f"--max-length must be at least 2, got {self.max_length}")
        refuse_failed(self.engine_options.engine_checks(), LiveTeacherError)

    def identity(self) -> dict:
        """What a resumed live run must match: not the engine's replicas, key, concurrency or timeout (a
        served teacher may come back elsewhere; the key is never written), nor whether the sparsity was
        the default (the run folder keeps the sparsity it settled on)."""
        out = dataclasses.asdict(self)
        del out["engine_options"], out["checked"]
        if self.engine_options.engine != EngineOptions.engine:  # the default left out: a run without one resumes
            out["engine"] = self.engine_options.engine
        return out
