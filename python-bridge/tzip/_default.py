"""The process-wide default client of the training integrations (tzip.distributed, tzip.ddp, tzip.fsdp,
tzip.optim, tzip.save/load, tzip.checkpoint).

Every integration takes ``client=None``: None means one :class:`~tzip.client.Client` per process, made on first use
with :func:`tzip.connect` (``$TZIP_SOCKET`` or the default socket; a daemon is started when none runs) and made again
in a child after ``fork`` (a Client is not usable across fork). A lenient client (``strict=False``, the default) sends
uncompressed frames and warns once while the daemon is away; ``strict=True`` raises
:class:`~tzip.DaemonUnavailableError`. The strict and lenient defaults are separate clients.
"""

from __future__ import annotations

import os
import threading

from .client import Client, connect

__all__ = ["default_client", "resolve_client"]

_lock = threading.Lock()
_clients: dict[tuple[int, bool], Client] = {}


def _after_fork_in_child() -> None:
    # Another thread of the parent may have held the lock at fork: the child's copy would stay locked for ever.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def default_client(strict: bool = False) -> Client:
    """This process's shared client (made on first call; see the module docstring).

    Raises DaemonUnavailableError (``strict=True``) when no daemon can be reached.
    """
    key = (os.getpid(), bool(strict))
    with _lock:
        c = _clients.get(key)
        if c is None or c._closed:  # noqa: SLF001 (a closed client is replaced, not reused)
            for k in [k for k in _clients if k[0] != key[0]]:
                del _clients[k]  # clients of the parent after fork: never used here, never closed here
            c = connect(strict=strict)
            _clients[key] = c
        return c


def resolve_client(client: Client | None, strict: bool = False) -> Client:
    """``client`` itself when given, else :func:`default_client` (``strict`` only applies to the default)."""
    return client if client is not None else default_client(strict)
