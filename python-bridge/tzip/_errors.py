"""Exceptions of the daemon client (re-exported by :mod:`tzip.client`) and the error codes they carry.

The codes are those of tzip's one error table, ``src/errors.json`` in the repository (name, stable value, meaning,
who raises it); ``python-bridge/tests/test_error_codes.py`` checks :data:`ERROR_CODES` and the exception classes
below against it.
"""

from __future__ import annotations

from . import _generated_constants as _generated

__all__ = ["ERROR_CODES", "TzipDaemonError", "OutOfMemoryError", "DaemonUnavailableError", "DaemonSpawnError",
           "DeviceUnavailableError"]

#: Every error code of tzip, by name, with its stable numeric value (src/errors.json; the C++ enums carry the values).
#: Generated: tzip._generated_constants (scripts/gen-constants.mjs).
ERROR_CODES: dict[str, int] = _generated.ERROR_CODES

# The subclass TzipDaemonError(code, ...) becomes for a code, as OSError(errno, ...) becomes FileNotFoundError
# (PEP 3151): callers that build the error from a reply's code need not know the subclasses. Filled below.
_CLASS_OF_CODE: dict[str, type[TzipDaemonError]] = {}


class TzipDaemonError(RuntimeError):
    """The daemon answered a request with an error.

    ``code`` is the daemon's error code (docs/protocol.md, "Errors"; :data:`ERROR_CODES`: TZIP_HANDLE,
    TZIP_UNSUPPORTED, TZIP_CORRUPT, ...), ``index`` the position in the batch of the tensor or frame at fault (or
    None), ``need`` the bytes a too small region needs (or None). Constructing it with a code that has its own
    subclass (TZIP_OUT_OF_MEMORY: :class:`OutOfMemoryError`, TZIP_NO_DEVICE: :class:`DeviceUnavailableError`) gives
    an instance of that subclass.
    """

    def __new__(cls, code: str, message: str, index: int | None = None, need: int | None = None):
        sub = _CLASS_OF_CODE.get(code)
        if sub is not None and issubclass(sub, cls):
            cls = sub
        return super().__new__(cls, code, message, index, need)

    def __init__(self, code: str, message: str, index: int | None = None, need: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.detail = message
        self.index = index
        self.need = need

    def __reduce__(self):
        # Pickles (multiprocessing, torch.distributed's object collectives) rebuild it with the same arguments.
        return (type(self), (self.code, self.detail, self.index, self.need))


class OutOfMemoryError(TzipDaemonError, MemoryError):
    """The daemon ran out of memory serving the request: code ``TZIP_OUT_OF_MEMORY``.

    A host allocation of the daemon (its codec buffers, mapping the request's shared memory) or a GPU allocation
    (the GPU codec's scratch memory: ``cudaErrorMemoryAllocation``) failed. Nothing was altered; the same request may
    succeed once memory is free (fewer or smaller tensors per request, or fewer requests at once). It is a
    :class:`MemoryError` too, so ``except MemoryError`` handlers see it; it is not a ``torch.OutOfMemoryError``, which
    PyTorch raises for the caller's own CUDA allocations.
    """


class DaemonUnavailableError(ConnectionError):
    """No tzip daemon answers on the socket (not running, died, or never started)."""


class DaemonSpawnError(DaemonUnavailableError):
    """Starting a tzip daemon failed (node or the CLI missing, or the daemon exited at once)."""


class DeviceUnavailableError(TzipDaemonError):
    """The daemon cannot serve this GPU (it has no GPU, or does not see this one): code ``TZIP_NO_DEVICE``.

    Raised by ``strict=True`` clients when they would otherwise store CUDA tensors uncompressed.
    """


_CLASS_OF_CODE.update({code: globals()[name] for code, name in _generated.ERROR_CLASS_NAMES.items()})
