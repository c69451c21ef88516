"""The client's side of the socket: one ZeroMQ DEALER per thread, one request at a time on each.

Each thread that talks to the daemon gets its own DEALER socket (ZeroMQ sockets must not be
shared between threads), so synchronous calls from any thread and the async variants (a small
thread pool) never wait on each other's socket. A request is sent and its reply awaited on the
same socket; replies carry the request id, and replies of abandoned requests are skipped.

While it waits, the transport asks ``alive()`` every 100 ms whether the daemon still runs, so a
daemon that dies mid-request is noticed within that time instead of a timeout later.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable

import msgpack
import zmq

from ._errors import DaemonUnavailableError
from ._spawn import normalize_endpoint

__all__ = ["Transport"]

#: How often a waiting request checks that the daemon still lives, ms.
POLL_MS = 100


class Transport:
    """Per-thread DEALER sockets to ``ipc://<socket_path>``, or to a ``tcp://`` endpoint with CURVE.

    ``socket_path``: any spelling :func:`tzip._spawn.normalize_endpoint` accepts (a path, ``ipc:///abs/path``,
    ``tcp://127.0.0.1:PORT``); raises ValueError for others. ``curve``: (server public key, client public key, client secret key), Z85 bytes, for a ``tcp://``
    endpoint (the daemon's TCP socket speaks only CURVE, docs/protocol.md).
    """

    def __init__(self, socket_path: str, curve: tuple[bytes, bytes, bytes] | None = None):
        endpoint = normalize_endpoint(socket_path)
        self.endpoint = endpoint if endpoint.startswith("tcp://") else f"ipc://{endpoint}"
        self._curve = curve
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._generation = 0
        self._sockets: list[zmq.Socket] = []
        self._ids = itertools.count(1)
        self._closed = False
        self._interrupted = False

    def _socket(self) -> zmq.Socket:
        local = self._local
        sock = getattr(local, "sock", None)
        if sock is not None and local.generation == self._generation and not sock.closed:
            return sock
        if sock is not None:
            self._forget(sock)
        with self._lock:
            if self._closed:
                raise DaemonUnavailableError("the tzip client is closed")
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.rcvtimeo = POLL_MS
            sock.sndtimeo = 1000
            if self._curve is not None:
                sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = self._curve
            sock.connect(self.endpoint)
            self._sockets.append(sock)
            local.sock, local.generation = sock, self._generation
        return sock

    def _forget(self, sock: zmq.Socket) -> None:
        with self._lock:
            if sock in self._sockets:
                self._sockets.remove(sock)
        sock.close(linger=0)

    def reset(self) -> None:
        """Makes every thread open a fresh socket on its next request (after the daemon went away)."""
        with self._lock:
            self._generation += 1

    def request(self, message: dict[str, Any], alive: Callable[[], bool], timeout: float | None = None) -> dict[str, Any]:
        """Sends ``message`` (an ``id`` is added) and returns the reply map.

        Raises DaemonUnavailableError when the daemon is found dead while waiting, or after ``timeout`` seconds.
        """
        sock = self._socket()
        rid = next(self._ids)
        message["id"] = rid
        try:
            sock.send(msgpack.packb(message, use_bin_type=True))
        except zmq.Again:
            self.reset()
            raise DaemonUnavailableError(f"cannot send to the tzip daemon at {self.endpoint}") from None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                raw = sock.recv()
            except zmq.Again:
                if self._interrupted:
                    raise DaemonUnavailableError("the tzip client is closing") from None
                if not alive():
                    self.reset()
                    raise DaemonUnavailableError(f"the tzip daemon at {self.endpoint} went away") from None
                if deadline is not None and time.monotonic() > deadline:
                    self.reset()
                    raise DaemonUnavailableError(f"no reply from the tzip daemon at {self.endpoint} in {timeout:g} s") from None
                continue
            except zmq.ZMQError as e:
                self.reset()
                raise DaemonUnavailableError(f"socket error talking to the tzip daemon: {e}") from None
            try:
                reply = msgpack.unpackb(raw, raw=False)
            except Exception:
                continue
            if isinstance(reply, dict) and reply.get("id") == rid:
                return reply
            # a late reply to a request abandoned earlier: skip it

    def interrupt(self) -> None:
        """Makes requests waiting for a reply (on any thread) give up within POLL_MS, raising DaemonUnavailableError."""
        self._interrupted = True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._sockets = self._sockets, []
        for s in socks:
            try:
                s.close(linger=0)
            except Exception:  # pragma: no cover
                pass
        self._ctx.term()
