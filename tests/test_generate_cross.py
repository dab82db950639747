"""`build --generate` across tokenizers: a generator whose tokenizer is not the teacher's (a tiny random
Llama speaking GPT-2) writes answers that the teacher scores as text, student tokenizers get the
answers aligned with their mask on the answer alone, and what cannot be aligned is refused in one line."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from typer.testing import CliRunner

import logitstore
from logitstore.cli.app import app
from logitstore.format.layout import student_arrays
from logitstore.pipelines.build import BuildConfig
from logitstore.pipelines.generate import Generation
from logitstore.pipelines.inputs import Document
from logitstore.pipelines.plan import load_student_tokenizers
from logitstore.pipelines.retokenize import AnswerText, stop_text
from logitstore.pipelines.teacher import describe_teacher, model_stop_ids
from logitstore.pipelines.workers import settled_settings
from logitstore.store.generation import seed_of
from logitstore.testing.prompts import PROMPTS, write_prompts
from logitstore.testing.teachers import save_tiny_llama

GPT2_EOS = 50256
N = 12  # --generate
# the generator's own chat template: another rendering of a conversation than the teacher's ChatML
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
CHATS = {"q": [{"role": "user", "content": "Where is Paris?"}], "r": [{"role": "user", "content": "Hi"}]}


def build(*args) -> dict:
    result = CliRunner().invoke(app, [*map(str, args), "--json"])
    assert result.exit_code == 0, result.stderr + result.stdout
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def gpt2_generator(tmp_path_factory, gpt2_tokenizer_dir) -> str:
    """A 1-layer random Llama with GPT-2's tokenizer and a chat template of its own, stopping at `<|endoftext|>`."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("generators") / "tiny-gpt2"
    tokenizer = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    tokenizer.chat_template = TEMPLATE
    save_tiny_llama(folder, tokenizer, eos_token_id=GPT2_EOS, bos_token_id=GPT2_EOS, max_position_embeddings=256)
    return str(folder)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", PROMPTS)


@pytest.fixture(scope="module")
def stores(tiny_teacher, gpt2_generator, gpt2_tokenizer_dir, prompts, tmp_path_factory):
    """Three builds with GPT-2 as a student tokenizer: answers by the GPT-2 generator (crossing) to plain
    prompts and to conversations, and by the teacher itself."""
    root = tmp_path_factory.mktemp("cross-generated")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": k, "messages": m}) + "\n" for k, m in CHATS.items()))
    common = ["build", "--generate", N, "--max-length", 64, "--teacher", tiny_teacher, "--seed", 7]
    common += ["--student-tokenizer", f"gpt2={gpt2_tokenizer_dir}"]
    plain = [*common, "--data", prompts, "--prompt-column", "prompt"]
    crossed = build(*plain, "--store", root / "crossed", "--generator", gpt2_generator)
    own = build(*plain, "--store", root / "own")
    chat = build(
        *common, "--data", chats, "--chat-column", "messages", "--store", root / "chat", "--generator", gpt2_generator
    )
    return {"crossed": (root / "crossed", crossed), "own": (root / "own", own), "chat": (root / "chat", chat)}


def student_side(view, sample_id: str) -> tuple[np.ndarray, np.ndarray]:
    row = view.index.filter(view.index["sample_id"].to_numpy(zero_copy_only=False) == sample_id).to_pylist()[0]
    s0, n = row["student_start"][0], row["n_student_tokens"][0]
    ids_name, _, mask_name = student_arrays("gpt2", chat=True)
    teacher = view.teacher_name(None)
    return tuple(np.asarray(view.array(teacher, row["part"], name)[s0 : s0 + n]) for name in (ids_name, mask_name))


