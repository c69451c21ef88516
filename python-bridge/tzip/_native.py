"""The in-process codec: ``libtzip.so`` (cuda/include/tzip/capi.h) loaded with ctypes.

The daemon owns the training paths; a serving process decodes its own weights, on its own CUDA streams, with the same
kernels (DESIGN.md, "Inference decodes in-process"). This module is the one place that loads the library and the one
place its error codes become Python exceptions (:class:`NativeCodecError`).

Where the library is looked for, first hit wins: ``$TZIP_LIBRARY`` (a path to the file), then ``build/Release/libtzip.so``
of the checkout this package lies in (``npm run build:native`` / ``scripts/setup.sh`` build it beside the addon).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

from ._dlpack import frame_layout_of
from ._errors import ERROR_CODES
from ._frame import CODEC_IDS, DEFAULT_CHUNK, DTYPE_CODES

__all__ = ["NativeCodecError", "library", "available", "CODEC_AUTO", "ALIGN", "align", "code_name", "codec_id", "frame_spec",
           "max_frame_bytes", "tensor_frame_bytes",
           "cpu_encode", "cpu_decode", "frame_info", "gpu_encode", "gpu_decode", "PointerArrays", "DecodePlan", "gpu_encode_frames"]

#: Codec id of "auto" in the C ABI (resolved per tensor from its data; gpu/codec.h kCodecAuto).
CODEC_AUTO = 255
_ABI_VERSION = 1
_CODE_NAMES = {v: k for k, v in ERROR_CODES.items()}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_error: str | None = None


class NativeCodecError(RuntimeError):
    """A call of the in-process codec failed.

    ``code`` is the error table's name (``TZIP_CORRUPT``, ``TZIP_TRUNCATED``, ``TZIP_CHECKSUM``, ``TZIP_UNSUPPORTED``,
    ``TZIP_INVALID_ARGUMENT``, ``TZIP_CUDA``, ``TZIP_OUT_OF_MEMORY``, ``TZIP_INTERNAL``; src/errors.json), ``index``
    the frame of a batch at fault, or None. Also raised with code ``TZIP_UNSUPPORTED`` when the library cannot be
    loaded.
    """

    def __init__(self, code: str, message: str, index: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.detail = message
        self.index = index


def _candidates() -> list[Path]:
    env = os.environ.get("TZIP_LIBRARY")
    if env:
        return [Path(env)]
    root = Path(__file__).resolve().parent.parent.parent  # python-bridge/tzip -> the checkout
    return [root / "build" / "Release" / "libtzip.so"]


def _declare(lib: ctypes.CDLL) -> None:
    c = ctypes
    u64, u32, u8, vp, sz = c.c_uint64, c.c_uint32, c.c_uint8, c.c_void_p, c.c_size_t
    sig = {
        "tzip_abi_version": (c.c_int, []),
        "tzip_format_version": (c.c_int, []),
        "tzip_last_error": (c.c_char_p, []),
        "tzip_max_frame_bytes": (u64, [u64, u32, u32]),
        "tzip_gpu_count": (c.c_int, []),
        "tzip_cpu_encode": (c.c_int, [vp, u64, u8, u8, u32, c.POINTER(u64), u32, u32, vp, u64, c.POINTER(u64)]),
        "tzip_cpu_decode": (c.c_int, [vp, u64, vp, u64, c.c_int, u32]),
        "tzip_frame_info": (c.c_int, [vp, u64, c.POINTER(u8), c.POINTER(u8), c.POINTER(u32), c.POINTER(u64),
                                      c.POINTER(u64), c.POINTER(u64)]),
        "tzip_gpu_encode": (c.c_int, [sz, vp, vp, vp, vp, vp, vp, vp, vp, u32, c.c_int, vp]),
        "tzip_gpu_decode": (c.c_int, [sz, vp, vp, vp, vp, vp, c.c_int, c.c_int, vp]),
        "tzip_gpu_decode_plan": (c.c_int, [sz, vp, vp, vp, vp, vp, c.c_int, c.c_int, c.POINTER(vp)]),
        "tzip_gpu_decode_run": (c.c_int, [vp, vp]),
        "tzip_gpu_decode_plan_free": (None, [vp]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args


def library() -> ctypes.CDLL:
    """The loaded library (loaded once per process). Raises :class:`NativeCodecError` (TZIP_UNSUPPORTED) naming every
    path tried when it is missing or of another ABI version."""
    global _lib, _load_error
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        if _load_error is None:
            tried = []
            for path in _candidates():
                if not path.is_file():
                    tried.append(f"{path} (missing)")
                    continue
                try:
                    lib = ctypes.CDLL(str(path))
                    _declare(lib)
                except OSError as e:
                    tried.append(f"{path} ({e})")
                    continue
                abi = lib.tzip_abi_version()
                if abi != _ABI_VERSION:
                    tried.append(f"{path} (ABI version {abi}, this package needs {_ABI_VERSION})")
                    continue
                _lib = lib
                return lib
            _load_error = ("the in-process codec library libtzip.so could not be loaded: " + "; ".join(tried) +
                           ". Build it with `npm run build:native` (or scripts/setup.sh), or set TZIP_LIBRARY.")
        raise NativeCodecError("TZIP_UNSUPPORTED", _load_error)


def available() -> bool:
    """True when the library loads."""
    try:
        library()
        return True
    except NativeCodecError:
        return False


def code_name(code: int) -> str:
    """The error table's name of a numeric code (``TZIP_INTERNAL`` for a value that is none)."""
    return _CODE_NAMES.get(int(code), "TZIP_INTERNAL")


