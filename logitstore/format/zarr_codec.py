"""The log-probability grid as a Zarr v3 codec, so plain `zarr` reads a store's values as log-probabilities.

logitstore keeps log-probabilities as uint16 codes on a two-slope grid (`grid.CodecParams`). The
arrays of a teacher registered since store format 2 (`entry_logprobs`, `target_logprobs`, `tail`, the
last as the log of the tail mass) declare `data_type: float32` and put this codec first in their chain:

    "codecs": [{"name": "logitstore.logprob_grid", "configuration": {"fine_step": 0.05, "coarse_step": 0.5,
                "coarse_below": -5.0}}, {"name": "sharding_indexed", ...}]

so `zarr.open_array(...)[:]` decodes the codes to float32 log-probabilities (each within the grid's
error bound of the teacher's value; -inf for a mass of zero), and writing float32 through Zarr
quantizes them. The stored bytes are uint16 codes either way: logitstore's own readers
(`storage/rawread.py`) take the codes without decoding them twice.

Zarr finds the codec through the `zarr.codecs` entry point that installing logitstore registers
(`pyproject.toml`), without `import logitstore`; importing this module registers it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import cast

import numpy as np
from zarr.abc.codec import ArrayArrayCodec
from zarr.core.common import parse_named_configuration
from zarr.core.dtype import UInt16
from zarr.registry import register_codec

from logitstore.format.codec import dequantize, quantize
from logitstore.format.grid import CodecParams

NAME = "logitstore.logprob_grid"
_GRID = ("fine_step", "coarse_step", "coarse_below")  # the grid's numbers, in the order they are written


@dataclass(frozen=True)
class LogprobGrid(ArrayArrayCodec):
    """float32 log-probabilities <-> uint16 codes of a value grid (`CodecParams`, the grid's one holder:
    its three numbers are this codec's configuration; its id order plays no part here)."""

    params: CodecParams = field(default_factory=CodecParams)
    is_fixed_size = True

    @classmethod
    def of(cls, params: CodecParams) -> LogprobGrid:
        return cls(params=params)

    @classmethod
    def from_dict(cls, data: dict) -> LogprobGrid:
        _, configuration = parse_named_configuration(data, NAME)
        grid = cast(dict[str, float], configuration or {})  # JSON numbers, as `to_dict` writes them
        fine, coarse, below = (float(grid.get(k, getattr(CodecParams, k))) for k in _GRID)
        return cls(params=CodecParams(fine_step=fine, coarse_step=coarse, coarse_below=below))

    def to_dict(self) -> dict:
        return {"name": NAME, "configuration": {k: getattr(self.params, k) for k in _GRID}}

    def validate(self, *, shape, dtype, chunk_grid) -> None:
        if dtype.to_native_dtype() != np.dtype("float32"):
            raise ValueError(f"{NAME} encodes float32 log-probabilities, not {dtype}")  # the grid: `CodecParams`

    def resolve_metadata(self, chunk_spec):
        return replace(chunk_spec, dtype=UInt16(), fill_value=0)  # 0.0 is code 0

    async def _decode_single(self, chunk_array, chunk_spec):
        codes = np.asarray(chunk_array.as_numpy_array(), dtype=np.uint16)
        return chunk_spec.prototype.nd_buffer.from_numpy_array(dequantize(codes, params=self.params))

    async def _encode_single(self, chunk_array, chunk_spec):
        values = np.asarray(chunk_array.as_numpy_array(), dtype=np.float32)
        return chunk_spec.prototype.nd_buffer.from_numpy_array(quantize(values, params=self.params))

    def compute_encoded_size(self, input_byte_length: int, chunk_spec) -> int:
        return input_byte_length // 2


def as_codes(values: np.ndarray, params: CodecParams) -> np.ndarray:
    """What logitstore decodes, from an array read through Zarr: float32 log-probabilities (this codec)
    re-quantized, which gives the stored codes back exactly (tested for every code); any other array
    (codes of format-1 teachers, ids, counts) as it is."""
    return quantize(values, params=params) if values.dtype == np.float32 else values


def grid_of(metadata: dict) -> CodecParams | None:
    """The value grid an array's zarr.json (a dict) declares: its grid codec's, first in its chain or in
    its shards' inner chain; None where it declares none. A configuration no grid can have raises
    `ValueError`."""
    chains = [metadata.get("codecs") or []]
    chains += [c.get("configuration", {}).get("codecs") or [] for c in chains[0] if c.get("name") == "sharding_indexed"]
    found = [codec for chain in chains for codec in chain if codec.get("name") == NAME]
    return LogprobGrid.from_dict(found[0]).params if found else None


def same_grid(a: CodecParams, b: CodecParams) -> bool:
    """Whether two grids give every code the same value (their id orders play no part)."""
    return all(getattr(a, k) == getattr(b, k) for k in _GRID)


register_codec(NAME, LogprobGrid)