def generated_answers(cfg: BuildConfig) -> dict[str, np.ndarray]:
    """The generator's own answers to the prompts, as the build asked for them (one call, input order)."""
    info = describe_teacher(cfg.teacher)
    generation = Generation(cfg, teacher=info, settings=settled_settings(cfg, teacher_spec=info.spec).settings)
    try:
        tokenizer = generation.tokenizer
        ids = [np.asarray(i) for i in tokenizer(list(PROMPTS.values()))["input_ids"]]
        seeds = [seed_of(cfg.seed, p, 0) for p in PROMPTS]
        answers = generation.generator().generate(ids, seeds, max_new_tokens=N, temperature=1.0, top_p=1.0)
    finally:
        generation.close()
    return dict(zip(PROMPTS, answers))


def test_answers_of_another_tokenizer_are_scored_as_their_text(stores, tiny_teacher, gpt2_generator, prompts):
    store, summary = stores["crossed"]
    view = logitstore.open(str(store))
    teacher = describe_teacher(tiny_teacher).tokenizer
    record = summary["generation"]
    assert record["crosses_tokenizers"] is True and view.generations()[record["id"]] == record
    assert record["generator"]["tokenizer_hash"] != describe_teacher(tiny_teacher).tokenizer_hash
    cfg = BuildConfig(store=str(store), data=str(prompts), prompt_column="prompt", generate=N, max_length=64)
    cfg = dataclasses.replace(cfg, teacher=tiny_teacher, generator=gpt2_generator, seed=7)
    generated = generated_answers(cfg)
    info = describe_teacher(tiny_teacher)
    gpt2 = Generation(cfg, teacher=info, settings=settled_settings(cfg, teacher_spec=info.spec).settings).tokenizer
    end = stop_text(teacher, model_stop_ids(describe_teacher(tiny_teacher).spec))
    retokenized = 0
    for prompt_id, prompt in PROMPTS.items():
        answer, ids = view.answer(f"{prompt_id}/g0"), generated[prompt_id]
        stopped = ids[-1] == GPT2_EOS
        body = ids[:-1] if stopped else ids
        text = gpt2.decode(body.tolist(), clean_up_tokenization_spaces=False) + (end if stopped else "")
        # the teacher's own prompt tokens, then its tokens of the generator's answer text
        assert answer["prompt_text"] == prompt and answer["text"] == text
        s = view.sample(f"{prompt_id}/g0")
        n_prompt = len(teacher(prompt)["input_ids"])
        assert s.loss_mask.tolist() == [0] * n_prompt + [1] * (len(s.input_ids) - n_prompt)
        # the student (the generator's tokenizer) holds its tokens of the prompt, then of the answer's text
        ids_s, mask_s = student_side(view, f"{prompt_id}/g0")
        n_s = len(gpt2(prompt)["input_ids"])
        assert ids_s[:n_s].tolist() == gpt2(prompt)["input_ids"] and mask_s.tolist() == [0] * n_s + [1] * (
            len(ids_s) - n_s
        )
        assert gpt2.decode(ids_s[n_s:].tolist()) == text
        # the generated ids themselves, unless their bytes do not spell the text (a character left unfinished)
        own = ids_s[n_s : n_s + len(body)].tolist() == body.tolist()
        assert own != ("\ufffd" in text)
        retokenized += not own
    assert summary["answers_retokenized"] == retokenized and summary["answers"] == len(PROMPTS)


def test_student_tokenizers_get_the_teachers_answers_masked_on_the_answer_alone(stores, tiny_teacher):
    store, summary = stores["own"]
    view = logitstore.open(str(store))
    teacher = describe_teacher(tiny_teacher).tokenizer
    assert "crosses_tokenizers" not in summary["generation"] and summary["answers"] == len(PROMPTS)
    gpt2 = view.student_tokenizer(view.teacher_name(None), "gpt2")
    texts = [view.answer(f"{prompt_id}/g0")["text"] for prompt_id in PROMPTS]
    # the teacher holds its generated ids, unless their bytes leave a character unfinished (byte-level BPE)
    assert summary["answers_retokenized"] == sum("\ufffd" in text for text in texts)
    for prompt_id, prompt in PROMPTS.items():
        answer = view.answer(f"{prompt_id}/g0")
        ids_s, mask_s = student_side(view, f"{prompt_id}/g0")
        supervised = ids_s[mask_s.astype(bool)].tolist()
        # exactly the answer's bytes: the student's masked tokens spell the teacher's answer text
        assert gpt2.decode(supervised) == answer["text"] and gpt2.decode(ids_s[~mask_s.astype(bool)].tolist()) == prompt
        assert mask_s.tolist() == sorted(mask_s.tolist()) and teacher.decode(answer["token_ids"]) == answer["text"]


