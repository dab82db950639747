"""Chat data: conversations rendered with the teacher's chat template, and which tokens the loss sees.

A conversation is a list of `{"role", "content"}` messages (the OpenAI / Hugging Face format). An
assistant turn's `tool_calls` are rendered by templates that read them (and then supervised like any
reply: the call is what the assistant writes); with a template that does not, the build skips and
counts such conversations (`tool_calls` in its summary) rather than train on an empty reply. The
build renders it to text with the teacher tokenizer's chat template and marks the *completion*: the
bytes the assistant writes. Span i is what rendering the first i+1 messages adds to rendering the
first i with the generation prompt (`add_generation_prompt=True`): for ChatML that is the reply and
its `<|im_end|>\n`, so the student also learns where a turn ends. This is the offset-based
equivalent of `return_assistant_tokens_mask`, which only works for templates with
`{% generation %}` markers (few have them). A template whose renders are not prefixes of each
other (one that drops earlier turns' reasoning, say) falls back to finding each reply's content in
the full text, after the previous reply.

A token is in the completion iff all its bytes lie inside one assistant span, for the teacher's
tokens and for a student tokenizer's alike. The store keeps this as a per-token `loss_mask`
(1 = completion); position t, which predicts token t + 1, is supervised iff token t + 1 is.

`TRAIN_ON` names what a run supervises: `completion` (the default: masked tokens only; every token
of a plain text store) or `prompt+completion` (every token). A build with `--train-on completion`
stores no teacher entries for prompt positions, so only `completion` can train on it.
"""

from __future__ import annotations

import json

import numpy as np

from logitstore.errors import LogitstoreError
from logitstore.text import TRAIN_ON

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatError(LogitstoreError):
    """A conversation that cannot be rendered: names the problem."""


def check_train_on(value: str, *, flag: str = "--train-on") -> str:
    if value not in TRAIN_ON:
        raise ChatError(f"{flag} must be one of {', '.join(TRAIN_ON)}, got {value!r}")
    return value


def message_problem(value) -> str | None:
    """Why `value` is not a conversation, or None. Extra keys (name, tool_calls) are allowed; a message
    with `tool_calls` may have no content (the OpenAI format's null)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return "is a string that is not a JSON list of messages"
    if not isinstance(value, list | tuple):
        return f"must be a list of {{'role', 'content'}} messages, got {type(value).__name__}"
    if not value:
        return "is an empty list of messages"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {i} must be an object with 'role' and 'content', got {type(message).__name__}"
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            return f"message {i} has role {role!r}; roles are {', '.join(ROLES)}"
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            what = "missing" if content is None else type(content).__name__
            return f"message {i} ({role}) has content {what}; content must be a string"
    return None


def as_messages(value) -> list[dict]:
    """A checked conversation as plain dicts (a JSON string is parsed; None-valued keys dropped, a
    missing content, beside tool calls, is "": templates concatenate it)."""
    if isinstance(value, str):
        value = json.loads(value)
    return [{"content": "", **{k: v for k, v in m.items() if v is not None}} for m in value]


def has_tool_calls(messages: list[dict]) -> bool:
    return any(m.get("tool_calls") for m in messages)


def renders_tool_calls(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders an assistant's `tool_calls` (the Hugging Face
    chat-template API hands them to the template inside the message; a template that never reads them
    renders such a turn as its content alone, often empty, and the call is lost)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return any("tool_calls" in text for text in (template.values() if isinstance(template, dict) else [template]))


def conversation_hash_text(messages: list[dict]) -> str:
    """The canonical text a conversation's source hash is taken of."""
    return json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def render(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(text, character spans of the assistant's replies) under the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatError("the teacher's tokenizer has no chat template; --chat-column needs one")
    text = _apply(tokenizer, messages, generation_prompt=False)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _apply(tokenizer, messages[:i], generation_prompt=True) if i else ""
        upto = _apply(tokenizer, messages[: i + 1], generation_prompt=False)
        if text.startswith(upto) and upto.startswith(before) and len(before) >= cursor:
            span = (len(before), len(upto))
        else:  # not prefix-stable: the reply's content where it appears after the previous reply
            start = text.find(message["content"], cursor) if message["content"] else -1
            if start < 0:
                continue
            span = (start, start + len(message["content"]))
        if span[1] > span[0]:
            spans.append(span)
            cursor = span[1]
    return text, spans


def render_prompt(tokenizer, messages: list[dict]) -> str:
    """A conversation to answer, rendered with the template's generation prompt (what an answer follows)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatError("the teacher's tokenizer has no chat template; --chat-column needs one")
    return _apply(tokenizer, messages, generation_prompt=True)


def _apply(tokenizer, messages: list[dict], *, generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja2 raises TemplateError subclasses for a template's own checks
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ChatError(f"the chat template refused the conversation: {detail}") from None


def byte_spans(text: str, spans: list[tuple[int, int]]) -> np.ndarray:
    """[n, 2] UTF-8 byte offsets of character spans of `text`."""
    out = np.zeros((len(spans), 2), dtype=np.int64)
    for i, (a, b) in enumerate(spans):  # one step per reply, not per token
        out[i, 0] = len(text[:a].encode("utf-8"))
        out[i, 1] = out[i, 0] + len(text[a:b].encode("utf-8"))
    return out


def token_mask(byte_ends: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """uint8 [n]: 1 for a token whose bytes [end of the previous token, its end) lie inside a span.
    Spans are sorted and disjoint. A token of no bytes (a special token added outside the text)
    counts as inside only when its place is strictly inside a span."""
    ends = np.asarray(byte_ends, dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]]) if len(ends) else ends
    if not len(spans) or not len(ends):
        return np.zeros(len(ends), dtype=np.uint8)
    span = np.searchsorted(spans[:, 0], starts, side="right") - 1
    found = span >= 0
    s = np.where(found, span, 0)
    inside = found & (starts >= spans[s, 0]) & (ends <= spans[s, 1]) & ((ends > starts) | (starts > spans[s, 0]))
    return inside.astype(np.uint8)


def supervised_positions(loss_mask: np.ndarray, n_tokens: np.ndarray) -> np.ndarray:
    """bool [sum (T_s - 1)]: position t of each sample is supervised iff token t + 1 is in the mask."""
    n_tokens = np.asarray(n_tokens, dtype=np.int64)
    first = np.zeros(len(n_tokens), dtype=np.int64)
    np.cumsum(n_tokens[:-1], out=first[1:])
    keep = np.ones(len(loss_mask), dtype=bool)
    keep[first] = False  # a sample's first token is predicted by no position of it
    return np.asarray(loss_mask, dtype=bool)[keep]
