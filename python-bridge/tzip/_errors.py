"""Exceptions of the daemon client (re-exported by :mod:`tzip.client`)."""

from __future__ import annotations

__all__ = ["TzipDaemonError", "DaemonUnavailableError", "DaemonSpawnError", "DeviceUnavailableError"]


class TzipDaemonError(RuntimeError):
    """The daemon answered a request with an error.

    ``code`` is the daemon's error code (docs/protocol.md, "Errors": TZIP_HANDLE, TZIP_UNSUPPORTED,
    TZIP_CORRUPT, ...), ``index`` the position in the batch of the tensor or frame at fault (or None).
    """

    def __init__(self, code: str, message: str, index: int | None = None, need: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.detail = message
        self.index = index
        self.need = need


class DaemonUnavailableError(ConnectionError):
    """No tzip daemon answers on the socket (not running, died, or never started)."""


class DaemonSpawnError(DaemonUnavailableError):
    """Starting a tzip daemon failed (node or the CLI missing, or the daemon exited at once)."""


class DeviceUnavailableError(TzipDaemonError):
    """The daemon cannot serve this GPU (it has no GPU, or does not see this one): code ``TZIP_NO_DEVICE``.

    Raised by ``strict=True`` clients when they would otherwise store CUDA tensors uncompressed.
    """
