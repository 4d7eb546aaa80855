"""A TCP proxy in front of a real server, which a test cuts and restores: the server's
clients see it go away (connections reset, new ones refused) while the server itself keeps
running for everything else on the machine. Or it stalls: connections stay open, new ones
are accepted, and no byte moves either way (a frozen server, a partition that keeps TCP
up), until the stall ends."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


def _port_outside_the_ephemeral_range() -> int:
    """A free port no other process is handed while the proxy is cut: port 0 comes from the
    ephemeral range (32768-60999 on Linux), and a parallel test's connection or server once
    took the cut proxy's port, so it could not listen again (EADDRINUSE)."""
    import random

    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and 32000")


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.connections = 0  # accepted since the start, across cuts
        self._flowing = threading.Event()
        self._flowing.set()
        self._held: list[socket.socket] = []  # accepted during a stall, never forwarded

    def stall(self) -> None:
        """Every connection stays open and nothing is forwarded; new ones are accepted and held."""
        self._flowing.clear()

    def unstall(self) -> None:
        """Bytes flow again; connections accepted during the stall are closed (never served)."""
        with self._lock:
            held, self._held = self._held, []
        for sock in held:
            with contextlib.suppress(OSError):
                sock.close()
        self._flowing.set()

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port or _port_outside_the_ephemeral_range()))  # the same one after a cut
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), name="tcp-proxy-accept", daemon=True).start()
        return self

    def cut(self) -> None:
        """New connections are refused; open ones are reset."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            doomed, self._sockets = self._sockets, set()
        for sock in doomed:
            with contextlib.suppress(OSError):
                # RST, not FIN: what a client sees when a server or a node goes away.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                # A pump thread blocked in recv() holds the socket open past close(), so an
                # idle connection (a pub/sub subscriber, a BRPOP) would never be reset: the
                # shutdown wakes it, and its close then resets the connection.
                sock.shutdown(socket.SHUT_RD)
            with contextlib.suppress(OSError):
                sock.close()

    def restore(self) -> None:
        self.start()

    def close(self) -> None:
        self.cut()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            if not self._flowing.is_set():
                with self._lock:
                    self._held.append(client)
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # cut while connecting
                    client.close()
                    server.close()
                    return
                self._sockets |= {client, server}
                self.connections += 1
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self._flowing.wait()  # a stall holds what arrived; it moves on once the stall ends
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._sockets.discard(source)
                self._sockets.discard(sink)
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.close()
