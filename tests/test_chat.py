"""Chat data: conversations rendered with the teacher's chat template, the assistant's tokens as the
loss mask, stored per token, shown by `show --json`, honoured by the teacher pass (no entries for the
prompt with `--train-on completion`) and by the stream (only completion positions are supervised)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from typer.testing import CliRunner

import logitstore
from logitstore.cli.app import BUILD_FLAGS, EVAL_FLAGS, TRAIN_FLAGS, app
from logitstore.data import SAMPLE_CHAT
from logitstore.format.layout import student_arrays
from logitstore.format.sparsity import Sparsity
from logitstore.pipelines.teacher import describe_teacher
from logitstore.store.meta import TeacherMeta
from logitstore.store.store import Store
from logitstore.testing.cli import build, jsonl
from logitstore.testing.stores import index_of
from logitstore.text import chat

runner = CliRunner()
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 is 4."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return describe_teacher(None).tokenizer


def marked(tokenizer, ids: np.ndarray, mask: np.ndarray) -> str:
    """The text with each masked run of tokens in [brackets]."""
    out = []
    for i, t in enumerate(ids.tolist()):
        opens = mask[i] and (i == 0 or not mask[i - 1])
        closes = mask[i] and (i + 1 == len(mask) or not mask[i + 1])
        out.append(("[" if opens else "") + tokenizer.decode([t]) + ("]" if closes else ""))
    return "".join(out)


def test_the_completion_is_each_reply_and_its_end_of_turn(tokenizer):
    from logitstore.pipelines import align

    text, spans = chat.render(tokenizer, CONVERSATION)
    assert [text[a:b] for a, b in spans] == ["2 + 2 is 4.<|im_end|>\n", "You are welcome.<|im_end|>\n"]
    [(ids, ends)] = align.encode_with_byte_ends(tokenizer, [text], add_special_tokens=False)
    mask = chat.token_mask(ends, chat.byte_spans(text, spans))
    assert ids.tolist() == tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert marked(tokenizer, ids, mask).endswith(
        "assistant\n[2 + 2 is 4.<|im_end|>\n]<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n"
        "[You are welcome.<|im_end|>\n]"
    )


def test_a_template_that_is_not_prefix_stable_falls_back_to_the_replies_content(tokenizer):
    counting = copy.copy(tokenizer)  # renders the turn count first: no render is a prefix of the next
    counting.chat_template = "{{ messages|length }}\n" + tokenizer.chat_template
    text, spans = chat.render(counting, CONVERSATION)
    assert text.startswith("5\n") and [text[a:b] for a, b in spans] == ["2 + 2 is 4.", "You are welcome."]


def test_token_mask_keeps_only_tokens_wholly_inside_a_span():
    ends = np.array([3, 5, 9, 12, 15])  # tokens [0,3) [3,5) [5,9) [9,12) [12,15)
    assert chat.token_mask(ends, np.array([[3, 12]])).tolist() == [0, 1, 1, 1, 0]
    assert chat.token_mask(ends, np.array([[4, 12]])).tolist() == [0, 0, 1, 1, 0]  # straddles the start: out
    assert chat.token_mask(ends, np.array([[0, 5], [9, 15]])).tolist() == [1, 1, 0, 1, 1]
    assert chat.token_mask(ends, np.zeros((0, 2), np.int64)).tolist() == [0] * 5
    mask = np.array([0, 1, 0, 0, 1, 1], np.uint8)  # two samples of 3 tokens
    assert chat.supervised_positions(mask, np.array([3, 3])).tolist() == [True, False, True, True]


@pytest.mark.parametrize(
    "value, problem",
    [
        ("hello", "not a JSON list"),
        (42, "list of"),
        ([], "empty list"),
        ([{"role": "robot", "content": "x"}], "role 'robot'"),
        ([{"role": "user"}], "content missing"),
        ([{"role": "user", "content": ["a"]}], "content list"),
        (["hi"], "must be an object"),
    ],
)
def test_bad_conversations_are_named(value, problem):
    assert problem in chat.message_problem(value)


def test_train_on_choices_are_one_list():
    for flags in (BUILD_FLAGS, TRAIN_FLAGS, EVAL_FLAGS):  # the CLI's choices are the registry's
        assert next(d for d in flags if d.name == "train_on").choices == chat.TRAIN_ON


def test_a_store_from_before_chat_data_reads_as_plain_text():
    meta = TeacherMeta(name="t", vocab_size=10, content_hash="c", tokenizer_hash="h", sparsity=Sparsity(k=2))
    old = {k: v for k, v in meta.to_json().items() if k != "loss_mask"}
    assert TeacherMeta.from_json(old).loss_mask is None and TeacherMeta.from_json(old).same_teacher(meta)


@pytest.fixture(scope="module")
def chat_stores(tmp_path_factory):
    """The shipped chat sample's first 6 conversations, built with entries for the completion only and
    for prompt+completion."""
    root = tmp_path_factory.mktemp("chat")
    out = {}
    for train_on in chat.TRAIN_ON:
        store = root / train_on.replace("+", "-")
        result = runner.invoke(
            app,
            [
                "build",
                "--chat-column",
                "messages",
                "--limit",
                "6",
                "--store",
                str(store),
                "--top-k",
                "8",
                "--train-on",
                train_on,
                "--json",
            ],
        )
        assert result.exit_code == 0, result.stderr
        out[train_on] = (store, json.loads(result.stdout))
    return out


def test_show_json_has_the_loss_mask_and_prompt_positions_hold_no_entries(chat_stores, tokenizer):
    (store, summary), (full_store, full_summary) = chat_stores["completion"], chat_stores["prompt+completion"]
    assert summary["samples"] == full_summary["samples"] == 6 and summary["tokens"] == full_summary["tokens"]
    first = json.loads(SAMPLE_CHAT.read_text().splitlines()[0])
    result = runner.invoke(app, ["show", str(store), first["id"], "--json"])
    assert result.exit_code == 0, result.stderr
    shown = json.loads(result.stdout)
    mask = np.array(shown["loss_mask"])
    assert len(mask) == len(shown["input_ids"]) and 0 < mask.sum() < len(mask)
    replies = [m["content"] for m in first["messages"] if m["role"] == "assistant"]
    assert marked(tokenizer, np.array(shown["input_ids"]), mask).count("[") == len(replies)
    n_entries = np.array([len(p["ids"]) for p in shown["positions"]])
    assert ((n_entries > 0) == mask[1:].astype(bool)).all()  # entries exactly where the next token is completion
    full = json.loads(runner.invoke(app, ["show", str(full_store), first["id"], "--json"]).stdout)
    assert full["loss_mask"] == shown["loss_mask"] and all(len(p["ids"]) == 8 for p in full["positions"])
    assert summary["stored_bytes"] < full_summary["stored_bytes"]


def test_the_stream_supervises_the_completion_only(chat_stores):
    for train_on in chat.TRAIN_ON:
        view = logitstore.open(str(chat_stores["prompt+completion"][0]))
        with logitstore.stream(view, seq_len=128, micro_batch=2, eval_fraction=0, train_on=train_on) as stream:
            batch = next(iter(stream))
        flat = batch.input_ids.reshape(-1).numpy()
        expected = []
        for sample_id, a, start, length in batch.segments:
            mask = view.sample(sample_id).loss_mask[a : a + length]
            for t in range(length - 1):
                if train_on == "prompt+completion" or mask[t + 1]:
                    expected.append(start + t)
        assert batch.positions.tolist() == expected
        assert (batch.target_ids.numpy() == flat[batch.positions.numpy() + 1]).all()
        assert int(batch.entry_pos.max()) == len(batch.positions) - 1 and len(batch.entry_ids) == 8 * len(expected)


def test_prompt_and_completion_need_a_store_with_prompt_entries(chat_stores, tmp_path):
    store = chat_stores["completion"][0]
    result = runner.invoke(
        app,
        [
            "eval",
            "--store",
            str(store),
            "--student",
            "llama-tiny",
            "--train-on",
            "prompt+completion",
            "--eval-fraction",
            "1",
        ],
    )
    assert result.exit_code == 2 and "completion tokens only" in result.stderr and "Traceback" not in result.stderr
    result = runner.invoke(
        app,
        [
            "build",
            "--chat-column",
            "messages",
            "--store",
            str(store),
            "--limit",
            "6",
            "--top-k",
            "8",
            "--train-on",
            "prompt+completion",
        ],
    )
    assert result.exit_code == 2 and "--train-on must match" in result.stderr


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": [{"role": "robot", "content": "hi"}]}, "role 'robot'"),
        ({"messages": "hello"}, "not a JSON list"),
        ({"messages": [{"role": "user", "content": 3}]}, "content int"),
    ],
)
def test_bad_messages_are_one_line_and_the_store_is_unchanged(chat_stores, tmp_path, row, message):
    store = chat_stores["completion"][0]
    before = Store.open(str(store)).resolve()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "bad", **row}) + "\n")
    result = runner.invoke(
        app, ["build", "--data", str(bad), "--chat-column", "messages", "--store", str(store), "--top-k", "8"]
    )
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert Store.open(str(store)).resolve() == before


def test_conversations_without_assistant_tokens_are_skipped_and_counted(tmp_path):
    data = tmp_path / "chat.jsonl"
    rows = [
        {"id": "q", "messages": [{"role": "user", "content": "Anyone there?"}]},
        {"id": "qa", "messages": CONVERSATION[1:3]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = runner.invoke(
        app,
        [
            "build",
            "--data",
            str(data),
            "--chat-column",
            "messages",
            "--store",
            str(tmp_path / "s"),
            "--top-k",
            "8",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["no_completion"] == 1 and summary["samples"] == 1
    assert logitstore.open(str(tmp_path / "s")).index["sample_id"].to_pylist() == ["qa"]


def test_the_mask_travels_through_the_cross_tokenizer_alignment(gpt2_tokenizer_dir, tmp_path):
    """A student token is supervised iff its bytes lie inside an assistant span: the student's masked
    text is the teacher's, and the stream supervises exactly the student positions before them."""
    from transformers import AutoTokenizer

    from logitstore.format.sparsity import Sparsity
    from logitstore.pipelines.build import BuildConfig, run_build
    from logitstore.streaming.spec import StreamSpec
    from logitstore.streaming.stream import store_stream
    from logitstore.trainer.config import TrainConfig
    from logitstore.trainer.signals import plan_sources

    store = str(tmp_path / "s")
    run_build(
        BuildConfig(
            store=store,
            chat_column="messages",
            limit=4,
            sparsity=Sparsity(k=8),
            progress=False,
            student_tokenizers=(f"gpt2={gpt2_tokenizer_dir}",),
        ),
        log=lambda _: None,
    )
    view = logitstore.open(store)
    teacher, gpt2 = view.teacher_name(None), AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    masks = {}
    for row in view.index.to_pylist():
        s0, n = row["student_start"][0], row["n_student_tokens"][0]
        ids_name, _, mask_name = student_arrays("gpt2", chat=True)
        ids, mask = (view.array(teacher, row["part"], name)[s0 : s0 + n] for name in (ids_name, mask_name))
        masks[row["sample_id"]] = mask
        sample = view.sample(row["sample_id"])
        runs = lambda tok, i, m: [tok.decode(i[a:b].tolist()) for a, b in _runs(m)]
        assert runs(gpt2, ids, mask) == runs(view_tokenizer(view), sample.input_ids, sample.loss_mask)
    cfg = TrainConfig.from_flags(store=store, out="-", student="llama-tiny", student_tokenizer="gpt2", eval_fraction=0)
    sources, _ = plan_sources(view, cfg)
    spec = StreamSpec(seq_len=96, micro_batch=2, rank=0, world_size=1, seed=0, prefetch=0)
    with store_stream(view, spec, sources=sources) as s:
        batch = next(iter(s))
    expected = [
        start + t
        for sample_id, a, start, length in batch.segments
        for t in range(length - 1)
        if masks[sample_id][a + t + 1]
    ]
    ((_, targets),) = batch.signals
    assert batch.positions.tolist() == expected and targets.n_positions == len(expected) > 0
    assert int(targets.exact_pos.max()) < len(expected)


