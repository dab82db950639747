"""Stage two: train a student from a pinned store version. Reads top to bottom, like nanoGPT's train.py.

Before any process starts, `run_folder.plan` checks `--out` (a new, empty or run-marked folder; what a
resume continues from and which snapshot it reads) and `check_before_launch` everything the store can refuse. Order of construction (fixed, as in torchtitan):
process group and mesh -> store version (pinned by snapshot id) -> student (seeded) -> the run takes
`--out` (`run_folder.claim`) -> FSDP2 sharding -> optimizer and schedule -> data stream -> resume from
the newest complete checkpoint -> the loop -> last checkpoint, final metrics, `final/`. Every resumable
piece is in the checkpoint: model and optimizer shards (DCP), step, data position, RNG state and the
store snapshot (train_state.json).

Launch: `logitstore train --nproc N` spawns N processes itself; under `torchrun` the environment
already names rank and world size and the same code runs. CPU uses gloo, CUDA uses NCCL.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from logitstore.environment import environment
from logitstore.errors import LogitstoreError
from logitstore.live.teacher import settle_engine
from logitstore.streaming.spec import StreamConfigError
from logitstore.trainer import checkpoint, run_folder
from logitstore.trainer.attention import describe as describe_attention
from logitstore.trainer.attention import packed_attention
from logitstore.trainer.config import TrainConfig, TrainConfigError
from logitstore.trainer.model import (
    apply_levers,
    build_student,
    distribute,
    student_max_positions,
)
from logitstore.trainer.objective import held_out_metrics
from logitstore.trainer.plots import plot_metrics
from logitstore.trainer.signals import LiveSignal, StoreSignal
from logitstore.trainer.step import StepLog, make_optimizer, train_step
from logitstore.trainer.stopping import die_with_launcher, end_stopped, interrupted_once, stopped, stopping_ranks
from logitstore.trainer.trackers import open_sinks

# -- launching -----------------------------------------------------------------------------------


def launch(cfg: TrainConfig) -> dict:
    """Run training on `cfg.student.nproc` processes (or under torchrun); returns rank 0's final metrics."""
    check_student_fits(cfg)  # before any process starts, like every other configuration error
    if cfg.live is not None:  # the engine's refusals (a served teacher's preflight) before --out is touched
        cfg = dataclasses.replace(cfg, live=settle_engine(cfg.live, log=lambda line: print(line, file=sys.stderr)))
    first = os.environ.get("RANK", "0") == "0"  # under torchrun, the first worker holds --out for them all
    with run_folder.taken(cfg, lock=first) as plan:  # a new --out that nothing was written to goes again
        return _launch(cfg, plan)


def _launch(cfg: TrainConfig, plan: run_folder.RunPlan) -> dict:
    if plan.finished is not None:
        print(f"the run in {plan.out} already finished at step {plan.resume_step}; nothing to do", file=sys.stderr)
        return plan.finished
    if plan.snapshot is not None:  # a resumed store run reads what its run pinned, not what the branch says now
        cfg = cfg.with_version(plan.snapshot)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    signal = check_before_launch(cfg, plan, world_size=int(os.environ["WORLD_SIZE"]) if torchrun else cfg.student.nproc)
    if torchrun:
        return _run(cfg, plan, signal=signal)
    if cfg.student.nproc == 1:
        with one_process_group():
            return _run(cfg, plan, signal=signal)
    # spawned ranks open the version themselves (an Icechunk session does not travel)
    _spawn(cfg, plan)
    return json.loads((plan.out / "final_metrics.json").read_text())


def check_before_launch(cfg: TrainConfig, plan: run_folder.RunPlan, *, world_size: int) -> StoreSignal | None:
    """Everything the store and the flags can refuse, in this process, before any rank starts and before
    a rank claims --out (so a refused start leaves the folder as it was): the version, its teachers and
    the student's tokenizer (`plan_sources`) and the streams (`check_streams`). Reads the index and the
    id order, no part. Returns the signal, which a rank in this process goes on with. Live mode (None)
    plans its samples in the rank, which makes the same checks before it claims --out."""
    if cfg.live is not None:
        return None
    signal = StoreSignal(cfg)
    check_streams(signal, cfg, world_size=world_size, resume_from=plan.resume_from, new_data=plan.new_data)
    return signal


