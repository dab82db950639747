"""`build --engine server`: a teacher behind an OpenAI-compatible server (`logitstore/testing/openai_server.py`,
which answers as vLLM's does from a teacher run through the torch engine), on 127.0.0.1.

The equality with `--engine torch` runs the real default teacher; the faults, refusals and the key run the
tiny random teacher (what they test is the client, not the model). Servers are shared per module and their
faults cleared between tests; builds stay at a few hundred tokens.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from logitstore.cli.app import app
from logitstore.pipelines.engines.prompt_logprobs import prompt_logprobs_to_sparse
from logitstore.pipelines.engines.server.client import ServerError, check_one_credential
from logitstore.pipelines.engines.server.completions import served_to_sparse
from logitstore.pipelines.engines.server.preflight import MAX_ALLOWED
from logitstore.pipelines.engines.server.served_json import MalformedResponse, parse_prompt_logprobs
from logitstore.store.store import Store
from logitstore.testing.cli import one_line_error, sample_corpus_head
from logitstore.testing.openai_server import OpenAIServer, Scores, render_completion
from logitstore.testing.stores import stored
from logitstore.testing.teachers import KEY, scoring_teacher, serve_teacher, torch_scorer
from logitstore.urls import recorded, redacted


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return sample_corpus_head(tmp_path_factory.mktemp("server-data") / "docs.jsonl", docs=3, chars=240)


@pytest.fixture(scope="module")
def real_data(tmp_path_factory) -> Path:
    """Four windows: the real teacher is the slow part here."""
    return sample_corpus_head(tmp_path_factory.mktemp("server-real") / "docs.jsonl", docs=2, chars=150)


@pytest.fixture(scope="module")
def real_server():
    """The real default teacher behind the server."""
    with serve_teacher(None, max_logprobs=32) as s:
        yield s


@pytest.fixture(scope="module")
def tiny_servers(tiny_teacher):
    """Three replicas of the tiny teacher, the first with a key (`KEY`) and a small max_model_len."""
    spec, teacher = scoring_teacher(tiny_teacher)
    scorer = torch_scorer(teacher)
    servers = [
        OpenAIServer(model=spec.name, scorer=scorer, tokenizer=teacher.tokenizer, max_logprobs=20) for _ in range(3)
    ]
    yield servers
    for server in servers:
        server.close()


@pytest.fixture
def servers(tiny_servers):
    for server in tiny_servers:
        server.faults.clear()
        server.api_key, server.max_model_len = None, None
    yield tiny_servers
    for server in tiny_servers:
        server.faults.clear()


def build(store, data, teacher, *args, env=None):
    common = ["--store", str(store), "--data", str(data), "--id-column", "id", "--max-length", "32"]
    result = CliRunner().invoke(
        app,
        ["build", *common, "--unit-tokens", "64", "--teacher", str(teacher), "--json", *map(str, args)],
        env=env,
    )
    return result


def summary(result) -> dict:
    text = result.stdout
    return json.loads(text[text.index("{") :])


def errors(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("error")]


@pytest.fixture(scope="module")
def tiny_reference(tiny_teacher, data, tmp_path_factory):
    """The tiny teacher's top-20 entries from the torch engine, one unpadded sample per batch."""
    store = tmp_path_factory.mktemp("server-ref") / "torch"
    result = build(store, data, tiny_teacher, "--top-k", 20, "--batch-tokens", 2)
    assert result.exit_code == 0, result.output
    return store


def assert_entries_equal(store, reference) -> None:
    """Each sample `store` holds has the reference's tokens and entries, decoded, equal entries in id order
    (the bytes differ where the first unit differs: its entries order the codec's ids, which order ties)."""
    got, want = Store.open(str(store)).read(), Store.open(str(reference)).read()
    for sample_id in got.index["sample_id"].to_pylist():
        a, b = got.sample(sample_id), want.sample(sample_id)
        for name in ("input_ids", "n_entries", "target_logprobs", "tail"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), (sample_id, name)
        ga, gb = (np.lexsort((x.entry_ids, np.repeat(np.arange(len(x.n_entries)), x.n_entries))) for x in (a, b))
        assert np.array_equal(a.entry_ids[ga], b.entry_ids[gb]), sample_id
        assert np.array_equal(a.entry_logprobs[ga], b.entry_logprobs[gb]), sample_id


# -- what is stored --------------------------------------------------------------------------------------