def _check(rc: int, index: int | None = None) -> None:
    if rc != 0:
        msg = library().tzip_last_error().decode("utf-8", "replace")
        raise NativeCodecError(code_name(rc), msg, index)


def frame_spec(t: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """The frame dtype code and frame shape of tensor ``t`` (as the daemon frames it: docs/protocol.md, "Tensors and
    frames"; a complex64 tensor is F32 with a trailing 2, a float8_e8m0fnu tensor U8 bytes)."""
    name, shape = frame_layout_of(t.dtype, tuple(t.shape))
    return DTYPE_CODES[name], tuple(shape)


#: Alignment of every frame and decoded tensor this process lays out in a shared buffer (bytes): the decoder's fast
#: path wants 16; 256 keeps each one on its own cache lines.
ALIGN = 256


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def codec_id(codec: str) -> int:
    """The C ABI's id of a codec name: raw, fast, max, bytes, auto. ValueError for another name."""
    if codec == "auto":
        return CODEC_AUTO
    if codec not in CODEC_IDS:
        raise ValueError(f"unknown codec {codec!r}: one of auto, fast, max, bytes, raw")
    return CODEC_IDS[codec]


def max_frame_bytes(nbytes: int, ndim: int, chunk_bytes: int = DEFAULT_CHUNK) -> int:
    """Exact upper bound of a frame's size in bytes (docs/format.md, "Bound")."""
    n = library().tzip_max_frame_bytes(nbytes, ndim, chunk_bytes)
    if n == 0:
        raise NativeCodecError("TZIP_INVALID_ARGUMENT", f"ndim {ndim} or chunk size {chunk_bytes} out of range")
    return n


def tensor_frame_bytes(t: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK) -> int:
    """:func:`max_frame_bytes` of tensor ``t``'s frame (its byte count and frame shape, :func:`frame_spec`): the bytes
    a buffer given to the GPU encoder for it must hold, since the encoder may write up to the bound."""
    return max_frame_bytes(t.numel() * t.element_size(), len(frame_spec(t)[1]), chunk_bytes)


def _shape_array(shape) -> ctypes.Array:
    return (ctypes.c_uint64 * max(len(shape), 1))(*shape)


def cpu_encode(t: torch.Tensor, codec: str = "auto", chunk_bytes: int = DEFAULT_CHUNK, threads: int = 1) -> torch.Tensor:
    """Encodes the contiguous CPU tensor ``t`` into one frame: a new 1-D uint8 tensor of exactly the frame's size.

    Raises NativeCodecError for what the codec refuses, ValueError for a non-contiguous or non-CPU tensor."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("cpu_encode needs a contiguous CPU tensor")
    dtype, shape = frame_spec(t)
    nbytes = t.numel() * t.element_size()
    bound = max_frame_bytes(nbytes, len(shape), chunk_bytes)
    out = torch.empty(bound, dtype=torch.uint8)
    size = ctypes.c_uint64(0)
    _check(library().tzip_cpu_encode(t.data_ptr() if nbytes else None, nbytes, dtype, codec_id(codec), len(shape),
                                     _shape_array(shape), chunk_bytes, threads, out.data_ptr(), bound,
                                     ctypes.byref(size)))
    return out[: size.value].clone()


def cpu_decode(frame: torch.Tensor, out: torch.Tensor, verify: bool = True, threads: int = 1) -> None:
    """Decodes ``frame`` (contiguous CPU uint8, exactly one frame) into ``out`` (contiguous CPU tensor of exactly the
    frame's byte count). Raises NativeCodecError (TZIP_CORRUPT, TZIP_TRUNCATED, TZIP_CHECKSUM, ...) before or instead of
    writing anything outside ``out``."""
    nbytes = out.numel() * out.element_size()
    _check(library().tzip_cpu_decode(frame.data_ptr(), frame.numel(), out.data_ptr() if nbytes else None, nbytes,
                                     1 if verify else 0, threads))


def frame_info(frame: torch.Tensor) -> dict:
    """The checked header of a frame held in a CPU uint8 tensor: dtype code, codec id, shape, nbytes, frame_bytes."""
    lib = library()
    dtype, codec, ndim = ctypes.c_uint8(), ctypes.c_uint8(), ctypes.c_uint32()
    shape = (ctypes.c_uint64 * 32)()
    nbytes, fbytes = ctypes.c_uint64(), ctypes.c_uint64()
    _check(lib.tzip_frame_info(frame.data_ptr(), frame.numel(), ctypes.byref(dtype), ctypes.byref(codec),
                               ctypes.byref(ndim), shape, ctypes.byref(nbytes), ctypes.byref(fbytes)))
    return {"dtype": dtype.value, "codec": codec.value, "shape": tuple(shape[: ndim.value]), "nbytes": nbytes.value,
            "frame_bytes": fbytes.value}


class PointerArrays:
    """ctypes arrays of one batch's pointers and sizes, built once and reused by every call that decodes the same
    frames into the same buffers (the per-call cost is then the library call alone)."""

    def __init__(self, frames: list[int], frame_bytes: list[int], outs: list[int], out_bytes: list[int]):
        n = len(frames)
        self.count = n
        self.frames = (ctypes.c_void_p * n)(*frames)
        self.frame_bytes = (ctypes.c_uint64 * n)(*frame_bytes)
        self.outs = (ctypes.c_void_p * n)(*outs)
        self.out_bytes = (ctypes.c_uint64 * n)(*out_bytes)


def gpu_decode(arrays: PointerArrays, errors: torch.Tensor, stream: int, sm_budget: int = 0,
               verify: bool = False) -> None:
    """Queues the decode of a batch on the CUDA stream handle ``stream`` (``torch.cuda.Stream.cuda_stream``).

    ``errors`` is a CUDA int32 tensor of at least ``arrays.count`` elements that receives each frame's error code
    when the stream gets there (0: decoded). ``sm_budget`` <= 0 uses every SM. Raises NativeCodecError for what the
    host checks before queuing."""
    _check(library().tzip_gpu_decode(arrays.count, arrays.frames, arrays.frame_bytes, arrays.outs, arrays.out_bytes,
                                     errors.data_ptr(), sm_budget, 1 if verify else 0, stream))


class DecodePlan:
    """A prepared GPU decode of fixed frames into fixed outputs (capi.h, tzip_gpu_decode_plan): :meth:`run` queues
    only the kernels (no allocation, no copy from the host, nothing that stops CUDA graph capture).

    Keeps references to ``tensors`` (the frames, outputs and error array it points into) so that they outlive it.
    Runs of one plan must not overlap: order them on one stream or with events."""

    def __init__(self, arrays: PointerArrays, errors: torch.Tensor, sm_budget: int = 0, verify: bool = False,
                 tensors: tuple = ()):
        if errors.numel() < arrays.count or errors.dtype != torch.int32 or errors.device.type != "cuda":
            raise ValueError("errors must be a CUDA int32 tensor of one element per frame")
        self._lib = library()
        self._keep = (arrays, errors, tensors)
        self._errors = errors
        handle = ctypes.c_void_p()
        _check(self._lib.tzip_gpu_decode_plan(arrays.count, arrays.frames, arrays.frame_bytes, arrays.outs,
                                              arrays.out_bytes, errors.data_ptr(), sm_budget, 1 if verify else 0,
                                              ctypes.byref(handle)))
        self._handle = handle

    def run(self, stream: int) -> None:
        """Queues one run on the CUDA stream handle ``stream``; per-frame error codes land in the errors tensor."""
        _check(self._lib.tzip_gpu_decode_run(self._handle, stream))

    def close(self) -> None:
        """Frees the plan's device memory (its runs must have finished: call after a synchronisation)."""
        if self._handle:
            self._lib.tzip_gpu_decode_plan_free(self._handle)
            self._handle = ctypes.c_void_p()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


def gpu_encode_frames(tensors: list[torch.Tensor], codec: str, chunk_bytes: int = DEFAULT_CHUNK,
                      sm_budget: int = 0) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Encodes contiguous CUDA ``tensors`` (one device) with ``codec`` on the current stream, waits for it, and returns
    one uint8 buffer on their device holding the frames (each starting 256-byte aligned) and each frame's
    (offset, size) in it. Byte for byte what :func:`cpu_encode` writes."""
    dev = tensors[0].device
    bounds = [tensor_frame_bytes(t, chunk_bytes) for t in tensors]
    offs, total = [], 0
    for b in bounds:
        offs.append(total)
        total += align(b)
    buf = torch.empty(total, dtype=torch.uint8, device=dev)
    sizes = torch.zeros(len(tensors), dtype=torch.int64, device=dev)
    gpu_encode(tensors, [codec] * len(tensors), [buf[o: o + b] for o, b in zip(offs, bounds)], sizes,
               torch.cuda.current_stream(dev).cuda_stream, chunk_bytes, sm_budget)
    return buf, list(zip(offs, sizes.tolist()))  # tolist() synchronises


def gpu_encode(tensors: list[torch.Tensor], codecs: list[str], frames: list[torch.Tensor], sizes: torch.Tensor,
               stream: int, chunk_bytes: int = DEFAULT_CHUNK, sm_budget: int = 0) -> None:
    """Queues the encode of contiguous CUDA ``tensors`` into ``frames`` (CUDA uint8 tensors of at least
    :func:`max_frame_bytes` each) on the stream handle ``stream``; ``sizes`` (CUDA int64/uint64, one per tensor)
    receives the frame sizes when the stream gets there. Byte for byte what :func:`cpu_encode` writes."""
    n = len(tensors)
    if not (len(codecs) == len(frames) == n) or sizes.numel() < n:
        raise ValueError("gpu_encode: tensors, codecs, frames and sizes disagree in length")
    specs = [frame_spec(t) for t in tensors]
    shape_arrays = [_shape_array(s) for _, s in specs]
    data = (ctypes.c_void_p * n)(*[t.data_ptr() for t in tensors])
    nbytes = (ctypes.c_uint64 * n)(*[t.numel() * t.element_size() for t in tensors])
    dtypes = (ctypes.c_uint8 * n)(*[d for d, _ in specs])
    cids = (ctypes.c_uint8 * n)(*[codec_id(c) for c in codecs])
    ndims = (ctypes.c_uint32 * n)(*[len(s) for _, s in specs])
    shapes = (ctypes.c_void_p * n)(*[ctypes.addressof(a) for a in shape_arrays])
    outs = (ctypes.c_void_p * n)(*[f.data_ptr() for f in frames])
    _check(library().tzip_gpu_encode(n, data, nbytes, dtypes, cids, ndims, shapes, outs, sizes.data_ptr(),
                                     chunk_bytes, sm_budget, stream))
