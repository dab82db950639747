"""Where a store keeps what: the one place that spells its paths, its array names and the axis each
part array runs along. Every module that reads or writes the tree asks here.

One store is one Icechunk repository (plus the Parquet indexes beside it, `store/index.py`):

    /                                   attrs["logitstore"]: format version, creation time, writer
    /teachers/<name>/                   attrs["logitstore_teacher"]: `TeacherMeta` (hashes, vocab, sparsity, codec)
    /teachers/<name>/code_of_id         uint32 [vocab]   the codec's id renumbering (frequency order)
    /teachers/<name>/tokenizer          uint8  [bytes]   tokenizer.json, so `show` can decode without the model
    /teachers/<name>/parts/<part>/...   one immutable group per write: the arrays of `codec.EncodedSamples`,
                                        as one Zarr array each ("arrays") or packed into one (`PACKED`)
    /teachers/<name>/students/<s>/      attrs["logitstore_student"]: a student tokenizer of this teacher
                                        (name, hash, vocab size, the mapped share of the teacher's mass)
    /teachers/<name>/students/<s>/tokenizer  uint8 [bytes]  its tokenizer.json
    /teachers/<name>/students/<s>/vocab_map  int32 [vocab]  teacher id -> student id with identical bytes, or -1
    /teachers/<name>/parts/<part>/students/<s>/ids        int32 [N]    the samples' student token ids
    /teachers/<name>/parts/<part>/students/<s>/groups     int32 [4 G]  alignment groups (t0, t1, s0, s1)
    /teachers/<name>/parts/<part>/students/<s>/loss_mask  uint8 [N]    chat data: student tokens in the completion
    /teachers/<name>/parts/<part>/prompts  uint8 [bytes]  generated answers: each one's prompt as given (`PROMPTS`)

A part's arrays are stored one of three ways (`TeacherMeta.part_layout`, `TeacherMeta.packs`): since
store format 3 packed, as `parts/<part>/packed`, one uint8 array of one chunk (one object) that holds
every array's shards end to end, its attribute `MEMBERS` saying where each array's shards lie and each
array's own zarr.json (`storage/packed.py` presents them as ordinary Zarr arrays again); since format 4 the
part's student-token arrays are members too, named by their path in the part (`student_arrays`:
`students/<s>/ids`, ...), so no `students` group is written; in format 3 they are arrays of their own
under `students/<s>/`; before format 3 every array is one sharded Zarr array of its own.

A part's arrays (`PART_ARRAYS`) run along one of three axes (`AXIS`): a sample of T tokens has T
elements on the token axis, T - 1 on the position axis (position t predicts token t + 1) and one per
stored entry on the entry axis; the index rows (`store/index.py`) give each sample's start on each axis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec

from logitstore.format.zarr_codec import LogprobGrid

if TYPE_CHECKING:  # annotations only
    import icechunk

    from logitstore.format.grid import CodecParams

TEACHERS, PARTS, STUDENTS = "teachers", "parts", "students"  # the groups that hold teachers, parts, students

# The arrays of a part, in the order `codec.EncodedSamples` holds them; `entry_counts` only for sampled
# teachers, `loss_mask` only for chat data.
PART_ARRAYS = (
    "input_ids",
    "n_entries",
    "entry_codes",
    "entry_logprobs",
    "tail",
    "target_logprobs",
    "entry_counts",
    "loss_mask",
)
AXIS = {
    "input_ids": "token",
    "loss_mask": "token",
    "n_entries": "position",
    "tail": "position",
    "target_logprobs": "position",
    "entry_codes": "entry",
    "entry_logprobs": "entry",
    "entry_counts": "entry",
}

# What a sample's content hash (the index's `content_hash`, `store/index.py`) covers, in the order hashed:
# its slice of each of these arrays that the part holds (along the array's axis), then each student
# tokenizer's ids, groups and loss mask.
HASHED_ARRAYS = (
    "input_ids",
    "loss_mask",
    "n_entries",
    "tail",
    "target_logprobs",
    "entry_codes",
    "entry_logprobs",
    "entry_counts",
)

# The Zarr data types a part's arrays are stored as (`codec.EncodedSamples`): token ids and entry codes
# in 16 or 32 bits by the vocabulary; log-probabilities float32 through the grid codec (uint16 codes
# before store format 2); a student tokenizer's ids and groups int32, its loss mask uint8.
DATA_TYPES = {
    "input_ids": ("uint16", "uint32"),
    "n_entries": ("uint16",),
    "entry_codes": ("uint16", "uint32"),
    "entry_logprobs": ("float32", "uint16"),
    "tail": ("float32", "uint16"),
    "target_logprobs": ("float32", "uint16"),
    "entry_counts": ("uint16",),
    "loss_mask": ("uint8",),
}
STUDENT_DATA_TYPES = {"ids": ("int32",), "groups": ("int32",), "loss_mask": ("uint8",)}


def data_types(name: str) -> tuple[str, ...]:
    """The data types a part's array (its path in the part) may be stored as."""
    if is_student_array(name):
        return STUDENT_DATA_TYPES.get(name.rsplit("/", 1)[-1], ())
    return DATA_TYPES.get(name, ())