def test_a_server_build_stores_what_the_torch_engine_stores(real_server, real_data, tmp_path):
    """The real teacher at top-16: every sample's stored bytes (its content hash) equal the torch engine's,
    and the teacher's metadata records the server (engine, served model, /version, K, URLs less credentials)."""
    torch_store, server_store = tmp_path / "torch", tmp_path / "server"
    assert build(torch_store, real_data, "default", "--top-k", 16, "--batch-tokens", 2).exit_code == 0
    url = real_server.url.replace("http://", "http://user:secret@")
    result = build(server_store, real_data, "default", "--engine", "server", "--server-url", url, "--top-k", 16)
    assert result.exit_code == 0, result.output
    hashes = stored(server_store)
    assert len(hashes) >= 3 and hashes == stored(torch_store)
    meta = next(iter(Store.open(str(server_store)).read().teachers.values()))
    assert (meta.engine, meta.sparsity.k) == ("server", 16)
    assert meta.server == {
        "model": real_server.model,
        "version": real_server.version,
        "k": 16,
        "urls": [real_server.url],
    }
    assert summary(result)["refused"] == 0


def test_served_answers_parse_as_the_dict_form_converts():
    """The compiled reader gives the vLLM engine's conversion of the same answer read by orjson, with
    escaped and odd tokens, spacing, and prompt tokens inside and outside the top-k; broken bytes are refused."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 1000, 40).tolist()
    logits = rng.normal(size=(39, 1000)) * 3
    logprobs = (logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)).astype(np.float32)
    order = np.argsort(-logprobs, axis=1, kind="stable")[:, :8]
    targets = np.array(prompt[1:])
    rank = (logprobs > logprobs[np.arange(39), targets][:, None]).sum(axis=1) + 1
    scores = Scores(order, np.take_along_axis(logprobs, order, 1), logprobs[np.arange(39), targets], rank)
    names = ['"q"', "\\", "é\n", "{}", "\u2028", "", " ", "a,b:c"]
    body = render_completion(prompt, scores, model="m", decode=lambda ids: [names[i % len(names)] for i in ids])
    import orjson

    entries = orjson.loads(body)["choices"][0]["prompt_logprobs"]

    class Item:
        def __init__(self, d):
            self.logprob, self.rank = d["logprob"], d["rank"]

    as_dicts = [None] + [{int(k): Item(v) for k, v in e.items()} for e in entries[1:]]
    want = prompt_logprobs_to_sparse(prompt, as_dicts, k=8, vocab_size=1000)
    # vLLM's compact entries (the fast path), then spaced ones and a null name before another key (the general)
    nulled = body.replace(b'"decoded_token":', b'"decoded_token":null,"name":')
    for variant in (body, body.replace(b":", b" : ").replace(b",", b" ,\n "), nulled):
        got = served_to_sparse(variant, np.array(prompt), k=8, vocab_size=1000)
        for name in want:
            assert np.array_equal(got[name], want[name]), name
    flat = parse_prompt_logprobs(body)
    assert flat.positions == 40 and list(flat.null_at) == [0]
    for broken in (body[: len(body) // 2], body.replace(b'"logprob"', b'"logprop"'), b'{"choices": []}'):
        with pytest.raises(MalformedResponse):
            served_to_sparse(broken, np.array(prompt), k=8, vocab_size=1000)


def test_every_entry_reads_as_json_reads_it_on_the_word_path_and_off_it():
    """Compact entries (the eight-bytes-at-a-time path) and what it hands to the byte reader (an exponent,
    ids and ranks of 8+ digits, an 8+ digit integer part, long and escaped strings, the answer's last bytes):
    the ids, float32 log-probabilities and ranks Python's json reads, whichever reader took an entry."""
    rng = np.random.default_rng(1)
    values = [float(v) for v in -rng.exponential(3.0, 400).astype(np.float32)]
    values += [-0.0, 0.0, -1e-07, -1.1920928955078125e-07, -100.5, -12345678.9, -0.000123456789012345678, -7.0]
    values += [-3.4028234663852886e38, -1.401298464324817e-45, -123456789012345678901.5, -42]
    names = ["", '"', "\\", "é\n", "東京", "\u2028", "x" * 100, '\\"' * 9, "}", ',"rank":', "a" * 7]
    positions = []
    for p in range(0, len(values), 5):
        ids = [int(i) for i in rng.choice([0, 7, 12345, 151_935, 1_234_567, 12_345_678], 5, replace=False)]
        ranks = [int(r) for r in rng.choice([1, 2, 99, 1_234_567, 12_345_678], 5)]
        positions.append(
            {
                str(i): {"logprob": v, "rank": r, "decoded_token": names[(p + j) % len(names)]}
                for j, (i, v, r) in enumerate(zip(ids, values[p : p + 5], ranks))
            }
        )
    body = json.dumps({"choices": [{"prompt_logprobs": [None, *positions]}], "usage": {}}, separators=(",", ":"))
    # the last entry's value with 100 fraction digits: the word path reads its fraction past REACH
    last = body.rindex('"logprob":') + len('"logprob":')
    end = body.index(",", last)
    body = body[:last] + "-1.5" + "0" * 98 + "1" + body[end:]
    flat = parse_prompt_logprobs(body.encode())
    read = [e for position in json.loads(body)["choices"][0]["prompt_logprobs"][1:] for e in position.items()]
    assert flat.ids.tolist() == [int(i) for i, _ in read]
    assert np.array_equal(flat.logprobs, np.array([e["logprob"] for _, e in read], dtype=np.float32))
    assert flat.ranks.tolist() == [e["rank"] for _, e in read]
    assert flat.starts.tolist() == [0, 0, *np.cumsum([len(p) for p in positions]).tolist()]


# vLLM 0.32.0's own answer (`vllm serve` on vLLM's CPU build, the vLLM tests' random Llama) to prompt
# [12, 400, 3000] with prompt_logprobs 2: the prompt tokens are outside the top 2 (ranks 29,750 and 2,939)
VLLM_ANSWER = (
    b'{"id":"cmpl-84b134ab69740da7","object":"text_completion","created":1795761306,"model":"/tmp/vs/l'
    b'lama-head32","choices":[{"index":0,"text":" division","logprobs":null,"finish_reason":"length","'
    b'stop_reason":null,"token_ids":null,"prompt_logprobs":[null,{"400":{"logprob":-10.887408256530762'
    b',"rank":29750,"decoded_token":"ld"},"5687":{"logprob":-9.642197608947754,"rank":1,"decoded_token'
    b'":" circumstances"},"18837":{"logprob":-9.851057052612305,"rank":2,"decoded_token":"kernel"}},{"'
    b'3000":{"logprob":-10.476804733276367,"rank":2939,"decoded_token":" Pre"},"44470":{"logprob":-9.8'
    b'38800430297852,"rank":1,"decoded_token":"odendron"},"24667":{"logprob":-9.918940544128418,"rank"'
    b':2,"decoded_token":" honored"}}],"prompt_token_ids":null,"routed_experts":null}],"service_tier":'
    b'null,"system_fingerprint":"vllm-0.32.0-08eed915","usage":{"prompt_tokens":3,"total_tokens":4,"co'
    b'mpletion_tokens":1,"prompt_tokens_details":null,"completion_tokens_details":null},"kv_transfer_p'
    b'arams":null,"ec_transfer_params":null,"metrics":null}'
)
# and its refusal of a K above --max-logprobs (HTTP 400)
VLLM_REFUSAL = (
    b'{"error":{"message":"Requested prompt logprobs of 64, which is greater than max allowed: 32 (parameter=prompt_'
    b'logprobs, value=64)","type":"BadRequestError","param":"prompt_logprobs","code":400}}'
)


def test_a_real_vllm_answer_and_refusal_are_read():
    """The bytes vLLM's server sent: the top-2 ids and log-probabilities in rank order, the prompt tokens'
    log-probabilities from outside the top 2, the tail as 1 - their sum; the refusal names the maximum."""
    got = served_to_sparse(VLLM_ANSWER, np.array([12, 400, 3000]), k=2, vocab_size=49_152)
    assert got["ids"].tolist() == [[5687, 18837], [44470, 24667]]
    np.testing.assert_allclose(got["logprobs"], [[-9.642198, -9.851057], [-9.838800, -9.918941]], rtol=1e-6)
    np.testing.assert_allclose(got["target_logprob"], [-10.887408, -10.476805], rtol=1e-6)
    np.testing.assert_allclose(got["tail"], 1 - np.exp(got["logprobs"]).sum(axis=1), rtol=1e-6)
    assert MAX_ALLOWED.search(json.loads(VLLM_REFUSAL)["error"]["message"]).group(1) == "32"


# -- refusals before anything is written -----------------------------------------------------------------


@pytest.mark.parametrize(
    "case, args, message",
    [
        ("wrong model", [], "serves other-model, not the teacher"),
        ("tokenizer", [], "tokenizes a probe text otherwise"),
        ("k", ["--top-k", 24], "vllm serve --max-logprobs 24"),
        ("key", [], "refused the API key"),
        ("unreachable", [], "cannot reach the server"),
        ("sample", ["--sample", 16], "cannot store --sample entries"),
        ("temperature", ["--top-k", 8, "--temperature", 2], "--temperature 1 only"),
    ],
)
def test_what_the_server_cannot_serve_is_refused_in_one_line(
    case, args, message, servers, tiny_teacher, data, tmp_path, gpt2_tokenizer_dir
):
    server = servers[0]
    url = server.url
    if case == "wrong model":
        server.model, restore = "other-model", server.model
    if case == "tokenizer":
        from transformers import AutoTokenizer

        server.tokenizer, restore = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir), server.tokenizer
    if case == "key":
        server.api_key = KEY
    if case == "unreachable":
        url = "http://127.0.0.1:9"
    try:
        result = build(tmp_path / "s", data, tiny_teacher, "--engine", "server", "--server-url", url, *args)
    finally:
        if case == "wrong model":
            server.model = restore
        if case == "tokenizer":
            server.tokenizer = restore
    assert result.exit_code == 2, result.output
    assert len(errors(result)) == 1 and message in errors(result)[0], result.output
    assert "Traceback" not in result.output and not (tmp_path / "s").exists()


