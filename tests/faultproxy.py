"""A TCP proxy between a client and a server that a test can break: pass, refuse, stall, resume.

It stands for a storage endpoint that goes away mid-run. `refuse` closes every connection, open or
new, with a reset (what a client sees of an endpoint that went down); `stall` accepts new connections and stops moving
bytes on all of them without closing anything (a hung endpoint: the client sees silence, no error);
`resume` passes traffic again. Clients pool connections, so a mode applies to open connections too,
not just to new ones.
"""

from __future__ import annotations

import select
import socket
import struct
import threading

PASS, REFUSE, STALL = "pass", "refuse", "stall"
_POLL_S = 0.05


class FaultProxy:
    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.mode = PASS
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
                    peer[s].sendall(data)
            except OSError:  # either side reset or closed under us
                return


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