def test_a_generator_renders_a_conversation_with_its_own_template_and_the_teacher_with_its(
    stores, tiny_teacher, gpt2_generator
):
    store, summary = stores["chat"]
    info = describe_teacher(tiny_teacher)
    cfg = BuildConfig(store=str(store), data=str(store), chat_column="messages", generate=N, max_length=64)
    cfg = dataclasses.replace(cfg, teacher=tiny_teacher, generator=gpt2_generator)
    generation = Generation(cfg, teacher=info, settings=settled_settings(cfg, teacher_spec=info.spec).settings)
    generation.carry_as_text(info.tokenizer, [])
    doc = Document(id="q", text=None, token_ids=None, source_hash="0" * 32, row=0, messages=CHATS["q"])
    [prompt] = generation.prompt_tokens(info.tokenizer, [doc])
    assert generation.tokenizer.decode(prompt.generator_ids.tolist()) == "user: Where is Paris?\nassistant:"
    assert info.tokenizer.decode(prompt.ids.tolist()) == prompt.text and prompt.text.endswith("<|im_start|>assistant\n")
    view = logitstore.open(str(store))
    assert summary["answers"] == len(CHATS) and summary["generation"]["crosses_tokenizers"] is True
    gpt2 = view.student_tokenizer(view.teacher_name(None), "gpt2")
    for prompt_id, messages in CHATS.items():
        answer = view.answer(f"{prompt_id}/g0")
        content = messages[0]["content"]
        assert answer["prompt_text"].endswith(f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n")
        ids_s, mask_s = student_side(view, f"{prompt_id}/g0")
        masked = mask_s.astype(bool)
        assert gpt2.decode(ids_s[masked].tolist()) == answer["text"] and mask_s.tolist() == sorted(mask_s.tolist())
        assert gpt2.decode(ids_s[~masked].tolist()) == answer["prompt_text"]


def test_answer_text_keeps_the_prompt_cut_and_counts_respelled_answers(tiny_teacher, gpt2_tokenizer_dir):
    """Unit level, real tokenizers: a stopped answer ends with the teacher's stop text, the student side
    with the generator's tokenizer holds the generated ids (another spelling than its own too) unless
    their bytes do not spell the text or the answer was cut (counted), and an answer too long for
    --max-length is cut at a character's end on every side."""
    info = describe_teacher(tiny_teacher)
    [student] = load_student_tokenizers((f"gpt2={gpt2_tokenizer_dir}",), teacher=info)
    gpt2 = student.tokenizer
    text = AnswerText(
        teacher=info.tokenizer,
        generator=gpt2,
        generator_hash=student.registration.tokenizer_hash,
        teacher_stop="<|im_end|>",
        students=[student],
        special_tokens=True,
    )
    [prompt] = text.prompts(["Capital of France?"], [np.asarray(gpt2("Capital of France?")["input_ids"])])
    canonical = np.asarray([*gpt2(" Paris, café")["input_ids"], GPT2_EOS])
    respelled = np.asarray([*gpt2(" P")["input_ids"], *gpt2("aris")["input_ids"]])
    long = np.asarray(gpt2(" 東京 " * 20)["input_ids"])
    unfinished = np.asarray(gpt2(" 東")["input_ids"][:-1])  # a character's first bytes only
    generated = [canonical, respelled, long, unfinished]
    samples = text.answers([prompt] * 4, generated, stop_ids=[GPT2_EOS], max_length=24)
    decode = info.tokenizer.decode
    first, second, third, fourth = samples
    n = len(prompt.students["gpt2"][0])
    assert decode(first.tokens[len(prompt.ids) :].tolist()) == " Paris, café<|im_end|>" and not first.retokenized
    assert first.students["gpt2"][0][n : n + len(canonical) - 1].tolist() == canonical[:-1].tolist()
    # another spelling than the tokenizer's: the student side holds the generated ids, the teacher the text's
    assert decode(second.tokens[len(prompt.ids) :].tolist()) == " Paris" and not second.retokenized
    assert second.students["gpt2"][0][n:].tolist() == respelled.tolist()
    assert third.cut and len(third.tokens) <= 24 and not first.cut and "\ufffd" not in decode(third.tokens.tolist())
    assert third.retokenized and fourth.retokenized and decode(fourth.tokens[len(prompt.ids) :].tolist()) == " \ufffd"
    for s in samples:
        ids, groups, mask = s.students["gpt2"]
        assert (s.mask == np.sort(s.mask)).all() and (mask == np.sort(mask)).all()
        assert gpt2.decode(ids[mask.astype(bool)].tolist()) == decode(s.tokens[s.mask.astype(bool)].tolist())
        # a group starts where the answer starts, on both sides
        assert [len(prompt.ids), len(prompt.students["gpt2"][0])] in groups[:, [0, 2]].tolist()


def test_what_cannot_be_aligned_is_refused_in_one_line(tiny_teacher, gpt2_generator, gpt2_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from logitstore.testing.openai_server import OpenAIServer

    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"id": "q", "messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    untemplated = tmp_path / "untemplated"
    save_tiny_llama(untemplated, AutoTokenizer.from_pretrained(gpt2_tokenizer_dir), eos_token_id=GPT2_EOS)
    args = ["build", "--teacher", tiny_teacher, "--store", str(tmp_path / "s"), "--generate", "4", "--max-length", "32"]
    no_template = [*args, "--data", str(chats), "--chat-column", "messages", "--generator", untemplated]
    plain = [*args, "--data", str(write_prompts(tmp_path / "p.jsonl", {"a": "Hi"})), "--prompt-column", "prompt"]
    gpt2 = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    with OpenAIServer(model="gpt2-served", replay=lambda ids, k: b"", tokenizer=gpt2) as server:
        cases = [
            (no_template, "has no chat template"),
            ([*plain, "--generator-url", server.url], "a served generator must have the teacher's tokenizer"),
            (
                [*plain, "--teacher", untemplated, "--student-tokenizer", f"gpt2={gpt2_tokenizer_dir}"],
                "--student-tokenizer with --generate takes one --teacher",
            ),
        ]
        for argv, message in cases:
            result = CliRunner().invoke(app, argv)
            errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
            assert result.exit_code == 2 and len(errors) == 1 and message in errors[0], result.stderr
    assert not (tmp_path / "s").exists()


def test_rounds_give_a_student_of_another_tokenizer_aligned_targets(tiny_teacher, gpt2_generator):
    """`logitstore rounds --student S`: every round's build takes S's tokenizer as a student tokenizer
    where it is not the teacher's (round 2 on, S writes the answers: they cross tokenizers)."""
    from logitstore.cli.rounds import Rounds, _student_tokenizers

    common = dict(store="s", out="o", prompts="p", rounds=2, steps_per_round=1, teacher=tiny_teacher)
    assert _student_tokenizers(Rounds(**common, student=gpt2_generator)) == (gpt2_generator,)
    assert _student_tokenizers(Rounds(**common, student=tiny_teacher)) == ()
    assert _student_tokenizers(Rounds(**common, student="llama-tiny")) == ()