@pytest.mark.parametrize("answer", [b"[1, 2, 3]", b'"tokens"', b'{"tokens": "1 2 3"}'])
def test_a_tokenize_answer_that_is_no_object_of_ids_is_one_line(answer, servers, tiny_teacher, data, tmp_path):
    server = servers[0]
    server.faults.answer_with["/tokenize"] = answer
    result = build(tmp_path / "s", data, tiny_teacher, "--engine", "server", "--server-url", server.url, "--top-k", 8)
    line = one_line_error(result, 2)
    assert f"--server-url {server.url}: /tokenize did not answer an object with a list of token ids" in line
    assert not (tmp_path / "s").exists()


# -- faults ----------------------------------------------------------------------------------------------


def test_replicas_that_fail_drop_or_hang_are_retried_and_the_build_equals_the_clean_one(
    servers, tiny_teacher, tiny_reference, data, tmp_path
):
    """One replica drops every connection (and is set aside), one answers 500 twice then recovers, one hangs
    past the timeout once: the build completes with every sample, as the torch engine stores them. No
    --top-k: K = min(64, the servers' maximum of 20), said at start."""
    dropping, failing, hanging = servers
    for server in servers:  # the preflight's two probes (K = 64 refused, then K = 20) get through
        server.faults.next(2, "ok")
    dropping.faults.down_after(2)
    failing.faults.next(2, "500")
    hanging.faults.hang_s = 3
    hanging.faults.next(1, "hang")
    urls = [a for s in servers for a in ("--server-url", s.url)]
    result = build(tmp_path / "s", data, tiny_teacher, "--engine", "server", *urls, "--server-timeout", 1)
    assert result.exit_code == 0, result.output
    assert "K = min(64, the server's maximum) = 20" in result.output
    assert f"{dropping.url} set aside after 3 failures in a row" in result.output
    assert not failing.faults.queue and not hanging.faults.queue  # each fault was met
    assert stored(tmp_path / "s") == stored(tiny_reference)


