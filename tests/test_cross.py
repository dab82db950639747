"""Cross-tokenizer distillation and several teachers, end to end on CPU: the default teacher (SmolLM2's
byte-level BPE) aligned to GPT-2's tokenizer at build time, a second teacher that speaks GPT-2, and
fresh students trained from the store."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.format.sparsity import Sparsity
from logitstore.pipelines.build import BuildConfig, run_build, run_builds
from logitstore.pipelines.config import BuildError
from logitstore.store.store import Store
from logitstore.testing.cli import sample_corpus_head, without_progress
from logitstore.trainer.config import TrainConfig
from logitstore.trainer.train import launch

runner = CliRunner()
COMMON = dict(seq_len=64, micro_batch=2, warmup_steps=2, lr=5e-3, eval_fraction=0.25)


def run(*args, code=0):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == code, (result.stdout, result.stderr, result.exception)
    return result


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """12 documents of the sample corpus, cut to ~1,000 characters; one longer one to exercise windows."""
    return sample_corpus_head(tmp_path_factory.mktemp("data") / "corpus.jsonl", docs=12, chars=1000, first_chars=2400)


@pytest.fixture(scope="module")
def store(tmp_path_factory, corpus, gpt2_tokenizer_dir) -> str:
    uri = str(tmp_path_factory.mktemp("store") / "store")
    run_build(
        BuildConfig(
            store=uri,
            data=str(corpus),
            id_column="id",
            max_length=256,
            sparsity=Sparsity(k=16),
            student_tokenizers=(f"gpt2={gpt2_tokenizer_dir}",),
            unit_tokens=1024,
            progress=False,
        ),
        log=lambda _: None,
    )
    return uri


@pytest.fixture(scope="module")
def gpt2_teacher(tmp_path_factory, gpt2_tokenizer_dir) -> Path:
    """A second teacher that speaks GPT-2: a small randomly initialised Llama saved as a Hugging Face model
    folder with GPT-2's tokenizer. Its predictions mean nothing; it exercises a real second model."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("teachers") / "tiny-gpt2"
    config = LlamaConfig(
        vocab_size=50257,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(gpt2_tokenizer_dir).save_pretrained(folder)
    return folder


def metrics(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step" in r]


# -- build side --------------------------------------------------------------------------------------


def test_info_reports_the_student_tokenizer_and_its_mapped_mass(store):
    info = json.loads(run("info", store, "--json").stdout)
    (teacher,) = info["teachers"]
    (student,) = teacher["student_tokenizers"]
    assert student["name"] == "gpt2" and student["vocab_size"] == 50257
    # Byte-level BPEs trained on English share most frequent tokens: most of the mass maps exactly.
    assert 0.5 < student["mapped_mass"] < 1.0, student
    assert student["mapped_mass_positions"] > 1000
    assert 10_000 < student["mapped_ids"] < 49_152
    assert "gpt2" in run("info", store).stdout


def test_show_gives_an_exact_alignment_of_every_sample(store, gpt2_tokenizer_dir):
    from transformers import AutoTokenizer

    view = Store.open(store).read()
    teacher_tok = view.tokenizer()
    student_tok = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    vmap = view.vocab_map(view.teacher_name(None), "gpt2")
    one_to_one = agree = 0
    for sample_id in view.index["sample_id"].to_pylist():
        shown = json.loads(run("show", store, sample_id, "--student-tokenizer", "gpt2", "--json").stdout)
        ids, student_ids, groups = shown["input_ids"], shown["student_ids"], np.array(shown["alignment"])
        assert student_ids == student_tok.convert_tokens_to_ids(student_tok.convert_ids_to_tokens(student_ids))
        # In order, contiguous, and covering every student token.
        assert groups[0, 2] == 0 and groups[-1, 3] == len(student_ids)
        assert (groups[1:, 0] == groups[:-1, 1]).all() and (groups[1:, 2] == groups[:-1, 3]).all()
        if "#w" not in sample_id:
            assert groups[0, 0] == 0 and groups[-1, 1] == len(ids)
        for t0, t1, s0, s1 in groups.tolist():  # the same bytes on both sides
            assert teacher_tok.decode(ids[t0:t1]) == student_tok.decode(student_ids[s0:s1])
        one = (groups[:, 1] - groups[:, 0] == 1) & (groups[:, 3] - groups[:, 2] == 1)
        mapped = vmap[np.array(ids)[groups[one, 0]]]
        one_to_one += int((mapped >= 0).sum())
        agree += int((mapped[mapped >= 0] == np.array(student_ids)[groups[one, 2]][mapped >= 0]).sum())
    # A 1:1 group's teacher token and student token have the same bytes, so the exact map agrees.
    assert one_to_one > 500 and agree == one_to_one
    assert run("verify", store).exit_code == 0


def test_a_build_with_other_student_tokenizers_is_refused_and_changes_nothing(store, corpus):
    before = Store.open(store).resolve()
    result = run(
        "build", "--store", store, "--data", corpus, "--id-column", "id", "--max-length", 256, "--top-k", 16, code=2
    )
    assert "student tokenizers" in result.stderr and "\n" not in without_progress(result.stderr)
    assert Store.open(store).resolve() == before


def test_student_tokenizer_needs_text(tmp_path, gpt2_tokenizer_dir):
    with pytest.raises(BuildError, match="--ids-column"):
        BuildConfig(store=str(tmp_path / "s"), ids_column="ids", student_tokenizers=(str(gpt2_tokenizer_dir),))
    result = run("build", "--store", tmp_path / "s2", "--student-tokenizer", tmp_path / "missing", code=2)
    assert "missing" in result.stderr


# -- train side --------------------------------------------------------------------------------------


def test_cross_tokenizer_student_learns_from_the_aligned_teacher(store, tmp_path):
    out = tmp_path / "run"
    launch(
        TrainConfig.from_flags(
            store=store,
            out=str(out),
            student="llama-tiny",
            student_tokenizer="gpt2",
            steps=24,
            eval_every=4,
            eval_batches=4,
            **COMMON,
        )
    )
    rows = metrics(out)
    evals = [r["eval_kl"] for r in rows if "eval_kl" in r]
    assert evals[-1] < evals[0] - 0.3, evals  # held-out KL over the 1:1-aligned positions goes down
    assert 0.6 < rows[-1]["signal_share"] <= 1.0 and 0.5 < rows[-1]["exact_share"] <= rows[-1]["signal_share"]
    assert all(np.isfinite(r["loss"]) for r in rows)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = out / "final"
    assert AutoModelForCausalLM.from_pretrained(final).config.vocab_size == 50257
    assert AutoTokenizer.from_pretrained(final)("Hello world")["input_ids"] == [15496, 995]  # GPT-2's own ids
    evaluated = json.loads(
        run("eval", "--store", store, "--student", final, "--seq-len", 64, "--eval-fraction", 0.25, "--json").stdout
    )
    assert 0 < evaluated["kl"] < evals[0]


def test_a_student_with_an_unknown_tokenizer_is_refused(store, tmp_path):
    result = run("train", "--store", store, "--out", tmp_path / "r", "--student-tokenizer", "t5", code=2)
    assert "no such student tokenizer" in result.stderr and "gpt2" in result.stderr


def test_same_tokenizer_signal_through_the_mixed_path_equals_the_single_teacher_path(store):
    """The mixed source with one same-tokenizer teacher gives the batches and loss of the store source."""
    from logitstore.streaming.mixing import MixedSource, WeightedTeacher
    from logitstore.streaming.spec import StreamSpec
    from logitstore.streaming.stream import Stream, store_stream
    from logitstore.trainer.config import LossConfig
    from logitstore.trainer.losses import distill_loss
    from logitstore.trainer.objective import StudentOutputs, mixed_loss
    from logitstore.trainer.objective import sparse_targets as _targets

    view = Store.open(store).read()
    teacher = view.teacher_name(None)
    args = dict(seq_len=64, micro_batch=2, rank=0, world_size=1, seed=3, prefetch=0)
    torch.manual_seed(0)
    mixed_source = MixedSource(view, sources=[WeightedTeacher(teacher, 1.0, None)], split="train", eval_fraction=0.05)
    with (
        store_stream(view, StreamSpec(teacher=teacher, **args)) as single,
        Stream(mixed_source, StreamSpec(**args)) as mixed,
    ):
        for a, b in zip(single, mixed):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.positions, b.positions)
            outputs = StudentOutputs(hidden=torch.randn(len(a.positions), 8), weight=torch.randn(49152, 8))
            cfg = LossConfig()
            expected, _ = distill_loss(outputs.logits(), _targets(a, "cpu"), cfg)
            got, parts = mixed_loss(outputs, b, cfg, device="cpu", chunk=7)
            torch.testing.assert_close(got, expected)
            assert parts["signal_share"] == 1.0
            if a.segments[-1][0] == single.table.sample_ids[-1]:
                break
            if len(a.segments) > 8:
                break


@pytest.mark.parametrize(("loss", "temperature"), [("reverse_kl", 1.0), ("topk_renorm", 1.0), ("forward_kl", 2.0)])
def test_a_cross_tokenizer_teacher_takes_only_the_loss_aligned_kd_computes(store, loss, temperature):
    from logitstore.trainer.config import TrainConfigError
    from logitstore.trainer.signals import plan_sources

    view = Store.open(store).read()
    cfg = TrainConfig.from_flags(
        store=store, out="-", student="llama-tiny", student_tokenizer="gpt2", loss=loss, kd_temperature=temperature
    )
    with pytest.raises(TrainConfigError, match="supports --loss forward_kl at --kd-temperature 1 only"):
        plan_sources(view, cfg)


def test_cross_tokenizer_loss_in_chunks_equals_the_loss_in_one_piece(store):
    """The chunked head on aligned targets (chunks that never split a many-token group) gives the value
    and gradients of the whole [P, V] logits at once, in training and in evaluation."""
    from logitstore.streaming.spec import StreamSpec
    from logitstore.streaming.stream import store_stream
    from logitstore.trainer.aligned_losses import aligned_kd
    from logitstore.trainer.config import LossConfig
    from logitstore.trainer.objective import StudentOutputs, _whole_groups, host_values, mixed_loss
    from logitstore.trainer.signals import plan_sources

    view = Store.open(store).read()
    cfg = TrainConfig.from_flags(store=store, out="-", student="llama-tiny", student_tokenizer="gpt2", eval_fraction=0)
    sources, vocab = plan_sources(view, cfg)
    spec = StreamSpec(seq_len=64, micro_batch=2, rank=0, world_size=1, seed=1, prefetch=0)
    with store_stream(view, spec, sources=sources) as s:
        batch = next(iter(s))
    ((name, targets),) = batch.signals
    assert len(targets.chain_group) > 0  # the batch has many-token groups to keep whole
    P = len(batch.positions)
    allowed = _whole_groups(batch.signals, P)
    assert allowed[0] and allowed[P] and not allowed.all()
    torch.manual_seed(0)
    hidden, weight = torch.randn(P, 8), torch.randn(50257, 8) * 0.3

    def run(chunk, evaluation=False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, parts = mixed_loss(
            StudentOutputs(hidden=h, weight=w),
            batch,
            LossConfig(alpha=0.5),
            device="cpu",
            chunk=chunk,
            indicator=evaluation,
        )
        loss.backward()
        return float(loss.detach()), host_values(parts), h.grad, w.grad

    whole, chunked = run(P), run(5)
    assert chunked[0] == pytest.approx(whole[0], rel=1e-5)
    assert chunked[1] == pytest.approx(whole[1], rel=1e-4, abs=1e-6)
    torch.testing.assert_close(chunked[2], whole[2], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(chunked[3], whole[3], rtol=1e-4, atol=1e-7)
    direct, sub = aligned_kd(hidden @ weight.T, targets, uld_weight=1.0)  # one piece, no chunking at all
    assert whole[1][f"kl/{name}"] == pytest.approx(sub["kd"], rel=1e-5)
    assert run(5, evaluation=True)[1][f"kl/{name}"] == pytest.approx(run(P, evaluation=True)[1][f"kl/{name}"], rel=1e-4)


# -- several teachers ---------------------------------------------------------------------------------


def test_several_teachers_in_one_store_and_one_run(store, corpus, gpt2_teacher, gpt2_tokenizer_dir, tmp_path):
    # A later build adds teacher B to the samples of the existing version, on a branch.
    summary = run_builds(
        BuildConfig(
            store=store,
            data=str(corpus),
            id_column="id",
            max_length=256,
            sparsity=Sparsity(k=16),
            branch="two-teachers",
            unit_tokens=1024,
            progress=False,
        ),
        [str(gpt2_teacher)],
        log=lambda _: None,
    )
    assert summary.samples > 0
    info = json.loads(run("info", store, "--version", "two-teachers", "--json").stdout)
    names = sorted(t["name"] for t in info["teachers"])
    assert names == sorted(["smollm2-135m-instruct", "tiny-gpt2"]), names
    shared = _sample_of_both(store, "two-teachers")
    shown = json.loads(
        run("show", store, shared, "--version", "two-teachers", "--teacher", "tiny-gpt2", "--json").stdout
    )
    aligned = json.loads(
        run(
            "show",
            store,
            shared,
            "--version",
            "two-teachers",
            "--teacher",
            "smollm2-135m-instruct",
            "--student-tokenizer",
            "gpt2",
            "--json",
        ).stdout
    )
    assert shown["teacher"] == "tiny-gpt2" and shown["input_ids"] == aligned["student_ids"]
    # main is untouched: the branch holds the second teacher.
    assert [t["name"] for t in json.loads(run("info", store, "--json").stdout)["teachers"]] == ["smollm2-135m-instruct"]

    out = tmp_path / "mixed"
    launch(
        TrainConfig.from_flags(
            store=store,
            version="two-teachers",
            out=str(out),
            student="llama-tiny",
            student_tokenizer="gpt2",
            teacher_weights={"smollm2-135m-instruct": 0.7, "tiny-gpt2": 0.3},
            steps=6,
            eval_every=6,
            eval_batches=2,
            **COMMON,
        )
    )
    rows = metrics(out)
    last = rows[-1]
    assert {"kl/smollm2-135m-instruct", "kl/tiny-gpt2", "signal_share", "exact_share"} <= set(last)
    assert {"eval_kl/smollm2-135m-instruct", "eval_kl/tiny-gpt2"} <= set(last)
    assert all(np.isfinite(r["loss"]) for r in rows)
    # The same-tokenizer teacher teaches every position of the samples it shares whole with the first
    # teacher (windows of long documents differ between the two tokenizers and are not shared).
    assert 0.5 < last["exact_share"] <= last["signal_share"] <= 1.0
    assert all(sum(r[f"kl/{t}"] for r in rows) > 0 for t in ("tiny-gpt2", "smollm2-135m-instruct"))
    header = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert [t["student_tokenizer"] for t in header["teachers"]] == ["gpt2", None]


def _sample_of_both(store: str, version: str) -> str:
    """A sample both teachers hold whole (one window each, so the same text)."""
    idx = Store.open(store).read(version).index
    by_teacher = {}
    for teacher, sample_id in zip(idx["teacher"].to_pylist(), idx["sample_id"].to_pylist()):
        by_teacher.setdefault(teacher, set()).add(sample_id)
    a, b = by_teacher.values()
    return sorted(s for s in a & b if "#w" not in s)[0]
