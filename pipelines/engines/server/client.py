"""The server engine's transport: the replicas' request pool (`Replicas`), the preflight's requests
(`Checks`) and the API key. Both make their aiohttp sessions in `session`, where `--server-timeout` bounds
each request as a whole: connecting, sending, and reading the answer to its last byte.

Requests (`Replicas`): an asyncio loop in a thread of its own, an aiohttp session per replica, at most
`--server-concurrency` requests in flight on each, a new request to the live replica with the least
outstanding work (prompt tokens in flight). Timeouts, refused or dropped connections, 429 and 5xx are
retried with backoff, `ATTEMPTS` times at most; a replica that fails `SET_ASIDE_AFTER` times in a row is set
aside and the others carry on; with none left every request fails with `ServerOutage` (exit 2, after the
build commits what it finished). Any other 4xx refuses that one sample, counted (`skips`). The unit's
threads parse the answers (the kernel releases the GIL), so the loop only moves bytes.

Log and error lines show a URL as `logitstore.urls.redacted` does: never with its password.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import urllib.parse
from concurrent.futures import Future
from dataclasses import dataclass, field

import aiohttp
import orjson

from logitstore.pipelines.engines.base import EngineError
from logitstore.urls import redacted, scrubbed

API_KEY_VARIABLE = "LOGITSTORE_SERVER_API_KEY"
ATTEMPTS = 6  # tries of one request over the replicas before the build stops
SET_ASIDE_AFTER = 3  # failures in a row after which a replica is set aside for the rest of the build
BACKOFF_S = 0.2  # the first retry's wait; doubled each time, with jitter, at most BACKOFF_MAX_S
BACKOFF_MAX_S = 5.0
CHECK_TIMEOUT_S = 30.0  # a preflight request at most (the probe is a few tokens), and connecting
JSON = {"Content-Type": "application/json"}


class ServerError(EngineError):
    """The server cannot serve this build: unreachable, a wrong key or model, another tokenizer, a K above
    its maximum, or an answer that is not a completion with prompt log-probabilities."""


class ServerOutage(ServerError):
    """No replica is left: the build commits what it finished and stops; the same command resumes."""


def api_key(settings) -> str | None:
    return settings.server_api_key or os.environ.get(API_KEY_VARIABLE) or None


def check_one_credential(settings, *, flag: str = "--server-url") -> None:
    """A URL's user:password is HTTP basic auth, and the API key a bearer header: both would be one
    Authorization header (the HTTP clients refuse, or let one replace the other), so a request has one."""
    if api_key(settings) is None:
        return
    for url in settings.server_urls:
        if urllib.parse.urlsplit(url).username is not None:
            raise ServerError(
                f"{flag} {redacted(url)} carries a user and password, and an API key is given too "
                f"(--server-api-key or {API_KEY_VARIABLE}): give one of them"
            )


def base_url(url: str) -> str:
    """The server's root: URLs are given with or without a trailing /v1."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def session(*, key: str | None, timeout: float, connections: int) -> aiohttp.ClientSession:
    """An aiohttp session (made on the loop that uses it) whose every request ends within `timeout` seconds,
    its answer read to the last byte (aiohttp's `total`). A per-read timeout (httpx's, aiohttp's
    `sock_read`) never ends a server that trickles its answer a byte at a time; this ends it as a
    timeout, retried as any other. aiohttp reads a body through its C parser (llhttp): a 1.5 MB answer
    costs the loop ~2.6 ms of CPU where httpx over h11 costs ~10.7 ms, the largest share of a served
    build's client (docs/benchmarks.md)."""
    return aiohttp.ClientSession(
        headers=headers(key),
        connector=aiohttp.TCPConnector(limit=connections, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, CHECK_TIMEOUT_S)),
    )


def timed_out(timeout: float) -> str:
    """Why a request failed that `session`'s deadline ended."""
    return f"no whole answer within {timeout:g} s (--server-timeout)"


