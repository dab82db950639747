"""The server engine (`--engine server --server-url URL ...`): the teacher runs behind vLLM's OpenAI-compatible
server (or any server that speaks its `/v1/completions` with `prompt_logprobs`), one or several replicas.

Each sample is one request: the prompt as token ids, `prompt_logprobs: K` (vLLM's extension) and one generated
token. The answer's per-position top-K (and the prompt token, added where it is outside them) is read straight
into arrays (`served_json`) and converted by the vLLM engine's own conversion (`vllm_engine.entries_to_sparse`):
the same ids, log-probabilities, target and tail (1 - sum of the top-K) as `--engine vllm --vllm-output
logprobs`, then the torch engine's selection (`sparsify.to_samples`: top-k, or top-p cut from the K).

Before anything is written (`check`, through `preflight`): every replica answers `/v1/models` with the
teacher's model, tokenizes a probe text as the local tokenizer does (`/tokenize`, else the ids a text prompt
echoes), and takes K prompt log-probabilities (a larger K is refused naming `vllm serve --max-logprobs`; with
no --top-k/--top-p the build takes K = min(64, the server's maximum)).

Requests (`Replicas`): an asyncio loop in a thread of its own, an aiohttp session per replica, at most
`--server-concurrency` requests in flight on each, a new request to the live replica with the least
outstanding work (prompt tokens in flight). Timeouts, refused or dropped connections, 429 and 5xx are
retried with backoff, `ATTEMPTS` times at most; a replica that fails `SET_ASIDE_AFTER` times in a row is set
aside and the others carry on; with none left every request fails with `ServerOutage` (exit 2, after the
build commits what it finished). Any other 4xx refuses that one sample, counted (`skips`). The unit's
threads parse the answers (the kernel releases the GIL), so the loop only moves bytes.

The API key (`--server-api-key` or `LOGITSTORE_SERVER_API_KEY`) goes into each request's header and nowhere
else: not the settings' repr, the teacher's metadata, a message or a log line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import random
import re
import sys
import threading
import urllib.parse
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field

import aiohttp
import httpx
import numpy as np
import orjson

from logitstore.format.samples import SparseSamples, concat
from logitstore.format.sparsity import Sparsity
from logitstore.pipelines.engines import EngineError, cut_at_stop
from logitstore.pipelines.engines.served_json import (
    MISSING_RANK,
    FlatPromptLogprobs,
    MalformedResponse,
    parse_prompt_logprobs,
)

API_KEY_VARIABLE = "LOGITSTORE_SERVER_API_KEY"
DEFAULT_K = 64  # with no --top-k/--top-p: K = min(this, the server's maximum)
ATTEMPTS = 6  # tries of one request over the replicas before the build stops
SET_ASIDE_AFTER = 3  # failures in a row after which a replica is set aside for the rest of the build
BACKOFF_S = 0.2  # the first retry's wait; doubled each time, with jitter, at most BACKOFF_MAX_S
BACKOFF_MAX_S = 5.0
CHECK_TIMEOUT_S = 30.0  # preflight requests (the probe is a few tokens)
JSON = {"Content-Type": "application/json"}
PROBE_TEXT = "Distillation stores a teacher's next-token distributions: 3.14, naïve café, 東京, \t<tags>."
# vLLM's refusal of too many prompt log-probabilities ("Requested prompt logprobs of 64, which is greater
# than max allowed: 20"); the number at its end is the server's --max-logprobs
MAX_ALLOWED = re.compile(r"greater than max allowed:?\s*(-?\d+)", re.IGNORECASE)


class ServerError(EngineError):
    """The server cannot serve this build: unreachable, a wrong key or model, another tokenizer, a K above
    its maximum, or an answer that is not a completion with prompt log-probabilities."""


class ServerOutage(ServerError):
    """No replica is left: the build commits what it finished and stops; the same command resumes."""


def api_key(settings) -> str | None:
    return settings.server_api_key or os.environ.get(API_KEY_VARIABLE) or None


def strip_credentials(url: str) -> str:
    """The URL less any user, password, query and fragment: what the teacher's metadata records."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def check_one_credential(settings, *, flag: str = "--server-url") -> None:
    """A URL's user:password is HTTP basic auth, and the API key a bearer header: both would be one
    Authorization header (the HTTP clients refuse, or let one replace the other), so a request has one."""
    if api_key(settings) is None:
        return
    for url in settings.server_urls:
        if urllib.parse.urlsplit(url).username is not None:
            raise ServerError(
                f"{flag} {strip_credentials(url)} carries a user and password, and an API key is given too "
                f"(--server-api-key or {API_KEY_VARIABLE}): give one of them"
            )


