"""A small OpenAI-compatible server on 127.0.0.1 that answers as vLLM's does, for `--engine server`'s tests
and benchmarks: `/v1/models`, `/version`, `/tokenize` and `/v1/completions` with vLLM's `prompt_logprobs`
extension, in vLLM's JSON shape (`render_completion`), with faults a test switches on.

A generation request (`max_tokens` > 1) is answered by a `Generate` callable (the tests' `torch_generator`:
the real teacher through the torch engine's seeded sampler, so one seed gives one answer), in vLLM's shape
(`render_generation`: `token_ids` with `return_token_ids`, the answer's top-K as `logprobs` keyed
`token_id:ID` with `return_tokens_as_token_ids`, the prompt's as `prompt_logprobs`).

What answers a scoring completion is a `Scorer`: the tests' `torch_scorer(teacher)` runs a real teacher through the torch
engine's own top-k forward pass (one unpadded prompt at a time), so a build against this server can be
compared entry for entry with `--engine torch`; `benchmarks/server.py` replays answers rendered once
(`replay(prompt, k) -> bytes`), so the server costs next to nothing.

Faults (`Faults`), each on the next N completion requests: `ok` (an answer: lets the client's preflight
probe through), `500` (then it recovers), `drop` (the
connection closes without an answer), `hang` (no answer for `hang_s`, past a client's timeout),
`malformed` (JSON cut short), `drip` (the whole answer, status line and headers included, one byte per
`drip_s`: every read is quick, the answer takes minutes); `down_after(n)`: after n more answers every
request is dropped (a replica gone); `refuse_if(prompt)`: a 400 for the prompts it picks; `drip_paths`:
every answer to these paths dripped (`/v1/models`: a preflight that trickles); `answer_with`: a path's
answer replaced by fixed bytes (`/tokenize` answering a list); `rewrite_answers(f)`: each
scoring answer (not an `ok`) as `f` rewrites its bytes (a hostile server's impossible values). The
server's answers to `/v1/models` and `/tokenize` come from its `model` and `tokenizer`: another name or
tokenizer makes the mismatches the client must refuse.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import orjson

VERSION = "0.32.0+logitstore-test"


@dataclass(frozen=True)
class Scores:
    """One prompt's answer: per position t (predicting token t+1) the top-k ids and log-probabilities
    (descending), the prompt token's log-probability and its rank in the vocabulary (> k when outside)."""

    ids: np.ndarray  # int [T-1, k]
    logprobs: np.ndarray  # float32 [T-1, k]
    target_logprob: np.ndarray  # float32 [T-1]
    target_rank: np.ndarray  # int [T-1]


Scorer = Callable[[np.ndarray, int], Scores]
# a generation request's answer: (prompt ids, the request's JSON) -> the answer's ids, ending with a stop token
# of the request's `stop_token_ids` or the model's unless cut at `max_tokens`
Generate = Callable[[list[int], dict], list[int]]


def _default_decode(ids: list[int]) -> list[str]:
    return [f"<{i}>" for i in ids]


def _prompt_entries(prompt: list[int], scores: Scores, decode: Callable) -> list:
    """vLLM's `prompt_logprobs`: entry 0 null, then per position a dict keyed by token id (the prompt token
    first, with its vocabulary rank, then the top-k by rank; a prompt token inside the top-k keeps its first
    place), each `{"logprob", "rank", "decoded_token"}`."""
    entries: list = [None]
    for t in range(len(prompt) - 1):
        row_ids = scores.ids[t].tolist()
        names = decode([prompt[t + 1], *row_ids])
        entry = {
            str(prompt[t + 1]): {
                "logprob": float(scores.target_logprob[t]),
                "rank": int(scores.target_rank[t]),
                "decoded_token": names[0],
            }
        }
        for r, (i, lp, name) in enumerate(zip(row_ids, scores.logprobs[t].tolist(), names[1:])):
            entry.setdefault(str(i), {"logprob": lp, "rank": r + 1, "decoded_token": name})
        entries.append(entry)
    return entries


