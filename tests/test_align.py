"""Cross-tokenizer alignment on real tokenizers, no mocks.

Six tokenizers of four families: the default teacher's (SmolLM2, byte-level BPE read from its GGUF
file), GPT-2 (byte-level BPE), GPT-2 again as a raw `tokenizers.Tokenizer` whose post-processor trims
whitespace off offsets, a SentencePiece-style Unigram with byte fallback twice (a Metaspace
pre-tokenizer with BOS and EOS from a TemplateProcessing post-processor; Llama 2's layout with a
Prepend/Replace normalizer and BOS only) and a lowercasing WordPiece, the trained ones trained here
on the shipped sample corpus. Every pair is aligned on hand-picked hard text and on hypothesis text.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logitstore.data import SAMPLE_CORPUS
from logitstore.errors import LogitstoreError
from logitstore.pipelines.align import align_groups, encode_with_byte_ends, token_byte_strings, vocab_map, window_groups
from logitstore.testing.gpt2 import gpt2_tokenizer
from logitstore.text.tokenizer_io import TokenizerError, load_tokenizer, parse_tokenizer_spec

HARD_TEXTS = [
    "",
    " ",
    "   \n\n\t  ",
    "Hello world",
    " leading space, then  two  spaces and a trailing one ",
    "héllo naïve café Ærøskøbing straße",
    "日本語のテキストと中文",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 done",
    "12345 3.14159 1,000,000 2024-01-31",
    "def f(x):\n    if x:\n\treturn x ** 2\n    return None\n\n\n",
    "tabs\t\tand\r\nwindows newlines",
    "a.\n\nx",
    "¿Qué? ¡Sí! «quotes» — dash … ellipsis",
    "\u200d\u200b zero-width joiner alone",
    "special tokens typed as text: <|endoftext|> <s> </s> [UNK] <|im_start|>",
]


class Tok:
    """One tokenizer under test (a plain class: hypothesis would print a dataclass's 60 kB vocabulary)."""

    def __init__(self, name: str, tok, strings: list, exact: bool, prepends: str | None):
        self.name, self.tok, self.strings = name, tok, strings  # strings: token_byte_strings(tok)
        self.exact = exact  # token strings spell the text's bytes exactly
        self.prepends = prepends  # SentencePiece: a "▁" before the first word, not in the text
        # Special tokens have no byte string, but their text in a document still matches them.
        pieces = tok.convert_ids_to_tokens if hasattr(tok, "convert_ids_to_tokens") else None
        self.specials = [pieces(i) if pieces else tok.id_to_token(i) for i, b in enumerate(strings) if b is None]

    def prepends_space(self, text: str) -> bool:
        """Metaspace prepends unless the text starts with a space; Llama's Prepend normalizer always."""
        return bool(text) and (self.prepends == "always" or (self.prepends == "unless-space" and text[0] != " "))

    @property
    def unspellable(self) -> frozenset[int]:
        """Bytes with no single-byte token: a byte-level BPE without them drops them from its ids."""
        return frozenset(range(256)) - {s[0] for s in self.strings if s is not None and len(s) == 1}

    def __repr__(self):  # hypothesis prints its arguments; the vocabulary would be 60 kB
        return f"Tok({self.name})"


def _ids(tok, text):
    if hasattr(tok, "encode_batch") and not hasattr(tok, "backend_tokenizer"):
        return tok.encode(text).ids
    return tok(text)["input_ids"]


@pytest.fixture(scope="session")
def corpus_texts():
    texts, size = [], 0
    for line in SAMPLE_CORPUS.read_text().splitlines():
        texts.append(json.loads(line)["text"])
        size += len(texts[-1])
        if size > 200_000:
            break
    return texts


@pytest.fixture(scope="session")
def smol():
    from logitstore.pipelines.teacher import describe_teacher

    return describe_teacher(None).tokenizer


@pytest.fixture(scope="session")
def gpt2():
    return gpt2_tokenizer()


@pytest.fixture(scope="session")
def gpt2_trim(gpt2):
    """A raw `tokenizers.Tokenizer` whose offsets leave out each token's whitespace (RoBERTa-style)."""
    from tokenizers import Tokenizer, processors

    raw = Tokenizer.from_str(gpt2.backend_tokenizer.to_str())
    raw.post_processor = processors.ByteLevel(trim_offsets=True)
    return raw


@pytest.fixture(scope="session")
def unigram_vocab(corpus_texts):
    """A 2000-piece Unigram vocabulary plus the 256 `<0xNN>` byte-fallback pieces."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trained = Tokenizer(models.Unigram())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(
        corpus_texts,
        trainers.UnigramTrainer(
            vocab_size=2000, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>", max_piece_length=16
        ),
    )
    # UnigramTrainer ignores byte_fallback in tokenizers 0.23, so add the byte pieces by hand.
    vocab = [tuple(v) for v in json.loads(trained.to_str())["model"]["vocab"]]
    low = min(score for _, score in vocab)
    return vocab + [(f"<0x{b:02X}>", low - 1.0) for b in range(256)]


def _sentencepiece_like(vocab, *, llama_style: bool):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    if llama_style:  # Llama 2's tokenizer.json: no pre-tokenizer, spaces become "▁" in the normalizer
        raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        raw.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        raw.pre_tokenizer = pre_tokenizers.Metaspace()
        raw.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    raw.add_special_tokens(["<unk>", "<s>", "</s>"])
    single = "<s> $A" if llama_style else "<s> $A </s>"
    raw.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", 1), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="session")
def unigram(unigram_vocab):
    """SentencePiece-style: Unigram over a Metaspace pre-tokenizer, byte fallback, BOS and EOS."""
    return _sentencepiece_like(unigram_vocab, llama_style=False)


@pytest.fixture(scope="session")
def llama_style(unigram_vocab):
    """The same model laid out as Llama 2's tokenizer.json: Prepend/Replace normalizer, BOS only."""
    return _sentencepiece_like(unigram_vocab, llama_style=True)


@pytest.fixture(scope="session")
def wordpiece(corpus_texts):
    """BERT-style, uncased: lowercases, strips accents, drops whitespace."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    raw.normalizer = normalizers.BertNormalizer(lowercase=True)
    raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    raw.decoder = decoders.WordPiece()
    raw.train_from_iterator(
        corpus_texts, trainers.WordPieceTrainer(vocab_size=2000, special_tokens=["[UNK]", "[CLS]", "[SEP]"])
    )
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")


@pytest.fixture(scope="session")
def toks(smol, gpt2, gpt2_trim, unigram, llama_style, wordpiece) -> dict[str, Tok]:
    spec = [
        ("smollm2", smol, True, None),
        ("gpt2", gpt2, True, None),
        ("gpt2-trim", gpt2_trim, True, None),
        ("unigram", unigram, True, "unless-space"),
        ("llama-style", llama_style, True, "always"),
        ("wordpiece", wordpiece, False, None),
    ]
    return {name: Tok(name, tok, token_byte_strings(tok), exact, pre) for name, tok, exact, pre in spec}


def _group_his(groups, ends, col):
    """Byte where each group ends on one side (0 where the side has had no token yet)."""
    t1 = groups[:, col].astype(np.int64)
    return np.where(t1 > 0, ends[np.maximum(t1 - 1, 0)] if len(ends) else 0, 0)


def check_pair(a: Tok, b: Tok, text: str) -> np.ndarray:
    data = text.encode("utf-8")
    ((ia, ea),) = encode_with_byte_ends(a.tok, [text])
    ((ib, eb),) = encode_with_byte_ends(b.tok, [text])
    for t, ids, ends in ((a, ia, ea), (b, ib, eb)):
        assert ids.tolist() == _ids(t.tok, text), t.name
        assert ids.dtype == np.int64 and ends.dtype == np.int64 and len(ids) == len(ends)
        if len(ends):
            assert (np.diff(ends) >= 0).all() and ends[0] >= 0 and ends[-1] == len(data), t.name

    groups = align_groups(ea, eb)
    assert groups.dtype == np.int32 and groups.ndim == 2 and groups.shape[1] == 4
    n, m = len(ia), len(ib)
    if n == 0 and m == 0:
        assert groups.shape == (0, 4)
        return groups
    # In order, contiguous, covering every token of both sides.
    assert groups[0, 0] == 0 and groups[0, 2] == 0 and groups[-1, 1] == n and groups[-1, 3] == m
    np.testing.assert_array_equal(groups[1:, 0], groups[:-1, 1])
    np.testing.assert_array_equal(groups[1:, 2], groups[:-1, 3])
    assert (groups[:, 1] >= groups[:, 0]).all() and (groups[:, 3] >= groups[:, 2]).all()
    if n == 0 or m == 0 or not data:
        assert len(groups) == 1, "a side without tokens, or an empty text: everything is one group"
        return groups
    # Both sides non-empty in every group, and both close each group at the same byte.
    assert (groups[:, 1] > groups[:, 0]).all() and (groups[:, 3] > groups[:, 2]).all()
    hi_a, hi_b = _group_his(groups, ea, 1), _group_his(groups, eb, 3)
    np.testing.assert_array_equal(hi_a, hi_b, err_msg=f"{a.name}/{b.name} {ea} {eb}")
    assert (np.diff(hi_a) > 0).all() and hi_a[0] > 0 and hi_a[-1] == len(data)
    lo = np.concatenate([[0], hi_a[:-1]])
    for t, ids, (c0, c1) in ((a, ia, (0, 1)), (b, ib, (2, 3))):
        if not t.exact or t.unspellable & set(data) or any(sp in text for sp in t.specials):
            # A tokenizer that drops a byte (see test_token_byte_strings) also shifts the offsets of the
            # tokens after it in the same word; its groups still tile the text, but not byte-exactly.
            # A special token typed into the text holds its bytes in the alignment but spells nothing.
            continue
        for k, row in enumerate(groups):
            got = b"".join(t.strings[i] or b"" for i in ids[row[c0] : row[c1]])
            want = data[lo[k] : hi_a[k]]
            if k == 0 and t.prepends_space(text):
                want = b" " + want
            assert got == want, (t.name, k, got, want)
    return groups


PAIRS = list(itertools.combinations(["smollm2", "gpt2", "gpt2-trim", "unigram", "llama-style", "wordpiece"], 2))


@pytest.mark.parametrize("text", HARD_TEXTS, ids=range(len(HARD_TEXTS)))
def test_hard_texts_every_pair(toks, text):
    for a, b in PAIRS:
        check_pair(toks[a], toks[b], text)
        check_pair(toks[b], toks[a], text)


# Everything here but "▁": Metaspace reads a literal "▁" in text as a space marker.
PIECES = list("abcxyzAQ .,;:!?()'\"-_=+*/\\{}[]<>@#$%&|~`^0123456789") + [
    "  ",
    "    ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    "é",
    "ñ",
    "ü",
    "ß",
    "Æ",
    "ő",
    "ą",
    "€",
    "日",
    "本",
    "語",
    "中",
    "ア",
    "한",
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "🇫🇷",
    "\u200d",
    "\u00a0",
    "ﬁ",
    " the",
    "The",
    "hello",
    " world",
    "def ",
    "    return ",
    "12345",
    "3.14159",
    "naïve",
    "東京都",
    "straße",
]
TEXTS = st.lists(st.sampled_from(PIECES), max_size=40).map("".join)


@settings(max_examples=120, deadline=None)
@given(text=TEXTS)
def test_random_text_every_pair(toks, text):
    for a, b in PAIRS:
        check_pair(toks[a], toks[b], text)


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(exclude_characters="▁", exclude_categories=("Cs",)), max_size=30))
def test_arbitrary_unicode_byte_level_pairs(toks, text):
    for a, b in [("smollm2", "gpt2"), ("smollm2", "unigram"), ("gpt2-trim", "llama-style")]:
        check_pair(toks[a], toks[b], text)


def test_batch_equals_one_by_one(toks):
    """One batched call lays all texts end to end; no text may leak into its neighbour."""
    for t in toks.values():
        batch = encode_with_byte_ends(t.tok, HARD_TEXTS)
        assert len(batch) == len(HARD_TEXTS)
        for text, (ids, ends) in zip(HARD_TEXTS, batch):
            ((ids1, ends1),) = encode_with_byte_ends(t.tok, [text])
            np.testing.assert_array_equal(ids, ids1)
            np.testing.assert_array_equal(ends, ends1)
    assert encode_with_byte_ends(toks["gpt2"].tok, []) == []


def test_split_characters_and_special_tokens(toks):
    # Byte-level BPE spells "日" (e6 97 a5) as " æ" + "Ĺ" + "¥", all with offsets (5, 7): one
    # token carries the character, the rest are zero-width and stay in its group.
    text = "héllo 日本語"
    ((ids, ends),) = encode_with_byte_ends(toks["smollm2"].tok, [text])
    pieces = toks["smollm2"].tok.convert_ids_to_tokens(ids.tolist())
    assert pieces[3:6] == ["Ġæ", "Ĺ", "¥"] and ends[3:6].tolist() == [10, 10, 10]
    # BOS (0, 0) joins the first group, EOS the last; the prepended "▁" shares the first character.
    ((uids, uends),) = encode_with_byte_ends(toks["unigram"].tok, ["Hello world"])
    assert uids[0] == 1 and uids[-1] == 2 and uends[0] == 0 and uends[-1] == 11
    groups = check_pair(toks["gpt2"], toks["unigram"], "Hello world")
    assert groups[0, 2] == 0 and groups[-1, 3] == len(uids)
    # Empty text: only the Unigram side has tokens (BOS, EOS), one group.
    assert check_pair(toks["gpt2"], toks["unigram"], "").tolist() == [[0, 0, 0, 2]]
    assert check_pair(toks["gpt2"], toks["smollm2"], "").shape == (0, 4)
    # Whitespace only: WordPiece has no tokens at all.
    g = check_pair(toks["smollm2"], toks["wordpiece"], "  \n\t ")
    assert g[0, 2] == g[0, 3] == 0
    # WordPiece drops the whitespace; its bytes go to the next token, the tail to the last.
    ((_, wends),) = encode_with_byte_ends(toks["wordpiece"].tok, ["  Hello   World  "])
    assert wends.tolist()[-1] == len("  Hello   World  ")


def test_align_groups_by_hand():
    def g(a, b):
        return align_groups(np.array(a, dtype=np.int64), np.array(b, dtype=np.int64)).tolist()

    assert g([3, 5], [5]) == [[0, 2, 0, 1]]
    assert g([0, 3, 5], [3, 5]) == [[0, 2, 0, 1], [2, 3, 1, 2]]  # leading BOS
    assert g([3, 3, 5], [3, 5, 5]) == [[0, 2, 0, 1], [2, 3, 1, 3]]  # zero-width tails, trailing EOS
    assert g([2, 4, 6], [3, 6]) == [[0, 3, 0, 2]]
    assert g([1, 2, 3], [1, 2, 3]) == [[0, 1, 0, 1], [1, 2, 1, 2], [2, 3, 2, 3]]
    assert g([], []) == []
    assert g([], [0, 0]) == [[0, 0, 0, 2]]
    assert g([4], []) == [[0, 1, 0, 0]]
    assert align_groups(np.array([1, 2], dtype=np.int32), np.array([2], dtype=np.uint16)).dtype == np.int32


def test_window_groups():
    groups = np.array([[0, 2, 0, 1], [2, 3, 1, 3], [3, 5, 3, 4], [5, 6, 4, 6]], dtype=np.int32)
    kept, s0, s1 = window_groups(groups, t_start=1, t_stop=5)
    assert kept.tolist() == [[1, 2, 0, 2], [2, 4, 2, 3]] and (s0, s1) == (1, 4)
    kept, s0, s1 = window_groups(groups, t_start=0, t_stop=6)
    assert kept.tolist() == groups.tolist() and (s0, s1) == (0, 6)
    kept, s0, s1 = window_groups(groups, t_start=3, t_stop=4)
    assert kept.shape == (0, 4) and kept.dtype == np.int32 and s0 == s1
    assert window_groups(groups[:0], t_start=0, t_stop=4)[0].shape == (0, 4)
    with pytest.raises(ValueError):
        window_groups(groups, t_start=4, t_stop=3)


def test_window_groups_on_a_document(toks, corpus_texts):
    """Windows of L teacher tokens with stride L-1 (as the build cuts them), on real alignment."""
    text = corpus_texts[0][:6000]
    ((ti, te),) = encode_with_byte_ends(toks["smollm2"].tok, [text])
    ((_, se),) = encode_with_byte_ends(toks["gpt2"].tok, [text])
    groups = align_groups(te, se)
    L = 97
    covered = np.zeros(len(groups), dtype=bool)
    for start in range(0, len(ti) - 1, L - 1):
        stop = min(start + L, len(ti))
        kept, s0, s1 = window_groups(groups, t_start=start, t_stop=stop)
        mask = (groups[:, 0] >= start) & (groups[:, 1] <= stop)
        np.testing.assert_array_equal(kept + np.array([start, start, s0, s0]), groups[mask])
        if len(kept):
            assert kept[0, 0] >= 0 and kept[-1, 1] <= stop - start and kept[0, 2] == 0 and kept[-1, 3] == s1 - s0
        covered |= mask
    assert covered.mean() > 0.95, "stride L-1 windows lose only groups longer than one token of overlap"


def test_token_byte_strings(toks):
    smol, gpt2, uni, wp = (toks[k] for k in ("smollm2", "gpt2", "unigram", "wordpiece"))
    assert len(smol.strings) == 49152 and len(gpt2.strings) == 50257
    for t in (smol, gpt2):
        tok = t.tok
        assert t.strings[tok.convert_tokens_to_ids("Ġthe")] == b" the"
        assert t.strings[tok.convert_tokens_to_ids("Ċ")] == b"\n"
        assert all(t.strings[i] is None for i in tok.all_special_ids)
    # GPT-2 spells every byte. SmolLM2's vocabulary lacks 21 single-byte tokens (bytes never valid in
    # UTF-8, a few control characters, and 0xF1/0xF2, lead bytes of U+40000..U+BFFFF); its BPE has no
    # unk token and no byte fallback, so it silently drops those bytes from the ids.
    assert gpt2.unspellable == frozenset()
    assert smol.unspellable == {4, 6, 19, 20, 22, 29, 192, 193, 241, 242, *range(245, 256)}
    assert smol.tok(chr(0x40000))["input_ids"] == [smol.tok.convert_tokens_to_ids("Ģ")] * 3
    assert uni.unspellable == frozenset()
    assert smol.strings[0] is None and smol.strings[1] is None  # <|endoftext|>, <|im_start|>
    assert uni.strings[uni.tok.convert_tokens_to_ids("<0x0A>")] == b"\n"
    assert uni.strings[uni.tok.convert_tokens_to_ids("▁the")] == b" the"
    assert uni.strings[0] is None and uni.strings[1] is None and uni.strings[2] is None
    wid = wp.tok.get_vocab()
    cont = next(p for p in wid if p.startswith("##") and len(p) > 3)
    assert wp.strings[wid[cont]] == cont[2:].encode()
    assert wp.strings[wid["[UNK]"]] is None
    assert toks["gpt2-trim"].strings == gpt2.strings  # a raw tokenizers.Tokenizer works too
    assert toks["llama-style"].strings == uni.strings  # Prepend/Replace("▁") read as Metaspace


def test_vocab_map_smollm2_to_gpt2(toks):
    smol, gpt2 = toks["smollm2"], toks["gpt2"]
    vm = vocab_map(smol.tok, gpt2.tok, teacher_vocab_size=49152 + 64)
    assert vm.dtype == np.int32 and vm.shape == (49152 + 64,)
    assert (vm[49152:] == -1).all()
    mapped = np.flatnonzero(vm >= 0)
    assert len(np.unique(vm[mapped])) == len(mapped), "injective"
    for tid in mapped:
        assert smol.strings[tid] == gpt2.strings[vm[tid]]
    for word in ("Ġthe", "Ġworld", "Hello", "Ċ", "ĊĊ", "1", "Ġ{"):
        assert vm[smol.tok.convert_tokens_to_ids(word)] == gpt2.tok.convert_tokens_to_ids(word), word
    assert (vm[smol.tok.all_special_ids] == -1).all()
    share = len(mapped) / 49152
    print(f"smollm2 -> gpt2: {len(mapped)} of 49152 teacher ids map ({share:.1%})")
    assert 0.5 < share < 0.95


def test_vocab_map_other_families(toks):
    uni, gpt2, wp = toks["unigram"], toks["gpt2"], toks["wordpiece"]
    vm = vocab_map(uni.tok, gpt2.tok, teacher_vocab_size=len(uni.tok))
    assert vm[uni.tok.convert_tokens_to_ids("▁the")] == gpt2.tok.convert_tokens_to_ids("Ġthe")
    # "\n" is both a trained piece and the byte piece <0x0A>: only the lower id maps.
    nl, byte_nl = uni.tok.convert_tokens_to_ids("\n"), uni.tok.convert_tokens_to_ids("<0x0A>")
    assert nl < byte_nl and vm[nl] == gpt2.tok.convert_tokens_to_ids("Ċ") and vm[byte_nl] == -1
    assert (vm[[0, 1, 2]] == -1).all()
    mapped = vm[vm >= 0]
    assert len(np.unique(mapped)) == len(mapped)
    # WordPiece: "##ing" continues a word, so it is the bytes "ing", not " ing".
    vw = vocab_map(wp.tok, gpt2.tok, teacher_vocab_size=len(wp.tok))
    assert vw[wp.tok.convert_tokens_to_ids("the")] == gpt2.tok.convert_tokens_to_ids("the")
    with pytest.raises(TokenizerError):
        vocab_map(gpt2.tok, wp.tok, teacher_vocab_size=100)
    print(f"unigram -> gpt2: {(vm >= 0).mean():.1%} mapped; wordpiece -> gpt2: {(vw >= 0).mean():.1%}")


def test_slow_tokenizer_refused():
    from transformers import PythonBackend

    class CharTokenizer(PythonBackend):
        """A real (if tiny) transformers Python tokenizer: one token per letter, no offsets."""

        def __init__(self, **kwargs):
            self._vocab = {c: i for i, c in enumerate("abc ")}
            super().__init__(**kwargs)

        @property
        def vocab_size(self):
            return len(self._vocab)

        def get_vocab(self):
            return dict(self._vocab)

        def _tokenize(self, text, **kwargs):
            return list(text)

        def _convert_token_to_id(self, token):
            return self._vocab.get(token, 0)

        def _convert_id_to_token(self, index):
            return "abc "[index]

    slow = CharTokenizer()
    for call in (lambda: encode_with_byte_ends(slow, ["ab c"]), lambda: token_byte_strings(slow)):
        with pytest.raises(TokenizerError, match="fast tokenizer") as info:
            call()
        assert isinstance(info.value, ValueError) and isinstance(info.value, LogitstoreError)


def test_parse_tokenizer_spec(tmp_path, gpt2_tokenizer_dir):
    d = str(gpt2_tokenizer_dir)
    assert parse_tokenizer_spec(d) == ("gpt2", d)
    assert parse_tokenizer_spec(d + "/") == ("gpt2", d + "/")
    assert parse_tokenizer_spec(d + "/tokenizer.json") == ("gpt2", d + "/tokenizer.json")
    assert parse_tokenizer_spec(f"gpt-2.small_v1={d}") == ("gpt-2.small_v1", d)
    assert parse_tokenizer_spec("student=relative/dir") == ("student", "relative/dir")
    odd = tmp_path / "a=b" / "tok"
    assert parse_tokenizer_spec(str(odd)) == ("tok", str(odd))  # "=" inside a path is no NAME
    for bad in ("", "bad name=/x", "-x=/p", "x" * 129 + "=/p", "name=", "=/p", str(tmp_path / "a b")):
        with pytest.raises(TokenizerError, match="--student-tokenizer") as info:
            parse_tokenizer_spec(bad)
        assert isinstance(info.value, ValueError) and isinstance(info.value, LogitstoreError)


def test_load_tokenizer(tmp_path, gpt2_tokenizer_dir, gpt2):
    from_dir = load_tokenizer(str(gpt2_tokenizer_dir))
    from_file = load_tokenizer(str(gpt2_tokenizer_dir / "tokenizer.json"))
    text = "Hello world, 日本 👍🏽\n"
    for tok in (from_dir, from_file):
        assert tok.is_fast and len(tok) == 50257
        assert tok(text)["input_ids"] == gpt2(text)["input_ids"]
        assert token_byte_strings(tok) == token_byte_strings(gpt2)
    missing = tmp_path / "nope"
    with pytest.raises(TokenizerError, match="nope") as info:
        load_tokenizer(str(missing))
    assert "\n" not in str(info.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "junk.json").write_text("{not json")
    for path in (empty, tmp_path / "junk.json"):
        with pytest.raises(TokenizerError, match="cannot load") as info:
            load_tokenizer(str(path))
        assert str(path) in str(info.value) and "\n" not in str(info.value)