def check_streams(
    signal: StoreSignal | LiveSignal, cfg: TrainConfig, *, world_size: int, resume_from, new_data: bool = False
) -> None:
    """Make (and close) the streams a rank will make: --train-on against the store, the memory budget
    against the parts, a split too small for one micro-batch per rank, a resumed run's data position.
    Reads no part and computes nothing."""
    splits = ["train", "eval"] if cfg.schedule.eval_every else ["train"]  # without it, an empty eval is a note
    for split in splits:
        with signal.stream(cfg, rank=0, world_size=world_size, split=split) as stream:
            if split == "train" and resume_from is not None and not new_data:
                stream.load_state_dict(checkpoint.train_state(resume_from)["data"])


def check_student_fits(cfg: TrainConfig) -> None:
    """--seq-len within the student's positions, read from its config alone (no weights loaded)."""

    limit = student_max_positions(cfg.student.student)
    if cfg.data.seq_len > limit:
        raise TrainConfigError(f"--seq-len {cfg.data.seq_len} exceeds the student's {limit} positions")


def _spawn(cfg: TrainConfig, plan: run_folder.RunPlan) -> None:
    """`cfg.student.nproc` processes; a rank's LogitstoreError comes back through a queue and is raised here, so
    the command prints one line and exits with its code (the parent sees only an exit status). SIGINT and
    SIGTERM to this process stop the ranks first (`stopping.stopping_ranks`)."""

    errors = mp.get_context("spawn").SimpleQueue()
    # torch logs a warning for each rank it ends after another failed; the one line below says it all
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    with stopping_ranks() as stops:
        try:
            with environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())):  # what the ranks inherit
                context = mp.start_processes(
                    _spawned,
                    args=(cfg, plan, errors, os.getpid()),
                    nprocs=cfg.student.nproc,
                    start_method="spawn",
                    join=False,
                )
            stops.watch(context.processes)
            while not context.join():
                pass
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
            if stops.signum is None:  # a stopped rank's exit says nothing the signal did not
                _raise_rank_failure(e, errors)
        stops.end()


def _raise_rank_failure(e: mp.ProcessExitedException | mp.ProcessRaisedException, errors) -> None:
    if not errors.empty():
        raise errors.get() from None
    if isinstance(e, mp.ProcessExitedException) and e.signal_name == "SIGINT":  # Ctrl-C reached a rank first
        raise KeyboardInterrupt from None
    if isinstance(e, mp.ProcessExitedException) and e.signal_name:  # killed from outside (kill -9, the OOM killer)
        raise LogitstoreError(
            f"rank {e.error_index} (pid {e.error_pid}) was killed by {e.signal_name}; run the same command with "
            "--resume to continue from the last checkpoint"
        ) from None
    raise e  # a bug, whose traceback the rank printed


def _spawned(rank: int, cfg: TrainConfig, plan: run_folder.RunPlan, errors, launcher: int) -> None:
    interrupted_once()
    world = str(cfg.student.nproc)
    try:
        die_with_launcher(launcher)
        with environment(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world, LOCAL_WORLD_SIZE=world):
            _run(cfg, plan)
    except BaseException as e:
        if stopped(e):  # the run was put away on the way here: nothing to say (the launcher says it)
            end_stopped()
        if isinstance(e, LogitstoreError):  # to the parent, which prints it once, not once per rank
            errors.put(e)
            raise SystemExit(e.exit_code) from None
        raise


