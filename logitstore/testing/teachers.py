"""Teachers for tests and benchmarks: a tiny random Llama saved as a Hugging Face folder, and a loaded
teacher behind the test server (`openai_server.py`) scoring through the torch engine's forward pass.
torch and transformers load inside the functions: importing this module costs neither."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from logitstore.data import SAMPLE_CORPUS
from logitstore.testing.openai_server import OpenAIServer, Scores

KEY = "sk-logitstore-test-4f1c9a"  # the API key tests give a served teacher
END_OF_TEXT = "<|endoftext|>"  # the toy tokenizer's one special token


def save_tiny_llama(folder, tokenizer, **config) -> None:
    """A 1-layer random Llama (hidden 16, seed 0) with `tokenizer`, saved as a Hugging Face folder;
    `config` overrides `LlamaConfig` (vocab_size: the tokenizer's length unless given)."""
    import torch  # torch and transformers: seconds to import, paid only where a teacher is made or run
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    LlamaForCausalLM(LlamaConfig(**{"vocab_size": len(tokenizer), **shape, **config})).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def toy_tokenizer(vocab: int):
    """A byte-level BPE of `vocab` tokens trained on the sample corpus (a fraction of a second), end of text its
    only special token: toy shapes down to the vocabulary, where a 49k-entry head would cost ~2 ms a position
    on 2 CPU cores."""
    # tokenizers and transformers: seconds to import, paid only where a toy tokenizer is made
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    texts = [json.loads(line)["text"] for line in SAMPLE_CORPUS.read_text().splitlines()]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    raw.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab, initial_alphabet=alphabet, special_tokens=[END_OF_TEXT], show_progress=False
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=END_OF_TEXT)


def save_tiny_gguf(path: Path, *, vocab: int = 512) -> str:
    """A 1-layer random Llama (hidden 16, seed 0) over `toy_tokenizer(vocab)`, written as a GGUF file (fp32
    tensors, llama.cpp's names and keys, the BPE as GGUF's "gpt2" tokenizer): what transformers loads from a
    GGUF teacher, at toy size. Returns the file's path."""
    import gguf  # as toy_tokenizer's imports

    tokenizer = toy_tokenizer(vocab)
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    hidden, ffn, heads, kv_heads = 16, 32, 2, 1
    kv = hidden // heads * kv_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_block_count(1)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(model["vocab"][END_OF_TEXT])
    writer.add_eos_token_id(model["vocab"][END_OF_TEXT])
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd": (len(tokens), hidden),
        "blk.0.attn_q": (hidden, hidden),
        "blk.0.attn_k": (kv, hidden),
        "blk.0.attn_v": (kv, hidden),
        "blk.0.attn_output": (hidden, hidden),
        "blk.0.ffn_gate": (ffn, hidden),
        "blk.0.ffn_up": (ffn, hidden),
        "blk.0.ffn_down": (hidden, ffn),
        "output": (len(tokens), hidden),
    }
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", (rng.standard_normal(shape) * 0.02).astype(np.float32))
    for norm in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        writer.add_tensor(f"{norm}.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def save_toy_teacher(folder, *, vocab: int = 1024, **config) -> str:
    """`save_tiny_llama` over `toy_tokenizer(vocab)`: toy shapes down to the vocabulary, the benchmarks'
    smokes' teacher. Returns the folder's path."""
    save_tiny_llama(folder, toy_tokenizer(vocab), **config)
    return str(folder)


def save_tiny_teacher(folder, **config) -> str:
    """`save_tiny_llama` with the default teacher's tokenizer (SmolLM2's, 49,152 tokens): real tokenizing,
    planning and writing where a real forward pass is not the point. Returns the folder's path."""
    # the default teacher's description loads transformers: paid only where a teacher is made
    from logitstore.pipelines.teacher import describe_teacher

    save_tiny_llama(folder, describe_teacher(None).tokenizer, **config)
    return str(folder)


def save_vllm_teacher(folder, **config) -> str:
    """A tiny teacher vLLM's CPU build runs: `save_tiny_teacher` with 2 layers of hidden size 128 and head size
    32 (vLLM's CPU attention takes head sizes 32, 64, ... only). Returns the folder's path."""
    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    return save_tiny_teacher(folder, **{"num_hidden_layers": 2, **shape, **config})


def torch_scorer(teacher):
    """A loaded `Teacher` through the torch engine's top-k forward pass, one prompt of shape [1, T] at a
    time (what `--engine torch --batch-tokens 2` computes). The rank of a prompt token outside the top-k
    is given as k + 1: only "inside or outside" matters to a client."""
    # torch and the teacher's forward pass: seconds to import, paid only where a teacher runs
    import torch

    from logitstore.pipelines.teacher import TeacherForward, sparse_topk_forward  # as torch, above

    forward = TeacherForward.of_model(teacher.model)
    lock = threading.Lock()  # one forward pass at a time: the server answers from several threads

    def score(tokens: np.ndarray, k: int) -> Scores:
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))[None]
        with lock, torch.inference_mode():
            batch = sparse_topk_forward(forward, ids, torch.ones_like(ids), k=k)
        top = batch.ids[0].numpy()
        targets = np.asarray(tokens[1:])
        inside = top == targets[:, None]
        rank = np.where(inside.any(axis=1), inside.argmax(axis=1) + 1, k + 1)
        return Scores(top, batch.logprobs[0].numpy(), batch.target_logprob[0].numpy(), rank)

    return score


def scoring_teacher(path):
    """(spec, loaded teacher) of `path` (None: the default teacher), on the CPU in fp32, for `torch_scorer`."""
    # the torch engine imports torch: seconds, paid only where a teacher is loaded
    from logitstore.pipelines.engines.torch_engine import load_teacher_once
    from logitstore.pipelines.teacher import resolve_teacher

    spec = resolve_teacher(path)
    return spec, load_teacher_once(spec, "cpu", "float32")


def serve_teacher(path, *, max_logprobs: int):
    """The teacher at `path` (None: the default) behind the test server (`logitstore/testing/openai_server.py`)
    on 127.0.0.1, answering through `torch_scorer`; started, and closed by `with` or `.close()`."""
    spec, teacher = scoring_teacher(path)
    return OpenAIServer(
        model=spec.name, scorer=torch_scorer(teacher), tokenizer=teacher.tokenizer, max_logprobs=max_logprobs
    )