# A part of generated answers (`build --generate`): each answer's prompt as the user gave it, UTF-8 JSON
# lines, one per answer in the part's sample order (`store/generation.py`: `prompt_lines`). Never packed:
# only an export reads it, so the trainer's one read per part does not carry it. Parts written before
# prompts were kept have none.
PROMPTS = "prompts"

# A packed part (store format 3): the one array holding the part's arrays, and its attribute that says
# where: {name: {"zarr": the array's zarr.json, "objects": [[offset, length] or null per shard]}}.
PACKED = "packed"
MEMBERS = "logitstore_members"


def part_arrays(*, sampled: bool, chat: bool) -> tuple[str, ...]:
    """The arrays every part of a teacher holds: `entry_counts` for a sampled one, `loss_mask` for chat data."""
    return tuple(n for n in PART_ARRAYS if (n != "entry_counts" or sampled) and (n != "loss_mask" or chat))


# The log-probability arrays: since store format 2 declared float32 through the grid codec (`zarr_codec.py`).
GRID_ARRAYS = ("entry_logprobs", "target_logprobs", "tail")

# A teacher's arrays outside its parts, and a student tokenizer's.
CODE_OF_ID = "code_of_id"
TOKENIZER = "tokenizer"
VOCAB_MAP = "vocab_map"
# A part's arrays of one student tokenizer: ids, groups, and loss_mask for chat data.
STUDENT_IDS, STUDENT_GROUPS, STUDENT_LOSS_MASK = "ids", "groups", "loss_mask"


def teacher_path(teacher: str) -> str:
    return f"{TEACHERS}/{teacher}"


def parts_path(teacher: str) -> str:
    """The group holding a teacher's parts."""
    return f"{teacher_path(teacher)}/{PARTS}"


def part_path(teacher: str, part: str) -> str:
    return f"{parts_path(teacher)}/{part}"


def packed_path(teacher: str, part: str) -> str:
    """A packed part's one array (store format 3, `storage/packed.py`)."""
    return f"{part_path(teacher, part)}/{PACKED}"


def student_path(teacher: str, student: str) -> str:
    """A student tokenizer registered with a teacher (its tokenizer and vocabulary map)."""
    return f"{teacher_path(teacher)}/{STUDENTS}/{student}"


def part_students_path(teacher: str, part: str) -> str:
    """The group holding a part's student tokens, one group per student tokenizer."""
    return f"{part_path(teacher, part)}/{STUDENTS}"


def part_student_path(teacher: str, part: str, student: str) -> str:
    """One student tokenizer's arrays of a part (`STUDENT_IDS`, `STUDENT_GROUPS`, `STUDENT_LOSS_MASK`)."""
    return f"{part_students_path(teacher, part)}/{student}"


def student_arrays(student: str, *, chat: bool) -> tuple[str, ...]:
    """One student tokenizer's arrays of a part, as paths in the part (`part_student_path` relative to
    `part_path`): ids, groups, and loss_mask for chat data. Also their member names in a packed part."""
    names = (STUDENT_IDS, STUDENT_GROUPS) + ((STUDENT_LOSS_MASK,) if chat else ())
    return tuple(f"{STUDENTS}/{student}/{name}" for name in names)


def is_student_array(name: str) -> bool:
    """Whether a part's array (its path in the part) is a student tokenizer's."""
    return name.startswith(f"{STUDENTS}/")


def in_a_part(path: str) -> bool:
    """Whether a node's path lies inside a part (the samples' arrays) rather than beside the parts."""
    return f"/{PARTS}/" in f"/{path}/"


def teacher_array(path: str) -> tuple[str, str | None, str] | None:
    """(teacher, student tokenizer or None, array name) of a teacher-level array's path
    (`teachers/<t>/<name>` or `teachers/<t>/students/<s>/<name>`); None for any other path."""
    parts = path.split("/")
    if len(parts) == 3 and parts[0] == TEACHERS:
        return parts[1], None, parts[2]
    if len(parts) == 5 and parts[0] == TEACHERS and parts[2] == STUDENTS:
        return parts[1], parts[3], parts[4]
    return None