def one_process_group():
    """A one-process group's variables, removed afterwards so a later launch in this process (a test, a
    notebook) is not mistaken for a torchrun worker."""
    one = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    return environment(**one, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- one rank --------------------------------------------------------------------------------------


def _run(cfg: TrainConfig, plan: run_folder.RunPlan, *, signal: StoreSignal | LiveSignal | None = None) -> dict:
    # CUDA only when every rank on this node gets a GPU of its own (NCCL refuses two ranks on one GPU);
    # otherwise the ranks train on the CPU over gloo, as on a machine without a GPU.
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        return _train(cfg, plan, cuda=cuda, signal=signal)
    finally:
        dist.destroy_process_group()


def _train(cfg: TrainConfig, plan: run_folder.RunPlan, *, cuda: bool, signal: StoreSignal | LiveSignal | None) -> dict:

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    out = Path(cfg.output.out)

    # The teachers' signal: a store version pinned by snapshot id (a later build on the branch cannot
    # change this run), or in live mode a teacher process beside this rank. `check_before_launch` made it in a
    # launching process that is also this rank.
    if signal is None:
        signal = LiveSignal(cfg) if cfg.live is not None else StoreSignal(cfg)
        check_streams(signal, cfg, world_size=world, resume_from=plan.resume_from, new_data=plan.new_data)
    teacher = signal.teacher
    # the store versions this run has read: the ones before a --new-version, then this one
    versions = list(plan.versions) if signal.snapshot in plan.versions else [*plan.versions, signal.snapshot]

    model, _tokenizer = build_student(
        cfg.student.student, vocab_size=signal.vocab_size, seed=cfg.student.seed, device=device
    )
    # Only now, with store and student accepted, does the run take --out: a failed start leaves it as it was.
    if rank == 0:
        run_folder.claim(plan, cfg, snapshot=signal.snapshot)
    dist.barrier()
    apply_levers(model, activation_checkpointing=cfg.student.activation_checkpointing, compile=cfg.student.compile)
    model = distribute(model, mesh=mesh, offload_optimizer=cfg.student.offload_optimizer, cuda=cuda)
    optimizer = make_optimizer(model, cfg, device=device)

    signal.start(cfg)
    stream = signal.stream(cfg, rank=rank, world_size=world, split="train")
    step = 0
    resumed_from = plan.resume_from
    if resumed_from is not None:
        state = checkpoint.load(resumed_from, model=model, optimizer=optimizer)
        step = state["step"]
        if not plan.new_data:  # a new version's samples are new data: its stream starts at its beginning
            stream.load_state_dict(state["data"])
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))
    resumed_step = step

    metrics_file = (out / "metrics.jsonl").open("a") if rank == 0 else None
    header = {
        "event": "start",
        "store": cfg.data.store,
        "version": signal.version,
        "versions": [v for v in versions if v is not None],
        "teacher": teacher,
        "teachers": [{"name": s.name, "weight": s.weight, "student_tokenizer": s.student} for s in signal.sources],
        "student": cfg.student.student,
        "nproc": world,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "signal": signal.kind,
        "attention": packed_attention(device, torch.bfloat16 if cuda else torch.float32),
        **signal.header(),
    }
    # said once, with the first step's line: a run refused before its first step says that in one line
    attention_note = describe_attention(header["attention"]) if rank == 0 else None
    _log(metrics_file, header)
    batches = iter(stream)
    record = run_folder.last_record(out, step=step) if resumed_from is not None else {}
    run_started = time.perf_counter()
    sinks: list = []
    try:
        if rank == 0:  # --report-to; in the try: a sink that cannot start still closes the stream
            sinks = open_sinks(cfg.output.report_to, out=out, header=header)
        steps = StepLog(device)
        while step < cfg.schedule.steps:
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            started, wait_before = steps.start(), stream.wait_seconds
            values, tokens = train_step(model, optimizer, batches, cfg, device, step=step + 1)
            step += 1
            steps.add(
                step,
                values,
                tokens=tokens,
                started=started,
                host={
                    "lr": lr,
                    "data_wait_seconds": stream.wait_seconds - wait_before,
                    "skipped_samples": getattr(stream, "skipped_samples", 0),
                    "version": signal.version,
                    "signal": signal.kind,
                },
            )
            evaluating = bool(cfg.schedule.eval_every) and step % cfg.schedule.eval_every == 0
            checkpointing = bool(cfg.schedule.checkpoint_every) and step % cfg.schedule.checkpoint_every == 0
            last = step == cfg.schedule.steps
            if not (evaluating or checkpointing or last or step % cfg.schedule.log_every == 0):
                continue  # nothing read back: the device runs on
            records = steps.flush()
            if evaluating:
                records[-1].update(evaluate(model, signal, cfg=cfg, device=device))
            elif last:  # every run ends with a held-out KL, if its split can give one
                records[-1].update(_final_evaluation(model, signal, cfg=cfg, device=device, rank=rank))
            per_step = (time.perf_counter() - run_started) / (step - resumed_step)
            if attention_note is not None and metrics_file is not None:
                print(attention_note, file=sys.stderr, flush=True)
                attention_note = None
            for record in records:
                record["eta_seconds"] = per_step * (cfg.schedule.steps - record["step"])
                shown = record["step"] % cfg.schedule.log_every == 0 or record["step"] == cfg.schedule.steps
                _log(metrics_file, record, echo=shown)
                for sink in sinks:
                    sink.write(record)
            if checkpointing and not last:
                checkpoint.save(
                    out,
                    step=step,
                    model=model,
                    optimizer=optimizer,
                    train_state=_train_state(step, stream, signal, versions=versions),
                )
        if step > resumed_step:  # a resumed run at or past --steps holds its last checkpoint already
            checkpoint.save(
                out,
                step=step,
                model=model,
                optimizer=optimizer,
                train_state=_train_state(step, stream, signal, versions=versions),
            )
        if rank == 0:
            (out / "final_metrics.json").write_text(json.dumps(record))

            plot_metrics(out)
        _export_final(model, signal.tokenizer(), out=out)  # last: final/ exists only once the run is done
    finally:
        stream.close()
        signal.close()
        if metrics_file:
            metrics_file.close()
        for sink in sinks:
            sink.close()
    return record


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine to lr * min_lr_ratio at `cfg.schedule.steps`: a function of the step alone, so
    a resumed run follows the schedule of an uninterrupted run of the same --steps."""
    if step < cfg.optim.warmup_steps:
        return cfg.optim.lr * (step + 1) / cfg.optim.warmup_steps
    progress = (step - cfg.optim.warmup_steps) / max(1, cfg.schedule.steps - cfg.optim.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.optim.lr * (cfg.optim.min_lr_ratio + (1 - cfg.optim.min_lr_ratio) * cosine)


def _train_state(step: int, stream, signal, *, versions: list) -> dict:
    return {
        "step": step,
        "data": stream.state_dict(),
        "rng": torch.get_rng_state().tolist(),
        "snapshot": signal.snapshot,
        "versions": [v for v in versions if v is not None],  # every store version the run has read
    }


def _log(metrics_file, record: dict, *, echo: bool = False) -> None:
    if metrics_file is None:
        return
    metrics_file.write(json.dumps(record) + "\n")
    metrics_file.flush()
    if echo and "step" in record:
        extra = f"  held-out KL {record['eval_kl']:.4f}" if "eval_kl" in record else ""
        eta = f"  ETA {record['eta_seconds'] / 60:.1f} min" if "eta_seconds" in record else ""
        print(
            f"step {record['step']:>6}  loss {record['loss']:.4f}  kd {record['kd']:.4f}  lr {record['lr']:.2e}  "
            f"grad {record['grad_norm']:.3f}  {record['tokens_per_second']:,.0f} tok/s  "
            f"data wait {record['data_wait_seconds'] * 1000:.0f} ms{extra}{eta}",
            file=sys.stderr,
            flush=True,
        )


def _final_evaluation(model, signal, *, cfg: TrainConfig, device, rank: int) -> dict:
    """The held-out KL at the last step; an empty held-out split is said once and skipped (every rank
    meets the same split, so all skip alike)."""

    if cfg.data.eval_fraction == 0:
        return {}
    try:
        return evaluate(model, signal, cfg=cfg, device=device)
    except StreamConfigError as e:
        if rank == 0:
            print(f"no held-out evaluation at the end: {e}", file=sys.stderr, flush=True)
        return {}


# -- evaluation and export -------------------------------------------------------------------------


def evaluate(model, signal, *, cfg: TrainConfig, device) -> dict:
    """The held-out split's metrics (`objective.held_out_metrics`) over at most `--eval-batches` batches."""
    stream = signal.stream(cfg, rank=dist.get_rank(), world_size=dist.get_world_size(), split="eval")
    try:
        return held_out_metrics(
            model,
            stream,
            cfg.loss,
            device=device,
            limit=cfg.schedule.eval_batches,
            weights={s.name: s.weight for s in signal.sources},
        )
    finally:
        stream.close()


