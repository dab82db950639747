"""A small OpenAI-compatible server on 127.0.0.1 that answers as vLLM's does, for `--engine server`'s tests
and benchmarks: `/v1/models`, `/version`, `/tokenize` and `/v1/completions` with vLLM's `prompt_logprobs`
extension, in vLLM's JSON shape (`render_completion`), with faults a test switches on.

What answers a completion is a `Scorer`: the tests' `torch_scorer(teacher)` runs a real teacher through the torch
engine's own top-k forward pass (one unpadded prompt at a time), so a build against this server can be
compared entry for entry with `--engine torch`; `benchmarks/server.py` replays answers rendered once
(`replay(prompt, k) -> bytes`), so the server costs next to nothing.

Faults (`Faults`), each on the next N completion requests: `ok` (an answer: lets the client's preflight
probe through), `500` (then it recovers), `drop` (the
connection closes without an answer), `hang` (no answer for `hang_s`, past a client's timeout),
`malformed` (JSON cut short); `down_after(n)`: after n more answers every request is dropped (a replica
gone); `refuse_if(prompt)`: a 400 for the prompts it picks. The server's answers to `/v1/models` and
`/tokenize` come from its `model` and `tokenizer`: another name or tokenizer makes the mismatches the
client must refuse.
"""

from __future__ import annotations

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


def render_completion(prompt: list[int], scores: Scores, *, model: str, decode: Callable | None = None) -> bytes:
    """A `/v1/completions` answer as vLLM writes it: entry 0 null, then per position a dict keyed by token id
    (the prompt token first, with its vocabulary rank, then the top-k by rank; a prompt token inside the
    top-k keeps its first place), each `{"logprob", "rank", "decoded_token"}`."""
    decode = decode or (lambda ids: [f"<{i}>" for i in ids])
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
    return orjson.dumps(
        {
            "id": "cmpl-logitstore-test",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": "",
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                    "prompt_logprobs": entries,
                }
            ],
            "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + 1, "completion_tokens": 1},
        }
    )


@dataclass
class Faults:
    """What the server does to the next completion requests (module docstring)."""

    queue: list[str] = field(default_factory=list)  # one action per request, in order
    answers_left: int | None = None  # `down_after`: answers before every request is dropped
    refuse: Callable[[list[int]], bool] | None = None
    hang_s: float = 5.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next(self, n: int, action: str) -> None:
        assert action in ("ok", "500", "drop", "hang", "malformed"), action
        with self.lock:
            self.queue.extend([action] * n)

    def down_after(self, n: int) -> None:
        with self.lock:
            self.answers_left = n

    def refuse_if(self, picks: Callable[[list[int]], bool] | None) -> None:
        self.refuse = picks

    def clear(self) -> None:
        with self.lock:
            self.queue.clear()
            self.answers_left = None
            self.refuse = None

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
    ):
        assert (scorer is None) != (replay is None), "a scorer, or answers rendered before (replay)"
        self.model, self.scorer, self.replay, self.tokenizer = model, scorer, replay, tokenizer
        self.max_logprobs, self.max_model_len, self.api_key = max_logprobs, max_model_len, api_key
        self.tokenize, self.version = tokenize, version
        self.faults = Faults()
        self.completions = 0  # completion requests answered with 200
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
        self.completions += 1
        _send_bytes(handler, 200, answer)


class _Listener(ThreadingHTTPServer):
    # the standard library's backlog of 5 overflows when a client opens its pool of 64 connections at once: the
    # kernel then drops or resets some of them, which a client reads as a dead replica
    request_queue_size = 1024


def _error(message: str, code: int) -> dict:
    return {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": code}


def _send(handler, status: int, payload) -> None:
    _send_bytes(handler, status, orjson.dumps(payload))


def _send_bytes(handler, status: int, body: bytes) -> None:
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
