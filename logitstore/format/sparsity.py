"""Which entries of the teacher's next-token distribution a store keeps: one type, `Sparsity`.

    topk     the k most probable tokens
    topp     the smallest set of top tokens whose probability (at the selection temperature) reaches p,
             capped at k; the rest of the top-k joins the tail
    sampled  n draws from the teacher distribution at the temperature, stored as distinct ids with
             counts (unbiased: Anshumann et al. 2025, "Sparse Logit Sampling")

plus the selection temperature (stored log-probabilities are always at temperature 1) and the value
grid the log-probabilities are quantised to (`grid.CodecParams`; `grid.GRIDS` names three).

A `Sparsity` comes from build's (and live train's) flags (`sparsity_from_flags`), from a store's teacher
metadata (`Sparsity.from_meta`, which `TeacherMeta` holds), or is `default_sparsity()`: the one default.

A config holds the sparsity as asked (`SparsityRequest`, made by `requested`): the `Sparsity` its flags name,
or, where none of --top-k/--top-p/--sample is given, the flags themselves, which only an engine can settle
(`pipelines/engines/base.py`'s `Engine.settle`: sampled 16, top-64, or a served teacher's K). How the
entries are selected from a forward pass lives in `pipelines/sparsify.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, TypeAlias, get_args

from logitstore.errors import LogitstoreError
from logitstore.format.grid import GRIDS, CodecParams
from logitstore.options import option

Mode = Literal["topk", "topp", "sampled"]
MODES: tuple[Mode, ...] = get_args(Mode)


class SparsityError(LogitstoreError, ValueError):
    """Sparsity flags or metadata that contradict each other or are out of range; the message names the flag."""


# K of top-k when no --top-k is given: the cap of --top-p, the top-k default (`DEFAULT_TOPK`) and a served
# teacher's K (at most the server's maximum).
DEFAULT_K = 64


@dataclass(frozen=True)
class Sparsity:
    mode: Mode = "topk"
    k: int = DEFAULT_K
    p: float | None = None
    n: int | None = None
    temperature: float = 1.0
    grid: CodecParams = field(default_factory=CodecParams)  # the value grid (stored as the teacher's codec)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SparsityError(f"sparsity mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.k < 1:
            raise SparsityError(f"--top-k must be at least 1, got {self.k}")
        if self.mode == "topp" and not (self.p is not None and 0 < self.p <= 1):
            raise SparsityError(f"--top-p must be in (0, 1], got {self.p}")
        if self.mode == "sampled" and not (self.n is not None and 1 <= self.n <= 65535):
            raise SparsityError(f"--sample must be between 1 and 65535 draws, got {self.n}")
        if not self.temperature > 0:
            raise SparsityError(f"--temperature must be positive, got {self.temperature}")

    @property
    def sampled(self) -> bool:
        """Entries are distinct draws with counts (the loss uses the sampled estimator)."""
        return self.mode == "sampled"

    @property
    def width(self) -> int:
        """Entries the forward pass produces per position before selection."""
        if self.sampled:
            assert self.n is not None  # __post_init__ requires n for sampled mode
            return self.n
        return self.k

    def describe(self) -> str:
        """As a user would write it: "top-64", "top-p 0.95 (cap 64)", "sampled 16", with the temperature."""
        text = {"topk": f"top-{self.k}", "topp": f"top-p {self.p} (cap {self.k})", "sampled": f"sampled {self.n}"}[
            self.mode
        ]
        return text if self.temperature == 1 else f"{text} at temperature {self.temperature}"

    def to_json(self) -> dict:
        """The teacher metadata's `sparsity` field (the grid is stored apart, as the teacher's codec)."""
        out = {"mode": self.mode, "k": self.k, "p": self.p, "n": self.n, "temperature": self.temperature}
        if self.mode != "topp":
            out.pop("p")
        if self.mode != "sampled":
            out.pop("n")
        else:
            out.pop("k")
        return out

    @classmethod
    def from_meta(cls, sparsity: dict, codec: CodecParams | None = None) -> Sparsity:
        """A sparsity as a store's teacher metadata records it (its `sparsity` and `codec` JSON)."""
        known = {key: sparsity[key] for key in ("mode", "k", "p", "n", "temperature") if key in sparsity}
        return cls(**known, grid=codec if codec is not None else CodecParams())


# The one default, for `logitstore build`, `train --live-teacher`, `BuildConfig` and `LiveConfig`: 16
# draws per position, the smallest variant of benchmarks/frontier.py whose student matched (in fact beat)
# top-64 fp16 entries, at ~21 bytes/token (docs: "Choosing a budget"). Top-64 where the teacher's
# probabilities of the entries themselves are needed: cross-tokenizer alignment, and engines that
# cannot draw exactly (none does: the vLLM engine draws through its hidden-state output).
DEFAULT_SAMPLED = Sparsity(mode="sampled", n=16)
DEFAULT_TOPK = Sparsity(k=DEFAULT_K)