def test_an_answer_dripped_past_the_timeout_is_retried_and_the_build_equals_the_clean_one(
    servers, tiny_teacher, tiny_reference, data, tmp_path
):
    """--server-timeout bounds the whole request: an answer trickled a byte at a time (every read quick)
    ends as a timeout at 1 s and is asked again; the build then stores what the torch engine stores."""
    server = servers[0]
    server.faults.next(1, "ok")  # the preflight's probe
    server.faults.next(1, "drip")
    args = ["--engine", "server", "--server-url", server.url, "--top-k", 20, "--server-timeout", 1]
    result = build(tmp_path / "s", data, tiny_teacher, *args)
    assert result.exit_code == 0, result.output
    assert not server.faults.queue  # the drip was met
    assert stored(tmp_path / "s") == stored(tiny_reference)


@pytest.mark.parametrize("where", ["answers", "preflight"])
def test_a_server_that_trickles_every_answer_is_one_line_after_the_retries(
    where, servers, tiny_teacher, data, tmp_path
):
    """Every answer (or the preflight's /v1/models) dripped a byte per 0.2 s: each request ends at the
    1-s deadline; once the retries are spent (the replica set aside), one line and exit 2, no store."""
    server = servers[0]
    if where == "answers":
        server.faults.next(1, "ok")  # the preflight's probe
        server.faults.next(10, "drip")
    else:
        server.faults.drip_paths.add("/v1/models")
    args = ["--engine", "server", "--server-url", server.url, "--top-k", 8, "--server-timeout", 1]
    result = build(tmp_path / "s", data, tiny_teacher, *args)
    line = one_line_error(result, 2)
    assert "no whole answer within 1 s (--server-timeout)" in line
    if where == "preflight":
        assert f"--server-url {server.url}: /v1/models: no whole answer" in line
    else:
        assert "set aside after 3 failures" in result.output and "run the same command again" in line
    assert not (tmp_path / "s").exists()