def spans(*, token_start, position_start, entry_start, n_tokens, n_entries) -> dict[str, tuple]:
    """Per axis, the [start, stop) of samples' elements, from their index columns (numbers or arrays)."""
    return {
        "token": (token_start, token_start + n_tokens),
        "position": (position_start, position_start + n_tokens - 1),
        "entry": (entry_start, entry_start + n_entries),
    }


def row_slices(row: dict, names) -> dict[str, slice]:
    """One index row's (a dict from `index.to_pylist()`) slice of each named part array."""
    by_axis = spans(
        token_start=row["token_start"],
        position_start=row["position_start"],
        entry_start=row["entry_start"],
        n_tokens=row["n_tokens"],
        n_entries=row["n_entries"],
    )
    return {name: slice(*by_axis[AXIS[name]]) for name in names}


# -- how each array is chunked and compressed ---------------------------------------------------------

# Chunking, measured in benchmarks/codec.py: an inner chunk (the unit of reading) holds 256 KiB of
# encoded values, about 2k tokens of top-64 entries, so one sample's read touches a few chunks; a
# shard (the unit of writing, one object) holds up to 64 of them, a few MB compressed: large enough
# that object-store request overhead is small, small enough that a part's last shard wastes little.
CHUNK_BYTES = 256 * 1024
CHUNKS_PER_SHARD = 64
# Blosc's level (byte-shuffle first, which suits small uint16 codes; Blosc runs zstd at level 2 x this - 1).
# Measured on the default teacher at top-64, one core: level 3 97.8 B/token at 434k tokens/s, 5 95.3 at
# 225k, 7 93.6 at 77k. Level 4 against 5, a part of 16.9k tokens, medians of 9 alternating runs: top-64 at a
# 151,936-token vocabulary 42 ms against 65 ms for 0.2% more bytes, sampled-16 5.0 against 7.1 ms for 0.4%
# more: the build's host side and the writer spend a third of their CPU here.
BLOSC_LEVEL = 4


def array_kwargs(values: np.ndarray, *, grid: CodecParams | None = None) -> dict:
    """How a 1-D array is laid out (`zarr.create_array`'s arguments): one definition for both write paths.
    With `grid`, the array is float32 log-probabilities stored as these uint16 codes (`zarr_codec.py`)."""
    itemsize = values.dtype.itemsize
    chunk = max(1, CHUNK_BYTES // itemsize)
    n_chunks = max(1, -(-len(values) // chunk))
    shard = chunk * min(CHUNKS_PER_SHARD, n_chunks)
    blosc = BloscCodec(
        typesize=itemsize, cname="zstd", clevel=BLOSC_LEVEL, shuffle="shuffle" if itemsize > 1 else "noshuffle"
    )
    if grid is not None:
        assert values.dtype == np.uint16, "grid-coded arrays are written from their uint16 codes"
        return dict(
            shape=values.shape,
            dtype=np.float32,
            chunks=(chunk,),
            shards=(shard,),
            filters=[LogprobGrid.of(grid)],
            compressors=[blosc, Crc32cCodec()],
            fill_value=0.0,
        )
    return dict(
        shape=values.shape,
        dtype=values.dtype,
        chunks=(chunk,),
        shards=(shard,),
        compressors=[blosc, Crc32cCodec()],
        fill_value=0,
    )


# -- typed access ---------------------------------------------------------------------------------------

# zarr types every member of a group as an array or a group, every read of an array as any array-like or
# scalar, and every attribute as any JSON value; the store's layout fixes which one each is.


def group_at(parent: zarr.Group, path: str) -> zarr.Group:
    """`parent[path]`, where the store's layout puts a group."""
    return cast(zarr.Group, parent[path])


def array_at(parent: zarr.Group, path: str) -> zarr.Array:
    """`parent[path]`, where the store's layout puts an array."""
    return cast(zarr.Array, parent[path])


def read_values(array: zarr.Array, rows: slice = slice(None)) -> np.ndarray:
    """`array[rows]` of a 1-D array: a numpy array."""
    return cast(np.ndarray, array[rows])


def json_attr(node: zarr.Group | zarr.Array, key: str) -> dict:
    """An attribute that logitstore writes as a JSON object (its "logitstore", "logitstore_teacher", ...)."""
    return cast(dict, node.attrs[key])


def root_attrs(session: icechunk.Session) -> dict:
    try:
        return dict(zarr.open_group(session.store, mode="r").attrs)
    except zarr.errors.GroupNotFoundError:
        return {}