@dataclass(frozen=True)
class Response:
    """A preflight request's answer, read whole."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


class Checks:
    """The preflight's requests, one at a time from the calling thread: a `session` on an event loop of its
    own, each request bounded by --server-timeout, at most `CHECK_TIMEOUT_S` (a `with` block closes it)."""

    def __init__(self, settings):
        self.timeout = min(settings.server_timeout, CHECK_TIMEOUT_S)
        self._loop = asyncio.new_event_loop()
        self._session = self._loop.run_until_complete(self._open(api_key(settings)))

    async def _open(self, key: str | None) -> aiohttp.ClientSession:
        return session(key=key, timeout=self.timeout, connections=1)

    def send(self, method: str, url: str, body: bytes | None) -> Response:
        return self._loop.run_until_complete(self._send(method, url, body))

    async def _send(self, method: str, url: str, body: bytes | None) -> Response:
        extra = JSON if body is not None else None
        async with self._session.request(method, url, data=body, headers=extra) as answer:
            return Response(answer.status, await answer.read())

    def close(self) -> None:
        self._loop.run_until_complete(self._session.close())
        self._loop.close()

    def __enter__(self) -> Checks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def request(client: Checks, method: str, url: str, path: str, *, body: bytes | None = None) -> Response:
    shown = redacted(url)
    try:
        response = client.send(method, base_url(url) + path, body)
    except aiohttp.ClientError as error:  # a connection's own timeout included: it says which
        why = scrubbed(f"{type(error).__name__}: {error}".rstrip(": "), url)
        raise ServerError(f"--server-url {shown}: cannot reach the server ({why})") from None
    except TimeoutError:  # the request's deadline
        raise ServerError(f"--server-url {shown}: {path}: {timed_out(client.timeout)}") from None
    if response.status_code in (401, 403):
        raise ServerError(
            f"--server-url {shown} refused the API key (HTTP {response.status_code}): set --server-api-key or "
            f"{API_KEY_VARIABLE} to the server's key"
        )
    return response


def get_json(client: Checks, url: str, path: str):
    response = request(client, "GET", url, path)
    if response.status_code != 200:
        raise ServerError(f"--server-url {redacted(url)}: {path} answered HTTP {response.status_code}")
    return parse_json(response.content, url, path)


def parse_json(content: bytes, url: str, path: str):
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        raise ServerError(f"--server-url {redacted(url)}: {path} answered malformed JSON") from None


def server_version(client: Checks, url: str) -> str:
    response = request(client, "GET", url, "/version")
    if response.status_code != 200:
        return "unknown"
    answer = parse_json(response.content, url, "/version")
    return str(answer.get("version", "unknown")) if isinstance(answer, dict) else "unknown"


def served_models(client: Checks, url: str) -> list[dict] | None:
    """The model cards `/v1/models` lists (those that are objects), or None where it answers no list."""
    models = get_json(client, url, "/v1/models")
    cards = models.get("data") if isinstance(models, dict) else None
    return [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else None


@dataclass(eq=False)
class Replica:
    url: str
    client: aiohttp.ClientSession
    in_flight: int = 0
    outstanding: int = 0  # prompt tokens in flight
    failures: int = 0  # in a row
    set_aside: bool = False
    last_error: str = ""


@dataclass(frozen=True)
class Answer:
    """A request's end: the answer's bytes (status 200), or a refusal of the sample (another 4xx)."""

    url: str
    status: int
    body: bytes = b""
    reason: str = ""


@dataclass
class Replicas:
    """The replicas' request pool (module docstring): `submit` from any thread, a `Future` of an `Answer`."""

    urls: tuple[str, ...]
    key: str | None
    concurrency: int
    timeout: float
    log: object = None  # a callable told when a replica is set aside
    loop: asyncio.AbstractEventLoop = field(init=False)
    replicas: list[Replica] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="logitstore-server", daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.replicas = [Replica(url, self.loop.run_until_complete(self._session())) for url in self.urls]
        self._free = asyncio.Condition()
        self._ready.set()
        self.loop.run_forever()

    async def _session(self) -> aiohttp.ClientSession:
        return session(key=self.key, timeout=self.timeout, connections=self.concurrency)

    def submit(self, body: bytes, *, tokens: int) -> Future:
        return asyncio.run_coroutine_threadsafe(self._request(body, tokens), self.loop)

    async def _request(self, body: bytes, tokens: int) -> Answer:
        for attempt in range(ATTEMPTS):
            replica = await self._take(tokens)
            answer = await self._send(replica, body)
            await self._give_back(replica, tokens)
            if answer is not None:
                return answer
            await asyncio.sleep(min(BACKOFF_MAX_S, BACKOFF_S * 2**attempt) * (0.5 + random.random()))
        raise self._outage(f"a request failed {ATTEMPTS} times")

    async def _take(self, tokens: int) -> Replica:
        async with self._free:
            while True:
                live = [r for r in self.replicas if not r.set_aside]
                if not live:
                    raise self._outage("every replica was set aside")
                open_ = [r for r in live if r.in_flight < self.concurrency]
                if open_:
                    replica = min(open_, key=lambda r: (r.outstanding, r.in_flight))
                    replica.in_flight += 1
                    replica.outstanding += tokens
                    return replica
                await self._free.wait()

    async def _give_back(self, replica: Replica, tokens: int) -> None:
        async with self._free:
            replica.in_flight -= 1
            replica.outstanding -= tokens
            self._free.notify_all()

    async def _send(self, replica: Replica, body: bytes) -> Answer | None:
        """The answer, or None after a failure worth retrying (counted against the replica)."""
        try:
            async with replica.client.post(
                base_url(replica.url) + "/v1/completions", data=body, headers=JSON
            ) as response:
                status = response.status
                content = await response.read()
        except aiohttp.ClientError as error:  # a connection's own timeout included: it says which
            return await self._failed(replica, scrubbed(f"{type(error).__name__}: {error}".rstrip(": "), replica.url))
        except TimeoutError:  # the request's deadline
            return await self._failed(replica, timed_out(self.timeout))
        if status == 200:
            replica.failures = 0
            return Answer(replica.url, status, content)
        if status in (401, 403):
            raise ServerError(f"--server-url {redacted(replica.url)} refused the API key (HTTP {status})")
        if status >= 500 or status in (408, 429):
            return await self._failed(replica, f"HTTP {status}")
        replica.failures = 0
        return Answer(replica.url, status, reason=error_message(content))

    async def _failed(self, replica: Replica, error: str) -> Answer | None:
        """None (retry), after counting the failure against the replica and setting it aside at the limit."""
        replica.failures += 1
        replica.last_error = error
        if replica.failures >= SET_ASIDE_AFTER and not replica.set_aside:
            replica.set_aside = True
            if self.log is not None:
                self.log(  # type: ignore[operator]
                    f"build: --server-url {redacted(replica.url)} set aside after {replica.failures} "
                    f"failures in a row ({error}); {sum(not r.set_aside for r in self.replicas)} replica(s) left"
                )
            async with self._free:
                self._free.notify_all()
        return None

    def _outage(self, why: str) -> ServerOutage:
        errors = "; ".join(f"{redacted(r.url)}: {r.last_error or 'ok'}" for r in self.replicas)
        return ServerOutage(
            f"the teacher's server is unreachable ({why}: {errors}); the finished work is committed, run the same "
            "command again to resume"
        )

    def close(self) -> None:
        if not self.loop.is_running():
            return

        async def close_clients():
            for replica in self.replicas:
                await replica.client.close()

        try:
            asyncio.run_coroutine_threadsafe(close_clients(), self.loop).result(timeout=10)
        except Exception:  # a client that cannot close cleanly is dropped with the loop
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def error_message(content: bytes) -> str:
    try:
        answer = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content[:200].decode(errors="replace")
    if isinstance(answer, dict):
        error = answer.get("error", answer.get("message", answer))
        if isinstance(error, dict):
            error = error.get("message", error)
        return str(error)[:200]
    return str(answer)[:200]
