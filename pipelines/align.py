"""Cross-tokenizer alignment: which teacher tokens and which student tokens cover the same text.

A student with its own tokenizer cannot read the teacher's per-token distributions directly. What the two
sides share is the text, so the alignment is defined on its UTF-8 bytes.

- **Byte ends** (`encode_with_byte_ends`): each token's byte offset where it ends, from a fast tokenizer's
  character offsets, made a partition of the text (zero-width special tokens, uncovered bytes to the next
  token, a split character's tokens all ending at its last byte). Tokenizers without offsets are refused.
- **Groups** (`align_groups`, numba, linear time): the shortest runs of teacher and student tokens that
  start and end at a byte where both tokenizers cut.
- **Windows** (`window_groups`): a window keeps the groups lying entirely inside it; a group on a window's
  edge has no target there.
- **Vocabulary map** (`token_byte_strings`, `vocab_map`): every token spelled as the bytes it stands for
  (byte-level BPE, SentencePiece with byte fallback, WordPiece), a teacher id mapped to the student id with
  the same bytes; injective, special tokens never map.

docs/build.md "Cross-tokenizer alignment" has the rules in full: what a clean boundary is, what "same
bytes" means for normalizing tokenizers, and where offsets are only as good as the tokenizer.
"""

from __future__ import annotations

import json
import re
from itertools import chain

import numba
import numpy as np

from logitstore.text.tokenizer_io import TokenizerError, is_raw_tokenizer, require_fast

__all__ = ["align_groups", "encode_with_byte_ends", "token_byte_strings", "vocab_map", "window_groups"]


# ---------------------------------------------------------------------------------------------
# Tokenization with byte ends