def default_sparsity(*, student_tokenizers: bool = False, engine_samples: bool = True) -> Sparsity:
    """The default when no --top-k/--top-p/--sample is given: sampled 16, or top-64 when the build aligns
    student tokenizers or its engine cannot draw samples (`engine_samples=False`)."""
    return DEFAULT_SAMPLED if engine_samples and not student_tokenizers else DEFAULT_TOPK


def sparsity_from_flags(
    *,
    top_k: int | None,
    top_p: float | None,
    sample: int | None,
    temperature: float,
    default: Sparsity,
    grid: str | CodecParams = "default",
) -> Sparsity:
    """The sparsity of build's and live train's flags; `default` when none of --top-k/--top-p/--sample
    is given (at `temperature`). `grid` is a name of `GRIDS` (--value-grid) or a `CodecParams`."""
    if top_p is not None and sample is not None:
        raise SparsityError("choose one of --top-p and --sample")
    if sample is not None and top_k is not None:
        raise SparsityError("choose one of --top-k and --sample (--top-k caps --top-p only)")
    if isinstance(grid, str):
        if grid not in GRIDS:
            raise SparsityError(f"--value-grid must be one of {', '.join(GRIDS)}, got {grid!r}")
        grid = GRIDS[grid]
    if top_k is None and top_p is None and sample is None:
        return replace(default, temperature=temperature, grid=grid)
    mode: Mode = "sampled" if sample is not None else "topp" if top_p is not None else "topk"
    return Sparsity(
        mode=mode, k=DEFAULT_K if top_k is None else top_k, p=top_p, n=sample, temperature=temperature, grid=grid
    )


PANEL = "Sparsity"


@dataclass(frozen=True)
class SparsityFlags:
    """What `--top-k`, `--top-p`, `--sample`, `--temperature` and `--value-grid` ask for (build's flags,
    and live train's); `resolve(default)` is the `Sparsity` they make, `of(sparsity)` the inverse."""

    top_k: int | None = option(
        None, panel=PANEL, help="Store the top K entries per position (the cap, with --top-p: default 64)."
    )
    top_p: float | None = option(
        None, panel=PANEL, help="Keep the smallest set of top entries reaching this probability, capped at --top-k."
    )
    sample: int | None = option(
        None,
        panel=PANEL,
        help="Store N draws per position as distinct ids with counts (unbiased). Default without any of --top-k/--top-p/--sample: --sample 16, or --top-k 64 with --student-tokenizer.",
    )
    temperature: float = option(
        1.0, panel=PANEL, help="Temperature for selecting/sampling entries; stored log-probabilities stay at 1."
    )
    value_grid: str = option(
        "default",
        panel=PANEL,
        choices=lambda: GRIDS,
        help="Log-probability grid: default (0.025-nat bound above -5 nats), fine (0.001, finer than fp16) or coarse (0.05); see 'Choosing a budget'.",
    )

    @property
    def given(self) -> bool:
        """Whether these flags name a sparsity (one of --top-k, --top-p, --sample); else an engine's
        default applies, at these flags' temperature and grid."""
        return self.top_k is not None or self.top_p is not None or self.sample is not None

    def resolve(self, default: Sparsity) -> Sparsity:
        return sparsity_from_flags(
            top_k=self.top_k,
            top_p=self.top_p,
            sample=self.sample,
            temperature=self.temperature,
            default=default,
            grid=self.value_grid,
        )

    @classmethod
    def of(cls, sparsity: Sparsity) -> SparsityFlags:
        """The flags that ask for `sparsity` (its grid must be one of `GRIDS`)."""
        grid = next((name for name, params in GRIDS.items() if params == sparsity.grid), None)
        if grid is None:
            raise SparsityError(f"the value grid {sparsity.grid} has no name (--value-grid takes {', '.join(GRIDS)})")
        return cls(
            top_k=None if sparsity.sampled else sparsity.k,
            top_p=sparsity.p if sparsity.mode == "topp" else None,
            sample=sparsity.n if sparsity.sampled else None,
            temperature=sparsity.temperature,
            value_grid=grid,
        )


# A config's sparsity until an engine settles it: a `Sparsity` where the flags name one, else the flags
# (`SparsityFlags`, none of --top-k/--top-p/--sample given), whose temperature and grid the default takes.
SparsityRequest: TypeAlias = "Sparsity | SparsityFlags"


def requested(value: Sparsity | SparsityFlags | None) -> Sparsity | SparsityFlags:
    """`value` as a config keeps it (`SparsityRequest`): flags that name a sparsity become it (checked
    here, so a contradiction is refused before anything loads); None asks for the default."""
    if value is None:
        return SparsityFlags()
    if isinstance(value, SparsityFlags):
        settled = value.resolve(DEFAULT_SAMPLED)  # refuses bad flags now; the default is only taken if none given
        return settled if value.given else value
    return value


def settle(request: Sparsity | SparsityFlags, *, default: Sparsity) -> Sparsity:
    """The sparsity `request` asks for: itself, or `default` at the request's temperature and grid."""
    return request if isinstance(request, Sparsity) else request.resolve(default)


def flags_of(request: Sparsity | SparsityFlags) -> SparsityFlags:
    """The flags that make `request` (what print-config shows)."""
    return request if isinstance(request, SparsityFlags) else SparsityFlags.of(request)
