"""The run folder (`--out`): which folder a run may take, what `--force` removes, where a resumed run
continues and which store snapshot it reads.

A run marks the folder it takes with `logitstore-run.json` (the format, the run's identity and the store
snapshot it reads) and keeps the configuration it runs with in `config.yaml` (`--resume` starts from it). `--out` may be a new folder, an empty one, or a folder a run marked; a folder that
holds anything else is refused, with or without `--force`: `--force` removes only what a run writes
(`_RUN_ENTRIES`), and a folder without the marker was not made by a run. `plan` decides before any
process starts and writes nothing but the empty folder (taken away again, `unmake`, when the start
fails before the claim); `claim` takes the folder once the run's
configuration has passed the checks that need the store and the student, so a failed start leaves it
as it was. `taken` holds the folder for one launcher (`LOCK`) from `plan` to the run's end: a second
launcher on it is refused while the first runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from logitstore.options import dump
from logitstore.store.meta import RUN_MARKER
from logitstore.store.store import Store
from logitstore.streaming.version_mix import pinned, shown, snapshot_weights
from logitstore.trainer import checkpoint
from logitstore.trainer.config import RUN_CONFIG, TrainConfig, TrainConfigError, kept_values

MARKER = RUN_MARKER
_FORMAT = {"format": "logitstore-run", "format_version": 1}
# The lock of a launcher that holds --out (`held`): flock'ed while it runs, holding its pid; never a run's
# entry (--force leaves it, and a folder that holds it alone counts as empty).
LOCK = "logitstore-run.lock"
# Everything a run writes into --out, and so everything --force may remove.
_RUN_ENTRIES = re.compile(
    r"step-\d+(\.partial)?|final(\.partial)?|final_metrics\.json|training\.png"
    r"|metrics\.jsonl(\.partial)?|logitstore-run\.json(\.partial)?|config\.yaml(\.partial)?"
)
# The previous export: a run that trains or exports again replaces it, so final/ exists only while it
# belongs to the newest checkpoint (that is what makes a resumed finished run a no-op).
_EXPORT_ENTRIES = ("final", "final.partial", "final_metrics.json")


@dataclass(frozen=True)
class RunPlan:
    """What a run does with its folder, decided before any process starts."""

    out: Path
    resume_from: Path | None = None  # the newest complete checkpoint, which a resumed run loads
    # the store snapshot (or mix {snapshot: weight}, `streaming/version_mix.py`) the folder's run pinned,
    # which a resumed run reads
    snapshot: str | dict | None = None
    replace: bool = False  # --force on a marked folder: the old run's entries go when the run claims it
    finished: dict | None = None  # a resumed run that already finished: its final metrics
    made: bool = False  # `plan` made the folder: a start that fails before any write takes it away again
    # the store versions the run has read, in order (with --new-version, the new one last)
    versions: tuple[str | dict, ...] = ()
    new_data: bool = False  # --new-version: the checkpoint's data position is not the new version's

    @property
    def resume_step(self) -> int:
        return checkpoint.step_of(self.resume_from) if self.resume_from is not None else 0


@contextlib.contextmanager
def taken(cfg: TrainConfig, *, lock: bool = True) -> Iterator[RunPlan]:
    """--out for one launch: made if new, `held` by this launcher alone (with `lock`; a torchrun worker
    but the first leaves it to that one) and `plan`ned; a start that fails before the run claims the
    folder takes a folder it made away again (`unmake`)."""
    out = Path(cfg.output.out)
    made = _ensure_writable(out)
    run = None
    try:
        with held(out) if lock else contextlib.nullcontext():
            run = dataclasses.replace(plan(cfg), made=made)
            yield run
    except BaseException:
        if run is not None:
            unmake(run)  # after the lock went: a folder that holds nothing else is empty
        raise


@contextlib.contextmanager
def held(out: Path) -> Iterator[None]:
    """--out for this process alone while the block runs: `LOCK` in it, flock'ed and holding this pid. A
    second launcher is refused in one line naming the first's pid; a lock left by a launcher that died
    (SIGKILL) is stale, its flock gone with it, and is taken over. Removed at the end (the flock goes
    with the descriptor: a launcher that waited for it finds the file gone, and opens the new one)."""
    path = out / LOCK
    descriptor = _lock(path)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(descriptor)


def _lock(path: Path) -> int:
    """The descriptor of `path`, created if need be, flock'ed and holding this pid."""
    while True:  # again only when the file it opened was removed meanwhile (its holder ended)
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise TrainConfigError(f"--out {path.parent} cannot be written: {e.strerror or e}") from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(descriptor)
            raise TrainConfigError(
                f"--out {path.parent} is in use by another train (pid {holder}); wait for it to end, "
                "or stop it (a run goes on with --resume)"
            ) from None
        if _same_file(descriptor, path):
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
            return descriptor
        os.close(descriptor)