def test_targets_at_kept_positions_drop_partly_kept_groups():
    import torch

    from logitstore.streaming.targets import AlignedTargets, SparseTargets

    t = lambda *x, dt=torch.long: torch.tensor(x, dtype=dt)
    aligned = AlignedTargets(
        target_ids=t(10, 11, 12, 13, 14),
        exact_pos=t(0, 3),
        entry_ids=t(1, 2, 3),
        entry_logprobs=t(-1.0, -2.0, -3.0, dt=torch.float),
        entry_pos=t(0, 0, 1),
        tail=t(0.1, 0.2, dt=torch.float),
        chain_teacher_logprob=t(-4.0, -5.0, dt=torch.float),
        chain_pos=t(1, 2, 4),
        chain_group=t(0, 0, 1),
        weight=t(1.0, 1.0, 1.0, 1.0, 0.5, dt=torch.float),
    )
    got = aligned.restrict(t(False, True, True, True, True, dt=torch.bool))  # position 0 goes; groups stay whole
    assert got.target_ids.tolist() == [11, 12, 13, 14] and got.exact_pos.tolist() == [2]
    assert got.entry_ids.tolist() == [3] and got.entry_pos.tolist() == [0] and got.tail.tolist() == [pytest.approx(0.2)]
    assert got.chain_pos.tolist() == [0, 1, 3] and got.chain_group.tolist() == [0, 0, 1]
    got = aligned.restrict(t(True, True, False, True, True, dt=torch.bool))  # group 0 loses a position: dropped
    assert got.chain_pos.tolist() == [3] and got.chain_group.tolist() == [0]
    assert got.chain_teacher_logprob.tolist() == [-5.0] and got.exact_pos.tolist() == [0, 2]
    sparse = SparseTargets(
        entry_ids=t(1, 2, 3, 4),
        entry_logprobs=t(-1.0, -2.0, -3.0, -4.0, dt=torch.float),
        entry_pos=t(0, 0, 2, 2),
        tail=t(0.1, 0.2, 0.3, dt=torch.float),
        target_ids=t(5, 6, 7),
        target_logprobs=t(-1.0, -2.0, -3.0, dt=torch.float),
    )
    got = sparse.restrict(t(False, True, True, dt=torch.bool))
    assert got.entry_ids.tolist() == [3, 4] and got.entry_pos.tolist() == [1, 1] and got.target_ids.tolist() == [6, 7]