def _export_final(model, tokenizer, *, out: Path) -> None:
    """Gather the full weights and save a plain Hugging Face model (with tokenizer) in OUT/final/, written
    as final.partial/ and renamed, so final/ exists only complete (the run claimed --out, removing any
    previous export)."""

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        partial = out / "final.partial"
        if partial.exists():
            shutil.rmtree(partial)
        plain = AutoModelForCausalLM.from_config(model.config)
        plain.load_state_dict(full)
        plain.save_pretrained(partial)
        if tokenizer is not None:
            PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(partial)
        partial.rename(out / "final")
    dist.barrier()


def run_eval(cfg: TrainConfig) -> dict:
    """`logitstore eval`: a trained student's mean KL to the stored teacher and CE, on the held-out split
    (for a cross-tokenizer teacher: the KL over 1:1-aligned positions). `cfg`: `TrainConfig.for_eval`."""

    signal = StoreSignal(cfg)
    model, _ = build_student(cfg.student.student, vocab_size=signal.vocab_size, seed=cfg.student.seed)
    with one_process_group():
        dist.init_process_group("gloo")
        try:
            result = evaluate(model.eval(), signal, cfg=cfg, device=torch.device("cpu"))
        finally:
            dist.destroy_process_group()
    return {"kl": result["eval_kl"], "ce": result["eval_ce"], "version": signal.version, "teacher": signal.teacher}
