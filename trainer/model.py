"""The student: a built-in fresh config or a Hugging Face causal-LM directory, sharded with FSDP2 across
ranks.

A built-in student is built on the meta device (no memory, no work), given storage on its device with
`to_empty` and initialised there (torchtitan's recipe): Hugging Face's own initialisation (normal(0,
0.02) weights, unit norms, the rotary tables), drawn from the device's generator seeded with `--seed`,
so a launch spends no CPU time drawing 100M numbers one by one. Every rank initialises the full model
with the same seed before sharding, so the initial weights are identical whatever the process count
(1-process and 2-process runs agree on the first loss). A CPU run draws from the CPU's generator and a
CUDA run from the GPU's: the same distribution, not the same numbers.

One rank without optimizer offloading trains the plain module (`distribute`): FSDP2's all-gathers and
reduce-scatters would copy every parameter and gradient for nothing there. bf16 on CUDA is FSDP2's
parameter dtype across ranks and autocast on one rank (`precision`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from logitstore.errors import LogitstoreError
from logitstore.text.hub import is_hub_id, local_folder
from logitstore.text.tokenizer_io import tokenizer_hash
from logitstore.trainer.attention import ATTENTION
from logitstore.trainer.attention import register as register_attention

# Fresh Llama-style students, sized for CPU tests and small runs. The vocabulary comes from the store.
# `smollm2-135m` is SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 key/value heads), freshly
# initialised: the GPU benchmark's student. Rotary positions, so max_position_embeddings is only a limit.
BUILTIN_STUDENTS: dict[str, dict[str, Any]] = {  # LlamaConfig's keyword arguments
    "llama-tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    ),
    "llama-small": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=8192,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
    ),
}


class StudentError(LogitstoreError):
    """The student cannot be built or does not fit the store's teacher."""


def build_student(spec: str, *, vocab_size: int, seed: int, device: torch.device | str = "cpu"):
    """(model, tokenizer or None) on `device`. A built-in name is a fresh model over `vocab_size` tokens,
    initialised on `device` (its tokenizer is the store's: the teacher's, or `--student-tokenizer`); a
    directory brings its weights and its own tokenizer, which `student_tokenizer_hash` matches against
    the store's before this is called."""
    register_attention()  # packed rows attend within their segments, without an L x L mask
    torch.manual_seed(seed)
    if spec in BUILTIN_STUDENTS:
        config = LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=True, **BUILTIN_STUDENTS[spec])
        config._attn_implementation = ATTENTION
        return initialised(LlamaForCausalLM, config, device=torch.device(device)), None
    path = _model_dir(spec)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ATTENTION)
    model.to(torch.device(device))  # type: ignore[arg-type]  # transformers types its wrapped Module.to for models only
    out = model.get_output_embeddings().weight.shape[0]
    if out < vocab_size:
        raise StudentError(
            f"--student {spec}: predicts {out} tokens but its tokenizer's vocabulary in the store has {vocab_size}"
        )
    return model, _tokenizer_of(path)


def initialised(model_class, config, *, device: torch.device):
    """A fresh Hugging Face model built on the meta device, then given storage on `device` and
    initialised there by its own `_init_weights`, drawing from the current seed of `device`'s generator."""
    with torch.device("meta"):
        model = model_class(config)
    model.to_empty(device=device)
    for module in model.modules():  # what the meta construction marked done initialises now, for real
        module.__dict__.pop("_is_hf_initialized", None)
    model.initialize_weights()
    _rebuild_buffers(model)
    model.tie_weights()
    return model


def _rebuild_buffers(model) -> None:
    """The non-persistent buffers (the rotary tables, a few KB), computed again by a fresh module on the
    CPU and copied into the model's: `to_empty` left them uninitialised, and not every Hugging Face
    version's `_init_weights` writes them."""
    for module in model.modules():
        names: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        if not names:
            continue
        fresh = type(module)(module.config)
        for name in names:
            getattr(module, name).copy_(getattr(fresh, name))


def student_tokenizer_hash(spec: str) -> str | None:
    """The tokenizer hash of a student directory; None for a built-in (it takes the store's tokenizer)."""
    if spec in BUILTIN_STUDENTS:
        return None

    return tokenizer_hash(_tokenizer_of(_model_dir(spec)))


def _model_dir(spec: str) -> Path:
    path = local_folder(spec, flag="--student") if is_hub_id(spec) else Path(spec)
    if not (path / "config.json").is_file():
        names = ", ".join(BUILTIN_STUDENTS)
        raise StudentError(f"--student {spec!r}: not a model directory with config.json, nor a built-in ({names})")
    return path


def _tokenizer_of(path: Path):
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise StudentError(f"--student {path}: no usable tokenizer ({e})") from None


def student_max_positions(spec: str) -> int:
    """The longest row the student takes, from its config alone (a built-in's, or config.json's
    `max_position_embeddings`; none given: no limit)."""
    if spec in BUILTIN_STUDENTS:
        return BUILTIN_STUDENTS[spec]["max_position_embeddings"]

    config = AutoConfig.from_pretrained(_model_dir(spec))
    return int(getattr(config, "max_position_embeddings", None) or 1 << 30)


def apply_levers(model, *, activation_checkpointing: bool, compile: bool) -> None:
    """The memory and speed levers, before sharding (torchtitan's order: checkpointing, compile, FSDP).

    activation checkpointing: each decoder block keeps only its input for backward and recomputes
    the rest (about one more forward per step, for activation memory of one block instead of all);
    compile: `torch.compile` of each block's feed-forward, the bulk of its FLOPs with shapes fixed by
    the batch. The attention stays eager: it is already a fused kernel, and its per-segment shapes change
    with every batch, which would recompile a compiled attention again and again."""
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile:
        for block in model.get_decoder().layers:
            if hasattr(block, "mlp"):
                block.mlp.compile()


def distribute(model, *, mesh: DeviceMesh, offload_optimizer: bool, cuda: bool):
    """FSDP2 (`shard`) across ranks, or for optimizer offloading; one rank otherwise keeps the plain module."""
    if mesh.size() == 1 and not offload_optimizer:
        return model
    return shard(model, mesh=mesh, offload_optimizer=offload_optimizer, cuda=cuda)


def precision(model, device: torch.device):
    """The context a step's forward and loss run in: bf16 autocast for an unsharded model on CUDA (a
    sharded one computes in FSDP2's bf16 parameters already), nothing otherwise."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and not is_sharded(model))


def is_sharded(model) -> bool:
    return isinstance(model, FSDPModule)


def shard(model, *, mesh: DeviceMesh, offload_optimizer: bool, cuda: bool):
    """FSDP2: each decoder block, then the root. bf16 compute with fp32 reduction on GPU."""
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else MixedPrecisionPolicy()
    )
    # On a CPU-only run the state already lives in host memory; pinning needs an accelerator.
    # OffloadPolicy(): fully_shard's default, no offloading
    offload = CPUOffloadPolicy(pin_memory=cuda) if offload_optimizer else OffloadPolicy()
    for block in model.get_decoder().layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    return model