def view_tokenizer(view):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=view.tokenizer())


def _runs(mask) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(mask, int), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


TOOL_CHAT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "18 degrees and sunny"},
    {"role": "assistant", "content": "It is 18 degrees and sunny in Paris."},
]


PLAIN_CHAT = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there!"}]


# ChatML that renders an assistant's tool calls, as tool-calling templates do
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tool_calls_are_rendered_by_a_template_that_reads_them_or_skipped_and_counted(tiny_teacher, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from logitstore.text import chat

    null_content = [{**m, "content": None} if m.get("tool_calls") else m for m in TOOL_CHAT]  # OpenAI's form
    rows = [{"id": "tool", "messages": TOOL_CHAT}, {"id": "null", "messages": null_content}]
    data = jsonl(tmp_path / "chat.jsonl", [*rows, {"id": "plain", "messages": PLAIN_CHAT}])
    args = ["--chat-column", "messages", "--json"]
    result = build(tiny_teacher, tmp_path / "plain-template", data, *args)  # SmolLM2's template: no tool calls
    summary = json.loads(result.stdout)
    assert result.exit_code == 0 and summary["tool_calls"] == 2, result.stderr  # was: an empty reply, no word
    assert documents_in(tmp_path / "plain-template") == {"plain"}

    teacher = tmp_path / "tool-teacher"
    shutil.copytree(tiny_teacher, teacher)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(teacher)
    messages = chat.as_messages(TOOL_CHAT)
    text, spans = chat.render(tokenizer, messages)
    replies = [text[a:b] for a, b in spans]
    assert replies[0].startswith('<tool_call>{"name": "get_weather"') and "Paris" in replies[0]  # supervised
    result = build(str(teacher), tmp_path / "tool-template", data, *args)
    assert result.exit_code == 0 and json.loads(result.stdout)["tool_calls"] == 0, result.stderr
    assert documents_in(tmp_path / "tool-template") == {"tool", "null", "plain"}


def documents_in(store) -> set[str]:
    return {sample_id.split("#")[0] for sample_id in index_of(store)}
