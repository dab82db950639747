"""The value grid: the two-slope grid log-probabilities are stored on (`CodecParams`) and its named
variants (`GRIDS`, what `build --value-grid` takes). How values are put on the grid and read back is the
codec's (`codec.quantize`, `codec.dequantize`); the grid itself is plain numbers, here apart from the
codec's numba kernels so that a configuration (`Sparsity`, the CLI's choices) names a grid without
loading them (0.3-0.8 s).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from logitstore.errors import IncompatibleStoreError

CODEC_NAME = "logitstore.sparse"
CODEC_VERSION = 1
Q_MAX = 65535  # the code reserved for minus infinity: the largest uint16


@dataclass(frozen=True)
class CodecParams:
    fine_step: float = 0.05  # nats per step for log-probabilities >= coarse_below
    coarse_step: float = 0.5  # nats per step below it
    coarse_below: float = -5.0
    id_order: str = "frequency"  # "frequency" or "identity"

    def __post_init__(self) -> None:
        if not (0 < self.fine_step <= self.coarse_step <= 4):
            raise ValueError(f"need 0 < fine_step <= coarse_step <= 4 nats, got {self.fine_step}, {self.coarse_step}")
        if self.coarse_below > 0 or abs(self.fine_levels * self.fine_step + self.coarse_below) > 1e-9:
            raise ValueError(f"coarse_below must be <= 0 and a multiple of fine_step, got {self.coarse_below}")
        if self.id_order not in ("frequency", "identity"):
            raise ValueError(f"id_order must be 'frequency' or 'identity', got {self.id_order!r}")

    @property
    def fine_levels(self) -> int:
        return round(-self.coarse_below / self.fine_step)

    @property
    def floor(self) -> float:
        """The lowest finite log-probability the grid holds; anything lower (but finite) is stored as it."""
        return self.coarse_below - (Q_MAX - 1 - self.fine_levels) * self.coarse_step

    @property
    def error_bound(self) -> float:
        """Largest absolute error, in nats, of any decoded log-probability (and of the log of the tail)."""
        return self.coarse_step / 2

    @property
    def error_bound_fine(self) -> float:
        """Largest absolute error for log-probabilities >= `coarse_below`."""
        return self.fine_step / 2

    def to_json(self) -> dict:
        bounds = {"error_bound": self.error_bound, "error_bound_fine": self.error_bound_fine}
        return {"name": CODEC_NAME, "version": CODEC_VERSION, **bounds, **asdict(self)}

    @classmethod
    def from_json(cls, meta: dict) -> CodecParams:
        if meta.get("name") != CODEC_NAME or meta.get("version", 0) > CODEC_VERSION:
            raise IncompatibleStoreError(
                f"codec {meta.get('name')} v{meta.get('version')} is not readable by this logitstore "
                f"({CODEC_NAME} v{CODEC_VERSION}); upgrade logitstore"
            )
        fields = ("fine_step", "coarse_step", "coarse_below", "id_order")
        return cls(**{k: meta[k] for k in fields})


# Named value grids, measured against each other by benchmarks/frontier.py. "fine" is finer than fp16
# for every log-probability below -1 nat (0.001-nat bound to -131 nats); "coarse" halves the grid's
# entropy (0.05 / 0.5-nat bounds).
GRIDS = {
    "default": CodecParams(),
    "fine": CodecParams(fine_step=0.002, coarse_step=0.002, coarse_below=-60.0),
    "coarse": CodecParams(fine_step=0.1, coarse_step=1.0, coarse_below=-5.0),
}
