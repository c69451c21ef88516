"""CUDA stream memory operations through the driver API: the GPU ordering flags of the ring (docs/ring.md, "GPU
ordering flags").

* :func:`write_value64` -- ``cuStreamWriteValue64``: the stream stores a u64 into device memory once the work queued
  before it finished (the default flags: with a memory barrier, so that work's writes are visible first). The
  client writes the ring's ``produced`` word after the work that produces a batch's inputs.
* :func:`wait_value64` -- ``cuStreamWaitValue64`` with ``CU_STREAM_WAIT_VALUE_GEQ``: the stream waits, on the GPU,
  until a u64 in device memory is at least a value. The client waits on the ring's ``done`` word, which the daemon's
  stream writes after a batch.
* The 32-bit variants (:func:`write_value32`, :func:`wait_value32`) for words of 4 bytes.
* :func:`copy_device` -- ``cuMemcpyDtoDAsync``: a device-to-device copy on a stream, the client's staging copies
  of a single tensor.
* :func:`host_register` / :func:`host_unregister` -- ``cudaHostRegister`` (portable, mapped) of host memory such as the
  ring file's header page, where the ordering words live, and the device address the stream operations use for it
  (``cuMemHostGetDevicePointer``).
* :func:`allocation_of` -- ``cuPointerGetAttributes``: the CUDA allocation holding a device address (its base, size,
  buffer id and whether it can be shared by a legacy CUDA IPC handle), and :func:`ipc_handle` -- ``cuIpcGetMemHandle``
  of an allocation's base: how the client registers the caller's memory on a ring (tzip._cuda_segments).

The entry points are the ``_v2`` ones of libcuda.so.1 (CUDA 11.7+; the only ones in CUDA 12 headers), found with
ctypes; the CUstream is ``torch.cuda.Stream.cuda_stream``. Nothing here initialises CUDA: the caller's PyTorch did.
The calls work from any thread: each makes the device's primary context current where the thread has none.
:func:`available` says why these cannot be used on a machine without the driver; the calls raise
``TzipDaemonError("TZIP_CUDA", ...)`` with the driver's error name when a call fails.
"""

from __future__ import annotations

import ctypes
import threading

from ._errors import TzipDaemonError

__all__ = ["available", "write_value64", "wait_value64", "write_value32", "wait_value32", "copy_device", "host_register",
           "host_unregister", "allocation_of", "ipc_handle", "Allocation", "CU_STREAM_WAIT_VALUE_GEQ",
           "CU_STREAM_WAIT_VALUE_EQ", "CU_STREAM_WRITE_VALUE_DEFAULT"]

# cuda.h: CUstreamWaitValue_flags, CUstreamWriteValue_flags
CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_STREAM_WAIT_VALUE_EQ = 0x1
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0
# cuda.h: CUpointer_attribute
_CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
_CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
_CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12

_lock = threading.Lock()
_driver: "_Driver | None" = None
_why_not: str | None = None


