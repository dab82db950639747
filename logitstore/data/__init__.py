"""Data shipped with logitstore: a small English sample corpus for quick starts and tests."""

from pathlib import Path

# One {"id", "text"} JSON object per line; built by scripts/make_sample_corpus.py.
SAMPLE_CORPUS = Path(__file__).with_name("sample_corpus.jsonl")