def _same_file(descriptor: int, path: Path) -> bool:
    try:
        held, named = os.fstat(descriptor), os.stat(path)
    except FileNotFoundError:
        return False
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def plan(cfg: TrainConfig) -> RunPlan:
    """Check --out against the options; refuse in one line what the run must not touch."""
    out = Path(cfg.output.out)
    made = _ensure_writable(out)
    marker = read_marker(out)
    if marker is None:
        if any(p.name != LOCK for p in out.iterdir()):
            raise TrainConfigError(
                f"--out {out} holds files but no logitstore run (no {MARKER}); use a new or "
                "empty folder (--force replaces only a folder a run marked)"
            )
        return RunPlan(out, made=made)
    if cfg.output.force:
        return RunPlan(out, replace=True)
    if not cfg.output.resume:
        raise TrainConfigError(
            f"--out {out} already holds a run; pass --resume to continue it or --force to replace it"
        )
    return _resume_plan(out, marker, cfg)


def unmake(plan: RunPlan) -> None:
    """Take away the folder `plan` made, if nothing was written into it (a start that failed before the
    run claimed it): a refused `train` leaves no trace. A folder with anything in it stays."""
    if plan.made:
        with contextlib.suppress(OSError):  # not empty, or gone: nothing to take away
            plan.out.rmdir()


def _ensure_writable(out: Path) -> bool:
    """Create --out (an empty folder claims nothing) and write a nameless file in it: os.access misses
    read-only mounts for root, and a rank's OSError would be a traceback. Returns whether it made it."""
    if out.exists() and not out.is_dir():
        raise TrainConfigError(f"--out {out} is a file, not a folder")
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise TrainConfigError(f"--out {out} cannot be written: {e.strerror or e}") from None
    return made


def read_marker(out: Path) -> dict | None:
    path = out / MARKER
    if not path.exists():
        return None
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TrainConfigError(f"--out {out}: its run marker {MARKER} cannot be read ({e})") from None
    if not isinstance(marker, dict) or {k: marker.get(k) for k in _FORMAT} != _FORMAT:
        raise TrainConfigError(f"--out {out}: {MARKER} is not a run marker this logitstore writes ({_FORMAT})")
    return marker


def _resume_plan(out: Path, marker: dict, cfg: TrainConfig) -> RunPlan:
    _check_identity(out, marker["identity"], cfg)
    resume_from = checkpoint.latest(out)
    state = checkpoint.train_state(resume_from) if resume_from is not None else {}
    snapshot = state.get("snapshot", marker["snapshot"])
    versions = tuple(state.get("versions") or ([snapshot] if snapshot is not None else []))
    asked = cfg.data.version is not None or bool(cfg.data.version_weights)
    if cfg.output.new_version and not asked:
        raise TrainConfigError(
            "--new-version continues the run on the version --version names (or the mix --version-weight "
            "names); give --version or --version-weight"
        )
    if snapshot is not None and asked:
        requested = _check_version(out, cfg, snapshot)
        if requested != snapshot:
            return _new_version_plan(out, cfg, resume_from, step=state.get("step", 0), versions=(*versions, requested))
    finished = None
    # A run finishes by exporting final/ last, and a run that continues removes the old final/ first.
    if resume_from is not None and state["step"] >= cfg.schedule.steps and (out / "final").is_dir():
        finished = json.loads((out / "final_metrics.json").read_text())
    return RunPlan(out, resume_from=resume_from, snapshot=snapshot, finished=finished, versions=versions)