def _base(url: str) -> str:
    """The server's root: URLs are given with or without a trailing /v1."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


# -- preflight -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServedTeacher:
    """What the preflight learned of the replicas (the first one's answers, the others checked alike)."""

    model: str  # the served model's name, which every request names
    version: str  # the server's /version ("unknown" where it has none)
    k: int  # prompt log-probabilities asked per position
    max_model_len: int | None  # the longest prompt + generated token it takes (None: not said)
    urls: tuple[str, ...]  # as given (credentials included: for requests only)

    def record(self) -> dict:
        """The teacher metadata's `server` field: nothing secret."""
        return {
            "model": self.model,
            "version": self.version,
            "k": self.k,
            "urls": [strip_credentials(u) for u in self.urls],
        }


_preflights: dict[tuple, ServedTeacher] = {}  # by (urls, teacher, K asked, default): one per build
_preflights_lock = threading.Lock()


def preflight(settings, spec, *, default_k: bool = False, fresh: bool = False) -> ServedTeacher:
    """Checks every replica (module docstring) and returns what the build records; one line on failure.
    Asked again with the same settings, the answer of the last check (`fresh`: ask the servers again)."""
    if not settings.server_urls:
        raise ServerError("--engine server needs --server-url URL (repeat it for several replicas)")
    check_one_credential(settings)
    sparsity = settings.sparsity
    if sparsity.sampled:
        raise ServerError(
            "--engine server cannot store --sample entries: a server returns the top-K prompt log-probabilities "
            "only, not the whole distribution to draw from; use --top-k or --top-p"
        )
    if sparsity.temperature != 1:
        raise ServerError(
            "--engine server selects entries at --temperature 1 only: a server's prompt log-probabilities are at "
            "temperature 1"
        )
    # with the default, K is asked as DEFAULT_K whatever the settings carry (the settled K, once settled)
    k = DEFAULT_K if default_k else sparsity.k
    key = (tuple(settings.server_urls), api_key(settings), spec, k, default_k)
    with _preflights_lock:
        if fresh:
            _preflights.pop(key, None)
        if key not in _preflights:
            with httpx.Client(timeout=CHECK_TIMEOUT_S, headers=_headers(api_key(settings))) as client:
                served = [_check_replica(client, url, spec, k=k, default_k=default_k) for url in key[0]]
            _preflights[key] = ServedTeacher(
                model=served[0].model,
                version=served[0].version,
                k=min(s.k for s in served),
                max_model_len=min((s.max_model_len for s in served if s.max_model_len), default=None),
                urls=key[0],
            )
        return _preflights[key]


def _headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _check_replica(client, url: str, spec, *, k: int, default_k: bool) -> ServedTeacher:
    shown = strip_credentials(url)
    models = _get_json(client, url, "/v1/models")
    cards = models.get("data") if isinstance(models, dict) else None
    if not isinstance(cards, list):
        raise ServerError(f"--server-url {shown}: /v1/models did not answer a list of models")
    card = next((c for c in cards if isinstance(c, dict) and _same_model(c, spec)), None)
    if card is None:
        names = ", ".join(str(c.get("id")) for c in cards if isinstance(c, dict)) or "none"
        raise ServerError(
            f"--server-url {shown} serves {names}, not the teacher {spec.name!r} (--teacher names the model "
            "whose tokenizer logitstore uses: the served model's id or folder name must be its name)"
        )
    model = str(card["id"])
    version = _version(client, url)
    probe = _check_tokenizer(client, url, model, spec)
    limit = card.get("max_model_len")
    limit = int(limit) if isinstance(limit, int) else None
    probe = probe[: max(2, limit - 1)] if limit else probe  # the prompt and its one generated token fit
    k = _check_k(client, url, model, probe, k=k, default_k=default_k)
    return ServedTeacher(model, version, k, limit, (url,))


def _same_model(card: dict, spec) -> bool:
    names = {spec.name.lower(), spec.path.name.lower()}
    for value in (card.get("id"), card.get("root")):
        if isinstance(value, str) and value.rstrip("/").rsplit("/", 1)[-1].lower() in names:
            return True
    return False


def _request(client, method: str, url: str, path: str, **kwargs):
    shown = strip_credentials(url)
    try:
        response = client.request(method, _base(url) + path, **kwargs)
    except httpx.HTTPError as error:
        raise ServerError(f"--server-url {shown}: cannot reach the server ({type(error).__name__}: {error})") from None
    if response.status_code in (401, 403):
        raise ServerError(
            f"--server-url {shown} refused the API key (HTTP {response.status_code}): set --server-api-key or "
            f"{API_KEY_VARIABLE} to the server's key"
        )
    return response


def _get_json(client, url: str, path: str):
    response = _request(client, "GET", url, path)
    if response.status_code != 200:
        raise ServerError(f"--server-url {strip_credentials(url)}: {path} answered HTTP {response.status_code}")
    return _json(response.content, url, path)


def _json(content: bytes, url: str, path: str):
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        raise ServerError(f"--server-url {strip_credentials(url)}: {path} answered malformed JSON") from None


def _version(client, url: str) -> str:
    response = _request(client, "GET", url, "/version")
    if response.status_code != 200:
        return "unknown"
    answer = _json(response.content, url, "/version")
    return str(answer.get("version", "unknown")) if isinstance(answer, dict) else "unknown"


def _check_tokenizer(client, url: str, model: str, spec) -> list[int]:
    """The probe's ids as the server makes them equal the local tokenizer's; returns them."""
    from logitstore.pipelines.teacher import (
        describe_teacher,
    )  # torch comes with it: the preflight imports this module before a build loads torch

    tokenizer = describe_teacher(spec).tokenizer
    response = _request(
        client, "POST", url, "/tokenize", json={"model": model, "prompt": PROBE_TEXT, "add_special_tokens": False}
    )
    if response.status_code == 200:
        theirs = _json(response.content, url, "/tokenize").get("tokens")
        ours = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    else:  # no /tokenize: the ids of a text prompt, echoed in its prompt log-probabilities
        theirs, whole = _echoed_ids(client, url, model)
        ours = tokenizer.encode(PROBE_TEXT)
        ours = ours if whole else ours[1:]  # without its token ids, the first (null) position is unknown
    if list(theirs or []) != list(ours):
        raise ServerError(
            f"--server-url {strip_credentials(url)} tokenizes a probe text otherwise than the teacher's tokenizer "
            f"({len(theirs or [])} ids against {len(ours)}): it serves another model or tokenizer than --teacher"
        )
    return list(ours)


def _echoed_ids(client, url: str, model: str) -> tuple[list[int], bool]:
    """The probe's ids as the server made them, and whether the first is among them."""
    body = {"model": model, "prompt": PROBE_TEXT, "max_tokens": 1, "prompt_logprobs": 0, "return_token_ids": True}
    response = _request(client, "POST", url, "/v1/completions", json=body)
    if response.status_code != 200:
        raise ServerError(
            f"--server-url {strip_credentials(url)}: neither /tokenize nor a text completion answered "
            f"(HTTP {response.status_code}), so its tokenizer cannot be checked"
        )
    choice = (_json(response.content, url, "/v1/completions").get("choices") or [{}])[0]
    if choice.get("prompt_token_ids"):
        return list(choice["prompt_token_ids"]), True
    entries = choice.get("prompt_logprobs") or []
    # prompt_logprobs 0: each position holds the prompt token alone; the first position is null
    return [int(next(iter(e))) for e in entries[1:] if e], False


def _check_k(client, url: str, model: str, probe: list[int], *, k: int, default_k: bool) -> int:
    """K, or the server's maximum below it where the build took the default; checks the answer parses."""
    body = {"model": model, "prompt": probe, "max_tokens": 1, "prompt_logprobs": k, "temperature": 1.0}
    response = _request(client, "POST", url, "/v1/completions", json=body)
    shown = strip_credentials(url)
    if response.status_code == 400:
        found = MAX_ALLOWED.search(response.text)
        if found is None:
            raise ServerError(f"--server-url {shown} refused {k} prompt log-probabilities: {response.text[:200]}")
        most = int(found.group(1))
        if not default_k:
            raise ServerError(
                f"--top-k {k} is above {shown}'s maximum of {most} prompt log-probabilities: lower --top-k, or "
                f"start the server with vllm serve --max-logprobs {k} (or more)"
            )
        return _check_k(client, url, model, probe, k=min(DEFAULT_K, most), default_k=False)
    if response.status_code != 200:
        raise ServerError(f"--server-url {shown}: /v1/completions answered HTTP {response.status_code}")
    try:
        served_to_sparse(response.content, np.asarray(probe), k=k, vocab_size=1 << 62)
    except (MalformedResponse, EngineError) as error:
        raise ServerError(f"--server-url {shown}: {error}") from None
    return k


# -- answers ---------------------------------------------------------------------------------------------


def served_to_sparse(body: bytes, tokens: np.ndarray, *, k: int, vocab_size: int) -> dict[str, np.ndarray]:
    """One answer's prompt log-probabilities as the sparse top-k arrays (`vllm_engine`'s module docstring),
    through the vLLM engine's conversion; `MalformedResponse` or `VllmEngineError` where it cannot be."""
    return flat_to_sparse(parse_prompt_logprobs(body), tokens, k=k, vocab_size=vocab_size)


def flat_to_sparse(flat: FlatPromptLogprobs, tokens: np.ndarray, *, k: int, vocab_size: int) -> dict[str, np.ndarray]:
    """`served_to_sparse` of prompt log-probabilities already read into flat arrays."""
    from logitstore.pipelines.engines.vllm_engine import (
        entries_to_sparse,
    )  # torch comes with it: the preflight imports this module before a build loads torch

    if flat.positions != len(tokens):
        raise MalformedResponse(f"{flat.positions} prompt_logprobs entries for a {len(tokens)}-token prompt")
    if len(flat.null_at) != 1 or flat.null_at[0] != 0:
        raise MalformedResponse("prompt_logprobs must be null at the first position only")
    targets = np.asarray(tokens, dtype=np.int64)[1:]
    counts = np.diff(flat.starts)[1:]
    rows = np.repeat(np.arange(len(targets)), counts)
    is_target = flat.ids == targets[rows]
    first = np.full(len(targets), -1, dtype=np.int64)
    hits = np.flatnonzero(is_target)
    first[rows[hits][::-1]] = hits[::-1]  # each row's first entry that is its prompt token
    if (first < 0).any():
        t = int(np.flatnonzero(first < 0)[0])
        raise MalformedResponse(f"prompt_logprobs entry {t + 1} lacks the prompt token {int(targets[t])}")
    target_lp = flat.logprobs[first].astype(np.float64)
    rank = flat.ranks[first]
    if (rank == MISSING_RANK).any():  # V1's convention: entries at least as likely, itself included
        at_least = np.bincount(rows, weights=flat.logprobs >= np.repeat(flat.logprobs[first], counts))
        rank = np.where(rank == MISSING_RANK, at_least.astype(np.int64), rank)
    return entries_to_sparse(
        targets,
        flat.ids,
        flat.logprobs.astype(np.float64),
        counts,
        target_lp,
        rank > k,
        k=k,
        vocab_size=vocab_size,
    )


# -- requests --------------------------------------------------------------------------------------------


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
        # aiohttp reads a body through its C parser (llhttp): a 1.5 MB answer costs the loop ~2.6 ms of CPU
        # where httpx over h11 took ~10.7 ms, the largest share of a served build's client (docs/benchmarks.md).
        # The timeouts are httpx's: connecting, then each read, not the whole answer.
        return aiohttp.ClientSession(
            headers={**_headers(self.key), "Content-Type": "application/json"},
            connector=aiohttp.TCPConnector(limit=self.concurrency, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=min(self.timeout, CHECK_TIMEOUT_S), sock_read=self.timeout
            ),
        )

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
            async with replica.client.post(_base(replica.url) + "/v1/completions", data=body) as response:
                status = response.status
                content = await response.read()
        except (TimeoutError, aiohttp.ClientError) as error:
            return await self._failed(replica, f"{type(error).__name__}: {error}".rstrip(": "))
        if status == 200:
            replica.failures = 0
            return Answer(replica.url, status, content)
        if status in (401, 403):
            raise ServerError(f"--server-url {strip_credentials(replica.url)} refused the API key (HTTP {status})")
        if status >= 500 or status in (408, 429):
            return await self._failed(replica, f"HTTP {status}")
        replica.failures = 0
        return Answer(replica.url, status, reason=_error_message(content))

    async def _failed(self, replica: Replica, error: str) -> Answer | None:
        """None (retry), after counting the failure against the replica and setting it aside at the limit."""
        replica.failures += 1
        replica.last_error = error
        if replica.failures >= SET_ASIDE_AFTER and not replica.set_aside:
            replica.set_aside = True
            if self.log is not None:
                self.log(  # type: ignore[operator]
                    f"build: --server-url {strip_credentials(replica.url)} set aside after {replica.failures} "
                    f"failures in a row ({error}); {sum(not r.set_aside for r in self.replicas)} replica(s) left"
                )
            async with self._free:
                self._free.notify_all()
        return None

    def _outage(self, why: str) -> ServerOutage:
        errors = "; ".join(f"{strip_credentials(r.url)}: {r.last_error or 'ok'}" for r in self.replicas)
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


def _error_message(content: bytes) -> str:
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


# -- the engine ------------------------------------------------------------------------------------------


SKIP_REASONS = ("refused", "too_long")  # why a sample was not stored: a 4xx for it, longer than the server takes


class Engine:
    """The server engine behind the engine interface (`pipelines/engines/__init__.py`)."""

    name = "server"
    live = "rank"  # live mode: the trainer's rank sends the requests itself (no model to hold)

    @classmethod
    def samples(cls, settings) -> bool:
        return False  # top-K prompt log-probabilities only: the default is top-K

    @classmethod
    def check(cls, settings, spec) -> None:
        preflight(settings, spec, default_k=settings.default_sparsity, fresh=True)

    @classmethod
    def resolved_dtype(cls, settings) -> str:
        return "served"  # the server's own; not known to the client

    @classmethod
    def gpus_per_worker(cls, settings) -> int:
        return 0

    @classmethod
    def version(cls) -> str:
        return f"aiohttp {aiohttp.__version__}, orjson {orjson.__version__}"

    @classmethod
    def settled(cls, settings, spec) -> tuple[Sparsity, str | None]:
        """The sparsity at the K the servers take (module docstring), and the line the build starts with."""
        served = preflight(settings, spec, default_k=settings.default_sparsity)
        sparsity = dataclasses.replace(settings.sparsity, k=served.k)
        note = (
            f"--engine server: {sparsity.describe()} from {len(served.urls)} replica(s) of {served.model} "
            f"(server {served.version})"
        )
        if settings.default_sparsity:
            note += f"; no --top-k given: K = min({DEFAULT_K}, the server's maximum) = {served.k}"
        return sparsity, note

    @classmethod
    def recorded(cls, settings, spec) -> dict:
        """The teacher metadata's `server` field (`ServedTeacher.record`: no key, no credentials)."""
        return {"server": preflight(settings, spec, default_k=settings.default_sparsity).record()}

    def __init__(self, settings, *, lock: threading.Lock, log=None):
        from logitstore.pipelines.teacher import (
            describe_teacher,
        )  # torch comes with it: the preflight imports this module before a build loads torch

        self.settings, self.spec = settings, settings.teacher_spec
        self.vocab_size = describe_teacher(self.spec).vocab_size
        self.served = preflight(settings, self.spec, default_k=settings.default_sparsity)
        if self.served.k != settings.sparsity.k:  # `settled` ran in the driver: the settings carry the K
            raise ServerError(
                f"the server's K changed since the build started ({settings.sparsity.k} -> {self.served.k})"
            )
        log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self.skips: dict[str, str] = {}  # sample id -> a `SKIP_REASONS`, until the worker takes it
        self.replicas: Replicas | None = Replicas(
            urls=self.served.urls,
            key=api_key(settings),
            concurrency=settings.server_concurrency,
            timeout=settings.server_timeout,
            log=log,
        )

    def compute(
        self, sample_ids: list[str], tokens: list[np.ndarray], *, seed: int, keep: list | None = None, on_batch=None
    ) -> SparseSamples:
        """Every position of every sample that the server answers (the worker applies `keep`); refused and
        too long samples are left out, their reasons in `skips`."""
        assert self.replicas is not None, "the engine is closed"
        from logitstore.pipelines.engines.vllm_engine import (
            row_samples,
        )  # torch comes with it: the preflight imports this module before a build loads torch

        limit = self.served.max_model_len
        sent, parts = [], []
        for sid, row in zip(sample_ids, tokens):
            arrays = HAND_OVER.take(row)  # scored by the request that generated it (`Generator`)
            if arrays is not None:
                parts.append(row_samples(sid, np.asarray(row), arrays, self.settings.sparsity))
                if on_batch is not None:
                    on_batch(len(row))
                continue
            if limit is not None and len(row) + 1 > limit:  # the prompt and the one token it generates
                self.skips[sid] = "too_long"
                continue
            body = orjson.dumps(
                {
                    "model": self.served.model,
                    "prompt": np.asarray(row, dtype=np.int64).tolist(),
                    "max_tokens": 1,
                    "prompt_logprobs": self.served.k,
                    "temperature": 1.0,
                }
            )
            sent.append((sid, row, self.replicas.submit(body, tokens=len(row))))
        try:
            for sid, row, future in sent:
                answer = future.result()
                if answer.status != 200:
                    self.skips[sid] = "refused"
                    continue
                try:
                    arrays = served_to_sparse(answer.body, row, k=self.served.k, vocab_size=self.vocab_size)
                except (MalformedResponse, EngineError) as error:
                    raise ServerError(
                        f"--server-url {strip_credentials(answer.url)}: malformed answer: {error}"
                    ) from None
                parts.append(row_samples(sid, np.asarray(row), arrays, self.settings.sparsity))
                if on_batch is not None:
                    on_batch(len(row))
        finally:
            for _, _, future in sent:
                future.cancel()
        return concat(parts) if parts else _empty(self.settings.sparsity)

    def take_skips(self, sample_ids: list[str]) -> Counter:
        """How many of these samples were skipped, by reason (forgotten here)."""
        return Counter(self.skips.pop(sid) for sid in sample_ids if sid in self.skips)

    def close(self) -> None:
        replicas, self.replicas = self.replicas, None
        if replicas is not None:
            replicas.close()


def _empty(sparsity) -> SparseSamples:
    return SparseSamples(
        sample_ids=[],
        n_tokens=np.zeros(0, dtype=np.int64),
        input_ids=np.zeros(0, dtype=np.int64),
        n_entries=np.zeros(0, dtype=np.int64),
        entry_ids=np.zeros(0, dtype=np.int64),
        entry_logprobs=np.zeros(0, dtype=np.float32),
        tail=np.zeros(0, dtype=np.float32),
        target_logprobs=np.zeros(0, dtype=np.float32),
        entry_counts=None,
    )


# -- generation (`build --generate`) ---------------------------------------------------------------------


@dataclass(frozen=True)
class ServedGenerator:
    """What the preflight learned of a served generator (`--generator-url`)."""

    model: str
    version: str
    urls: tuple[str, ...]  # as given (credentials included: for requests only)

    def record(self) -> dict:
        """The generation record's `server` field: nothing secret."""
        return {"model": self.model, "version": self.version, "urls": [strip_credentials(u) for u in self.urls]}


def generator_preflight(settings, spec) -> ServedGenerator:
    """Checks every `--generator-url` replica (`settings.server_urls`) as the teacher's are checked: reachable,
    serving one model (the same on each), tokenizing as the teacher's tokenizer `spec` does, and answering
    a seeded generation request with its token ids; one line on failure, naming --generator-url."""
    check_one_credential(settings, flag="--generator-url")
    try:
        with httpx.Client(timeout=CHECK_TIMEOUT_S, headers=_headers(api_key(settings))) as client:
            served = [_check_generator(client, url, spec) for url in settings.server_urls]
    except ServerError as error:  # the checks shared with the teacher's name its flag
        raise ServerError(str(error).replace("--server-url", "--generator-url", 1)) from None
    models = sorted({s.model for s in served})
    if len(models) > 1:
        raise ServerError(f"the --generator-url replicas serve different models ({', '.join(models)})")
    return ServedGenerator(served[0].model, served[0].version, tuple(settings.server_urls))


def _check_generator(client, url: str, spec) -> ServedGenerator:
    shown = strip_credentials(url)
    models = _get_json(client, url, "/v1/models")
    cards = models.get("data") if isinstance(models, dict) else None
    names = [str(c["id"]) for c in cards or [] if isinstance(c, dict) and "id" in c]
    if len(names) != 1:
        raise ServerError(
            f"--server-url {shown} serves {', '.join(names) or 'no model'}: a generator's server must serve one model"
        )
    probe = _check_tokenizer(client, url, names[0], spec)
    body = generation_request(
        names[0], probe, seed=0, max_new_tokens=2, temperature=1.0, top_p=1.0, stop_ids=[], k=None
    )
    response = _request(client, "POST", url, "/v1/completions", content=body, headers=JSON)
    if response.status_code != 200:
        raise ServerError(
            f"--server-url {shown} refused a generation request (HTTP {response.status_code}): "
            f"{_error_message(response.content)}"
        )
    try:
        answer_ids(response.content)
    except MalformedResponse as error:
        raise ServerError(f"--server-url {shown}: {error}") from None
    return ServedGenerator(names[0], _version(client, url), (url,))


def generation_request(
    model: str,
    prompt,
    *,
    seed: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: list[int],
    k: int | None,
) -> bytes:
    """One answer's `/v1/completions` request: the prompt as token ids, its own seed (n = 1: each answer
    is one request, so answer g1 does not depend on how many answers a prompt has), the answer's ids back
    (`return_token_ids`). Every sampling setting a server could default from the model's generation config
    (top-k, min-p, penalties) is pinned to "off", so the flags alone decide the draws. With `k`, the top-k
    of every position in the same request: the prompt's as `prompt_logprobs`, the answer's as `logprobs`
    keyed `token_id:ID` (`return_tokens_as_token_ids`)."""
    body = {
        "model": model,
        "prompt": np.asarray(prompt, dtype=np.int64).tolist(),
        "max_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "seed": seed,
        "n": 1,
        "stop_token_ids": list(stop_ids),
        "return_token_ids": True,
    }
    if k is not None:
        body.update(logprobs=k, prompt_logprobs=k, return_tokens_as_token_ids=True)
    return orjson.dumps(body)


_TOKEN_IDS = re.compile(rb'"token_ids"\s*:\s*\[([-0-9,\s]*)\]')
_TOP_LOGPROBS = re.compile(rb'"top_logprobs"\s*:\s*\[([^\]]*)\]')
# one entry of an answer position's top log-probabilities; the `{` marks a position's first entry
_TOP_ENTRY = re.compile(rb'(\{?)\s*"token_id:(-?\d+)"\s*:\s*([-+0-9.eE]+|NaN|-?Infinity)')


def answer_ids(body: bytes) -> np.ndarray:
    """The answer's token ids (`token_ids` of the first choice: vLLM's `return_token_ids`)."""
    found = _TOKEN_IDS.search(body)
    if found is None:
        raise MalformedResponse(
            "the answer has no token_ids: the server must return them (a vLLM that takes return_token_ids)"
        )
    text = found.group(1).strip()
    return np.array(text.split(b","), dtype=np.int64) if text else np.zeros(0, dtype=np.int64)


def answer_top_logprobs(body: bytes, *, positions: int) -> FlatPromptLogprobs:
    """The answer positions' top log-probabilities (`logprobs.top_logprobs`, keys `token_id:ID`) as flat
    arrays in the shape of `served_json`'s: one regular-expression pass and numpy, no object per entry
    but the matched bytes. Ranks are not sent: `MISSING_RANK`."""
    found = _TOP_LOGPROBS.search(body)
    if found is None:
        raise MalformedResponse("the answer has no logprobs.top_logprobs keyed token_id:ID")
    entries = np.array(_TOP_ENTRY.findall(found.group(1)), dtype=bytes).reshape(-1, 3)
    first = np.flatnonzero(entries[:, 0] == b"{")
    if len(first) != positions or (positions and first[0] != 0):
        raise MalformedResponse(f"{len(first)} top_logprobs positions for a {positions}-token answer")
    return FlatPromptLogprobs(
        starts=np.append(first, len(entries)).astype(np.int64),
        ids=entries[:, 1].astype(np.int64),
        logprobs=entries[:, 2].astype(np.float64).astype(np.float32),
        ranks=np.full(len(entries), MISSING_RANK, dtype=np.int64),
        null_at=np.zeros(0, dtype=np.int64),
    )


def scored_answer(body: bytes, prompt: np.ndarray, answer: np.ndarray, *, k: int, vocab_size: int) -> dict:
    """The sparse arrays of prompt + answer from the generating request alone: the prompt's positions
    from `prompt_logprobs`, the answer's from `logprobs`, put end to end as one prompt's entries (what a
    second request scoring prompt + answer would answer) and converted as any served answer."""
    prompt_part = parse_prompt_logprobs(body)
    answer_part = answer_top_logprobs(body, positions=len(answer))
    flat = FlatPromptLogprobs(
        starts=np.concatenate([prompt_part.starts[:-1], answer_part.starts + prompt_part.starts[-1]]),
        ids=np.concatenate([prompt_part.ids, answer_part.ids]),
        logprobs=np.concatenate([prompt_part.logprobs, answer_part.logprobs]),
        ranks=np.concatenate([prompt_part.ranks, answer_part.ranks]),
        null_at=prompt_part.null_at,
    )
    return flat_to_sparse(flat, np.concatenate([prompt, answer]), k=k, vocab_size=vocab_size)


class _HandOver:
    """Answers scored in their generating request, by the digest of prompt + answer tokens, until the
    engine's `compute` takes them: the planner's generator and the in-process executor's engine share
    this process (one build at a time). What is never taken (a sample already stored, a dry run) goes when
    the generator closes."""

    def __init__(self) -> None:
        self._arrays: dict[bytes, dict] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(tokens) -> bytes:
        return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).digest()

    def put(self, tokens, arrays: dict) -> None:
        with self._lock:
            self._arrays[self.key(tokens)] = arrays

    def take(self, tokens) -> dict | None:
        with self._lock:
            return self._arrays.pop(self.key(tokens), None)

    def clear(self) -> None:
        with self._lock:
            self._arrays.clear()


