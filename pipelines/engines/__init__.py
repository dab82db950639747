"""Teacher engines: what runs the teacher's forward passes in a build (and in live mode), and the registry
that names them (`ENGINES`), the one place an engine is named.

The interface is `base.Engine` and `base.Generator` (typing Protocols every engine subclasses). The engines:
`torch_engine.py` (`TorchEngine`, the default), `vllm/` (`VllmEngine`) and `server/` (`ServerEngine`); what
several of them use is in `shared.py`. Adding an engine is its module and one line in `ENGINES`. An engine's
module is imported only when the engine is asked for (`engine_class`), which keeps `logitstore --help` and
the builds of the other engines from importing torch, vLLM or aiohttp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, get_args

from logitstore.pipelines.engines.base import Engine, EngineError, Generator
from logitstore.pipelines.engines.settings import EngineName
from logitstore.pipelines.engines.vllm import VLLM_OUTPUTS

__all__ = ["ENGINES", "VLLM_OUTPUTS", "EngineError", "engine_class", "engine_names", "generator_class"]


class Registered(NamedTuple):
    engine: type[Engine]
    generator: type[Generator] | None  # what writes answers for `build --generate`; None: the engine cannot


def _torch() -> Registered:
    # imported when asked for: torch alone costs `build` 1.5 s before its input checks
    from logitstore.pipelines.engines.torch_engine import TorchEngine, TorchGenerator

    return Registered(TorchEngine, TorchGenerator)


def _vllm() -> Registered:
    # imported when asked for: torch and numba, and vLLM where it runs
    from logitstore.pipelines.engines.vllm.engine import VllmEngine, VllmGenerator

    return Registered(VllmEngine, VllmGenerator)


def _server() -> Registered:
    # imported when asked for: aiohttp and the compiled answer reader
    from logitstore.pipelines.engines.server.engine import ServerEngine, ServerGenerator

    return Registered(ServerEngine, ServerGenerator)


ENGINES: dict[EngineName, Callable[[], Registered]] = {"torch": _torch, "vllm": _vllm, "server": _server}
assert set(ENGINES) == set(get_args(EngineName)), "one registered engine per name"


def engine_names() -> list[EngineName]:
    """The engines `--engine` accepts."""
    return sorted(ENGINES)


def _registered(name: str) -> Registered:
    if name not in ENGINES:
        raise EngineError(f"--engine must be one of {', '.join(engine_names())}, got {name!r}")
    return ENGINES[name]()


def engine_class(name: str) -> type[Engine]:
    """The engine class of engine `name`."""
    return _registered(name).engine


def generator_class(name: str) -> type[Generator]:
    """The generator class of engine `name`: what writes answers for `build --generate`."""
    generator = _registered(name).generator
    if generator is None:
        raise EngineError(f"--engine {name} cannot generate answers (--generate); use --engine torch or vllm")
    return generator