def test_with_every_replica_gone_the_build_commits_stops_and_resumes(
    servers, tiny_teacher, tiny_reference, data, tmp_path
):
    """Both replicas go down mid-build: one line, exit 2, the commits made stay readable; the same command
    then completes, nothing stored twice, equal to the uninterrupted build."""
    two = servers[:2]
    for server in two:
        server.faults.down_after(4)
    urls = [a for s in two for a in ("--server-url", s.url)]
    args = ["--engine", "server", *urls, "--top-k", 20, "--commit-every", 0.001, "--server-timeout", 2]
    result = build(tmp_path / "s", data, tiny_teacher, *args)
    assert result.exit_code == 2, result.output
    assert len(errors(result)) == 1 and "run the same command again to resume" in errors(result)[0]
    first = stored(tmp_path / "s")
    assert 0 < len(first) < len(stored(tiny_reference))
    assert all(stored(tiny_reference)[s] == h for s, h in first.items())
    for server in two:
        server.faults.clear()
    again = build(tmp_path / "s", data, tiny_teacher, *args)
    assert again.exit_code == 0, again.output
    index = Store.open(str(tmp_path / "s")).read().index["sample_id"].to_pylist()
    assert len(index) == len(set(index)) and stored(tmp_path / "s") == stored(tiny_reference)


def test_a_sample_the_server_refuses_is_counted_and_the_rest_stored(
    servers, tiny_teacher, tiny_reference, data, tmp_path
):
    server = servers[0]
    seen: list = []

    def refuse(prompt):  # the first sample's request (the first of all is the preflight's probe)
        seen.append(list(prompt))
        return len(seen) > 1 and list(prompt) == seen[1]

    server.faults.refuse_if(refuse)
    result = build(tmp_path / "s", data, tiny_teacher, "--engine", "server", "--server-url", server.url, "--top-k", 20)
    assert result.exit_code == 0, result.output
    assert summary(result)["refused"] == 1
    assert len(stored(tmp_path / "s")) == len(stored(tiny_reference)) - 1
    assert_entries_equal(tmp_path / "s", tiny_reference)


def test_a_malformed_answer_is_one_line_naming_the_url(servers, tiny_teacher, data, tmp_path):
    server = servers[0]
    server.faults.next(1, "ok")  # the preflight's probe
    server.faults.next(1, "malformed")
    result = build(tmp_path / "s", data, tiny_teacher, "--engine", "server", "--server-url", server.url, "--top-k", 8)
    assert result.exit_code == 2, result.output
    assert len(errors(result)) == 1 and f"--server-url {server.url}: malformed answer" in errors(result)[0]


def impossible(case: str):
    """A rewrite of a scoring answer's bytes (`Faults.rewrite_answers`) into an impossible one: each top
    entry at probability 0.905 (`mass`); a prompt token outside the top-8 at probability 1 where the top-8
    hold 0.3 (`tail`); every entry at -Infinity (`infinite`); an id of 2**64 + 5, which wraps to 5 in int64
    (`huge id`)."""

    def rewrite(body: bytes) -> bytes:
        answer = json.loads(body)
        positions = answer["choices"][0]["prompt_logprobs"][1:]
        for entries in positions:
            for entry in entries.values():
                entry["logprob"] = {"mass": math.log(0.905), "tail": math.log(0.3 / 8), "infinite": -math.inf}.get(
                    case, entry["logprob"]
                )
        if case == "tail":
            target = next(e for e in positions if next(iter(e.values()))["rank"] > 8)
            next(iter(target.values()))["logprob"] = 0.0
        if case == "huge id":
            entries = positions[0]
            key = list(entries)[-1]
            entries[str(2**64 + 5)] = entries.pop(key)
        return json.dumps(answer).encode()  # -Infinity as Python (and vLLM) write it

    return rewrite