HAND_OVER = _HandOver()


def answer_logprobs_are_raw(
    settings, model: str, probe: list[int], *, k: int, temperature: float, top_p: float
) -> bool:
    """Whether the server's answer log-probabilities are the model's own at these sampling settings (vLLM's
    default `--logprobs-mode raw_logprobs`), as its prompt log-probabilities always are: a short answer's
    first position against the same position scored as a prompt, on the first replica. At temperature 1
    and top-p 1 (the other settings pinned off) every mode gives the model's own."""
    if temperature == 1 and top_p == 1:
        return True
    url = settings.server_urls[0]
    asked = generation_request(
        model, probe, seed=0, max_new_tokens=2, temperature=temperature, top_p=top_p, stop_ids=[], k=k
    )
    with httpx.Client(timeout=CHECK_TIMEOUT_S, headers=_headers(api_key(settings))) as client:
        answer = _request(client, "POST", url, "/v1/completions", content=asked, headers=JSON)
        first = int(answer_ids(answer.content)[0]) if answer.status_code == 200 else None
        if first is None:
            return False
        scored = _request(
            client,
            "POST",
            url,
            "/v1/completions",
            headers=JSON,
            content=orjson.dumps({"model": model, "prompt": [*probe, first], "max_tokens": 1, "prompt_logprobs": k}),
        )
    if scored.status_code != 200:
        return False
    ids = answer_ids(answer.content)
    generated, prompted = answer_top_logprobs(answer.content, positions=len(ids)), parse_prompt_logprobs(scored.content)
    theirs = dict(
        zip(generated.ids[: generated.starts[1]].tolist(), generated.logprobs[: generated.starts[1]].tolist())
    )
    ours = dict(zip(prompted.ids[prompted.starts[-2] :].tolist(), prompted.logprobs[prompted.starts[-2] :].tolist()))
    common = theirs.keys() & ours.keys()
    return bool(common) and max(abs(theirs[i] - ours[i]) for i in common) < 1e-3