def _completion(model: str, choice: dict, *, prompt_tokens: int, completion_tokens: int) -> bytes:
    usage = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    return orjson.dumps(
        {
            "id": "cmpl-logitstore-test",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, **choice}],
            "usage": usage,
        }
    )


def render_completion(prompt: list[int], scores: Scores, *, model: str, decode: Callable | None = None) -> bytes:
    """A `/v1/completions` answer to a scoring request (one generated token) as vLLM writes it, with its
    `prompt_logprobs` (`_prompt_entries`)."""
    entries = _prompt_entries(prompt, scores, decode or _default_decode)
    choice = {"text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None, "prompt_logprobs": entries}
    return _completion(model, choice, prompt_tokens=len(prompt), completion_tokens=1)


def render_generation(
    prompt: list[int],
    answer: list[int],
    *,
    model: str,
    request: dict,
    finish_reason: str,
    scores: Scores | None = None,
    decode: Callable | None = None,
) -> bytes:
    """A `/v1/completions` answer to a generation request as vLLM writes it: the answer's text, with
    `return_token_ids` its `token_ids` (and `prompt_token_ids`), with `logprobs: K` the OpenAI-style
    `logprobs` of the answer's positions (`top_logprobs`: the chosen token first, then the top-K by rank,
    at most K + 1 keys, each `token_id:ID` with `return_tokens_as_token_ids`, else the decoded token),
    with `prompt_logprobs` those of the prompt. `scores`: of prompt + answer, position t predicting token t+1."""
    decode = decode or _default_decode
    choice: dict = {"text": "".join(decode(answer)), "logprobs": None, "finish_reason": finish_reason}
    choice["stop_reason"] = answer[-1] if finish_reason == "stop" and answer else None
    if request.get("logprobs") is not None:
        assert scores is not None, "logprobs need the scores of prompt + answer"
        key = (lambda i, name: f"token_id:{i}") if request.get("return_tokens_as_token_ids") else (lambda i, n: n)
        tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
        for j, token in enumerate(answer):
            t = len(prompt) - 1 + j
            row_ids = scores.ids[t, : request["logprobs"]].tolist()
            names = decode([token, *row_ids])
            entry = {key(token, names[0]): float(scores.target_logprob[t])}
            for i, lp, name in zip(row_ids, scores.logprobs[t].tolist(), names[1:]):
                entry.setdefault(key(i, name), lp)
            tokens.append(key(token, names[0]))
            token_logprobs.append(float(scores.target_logprob[t]))
            top.append(entry)
            offsets.append(offset)
            offset += len(names[0])
        choice["logprobs"] = {
            "text_offset": offsets,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": top,
        }
    if request.get("prompt_logprobs") is not None:
        assert scores is not None, "prompt_logprobs need the scores of the prompt"
        k = request["prompt_logprobs"]
        prompt_scores = Scores(scores.ids[:, :k], scores.logprobs[:, :k], scores.target_logprob, scores.target_rank)
        choice["prompt_logprobs"] = _prompt_entries(prompt, prompt_scores, decode)
    else:
        choice["prompt_logprobs"] = None
    if request.get("return_token_ids"):
        choice["prompt_token_ids"], choice["token_ids"] = list(prompt), list(answer)
    return _completion(model, choice, prompt_tokens=len(prompt), completion_tokens=len(answer))


@dataclass
class Faults:
    """What the server does to the next completion requests (module docstring)."""

    queue: list[str] = field(default_factory=list)  # one action per request, in order
    answers_left: int | None = None  # `down_after`: answers before every request is dropped
    refuse: Callable[[list[int]], bool] | None = None
    hang_s: float = 5.0
    drip_s: float = 0.2  # seconds between two bytes of a dripped answer
    drip_paths: set[str] = field(default_factory=set)
    answer_with: dict[str, bytes] = field(default_factory=dict)  # path -> the bytes of every answer to it
    rewrite: Callable[[bytes], bytes] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next(self, n: int, action: str) -> None:
        assert action in ("ok", "500", "drop", "hang", "malformed", "drip"), action
        with self.lock:
            self.queue.extend([action] * n)

    def down_after(self, n: int) -> None:
        with self.lock:
            self.answers_left = n

    def refuse_if(self, picks: Callable[[list[int]], bool] | None) -> None:
        self.refuse = picks

    def rewrite_answers(self, rewrite: Callable[[bytes], bytes] | None) -> None:
        self.rewrite = rewrite

    def clear(self) -> None:
        with self.lock:
            self.queue.clear()
            self.answers_left = None
            self.refuse = None
            self.rewrite = None
            self.drip_paths.clear()
            self.answer_with.clear()

    def take(self) -> str | None:
        with self.lock:
            if self.answers_left is not None:
                if self.answers_left <= 0:
                    return "drop"
                self.answers_left -= 1
            return self.queue.pop(0) if self.queue else None


class OpenAIServer:
    """The server, in a thread of this process (`close()` or a `with` block stops it)."""

    def __init__(
        self,
        *,
        model: str,
        scorer: Scorer | None = None,
        replay: Callable[[list[int], int], bytes] | None = None,
        tokenizer=None,
        max_logprobs: int = 20,
        max_model_len: int | None = None,
        api_key: str | None = None,
        tokenize: bool = True,
        version: str = VERSION,
        generate: Generate | None = None,
        stop_ids: tuple[int, ...] = (),
    ):
        assert (scorer is None) != (replay is None), "a scorer, or answers rendered before (replay)"
        self.model, self.scorer, self.replay, self.tokenizer = model, scorer, replay, tokenizer
        self.generate, self.stop_ids = generate, stop_ids  # generation requests; the model's stop tokens
        # vLLM's --logprobs-mode: "processed_logprobs" sends the answer's log-probabilities at its temperature
        self.logprobs_mode = "raw_logprobs"
        self.max_logprobs, self.max_model_len, self.api_key = max_logprobs, max_model_len, api_key
        self.tokenize, self.version = tokenize, version
        self.faults = Faults()
        self.completions = 0  # completion requests answered with 200
        self.generations = 0  # of which generation requests (max_tokens > 1)
        self.keys_seen: list[str | None] = []  # every request's Authorization header (what a client sent)
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                server._handle(self, "GET")

            def do_POST(self):
                server._handle(self, "POST")

        self._http = _Listener(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, name="openai-server", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> OpenAIServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- answers -------------------------------------------------------------------------------------------

    def _handle(self, handler, method: str) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        self.keys_seen.append(handler.headers.get("Authorization"))
        if self.api_key is not None and handler.headers.get("Authorization") != f"Bearer {self.api_key}":
            return _send(handler, 401, {"error": "Unauthorized"})
        path = handler.path.split("?")[0]
        handler.drip_s = self.faults.drip_s if path in self.faults.drip_paths else None
        if path in self.faults.answer_with:
            return _send_bytes(handler, 200, self.faults.answer_with[path])
        if method == "GET" and path == "/v1/models":
            card = {"id": self.model, "object": "model", "root": self.model, "max_model_len": self.max_model_len}
            return _send(handler, 200, {"object": "list", "data": [card]})
        if method == "GET" and path == "/version":
            return _send(handler, 200, {"version": self.version})
        if method == "POST" and path == "/tokenize" and self.tokenize and self.tokenizer is not None:
            request = orjson.loads(body)
            tokens = self.tokenizer.encode(
                request["prompt"], add_special_tokens=request.get("add_special_tokens", True)
            )
            return _send(handler, 200, {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len})
        if method == "POST" and path == "/v1/completions":
            return self._complete(handler, orjson.loads(body))
        return _send(handler, 404, {"detail": "Not Found"})

    def _complete(self, handler, request: dict) -> None:
        action = self.faults.take()
        if action == "drop":
            return _drop(handler)
        if action == "hang":
            time.sleep(self.faults.hang_s)
            return _drop(handler)
        if action == "500":
            return _send(handler, 500, _error("the engine died", 500))
        if action == "drip":
            handler.drip_s = self.faults.drip_s
        prompt = request["prompt"]
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt) if self.tokenizer is not None else []
        k = request.get("prompt_logprobs")
        if k is not None and k > self.max_logprobs:
            message = f"Requested prompt logprobs of {k}, which is greater than max allowed: {self.max_logprobs}"
            return _send(handler, 400, _error(message, 400))
        if self.faults.refuse is not None and self.faults.refuse(prompt):
            return _send(handler, 400, _error("this prompt is refused", 400))
        if self.max_model_len is not None and len(prompt) + request.get("max_tokens", 16) > self.max_model_len:
            return _send(handler, 400, _error(f"This model's maximum context length is {self.max_model_len}", 400))
        if request.get("max_tokens", 16) > 1:
            return self._generate(handler, list(prompt), request, action)
        if self.replay is not None:
            self.completions += 1
            return _send_bytes(handler, 200, self.replay(list(prompt), k or 0))
        assert self.scorer is not None
        scores = self.scorer(np.asarray(prompt), max(k or 0, 1))
        if k == 0:
            scores = Scores(scores.ids[:, :0], scores.logprobs[:, :0], scores.target_logprob, scores.target_rank)
        decode = self.tokenizer.convert_ids_to_tokens if self.tokenizer is not None else None
        answer = render_completion(list(prompt), scores, model=self.model, decode=decode)
        if action == "malformed":
            answer = answer[: len(answer) // 2]
        if action is None and self.faults.rewrite is not None:
            answer = self.faults.rewrite(answer)
        self.completions += 1
        _send_bytes(handler, 200, answer)

    def _generate(self, handler, prompt: list[int], request: dict, action: str | None) -> None:
        """A generation request (`max_tokens` > 1), answered by `generate`, scored by `scorer` where
        `logprobs` or `prompt_logprobs` ask for it."""
        if self.generate is None:
            return _send(handler, 400, _error("this server does not generate (max_tokens must be 1)", 400))
        answer = self.generate(prompt, request)
        stops = set(request.get("stop_token_ids") or []) | set(self.stop_ids)
        finish = "stop" if answer and answer[-1] in stops else "length"
        asked = [k for k in (request.get("logprobs"), request.get("prompt_logprobs")) if k is not None]
        scores = None
        if asked and self.scorer is not None:
            scores = self.scorer(np.asarray([*prompt, *answer]), max(1, *asked))
            temperature = request.get("temperature", 1.0)
            if self.logprobs_mode != "raw_logprobs" and temperature > 0:  # the answer's, tempered (roughly)
                rows = slice(len(prompt) - 1, None)
                logprobs, target = scores.logprobs.copy(), scores.target_logprob.copy()
                logprobs[rows], target[rows] = logprobs[rows] / temperature, target[rows] / temperature
                scores = Scores(scores.ids, logprobs, target, scores.target_rank)
        decode = self.tokenizer.convert_ids_to_tokens if self.tokenizer is not None else None
        body = render_generation(
            prompt, answer, model=self.model, request=request, finish_reason=finish, scores=scores, decode=decode
        )
        if action == "malformed":
            body = body[: len(body) // 2]
        self.completions += 1
        self.generations += 1
        _send_bytes(handler, 200, body)


class _Listener(ThreadingHTTPServer):
    # the standard library's backlog of 5 overflows when a client opens its pool of 64 connections at once: the
    # kernel then drops or resets some of them, which a client reads as a dead replica
    request_queue_size = 1024

    def handle_error(self, request, client_address) -> None:
        # a client that went away mid-answer (a build that stopped, a timeout) is no error of the server's:
        # printed, it would land in the stderr of the command under test
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _error(message: str, code: int) -> dict:
    return {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": code}


def _send(handler, status: int, payload) -> None:
    _send_bytes(handler, status, orjson.dumps(payload))


def _send_bytes(handler, status: int, body: bytes) -> None:
    if getattr(handler, "drip_s", None) is not None:
        return _drip(handler, status, body)
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _drop(handler) -> None:
    handler.close_connection = True
    try:
        import socket

        handler.connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _drip(handler, status: int, body: bytes) -> None:
    """The whole answer, status line first, one byte per `drip_s` seconds, until the client goes away."""
    head = f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    handler.close_connection = True
    for byte in head.encode() + body:
        try:
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
        except OSError:
            return
        time.sleep(handler.drip_s)