@pytest.mark.parametrize(
    "case, problem",
    [
        ("mass", "probabilities sum to 8.145, more than 1"),
        ("tail", "its top entries' and the prompt token's probabilities sum to 1.3, more than 1"),
        ("infinite", "holds a log-probability of -inf: not a finite number"),
        ("huge id", "a token id of 2**62 or more, outside the vocabulary [0, 49152)"),
    ],
)
def test_an_impossible_answer_is_one_line_naming_the_url_and_sample_and_stores_nothing(
    case, problem, servers, tiny_teacher, data, tmp_path
):
    server = servers[0]
    server.faults.next(1, "ok")  # the preflight's probe
    server.faults.rewrite_answers(impossible(case))
    result = build(tmp_path / "s", data, tiny_teacher, "--engine", "server", "--server-url", server.url, "--top-k", 8)
    line = one_line_error(result, 2)
    assert f"--server-url {server.url}: malformed answer for sample 'stdlib/" in line and problem in line, line
    assert not (tmp_path / "s").exists()


def test_samples_longer_than_the_server_takes_are_skipped_and_counted(servers, tiny_teacher, data, tmp_path):
    server = servers[0]
    server.max_model_len = 30  # a 32-token window and its generated token do not fit
    result = build(tmp_path / "s", data, tiny_teacher, "--engine", "server", "--server-url", server.url, "--top-k", 8)
    assert result.exit_code == 0, result.output
    counts = summary(result)
    assert counts["too_long"] > 0 and counts["samples"] > 0


# -- the key ---------------------------------------------------------------------------------------------


def test_the_api_key_is_sent_and_written_nowhere(servers, tiny_teacher, data, tmp_path):
    """From the variable and from the flag: every request carries it; the store, the output and
    --print-config never hold it."""
    server = servers[0]
    server.api_key = KEY
    seen = len(server.keys_seen)
    args = ["--engine", "server", "--server-url", server.url, "--top-k", 8]
    result = build(tmp_path / "s", data, tiny_teacher, *args, env={"LOGITSTORE_SERVER_API_KEY": KEY})
    assert result.exit_code == 0, result.output
    assert server.keys_seen[seen:] and all(key == f"Bearer {KEY}" for key in server.keys_seen[seen:])
    printed = build(tmp_path / "p", data, tiny_teacher, *args, "--server-api-key", KEY, "--print-config")
    assert printed.exit_code == 0, printed.output
    for text in (result.output, printed.output):
        assert KEY not in text
    for root, _, files in os.walk(tmp_path):
        for name in files:
            assert KEY.encode() not in (Path(root) / name).read_bytes(), name


PASSWORD = "S3cretPW-41d"


def with_password(url: str) -> str:
    return url.replace("http://", f"http://alice:{PASSWORD}@")


def test_a_password_in_a_url_is_sent_and_shown_or_written_nowhere(servers, tiny_teacher, data, tmp_path):
    """`http://alice:PASSWORD@host` is HTTP basic auth: the server gets it; no output (--print-config,
    --json, a replica set aside and the outage's line, an unreachable replica's line) and no file holds
    it. The printed configuration shows the URL redacted, and given back to --config it is refused in one
    line."""
    good, failing = servers[:2]
    failing.faults.next(1, "ok")  # the preflight's probe; then 500s until it is set aside
    failing.faults.next(10, "500")
    seen = len(good.keys_seen)
    args = ["--engine", "server", "--top-k", 8, "--server-url"]
    result = build(tmp_path / "s", data, tiny_teacher, *args, with_password(good.url))
    printed = build(tmp_path / "p", data, tiny_teacher, *args, with_password(good.url), "--print-config")
    (tmp_path / "printed.yaml").write_text(printed.stdout)
    again = CliRunner().invoke(app, ["build", "--config", str(tmp_path / "printed.yaml")])
    outage = build(tmp_path / "o", data, tiny_teacher, *args, with_password(failing.url))
    unreachable = build(tmp_path / "u", data, tiny_teacher, *args, with_password("http://127.0.0.1:9"))
    for output in (result, printed, again, outage, unreachable):
        assert PASSWORD not in output.output
    for root, _, files in os.walk(tmp_path):
        for name in files:
            assert PASSWORD.encode() not in (Path(root) / name).read_bytes(), name
    assert result.exit_code == 0, result.output
    assert "Basic " in good.keys_seen[-1] and len(good.keys_seen) > seen
    assert printed.exit_code == 0 and f"http://alice:<redacted>@{good.url[7:]}" in printed.output
    assert "give the URL with its password" in one_line_error(again, 2)
    shown = f"http://alice:<redacted>@{failing.url[7:]}"
    assert f"--server-url {shown} set aside" in outage.output and shown in one_line_error(outage, 2)
    assert "http://alice:<redacted>@127.0.0.1:9: cannot reach the server" in one_line_error(unreachable, 2)