class Generator:
    """Answers from a served model (`pipelines/engines/__init__.py`'s generator interface): the
    `--generator-url` replicas (`settings.server_urls`), or, with `shares_teacher`, the teacher's own
    replicas, whose generating request also returns the top-K of every position (`scored_answer`),
    handed to the engine's `compute` in this process (`HAND_OVER`) so no second request scores it. One
    request per answer through the engine's `Replicas` (retries, replicas set aside, `ServerOutage`)."""

    def __init__(self, settings, *, spec, shares_teacher: bool):
        from logitstore.pipelines.teacher import (
            describe_teacher,
            model_stop_ids,
        )  # torch comes with it: the preflight imports this module before a build loads torch

        self.stop_ids = model_stop_ids(spec)  # the teacher's tokenizer: its stop tokens
        self.k: int | None = None
        self.settings, self.spec, self._checked = settings, spec, True
        if shares_teacher:
            teacher = preflight(settings, spec, default_k=settings.default_sparsity)
            self.model, urls, self.k = teacher.model, teacher.urls, teacher.k
            self.vocab_size = describe_teacher(spec).vocab_size
            self.flag = "--server-url"
            self._checked = False  # whether answers' log-probabilities are the model's: at the first answers
        else:
            served = generator_preflight(settings, spec)
            self.model, urls, self.flag = served.model, served.urls, "--generator-url"
        self.replicas: Replicas | None = Replicas(
            urls=urls,
            key=api_key(settings),
            concurrency=settings.server_concurrency,
            timeout=settings.server_timeout,
            log=lambda message: print(message, file=sys.stderr, flush=True),
        )

    def generate(
        self, prompts: list[np.ndarray], seeds: list[int], *, max_new_tokens: int, temperature: float, top_p: float
    ) -> list[np.ndarray]:
        assert self.replicas is not None, "the generator is closed"
        if not self._checked:
            self._check_answer_logprobs(temperature=temperature, top_p=top_p)
        futures = []
        for prompt, seed in zip(prompts, seeds):
            body = generation_request(
                self.model,
                prompt,
                seed=seed,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                stop_ids=self.stop_ids,
                k=self.k,
            )
            futures.append(self.replicas.submit(body, tokens=len(prompt) + max_new_tokens))
        try:
            return [self._answer(np.asarray(prompt), future.result()) for prompt, future in zip(prompts, futures)]
        finally:
            for future in futures:
                future.cancel()

    def _check_answer_logprobs(self, *, temperature: float, top_p: float) -> None:
        """Answers are scored in their request only where the server sends the model's own log-probabilities
        for them; else (vLLM's --logprobs-mode processed_*) a second request scores each, said once."""
        from logitstore.pipelines.teacher import describe_teacher  # torch: loaded by the build by now

        assert self.k is not None, "only the teacher scores its own answers"
        probe = describe_teacher(self.spec).tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
        try:
            raw = answer_logprobs_are_raw(
                self.settings, self.model, probe, k=self.k, temperature=temperature, top_p=top_p
            )
        except MalformedResponse:
            raw = False
        if not raw:
            self.k = None
            print(
                "build: the teacher's server sends processed log-probabilities for answers (vLLM --logprobs-mode "
                "processed_*), not the model's own: each answer is scored by a second request",
                file=sys.stderr,
                flush=True,
            )
        self._checked = True

    def _answer(self, prompt: np.ndarray, answer: Answer) -> np.ndarray:
        shown = strip_credentials(answer.url)
        if answer.status != 200:
            raise ServerError(f"{self.flag} {shown} refused a generation request: {answer.reason}")
        try:
            ids = answer_ids(answer.body)
            cut = cut_at_stop(ids, self.stop_ids)
            if self.k is not None and len(cut) == len(ids):
                arrays = scored_answer(answer.body, prompt, ids, k=self.k, vocab_size=self.vocab_size)
                HAND_OVER.put(np.concatenate([prompt, ids]), arrays)
        except (MalformedResponse, EngineError) as error:
            raise ServerError(f"{self.flag} {shown}: malformed generation answer: {error}") from None
        return cut

    def close(self) -> None:
        HAND_OVER.clear()
        replicas, self.replicas = self.replicas, None
        if replicas is not None:
            replicas.close()
