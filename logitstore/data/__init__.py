"""Data shipped with logitstore: a small English sample corpus and a chat sample, for quick starts and tests."""

from pathlib import Path

# One {"id", "text"} JSON object per line; built by scripts/make_sample_corpus.py.
SAMPLE_CORPUS = Path(__file__).with_name("sample_corpus.jsonl")
# One {"id", "messages"} JSON object per line; built by scripts/make_sample_chat.py.
SAMPLE_CHAT = Path(__file__).with_name("sample_chat.jsonl")


def default_input(*, chat: bool) -> Path:
    """What a build reads without --data: the chat sample for --chat-column, else the sample corpus."""
    return SAMPLE_CHAT if chat else SAMPLE_CORPUS