@pytest.mark.parametrize(
    "url, problem",
    [
        ("http://127.0.0.1:99999", "not a URL (Port out of range 0-65535)"),
        ("http://[::1", "not a URL (Invalid IPv6 URL)"),
        ("127.0.0.1:8000", "a server URL starts with http:// or https://"),
        ("http://host:8000/v1?token=x", "takes no query or fragment"),
    ],
)
def test_a_url_that_cannot_be_a_server_is_one_line_before_anything_runs(url, problem, tiny_teacher, data, tmp_path):
    for flags in (
        ["--engine", "server", "--server-url", url],
        ["--generate", 4, "--prompt-column", "text", "--generator-url", url],
    ):
        result = build(tmp_path / "s", data, tiny_teacher, *flags)
        flag = flags[-2]
        assert one_line_error(result, 2).startswith(f"error: {flag} {redacted(url)}: {problem}")
    assert not (tmp_path / "s").exists()


def test_credentials_are_stripped_from_recorded_urls():
    assert recorded("https://u:p@host:8443/v1/?token=x#f") == "https://host:8443/v1"


def test_a_dry_run_times_the_server_and_writes_nothing(servers, tiny_teacher, data, tmp_path):
    server = servers[0]
    before = server.completions
    args = ["--engine", "server", "--server-url", server.url, "--top-k", 8, "--dry-run"]
    result = build(tmp_path / "s", data, tiny_teacher, *args)
    assert result.exit_code == 0, result.output
    (estimate,) = summary(result)["teachers"]
    assert estimate["measured_tokens"] > 0 and estimate["teacher_tokens_per_second"] > 0
    assert estimate["sparsity"]["k"] == 8 and server.completions > before + 1
    assert not (tmp_path / "s").exists()


def test_without_tokenize_the_echoed_ids_check_the_tokenizer(servers, tiny_teacher, gpt2_tokenizer_dir):
    """A server without /tokenize: the ids a text prompt echoes (prompt_logprobs 0) are compared instead."""
    from transformers import AutoTokenizer

    from logitstore.format.sparsity import Sparsity
    from logitstore.pipelines.engines.server.preflight import preflight
    from logitstore.pipelines.engines.settings import WorkerSettings
    from logitstore.pipelines.teacher import resolve_teacher

    server = servers[0]
    server.tokenize = False
    spec = resolve_teacher(tiny_teacher)
    settings = WorkerSettings(spec, "cpu", "auto", Sparsity(k=8), 8192, 0, engine="server", server_urls=(server.url,))
    try:
        assert preflight(settings, spec).k == 8
        server.tokenizer, mine = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir), server.tokenizer
        try:
            with pytest.raises(ServerError, match="tokenizes a probe text otherwise"):
                preflight(settings, spec)
        finally:
            server.tokenizer = mine
    finally:
        server.tokenize = True


def test_a_url_with_a_password_and_an_api_key_is_one_line_before_any_request(monkeypatch):
    settings = SimpleNamespace(
        server_urls=("http://127.0.0.1:9", "http://me:secret@127.0.0.1:9/v1"), server_api_key=None
    )
    check_one_credential(settings)  # basic auth alone is the URL's
    monkeypatch.setenv("LOGITSTORE_SERVER_API_KEY", KEY)
    with pytest.raises(
        ServerError, match="--server-url http://me:<redacted>@127.0.0.1:9/v1 carries a user and password"
    ) as error:
        check_one_credential(settings)
    assert "secret" not in str(error.value) and KEY not in str(error.value)