class _Driver:
    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

        def entry(*names: str):
            for n in names:
                fn = getattr(lib, n, None)
                if fn is not None:
                    fn.restype = ctypes.c_int
                    return fn
            raise OSError(f"libcuda.so.1 has none of {', '.join(names)}")

        u64, u32, ptr = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p
        self.write64 = entry("cuStreamWriteValue64_v2", "cuStreamWriteValue64")
        self.write64.argtypes = [ptr, u64, u64, ctypes.c_uint]
        self.wait64 = entry("cuStreamWaitValue64_v2", "cuStreamWaitValue64")
        self.wait64.argtypes = [ptr, u64, u64, ctypes.c_uint]
        self.write32 = entry("cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        self.write32.argtypes = [ptr, u64, u32, ctypes.c_uint]
        self.wait32 = entry("cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        self.wait32.argtypes = [ptr, u64, u32, ctypes.c_uint]
        self.copy_dtod = entry("cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync")
        self.copy_dtod.argtypes = [u64, u64, ctypes.c_size_t, ptr]
        self.host_dptr = entry("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
        self.host_dptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ptr, ctypes.c_uint]
        self.pointer_attrs = entry("cuPointerGetAttributes")
        self.pointer_attrs.argtypes = [ctypes.c_uint, ptr, ptr, u64]
        self.ipc_get = entry("cuIpcGetMemHandle")
        self.ipc_get.argtypes = [ptr, u64]
        pctx = ctypes.POINTER(ctypes.c_void_p)
        self.ctx_get = entry("cuCtxGetCurrent")
        self.ctx_get.argtypes = [pctx]
        self.ctx_set = entry("cuCtxSetCurrent")
        self.ctx_set.argtypes = [ptr]
        self.ctx_push = entry("cuCtxPushCurrent_v2", "cuCtxPushCurrent")
        self.ctx_push.argtypes = [ptr]
        self.ctx_pop = entry("cuCtxPopCurrent_v2", "cuCtxPopCurrent")
        self.ctx_pop.argtypes = [pctx]
        self.device_get = entry("cuDeviceGet")
        self.device_get.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        self.primary_retain = entry("cuDevicePrimaryCtxRetain")
        self.primary_retain.argtypes = [pctx, ctypes.c_int]
        self._primary: dict[int, int] = {}
        self.get_name = lib.cuGetErrorName
        self.get_name.restype = ctypes.c_int
        self.get_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.get_string = lib.cuGetErrorString
        self.get_string.restype = ctypes.c_int
        self.get_string.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def primary(self, index: int) -> int:
        """The primary context of device ``index`` (PyTorch's context there), retained once per process and kept."""
        ctx = self._primary.get(index)
        if ctx is None:
            dev = ctypes.c_int()
            self.check("cuDeviceGet", self.device_get(ctypes.byref(dev), index))
            c = ctypes.c_void_p()
            self.check("cuDevicePrimaryCtxRetain", self.primary_retain(ctypes.byref(c), dev.value))
            ctx = self._primary[index] = int(c.value or 0)
        return ctx

    def in_context(self, what: str, index: int, fn, *args) -> None:
        """Calls the driver function ``fn(*args)`` with device ``index``'s primary context current.

        Driver calls use the calling thread's current context, and a thread that has only made runtime calls, or
        none (the ring's reaper thread, which finishes a handle), may have none: the driver then answers
        CUDA_ERROR_INVALID_CONTEXT. A thread without a context gets the primary one, as the runtime would give it; a
        thread with another device's current gets it back afterwards."""
        target = self._primary.get(index) or self.primary(index)
        cur = ctypes.c_void_p()
        self.check("cuCtxGetCurrent", self.ctx_get(ctypes.byref(cur)))
        have = cur.value or 0
        if have == target:
            rc = fn(*args)
        elif have == 0:
            self.check("cuCtxSetCurrent", self.ctx_set(target))
            rc = fn(*args)
        else:
            self.check("cuCtxPushCurrent", self.ctx_push(target))
            try:
                rc = fn(*args)
            finally:
                self.ctx_pop(ctypes.byref(cur))
        if rc:
            self.check(what, rc)

    def check(self, what: str, rc: int) -> None:
        if rc == 0:
            return
        name = ctypes.c_char_p()
        text = ctypes.c_char_p()
        self.get_name(rc, ctypes.byref(name))
        self.get_string(rc, ctypes.byref(text))
        n = name.value.decode() if name.value else f"CUresult {rc}"
        t = text.value.decode() if text.value else "unknown error"
        raise TzipDaemonError("TZIP_CUDA", f"{what} failed: {n} ({t})")


def _load() -> "_Driver | None":
    global _driver, _why_not
    if _driver is not None or _why_not is not None:
        return _driver
    with _lock:
        if _driver is None and _why_not is None:
            try:
                _driver = _Driver(ctypes.CDLL("libcuda.so.1"))
            except (OSError, AttributeError) as e:
                _why_not = f"no CUDA driver (libcuda.so.1): {e}"
    return _driver


def available() -> str | None:
    """None when the driver's stream memory operations can be called, else why not."""
    _load()
    return _why_not


def _drv() -> _Driver:
    d = _load()
    if d is None:
        raise TzipDaemonError("TZIP_CUDA", f"stream memory operations need the CUDA driver: {_why_not}")
    return d


def write_value64(stream, address: int, value: int, flags: int = CU_STREAM_WRITE_VALUE_DEFAULT) -> None:
    """Queues on ``stream`` (a torch.cuda.Stream) the store of u64 ``value`` at device address ``address`` (8-byte
    aligned), after the work queued before it. Raises TzipDaemonError TZIP_CUDA."""
    d = _drv()
    d.in_context("cuStreamWriteValue64", stream.device_index, d.write64, stream.cuda_stream, address, value, flags)


def wait_value64(stream, address: int, value: int, flags: int = CU_STREAM_WAIT_VALUE_GEQ) -> None:
    """Queues on ``stream`` a GPU-side wait until the u64 at ``address`` is >= ``value`` (``flags`` GEQ; EQ and the
    others of cuda.h work too). No CPU wait. Raises TzipDaemonError TZIP_CUDA."""
    d = _drv()
    d.in_context("cuStreamWaitValue64", stream.device_index, d.wait64, stream.cuda_stream, address, value, flags)


def write_value32(stream, address: int, value: int, flags: int = CU_STREAM_WRITE_VALUE_DEFAULT) -> None:
    """:func:`write_value64` for a u32 (4-byte aligned)."""
    d = _drv()
    d.in_context("cuStreamWriteValue32", stream.device_index, d.write32, stream.cuda_stream, address, value, flags)


def wait_value32(stream, address: int, value: int, flags: int = CU_STREAM_WAIT_VALUE_GEQ) -> None:
    """:func:`wait_value64` for a u32."""
    d = _drv()
    d.in_context("cuStreamWaitValue32", stream.device_index, d.wait32, stream.cuda_stream, address, value, flags)


class Allocation:
    """The CUDA allocation holding a device address (:func:`allocation_of`): ``base`` and ``size`` in bytes,
    ``buffer_id`` (CU_POINTER_ATTRIBUTE_BUFFER_ID: the driver never gives two allocations of a process the same one, so
    an allocation freed and another made at the same address are told apart) and ``ipc`` (whether
    ``cuIpcGetMemHandle`` can share it: false for PyTorch's expandable segments and other cuMemCreate memory)."""

    __slots__ = ("base", "size", "buffer_id", "ipc")

    def __init__(self, base: int, size: int, buffer_id: int, ipc: bool):
        self.base, self.size, self.buffer_id, self.ipc = base, size, buffer_id, ipc


_attr_ids = (ctypes.c_int * 4)(_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, _CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                               _CU_POINTER_ATTRIBUTE_BUFFER_ID, _CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE)
_attr_local = threading.local()


def allocation_of(address: int, index: int) -> Allocation:
    """The allocation holding device address ``address`` of device ``index`` (one ``cuPointerGetAttributes``; about
    2 µs on the H200 host under MPS, docs/benchmarks.md). An address that no allocation holds (freed memory) gives
    base, size and buffer id 0: ``cuPointerGetAttributes`` answers with defaults there rather than an error. Raises
    TzipDaemonError TZIP_CUDA when the driver call fails."""
    d = _drv()
    bufs = getattr(_attr_local, "bufs", None)
    if bufs is None:  # per thread: the out-values of the call
        start, size, bid, ipc = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int()
        ptrs = (ctypes.c_void_p * 4)(*(ctypes.addressof(v) for v in (start, size, bid, ipc)))
        bufs = _attr_local.bufs = (start, size, bid, ipc, ptrs)
    start, size, bid, ipc, ptrs = bufs
    d.in_context("cuPointerGetAttributes", index, d.pointer_attrs, 4, _attr_ids, ptrs, address)
    return Allocation(int(start.value), int(size.value), int(bid.value), bool(ipc.value))


def ipc_handle(base: int, index: int) -> bytes:
    """The 64-byte CUDA IPC memory handle (cudaIpcMemHandle_t) of the allocation whose base is ``base`` on device
    ``index`` (``cuIpcGetMemHandle``). Raises TzipDaemonError TZIP_CUDA."""
    d = _drv()
    out = (ctypes.c_char * 64)()
    d.in_context("cuIpcGetMemHandle", index, d.ipc_get, out, base)
    return bytes(out)


def copy_device(dst: int, src: int, nbytes: int, index: int, raw_stream: int) -> None:
    """Queues a copy of ``nbytes`` from device address ``src`` to ``dst`` (both memory of device ``index``) on the
    CUstream ``raw_stream`` (``cuMemcpyDtoDAsync``): what ``dst_tensor.copy_(src_tensor)`` does for two contiguous
    byte tensors, without PyTorch's dispatch around it. (Under MPS on the H200 host the driver call itself takes about
    10 µs, a ``copy_`` of 2 bytes 8.3: docs/benchmarks.md, "Daemon fast lane, second round".) The caller keeps both
    alive until the stream has run it, as the caching allocator does for the current stream. Raises TzipDaemonError
    TZIP_CUDA."""
    d = _drv()
    d.in_context("cuMemcpyDtoDAsync", index, d.copy_dtod, dst, src, nbytes, raw_stream)


#: cudaHostRegisterPortable | cudaHostRegisterMapped (cuda_runtime_api.h): pinned for every context, and mapped into
#: the device address space.
_HOST_REGISTER_FLAGS = 0x01 | 0x02


def host_register(address: int, nbytes: int) -> int:
    """Pins and maps ``nbytes`` of host memory at ``address`` (page-aligned) for the GPUs (``cudaHostRegister``
    through PyTorch's runtime, portable and mapped); returns its device address for the stream operations. Undo it
    with :func:`host_unregister` before the memory is unmapped. Raises TzipDaemonError TZIP_CUDA."""
    import torch

    rc = torch.cuda.cudart().cudaHostRegister(address, nbytes, _HOST_REGISTER_FLAGS)
    if int(getattr(rc, "value", rc)) != 0:
        raise TzipDaemonError("TZIP_CUDA", f"cudaHostRegister of {nbytes} bytes failed: {rc}")
    d = _drv()
    dptr = ctypes.c_uint64()
    # The runtime call above made the primary context current on this thread, as this driver call needs.
    rc2 = d.host_dptr(ctypes.byref(dptr), ctypes.c_void_p(address), 0)
    if rc2 != 0:
        torch.cuda.cudart().cudaHostUnregister(address)
        d.check("cuMemHostGetDevicePointer", rc2)
    return int(dptr.value)


def host_unregister(address: int) -> None:
    """Undoes :func:`host_register` (errors are ignored: the memory is about to go)."""
    import torch

    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # pragma: no cover
        pass
