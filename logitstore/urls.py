"""Server URLs (`--server-url`, `--generator-url`): checked, shown and recorded here, and nowhere else.

A URL may carry a user and password (`http://user:password@host:8000`, HTTP basic auth): requests use
it as given. Everything that shows or writes a URL (`--print-config`, a run folder's `config.yaml`,
`--json`, log and error lines) shows `redacted(url)`, its password replaced by `REDACTED`; a teacher's
or generator's metadata records `recorded(url)`, without user, password, query or fragment. A URL
that comes back redacted (a printed or kept configuration given to `--config` or `train --resume`) is
refused by `url_checks` in one line asking for the password, instead of failing at the server.
"""

from __future__ import annotations

import urllib.parse

# `<` and `>` must be percent-encoded in a URL's user information, so no password given in a working URL
# reads as this
REDACTED = "<redacted>"
SCHEMES = ("http", "https")


def redacted(url: str) -> str:
    """`url` as shown or written: its password replaced by `REDACTED` (the user kept, which names whose
    password it was), and a query or fragment (which may hold a token) by `?<redacted>`. Plain string
    work, no parsing that could fail: a URL too broken to parse is redacted as well."""
    start, user, password, rest = _split(url)
    if password is not None:
        start += f"{user}:{REDACTED}@"
    query = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=None)
    if query is not None:
        rest = f"{rest[:query]}?{REDACTED}"
    return start + rest


def scrubbed(text: str, url: str) -> str:
    """`text` (a library's message about a request to `url`) with `url`'s password and query left out as
    `redacted` leaves them out, wherever the message quotes them, as given or percent-decoded."""
    text = text.replace(url, redacted(url))
    _, _, password, rest = _split(url)
    secrets = [password, urllib.parse.unquote(password)] if password else []
    query = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=None)
    if query is not None and len(rest) > query + 1:
        secrets.append(rest[query + 1 :])
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text


def _split(url: str) -> tuple[str, str, str | None, str]:
    """(`scheme://`, user, password or None, host and everything after it) of `url`, by its separators
    alone; a URL without a password gives its user information back in the first part."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    ends = [i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0]
    netloc_end = min(ends, default=len(rest))
    userinfo, at, _ = rest[:netloc_end].rpartition("@")
    user, colon, password = userinfo.partition(":")
    if not (at and colon):
        return f"{scheme}{sep}", "", None, rest
    return f"{scheme}{sep}", user, password, rest[len(userinfo) + 1 :]


def recorded(url: str) -> str:
    """What metadata records of a URL `url_checks` passed: no user, password, query or fragment, no trailing
    slash."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host  # an IPv6 address keeps its brackets
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def url_problem(url: str) -> str | None:
    """What makes `url` unusable as a server's URL, in words (None: nothing): it must parse, be http or
    https with a host and a port that exists, carry no query or fragment (request paths are appended to
    it), and not be a redacted URL (`REDACTED` where its password was)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # parsed when asked: a port past 65535 or not a number raises here
    except ValueError as e:
        return f"not a URL ({e})"
    if parts.scheme not in SCHEMES:
        return "a server URL starts with http:// or https://"
    if not parts.hostname:
        return "names no host"
    if port == 0:
        return "port 0 is not a port a server listens on"
    if parts.query or parts.fragment:
        return "takes no query or fragment (request paths such as /v1/completions are appended to it)"
    if parts.password == REDACTED:
        return (
            "its password was left out where the URL was printed or kept (a configuration file never holds it): "
            "give the URL with its password"
        )
    return None


def url_checks(urls, *, flag: str) -> list[tuple[bool, str]]:
    """(ok, message) pairs, one per URL of `flag`, in the shape of a config's checks."""
    problems = [(url, url_problem(url)) for url in urls]
    return [(problem is None, f"{flag} {redacted(url)}: {problem}") for url, problem in problems]