def encode_with_byte_ends(
    tokenizer, texts: list[str], *, add_special_tokens: bool = True
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Token ids and byte ends per text, from one batched tokenizer call.

    The ids are exactly what `tokenizer(texts)["input_ids"]` gives (special tokens included), so they
    index the same positions as the teacher's stored distributions. Rendered chat text holds its
    special tokens already: pass `add_special_tokens=False`, as `apply_chat_template(tokenize=True)` does."""
    require_fast(tokenizer)
    if isinstance(texts, str):
        raise TypeError("encode_with_byte_ends takes a list of texts, not one str")
    texts = list(texts)
    if not texts:
        return []
    id_lists, offset_lists = _encode(tokenizer, texts, add_special_tokens=add_special_tokens)
    counts = np.fromiter((len(x) for x in id_lists), dtype=np.int64, count=len(texts))
    n = int(counts.sum())
    ids = np.fromiter(chain.from_iterable(id_lists), dtype=np.int64, count=n)
    offsets = np.fromiter(chain.from_iterable(chain.from_iterable(offset_lists)), dtype=np.int64, count=2 * n)
    offsets = offsets.reshape(n, 2)

    # Byte position of every character boundary of all texts, laid end to end.
    joined = "".join(texts)
    cps = np.frombuffer(joined.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
    width = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
    byte_at = np.zeros(len(cps) + 1, dtype=np.int64)
    np.cumsum(width, out=byte_at[1:])
    char_base = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in texts], out=char_base[1:])
    byte_base = byte_at[char_base]  # [texts + 1]

    text_of = np.repeat(np.arange(len(texts)), counts)
    start = byte_at[char_base[text_of] + offsets[:, 0]]
    end = byte_at[char_base[text_of] + offsets[:, 1]]
    first = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(counts, out=first[1:])
    has = counts > 0
    last = first[1:][has] - 1

    # Global positions keep every text's tokens after the previous text's, so one accumulate serves all.
    ends = np.maximum.accumulate(end) if n else end
    ends[last] = byte_base[1:][has]
    # A token that starts before the previous one ends shares a character with it: no cut between them.
    split = np.zeros(n, dtype=bool)  # split[j]: boundary before token j is inside a character
    if n > 1:
        split[1:] = (start[1:] < end[1:]) & (start[1:] < ends[:-1])
        split[first[:-1][has]] = False
    if split.any():
        clean = np.flatnonzero(~np.append(split[1:], False))  # tokens after which a cut is allowed
        ends = ends[clean[np.searchsorted(clean, np.arange(n))]]
    ends -= byte_base[text_of]
    cut = first[1:-1]
    return list(zip(np.split(ids, cut), np.split(ends, cut)))


def _encode(tokenizer, texts, *, add_special_tokens: bool = True):
    if is_raw_tokenizer(tokenizer):
        encodings = tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings], [e.offsets for e in encodings]
    try:
        enc = tokenizer(texts, return_offsets_mapping=True, add_special_tokens=add_special_tokens)
    except NotImplementedError as exc:
        raise TokenizerError(f"{type(tokenizer).__name__} gives no offsets; logitstore needs a fast tokenizer") from exc
    return enc["input_ids"], enc["offset_mapping"]


# ---------------------------------------------------------------------------------------------
# Groups


def align_groups(teacher_ends: np.ndarray, student_ends: np.ndarray) -> np.ndarray:
    """Rows (t0, t1, s0, s1): half-open teacher and student token ranges that cover the same bytes.

    Groups are in order, contiguous and together hold every token of both sides. A side has no
    tokens in a group only in degenerate input: when that side has no tokens at all, or all tokens
    are zero-width (an empty text with BOS/EOS), in which case everything is one final group."""
    t = np.ascontiguousarray(teacher_ends, dtype=np.int64)
    s = np.ascontiguousarray(student_ends, dtype=np.int64)
    if t.ndim != 1 or s.ndim != 1:
        raise ValueError("align_groups: ends must be 1-D")
    return _align_kernel(t, s)


@numba.njit(cache=True, nogil=True)
def _align_kernel(a, b):
    n, m = a.shape[0], b.shape[0]
    out = np.empty((n + m + 1, 4), dtype=np.int32)
    g = 0
    i = j = 0
    gi = gj = 0
    start = 0
    big = np.iinfo(np.int64).max
    while i < n or j < m:
        ea = a[i] if i < n else big
        eb = b[j] if j < m else big
        if ea <= eb:
            i += 1
        if eb <= ea:
            j += 1
        ca = a[i - 1] if i > 0 else 0
        cb = b[j - 1] if j > 0 else 0
        if ca == cb and ca > start:
            while i < n and a[i] == ca:
                i += 1
            while j < m and b[j] == cb:
                j += 1
            out[g, 0] = gi
            out[g, 1] = i
            out[g, 2] = gj
            out[g, 3] = j
            g += 1
            gi, gj, start = i, j, ca
    if gi < n or gj < m:
        out[g, 0] = gi
        out[g, 1] = n
        out[g, 2] = gj
        out[g, 3] = m
        g += 1
    return out[:g].copy()


def window_groups(groups: np.ndarray, *, t_start: int, t_stop: int) -> tuple[np.ndarray, int, int]:
    """The groups inside teacher window [t_start, t_stop), rebased to the window.

    Returns (rows, s_start, s_stop): teacher indices relative to t_start, student indices relative to
    s_start, and [s_start, s_stop) the document's student tokens that the kept groups hold. Groups
    cut by the window's edges are dropped; a group with no teacher tokens belongs to the window its
    position t0 is in."""
    groups = np.asarray(groups)
    if groups.ndim != 2 or groups.shape[1] != 4:
        raise ValueError("window_groups: groups must be [G, 4]")
    if t_stop < t_start:
        raise ValueError(f"window_groups: t_stop {t_stop} < t_start {t_start}")
    # t0 and t1 are non-decreasing, so the kept groups are one run found by two binary searches.
    lo = int(np.searchsorted(groups[:, 0], t_start, side="left"))
    hi = min(
        int(np.searchsorted(groups[:, 1], t_stop, side="right")),
        int(np.searchsorted(groups[:, 0], t_stop, side="left")),
    )
    if hi <= lo:
        s = int(groups[lo, 2]) if lo < len(groups) else (int(groups[-1, 3]) if len(groups) else 0)
        return np.zeros((0, 4), dtype=np.int32), s, s
    kept = groups[lo:hi].astype(np.int32, copy=True)
    s_start, s_stop = int(kept[0, 2]), int(kept[-1, 3])
    kept[:, :2] -= t_start
    kept[:, 2:] -= s_start
    return kept, s_start, s_stop


# ---------------------------------------------------------------------------------------------
# Vocabulary


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (openai/gpt-2 encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for byte in range(256):
        if byte not in bs:
            bs.append(byte)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_UNICODE_TO_BYTE = {ord(c): b for b, c in _bytes_to_unicode().items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_bytes(piece: str) -> bytes:
    try:
        return piece.translate(_UNICODE_TO_BYTE).encode("latin-1")
    except UnicodeEncodeError:  # a character outside the byte alphabet: it stands for itself
        return b"".join(
            bytes([_UNICODE_TO_BYTE[ord(ch)]]) if ord(ch) in _UNICODE_TO_BYTE else ch.encode("utf-8") for ch in piece
        )


def _components(node):
    """Every typed component of a tokenizer-JSON section, inside Sequences too."""
    if isinstance(node, dict):
        if "type" in node:
            yield node
        for key in ("pretokenizers", "decoders", "normalizers", "processors"):
            for child in node.get(key) or ():
                yield from _components(child)
    elif isinstance(node, list):
        for child in node:
            yield from _components(child)


def _family(spec: dict) -> dict:
    model = spec.get("model") or {}
    parts = [c for key in ("pre_tokenizer", "decoder", "normalizer") for c in _components(spec.get(key))]
    types = {c["type"] for c in parts}
    fam = {
        "byte_level": "ByteLevel" in types,
        "space": None,
        "byte_fallback": bool(model.get("byte_fallback")) or "ByteFallback" in types,
        "prefix": "",
    }
    for c in parts:
        if c["type"] == "Metaspace":
            fam["space"] = c.get("replacement") or "▁"
        elif c["type"] == "Replace" and "▁" in json.dumps(c, ensure_ascii=False):
            fam["space"] = fam["space"] or "▁"  # Llama-style: Replace(" ", "▁") normalizer, Replace back in decoder
        elif c["type"] == "WordPiece" and "prefix" in c:
            fam["prefix"] = c["prefix"]
    if model.get("type") in ("WordPiece", "BPE") and model.get("continuing_subword_prefix"):
        fam["prefix"] = model["continuing_subword_prefix"]
    elif model.get("type") == "WordPiece" and not fam["prefix"]:
        fam["prefix"] = "##"
    return fam


def token_byte_strings(tokenizer) -> list[bytes | None]:
    """The bytes each token id stands for in text; None for special tokens and unknown ids.

    This is what two vocabularies can be compared on: the same text piece is `Ġthe` in byte-level
    BPE, `▁the` in SentencePiece and ` the` in the text."""
    require_fast(tokenizer)
    raw = is_raw_tokenizer(tokenizer)
    backend = tokenizer if raw else tokenizer.backend_tokenizer
    spec = json.loads(backend.to_str())
    fam = _family(spec)
    size = backend.get_vocab_size(with_added_tokens=True) if raw else len(tokenizer)
    special = {a["id"] for a in spec.get("added_tokens") or () if a.get("special")}
    added = {a["id"]: a["content"] for a in spec.get("added_tokens") or () if not a.get("special")}
    if not raw:
        special.update(tokenizer.all_special_ids)
        for tid, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
            if getattr(tok, "special", False):
                special.add(tid)
            else:
                added.setdefault(tid, str(tok))
    pieces = [backend.id_to_token(i) for i in range(size)]

    space, prefix, fallback, byte_level = fam["space"], fam["prefix"], fam["byte_fallback"], fam["byte_level"]
    out: list[bytes | None] = []
    for i, piece in enumerate(pieces):
        if piece is None or i in special:
            out.append(None)
            continue
        if i in added:  # added tokens are matched in raw text, so their content is the text itself
            out.append(added[i].encode("utf-8"))
            continue
        if fallback and (m := _BYTE_TOKEN.fullmatch(piece)):
            out.append(bytes([int(m.group(1), 16)]))
            continue
        if prefix and piece.startswith(prefix) and len(piece) > len(prefix):
            piece = piece[len(prefix) :]
        if byte_level:
            out.append(_byte_level_bytes(piece))
            continue
        if space:
            piece = piece.replace(space, " ")
        out.append(piece.encode("utf-8"))
    return out


def vocab_map(teacher_tokenizer, student_tokenizer, *, teacher_vocab_size: int) -> np.ndarray:
    """Teacher id -> student id with the same bytes, or -1; int32 [teacher_vocab_size].

    Injective, so the teacher's mass on mapped ids moves to distinct student ids and no student id
    collects two teacher entries: among teacher ids that spell the same bytes only the lowest maps,
    and it maps to the lowest student id with those bytes. Ids past the tokenizer (the padding rows
    of a model's output layer) and special tokens map to -1."""
    teacher = token_byte_strings(teacher_tokenizer)
    student = token_byte_strings(student_tokenizer)
    if len(teacher) > teacher_vocab_size:
        raise TokenizerError(
            f"teacher tokenizer has {len(teacher)} tokens, more than teacher_vocab_size={teacher_vocab_size}"
        )
    lowest: dict[bytes, int] = {}
    for sid, b in enumerate(student):
        if b:
            lowest.setdefault(b, sid)
    out = np.full(teacher_vocab_size, -1, dtype=np.int32)
    taken: set[bytes] = set()
    tids, sids = [], []
    for tid, b in enumerate(teacher):
        if b and b not in taken and b in lowest:
            taken.add(b)
            tids.append(tid)
            sids.append(lowest[b])
    out[np.asarray(tids, dtype=np.int64)] = np.asarray(sids, dtype=np.int32)
    return out
