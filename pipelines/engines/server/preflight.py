"""The server engine's checks before anything is written (`preflight` for the teacher, `generator_preflight`
for a served generator): every replica answers `/v1/models` with the model, tokenizes a probe text as the
local tokenizer does (`/tokenize`, else the ids a text prompt echoes), and takes K prompt log-probabilities
(a larger K is refused naming `vllm serve --max-logprobs`; with no --top-k/--top-p the build takes
K = min(DEFAULT_K, the server's maximum)).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import orjson

from logitstore.format.sparsity import DEFAULT_K, Sparsity
from logitstore.pipelines.engines.server.client import (
    Checks,
    ServerError,
    check_one_credential,
    error_message,
    parse_json,
    request,
    served_models,
    server_version,
)
from logitstore.pipelines.engines.server.completions import (
    UNUSABLE,
    answer_ids,
    answer_top_logprobs,
    generation_request,
    served_to_sparse,
)
from logitstore.pipelines.engines.server.served_json import MalformedResponse, parse_prompt_logprobs
from logitstore.urls import recorded, redacted

PROBE_TEXT = "Distillation stores a teacher's next-token distributions: 3.14, naïve café, 東京, \t<tags>."
# vLLM's refusal of too many prompt log-probabilities ("Requested prompt logprobs of 64, which is greater
# than max allowed: 20"); the number at its end is the server's --max-logprobs
MAX_ALLOWED = re.compile(r"greater than max allowed:?\s*(-?\d+)", re.IGNORECASE)


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
            "urls": [recorded(u) for u in self.urls],
        }


def refuse_unservable(settings) -> None:
    """What no server can do, refused without a request (`ServerEngine.check`): no --server-url, two
    credentials, sampled entries, a temperature other than 1."""
    if not settings.server_urls:
        raise ServerError("--engine server needs --server-url URL (repeat it for several replicas)")
    check_one_credential(settings)
    request = settings.sparsity
    if isinstance(request, Sparsity) and request.sampled:  # asked for the default: top-K (`ServerEngine.samples`)
        raise ServerError(
            "--engine server cannot store --sample entries: a server returns the top-K prompt log-probabilities "
            "only, not the whole distribution to draw from; use --top-k or --top-p"
        )
    if request.temperature != 1:
        raise ServerError(
            "--engine server selects entries at --temperature 1 only: a server's prompt log-probabilities are at "
            "temperature 1"
        )


def preflight(settings, spec) -> ServedTeacher:
    """Checks every replica (module docstring) and returns what the build records; one line on failure.
    `ServerEngine.settle` runs it once per build and passes its answer on (`WorkerSettings.checked`)."""
    refuse_unservable(settings)
    request = settings.sparsity
    # asked for the default (no --top-k/--top-p/--sample): K = min(DEFAULT_K, the server's maximum)
    k_defaulted = not isinstance(request, Sparsity)
    k = DEFAULT_K if k_defaulted else request.k
    urls = tuple(settings.server_urls)
    with Checks(settings) as client:
        served = [_check_replica(client, url, spec, k=k, k_defaulted=k_defaulted) for url in urls]
    return ServedTeacher(
        model=served[0].model,
        version=served[0].version,
        k=min(s.k for s in served),
        max_model_len=min((s.max_model_len for s in served if s.max_model_len), default=None),
        urls=urls,
    )


def _check_replica(client, url: str, spec, *, k: int, k_defaulted: bool) -> ServedTeacher:
    shown = redacted(url)
    cards = served_models(client, url)
    if cards is None:
        raise ServerError(f"--server-url {shown}: /v1/models did not answer a list of models")
    card = next((c for c in cards if _same_model(c, spec)), None)
    if card is None:
        names = ", ".join(str(c.get("id")) for c in cards) or "none"
        raise ServerError(
            f"--server-url {shown} serves {names}, not the teacher {spec.name!r} (--teacher names the model "
            "whose tokenizer logitstore uses: the served model's id or folder name must be its name)"
        )
    model = str(card["id"])
    version = server_version(client, url)
    probe = _check_tokenizer(client, url, model, spec)
    limit = card.get("max_model_len")
    limit = int(limit) if isinstance(limit, int) else None
    probe = probe[: max(2, limit - 1)] if limit else probe  # the prompt and its one generated token fit
    k = _check_k(client, url, model, probe, k=k, k_defaulted=k_defaulted)
    return ServedTeacher(model, version, k, limit, (url,))


def _same_model(card: dict, spec) -> bool:
    names = {spec.name.lower(), spec.path.name.lower()}
    for value in (card.get("id"), card.get("root")):
        if isinstance(value, str) and value.rstrip("/").rsplit("/", 1)[-1].lower() in names:
            return True
    return False


# what a served teacher that tokenizes otherwise is; a served generator's line says why it must not
OTHER_TOKENIZER = "it serves another model or tokenizer than --teacher"
OTHER_GENERATOR_TOKENIZER = (
    "a served generator must have the teacher's tokenizer (its own is not known here, so its answers could not "
    "be decoded and aligned); run a model of another tokenizer as --generator MODEL"
)


def _check_tokenizer(client, url: str, model: str, spec, *, mismatch: str = OTHER_TOKENIZER) -> list[int]:
    """The probe's ids as the server makes them equal the local tokenizer's; returns them."""
    from logitstore.pipelines.teacher import (
        describe_teacher,
    )  # torch comes with it: the preflight imports this module before a build loads torch

    tokenizer = describe_teacher(spec).tokenizer
    asked = {"model": model, "prompt": PROBE_TEXT, "add_special_tokens": False}
    response = request(client, "POST", url, "/tokenize", body=orjson.dumps(asked))
    if response.status_code == 200:
        theirs = _ids(parse_json(response.content, url, "/tokenize"), "tokens")
        if theirs is None:
            raise ServerError(
                f"--server-url {redacted(url)}: /tokenize did not answer an object with a list of token ids"
            )
        ours = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    else:  # no /tokenize: the ids of a text prompt, echoed in its prompt log-probabilities
        theirs, whole = _echoed_ids(client, url, model)
        ours = tokenizer.encode(PROBE_TEXT)
        ours = ours if whole else ours[1:]  # without its token ids, the first (null) position is unknown
    if list(theirs or []) != list(ours):
        raise ServerError(
            f"--server-url {redacted(url)} tokenizes a probe text otherwise than the teacher's tokenizer "
            f"({len(theirs or [])} ids against {len(ours)}): {mismatch}"
        )
    return list(ours)


def _echoed_ids(client, url: str, model: str) -> tuple[list[int], bool]:
    """The probe's ids as the server made them, and whether the first is among them."""
    body = {"model": model, "prompt": PROBE_TEXT, "max_tokens": 1, "prompt_logprobs": 0, "return_token_ids": True}
    response = request(client, "POST", url, "/v1/completions", body=orjson.dumps(body))
    if response.status_code != 200:
        raise ServerError(
            f"--server-url {redacted(url)}: neither /tokenize nor a text completion answered "
            f"(HTTP {response.status_code}), so its tokenizer cannot be checked"
        )
    answer = parse_json(response.content, url, "/v1/completions")
    choices = answer.get("choices") if isinstance(answer, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    ids = _ids(choice, "prompt_token_ids")
    if ids:
        return ids, True
    entries = choice.get("prompt_logprobs")
    # prompt_logprobs 0: each position holds the prompt token alone, keyed by its id; the first position is null
    keys = [next(iter(e)) for e in entries[1:] if isinstance(e, dict) and e] if isinstance(entries, list) else []
    return [int(key) if key.isdigit() else -1 for key in keys], False


def _ids(answer, key: str) -> list[int] | None:
    """`answer[key]` where `answer` is an object and that a list of integers, else None."""
    ids = answer.get(key) if isinstance(answer, dict) else None
    if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return ids
    return None


def _check_k(client, url: str, model: str, probe: list[int], *, k: int, k_defaulted: bool) -> int:
    """K, or the server's maximum below it where the build took the default; checks the answer parses."""
    body = {"model": model, "prompt": probe, "max_tokens": 1, "prompt_logprobs": k, "temperature": 1.0}
    response = request(client, "POST", url, "/v1/completions", body=orjson.dumps(body))
    shown = redacted(url)
    if response.status_code == 400:
        found = MAX_ALLOWED.search(response.text)
        if found is None:
            raise ServerError(f"--server-url {shown} refused {k} prompt log-probabilities: {response.text[:200]}")
        most = int(found.group(1))
        if not k_defaulted:
            raise ServerError(
                f"--top-k {k} is above {shown}'s maximum of {most} prompt log-probabilities: lower --top-k, or "
                f"start the server with vllm serve --max-logprobs {k} (or more)"
            )
        return _check_k(client, url, model, probe, k=min(DEFAULT_K, most), k_defaulted=False)
    if response.status_code != 200:
        raise ServerError(f"--server-url {shown}: /v1/completions answered HTTP {response.status_code}")
    try:
        served_to_sparse(response.content, np.asarray(probe), k=k, vocab_size=1 << 62)
    except UNUSABLE as error:
        raise ServerError(f"--server-url {shown}: {error}") from None
    return k


@dataclass(frozen=True)
class ServedGenerator:
    """What the preflight learned of a served generator (`--generator-url`)."""

    model: str
    version: str
    urls: tuple[str, ...]  # as given (credentials included: for requests only)

    def record(self) -> dict:
        """The generation record's `server` field: nothing secret."""
        return {"model": self.model, "version": self.version, "urls": [recorded(u) for u in self.urls]}


def generator_preflight(settings, spec) -> ServedGenerator:
    """Checks every `--generator-url` replica (`settings.server_urls`) as the teacher's are checked: reachable,
    serving one model (the same on each), tokenizing as the teacher's tokenizer `spec` does, and answering
    a seeded generation request with its token ids; one line on failure, naming --generator-url."""
    check_one_credential(settings, flag="--generator-url")
    try:
        with Checks(settings) as client:
            served = [_check_generator(client, url, spec) for url in settings.server_urls]
    except ServerError as error:  # the checks shared with the teacher's name its flag
        raise ServerError(str(error).replace("--server-url", "--generator-url", 1)) from None
    models = sorted({s.model for s in served})
    if len(models) > 1:
        raise ServerError(f"the --generator-url replicas serve different models ({', '.join(models)})")
    return ServedGenerator(served[0].model, served[0].version, tuple(settings.server_urls))


def _check_generator(client, url: str, spec) -> ServedGenerator:
    shown = redacted(url)
    names = [str(c["id"]) for c in served_models(client, url) or [] if "id" in c]
    if len(names) != 1:
        raise ServerError(
            f"--server-url {shown} serves {', '.join(names) or 'no model'}: a generator's server must serve one model"
        )
    probe = _check_tokenizer(client, url, names[0], spec, mismatch=OTHER_GENERATOR_TOKENIZER)
    body = generation_request(
        names[0], probe, seed=0, max_new_tokens=2, temperature=1.0, top_p=1.0, stop_ids=[], k=None
    )
    response = request(client, "POST", url, "/v1/completions", body=body)
    if response.status_code != 200:
        raise ServerError(
            f"--server-url {shown} refused a generation request (HTTP {response.status_code}): "
            f"{error_message(response.content)}"
        )
    try:
        answer_ids(response.content)
    except MalformedResponse as error:
        raise ServerError(f"--server-url {shown}: {error}") from None
    return ServedGenerator(names[0], server_version(client, url), (url,))


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
    with Checks(settings) as client:
        answer = request(client, "POST", url, "/v1/completions", body=asked)
        first = int(answer_ids(answer.content)[0]) if answer.status_code == 200 else None
        if first is None:
            return False
        scored = request(
            client,
            "POST",
            url,
            "/v1/completions",
            body=orjson.dumps({"model": model, "prompt": [*probe, first], "max_tokens": 1, "prompt_logprobs": k}),
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