def _new_version_plan(out: Path, cfg: TrainConfig, resume_from: Path | None, *, step: int, versions: tuple) -> RunPlan:
    """`--resume --new-version`: the run's checkpoint continues on the version requested (the last of
    `versions`), whose samples are new data: the stream starts at its beginning."""
    if step >= cfg.schedule.steps:
        raise TrainConfigError(
            f"--out {out} is at step {step}; to train on version {shown(versions[-1])} give a larger --steps"
        )
    return RunPlan(out, resume_from=resume_from, snapshot=versions[-1], versions=versions, new_data=True)


def _check_identity(out: Path, previous: dict, cfg: TrainConfig) -> None:
    current = json.loads(json.dumps(cfg.run_identity()))  # as the marker holds it: tuples are lists there
    changed = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
    if changed:
        raise TrainConfigError(
            f"--out {out} holds a run with another configuration ({', '.join(changed)}); use a new --out or --force"
        )


def _check_version(out: Path, cfg: TrainConfig, snapshot: str | dict) -> str | dict:
    """--version (or --version-weight) with --resume names the snapshot (or mix) the run reads (a tag, a
    branch still there, the id), or with --new-version another one, which it returns."""
    assert cfg.data.store is not None  # a pinned snapshot and --version: a store run (live mode has neither)
    store = Store.open(cfg.data.store)
    weights = cfg.data.version_weights
    requested = store.resolve(cfg.data.version) if not weights else pinned(snapshot_weights(store, weights))
    if requested != snapshot and not cfg.output.new_version:
        flag = f"--version {cfg.data.version}" if not weights else "--version-weight"
        raise TrainConfigError(
            f"--out {out} trains on version {shown(snapshot)}, but {flag} is {shown(requested)}; "
            "leave out --version to resume, add --new-version to continue the run on that version as new data, "
            "or use a new --out"
        )
    return requested


def claim(plan: RunPlan, cfg: TrainConfig, *, snapshot: str | dict | None) -> None:
    """Take --out for this run (rank 0, once the configuration passed): remove the old run's entries
    (--force) or the previous export, drop the metrics past the checkpoint a resumed run continues from,
    and write the configuration it runs with (`RUN_CONFIG`, what `--config` takes; a resumed run reads
    it) and the marker."""
    out = plan.out
    try:
        for path in _doomed(plan):
            _remove(path)
        if cfg.output.resume:
            truncate_metrics(out / "metrics.jsonl", step=plan.resume_step)
        write_atomic(
            out / MARKER, json.dumps({**_FORMAT, "identity": cfg.run_identity(), "snapshot": snapshot}, indent=2)
        )
        # After the marker: a kill between the two leaves a marked folder (the next run may take it), not
        # a folder of files that no run marked.
        write_atomic(out / RUN_CONFIG, dump(kept_values(cfg), command="train"))
    except OSError as e:
        raise TrainConfigError(f"--out {out} cannot be written: {e.strerror or e}") from None


def _doomed(plan: RunPlan) -> list[Path]:
    if plan.replace:
        return [path for path in plan.out.iterdir() if _RUN_ENTRIES.fullmatch(path.name)]
    return [plan.out / name for name in _EXPORT_ENTRIES]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def truncate_metrics(path: Path, *, step: int) -> None:
    """Keep the start events and the step records up to `step`, the checkpoint a resumed run continues
    from: a killed run logged steps past it that the resumed run logs again. A line the kill cut short
    goes too. Costs one read and rewrite of the file per resume."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if _record_upto(line, step)]
    write_atomic(path, "".join(f"{line}\n" for line in kept))


def _record_upto(line: str, step: int) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and record.get("step", 0) <= step


def last_record(out: Path, *, step: int) -> dict:
    """The metrics record of `step` (what final_metrics.json holds when a resumed run only exports)."""
    path = out / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return next((r for r in reversed(records) if r.get("step") == step), {})


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a `.partial` file renamed over it: readers see the old file or the new."""
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)
