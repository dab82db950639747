"""The teacher's output head: final hidden states -> logits, with the model's own final logit transforms.

Both engines select entries from the logits this head gives: the torch engine wraps its loaded model's
head (`OutputHead.of_model`); vLLM's hidden-state mode loads the head alone from the teacher's weights
(`load_head`: the output-embedding matrix, tied or not, and its bias if any), while vLLM runs the body.

A model may change its logits after the head's matmul. Those changes live in the model's forward, not in
its weights, so they are listed here by the config attribute that turns them on (`TRANSFORMS`, read
from transformers 5's modeling files). A config that names another such attribute (`unknown_transforms`:
a name about logits, the lm_head or the output with a scale, cap or multiplier in it, other than those known to act
inside the body) is refused in one line: its logits would be silently wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open  # transformers' own dependency: reading a head costs no extra install
from torch import Tensor

from logitstore.errors import LogitstoreError
from logitstore.pipelines.teacher_files import loadable


class HeadError(LogitstoreError):
    """The teacher's output head cannot be loaded, or changes its logits in a way logitstore does not know."""


def _softcap(logits: Tensor, cap: float) -> Tensor:
    return torch.tanh(logits / cap) * cap


# config attribute -> what the model's forward does with its value after the head's matmul (fp32 logits in
# and out), in the order the forwards apply them: scales first, the soft cap last.
TRANSFORMS: dict[str, Callable[[Tensor, float], Tensor]] = {
    "logit_scale": lambda logits, s: logits * s,  # Cohere, Cohere 2
    "logits_scaling": lambda logits, s: logits / s,  # Granite, GraniteMoE
    "lm_head_multiplier": lambda logits, m: logits * m,  # Falcon-H1
    "output_multiplier": lambda logits, m: logits * m,  # Muse Spark and Glimmer (text config)
    "logits_mup_width_multiplier": lambda logits, m: logits / m,  # divides the hidden states; the head is linear
    "final_logit_softcapping": _softcap,  # Gemma 2 to 4 and others: tanh(logits / cap) * cap
}

# Attributes that look like logit transforms but act inside the body (which the engine runs) or elsewhere.
NOT_THE_HEAD = frozenset(
    {
        "attn_logit_softcapping",  # attention scores (Gemma 2)
        "moe_router_logit_softcapping",  # the router's scores
        "logit_scale_init_value",  # contrastive models' learned scale, not a language-model head
        "contrastive_logits_temperature",
        "conf_attention_logit_cap",
    }
)
_LOOKS_LIKE_A_TRANSFORM = re.compile(
    r"(logit|lm_head|output).*(scal|cap|mult|temperature)|(scal|cap|mult).*(logit|lm_head)"
)


def _configs(config) -> list:
    """The config and its text model's config (multimodal models keep the head's settings there)."""
    text = getattr(config, "text_config", None)
    return [config] if text is None or text is config else [config, text]


def logit_transforms(config) -> tuple[tuple[str, float], ...]:
    """The transforms `config` turns on, as (attribute, value) in `TRANSFORMS`' order; refuses unknown ones."""
    unknown = unknown_transforms(config)
    if unknown:
        raise HeadError(
            f"the teacher's config sets {', '.join(unknown)}, which may change its logits after the output head "
            "in a way logitstore does not know; use --engine torch with a known model, or --vllm-output logprobs "
            "(vLLM applies the model's own forward)"
        )
    found = []
    for name in TRANSFORMS:
        for cfg in _configs(config):
            value = getattr(cfg, name, None)
            if value is not None and not isinstance(value, bool):
                found.append((name, float(value)))
                break
    return tuple(found)


def unknown_transforms(config) -> list[str]:
    """Attributes of `config` that look like a final logit transform and are neither known nor harmless."""
    names = set()
    for cfg in _configs(config):
        for name, value in vars(cfg).items():
            if value is None or isinstance(value, bool) or name in TRANSFORMS or name in NOT_THE_HEAD:
                continue
            if _LOOKS_LIKE_A_TRANSFORM.search(name):
                names.add(name)
    return sorted(names)


@dataclass
class OutputHead:
    """`head(hidden)`: fp32 logits [positions, vocab] from final hidden states [positions, hidden]."""

    linear: torch.nn.Module  # the model's output embeddings (weight [vocab, hidden], maybe a bias)
    transforms: tuple[tuple[str, float], ...] = ()

    @classmethod
    def of_model(cls, model) -> OutputHead:
        linear = model.get_output_embeddings()
        if linear is None:
            raise HeadError(f"{type(model).__name__} has no output embeddings (lm_head)")
        return cls(linear=linear, transforms=logit_transforms(model.config))

    @property
    def weight(self) -> Tensor:
        weight = self.linear.weight
        assert isinstance(weight, Tensor), "an output embedding has a weight matrix"
        return weight

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def __call__(self, hidden: Tensor) -> Tensor:
        # The matmul in the head's dtype, as in model(...).logits; the transforms and the softmax in fp32.
        logits = self.linear(hidden.to(self.weight.dtype)).float()
        for name, value in self.transforms:
            logits = TRANSFORMS[name](logits, value)
        return logits


def load_head(spec, *, device: str | torch.device, dtype: torch.dtype) -> OutputHead:
    """The teacher's head alone, from its safetensors files: vocab x hidden values, not the whole model.

    The parameter's names come from the model class built on the meta device (no memory): the head's own
    name and, when tied, the input embedding's, since tied checkpoints store only that one. Teachers in
    other formats (.bin) load whole on the CPU and keep the head (costs the model's load once); a GGUF
    teacher reads its head from its converted folder (`teacher_files.loadable`)."""
    # transformers' Auto classes: 2-3 s to import, and only this path needs them
    from transformers import AutoConfig, AutoModelForCausalLM

    path, kwargs = loadable(spec)
    config = AutoConfig.from_pretrained(path, **kwargs)
    transforms = logit_transforms(config)  # refused before any weight is read
    tensors = None
    if not kwargs:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = _head_tensors(Path(path), skeleton)
    if tensors is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
        head = OutputHead.of_model(model)
        return OutputHead(linear=head.linear.to(device).requires_grad_(False), transforms=transforms)
    weight, bias = tensors
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
    return OutputHead(linear=linear, transforms=transforms)


def _head_tensors(folder: Path, skeleton) -> tuple[Tensor, Tensor | None] | None:
    """(weight, bias) of `skeleton`'s output head read from `folder`'s safetensors, or None if not there."""

    head = skeleton.get_output_embeddings()
    if head is None:
        raise HeadError(f"{type(skeleton).__name__} has no output embeddings (lm_head)")
    params = list(skeleton.named_parameters(remove_duplicate=False))
    weight_names = [name for name, p in params if p is head.weight]  # the head's name, and the tied embedding's
    bias_names = [name for name, p in params if getattr(head, "bias", None) is not None and p is head.bias]
    where = _tensor_files(folder)
    weight = _read(where, weight_names)
    if weight is None:
        return None
    bias = _read(where, bias_names) if bias_names else None
    if bias_names and bias is None:
        return None
    return weight, bias


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the shards' index, or each file's header)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return {name: folder / file for name, file in weight_map.items()}
    found: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            found.update(dict.fromkeys(handle.keys(), file))
    return found


def _read(where: dict[str, Path], names: list[str]) -> Tensor | None:
    for name in names:
        if name in where:
            with safe_open(str(where[name]), framework="pt") as handle:
                return handle.get_tensor(name)
    return None
