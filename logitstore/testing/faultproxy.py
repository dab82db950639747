"""A TCP proxy between a client and a server that a test can break: pass, refuse, stall, resume; and
that can stand for a distant one: a fixed delay per request, and a count of the requests.

It stands for a storage endpoint that goes away mid-run. `refuse` closes every connection, open or
new, with a reset (what a client sees of an endpoint that went down); `stall` accepts new connections and stops moving
bytes on all of them without closing anything (a hung endpoint: the client sees silence, no error);
`resume` passes traffic again. Clients pool connections, so a mode applies to open connections too,
not just to new ones.

`latency_s` holds each HTTP request that long before passing it on (object storage's first-byte
latency, 20-100 ms on S3 or GCS, which moto on loopback lacks); connections are independent, so
requests in flight together wait together, as they do against a real endpoint. `requests` lists
every HTTP request seen as (method, path), parsed from the client's bytes (headers, then a
Content-Length or chunked body). `python -m logitstore.testing.faultproxy HOST:PORT --latency-ms 50` runs one in
a process of its own (so its threads do not share a reader's GIL) and prints its endpoint.
"""

from __future__ import annotations

import argparse
import select
import socket
import struct
import sys
import threading

PASS, REFUSE, STALL = "pass", "refuse", "stall"
_POLL_S = 0.05


class FaultProxy:
    def __init__(self, upstream: tuple[str, int], *, latency_s: float = 0.0):
        self.upstream = upstream
        self.mode = PASS
        self.latency_s = latency_s
        self.requests: list[tuple[str, str]] = []  # (method, path) of every HTTP request passed on
        # Requests passed on whose answer has not begun, now and at most: how many a client keeps in
        # flight (what hides the latency), counted without looking at a clock.
        self.in_flight = self.peak_in_flight = 0
        self._requests_lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="fault-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"http://{host}:{port}"

    def refuse(self) -> None:
        self.mode = REFUSE  # each connection's own thread resets it within one poll

    def stall(self) -> None:
        self.mode = STALL

    def resume(self) -> None:
        self.mode = PASS

    def close(self) -> None:
        self._closed.set()  # every thread ends within one poll and closes its own sockets
        self._thread.join(timeout=5)
        self._listener.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- inside the proxy ----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.mode == REFUSE:
                _reset(client)
                continue
            threading.Thread(target=self._serve, args=(client,), name="fault-proxy-conn", daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        # A connection accepted during a stall waits, silent, until the stall ends or the client gives up.
        while self.mode == STALL and not self._closed.is_set():
            if _peer_closed(client):
                client.close()
                return
            self._closed.wait(_POLL_S)
        if self.mode != PASS or self._closed.is_set():
            _reset(client)
            return
        try:
            server = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            _reset(client)
            return
        server.settimeout(None)
        try:
            self._pump(client, server)
        finally:
            if self.mode == PASS:
                client.close()
            else:
                _reset(client)
            server.close()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        peer = {client: server, server: client}
        requests = _RequestParser()
        waiting = 0  # this connection's requests passed on and not yet answering
        while not self._closed.is_set():
            if self.mode == REFUSE:
                return
            if self.mode == STALL:  # hold the bytes: neither side hears anything
                self._closed.wait(_POLL_S)
                continue
            try:
                ready, _, _ = select.select([client, server], [], [], _POLL_S)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    if s is client:
                        started = requests.feed(data)
                        self._arrived(started)
                        waiting += len(started)
                    elif waiting:
                        self._answered(waiting)
                        waiting = 0
                    peer[s].sendall(data)
            except OSError:  # either side reset or closed under us
                return

    def _arrived(self, started: list[tuple[str, str]]) -> None:
        """Requests whose headers just arrived: count them, and hold them `latency_s` (one client
        sends one request at a time on a connection, so this delays each request once)."""
        if not started:
            return
        with self._requests_lock:
            self.requests.extend(started)
            self.in_flight += len(started)
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        if self.latency_s > 0:
            self._closed.wait(self.latency_s)

    def _answered(self, n: int) -> None:
        with self._requests_lock:
            self.in_flight -= n


class _RequestParser:
    """HTTP/1.1 requests in a client's byte stream: each header, then its body skipped by its
    Content-Length or its chunked framing. `feed` returns the (method, path) of requests begun."""

    def __init__(self):
        self._buffer = b""
        self._body = 0  # body bytes still to skip
        self._chunked = False

    def feed(self, data: bytes) -> list[tuple[str, str]]:
        self._buffer += data
        started: list[tuple[str, str]] = []
        while True:
            if self._body:
                skipped = min(self._body, len(self._buffer))
                self._buffer, self._body = self._buffer[skipped:], self._body - skipped
                if self._body:
                    return started
            if self._chunked:
                if not self._skip_chunk():
                    return started
                continue
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return started
            head, self._buffer = self._buffer[:end].decode("latin-1"), self._buffer[end + 4 :]
            line, *fields = head.split("\r\n")
            method, path = (line.split(" ") + ["", ""])[:2]
            started.append((method, path))
            headers = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}
            self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
            self._body = 0 if self._chunked else int(headers.get("content-length", "0") or 0)

    def _skip_chunk(self) -> bool:
        """Skip one chunk of a chunked body (the last, of size 0, ends it with its trailers); False
        until all of it has arrived."""
        end = self._buffer.find(b"\r\n")
        if end < 0:
            return False
        size = int(self._buffer[:end].split(b";")[0], 16)
        if size == 0:  # "0\r\n", trailer lines, then an empty line
            rest = end + 2
            if self._buffer[rest : rest + 2] == b"\r\n":
                done = rest + 2
            else:
                trailers = self._buffer.find(b"\r\n\r\n", rest)
                if trailers < 0:
                    return False
                done = trailers + 4
            self._buffer, self._chunked = self._buffer[done:], False
            return True
        if len(self._buffer) < end + 2 + size + 2:
            return False
        self._buffer = self._buffer[end + 2 + size + 2 :]
        return True


def _reset(s: socket.socket) -> None:
    """Close with RST rather than FIN, as a connection to a dead endpoint ends."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    s.close()


def _peer_closed(s: socket.socket) -> bool:
    try:
        ready, _, _ = select.select([s], [], [], 0)
        return bool(ready) and s.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def main(argv=None) -> None:
    """Run a proxy in this process until stdin closes or the process is terminated; print its endpoint."""
    parser = argparse.ArgumentParser(description="a TCP proxy with a fixed delay per HTTP request")
    parser.add_argument("upstream", help="HOST:PORT of the server")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    with FaultProxy((host, int(port)), latency_s=args.latency_ms / 1000) as proxy:
        print(proxy.endpoint, flush=True)
        sys.stdin.read()  # until the parent closes our stdin (or ends us)


if __name__ == "__main__":
    main()
