"""What the client does here, without the daemon: raw frames written and read in this process (the fallback of
compress when the daemon is away or cannot serve a GPU; raw frames of decompress), and the host copies they go
through (any dtype: as bytes, through integer views, so -0.0 and NaN payloads survive bit for bit)."""

from __future__ import annotations

import torch

from ._dlpack import copy_bytes, copy_from_bytes, copy_into_bytes, from_bytes, int_alias
from ._errors import TzipDaemonError
from ._frame import FrameError, decode_raw, encode_raw, read_header
from ._wire import layout
from .compressed import CompressedTensor


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU uint8 tensor of ``t``'s values in C order (any device, any dtype)."""
    n = t.numel() * t.element_size()
    flat = torch.empty(n, dtype=torch.uint8)
    if n:
        copy_into_bytes(flat, int_alias(t.detach()).cpu())
    return flat


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor's bytes as a tensor of the same dtype and shape on ``device`` (any dtype: copied as bytes)."""
    if host.numel() == 0:
        return torch.empty(host.shape, dtype=host.dtype, device=device)
    return from_bytes(_host_bytes(host).to(device), host.dtype, host.shape)


def _compress_raw(t: torch.Tensor) -> CompressedTensor:
    """The fallback: a frame of codec raw, written here (for a CUDA tensor: on the CPU, then copied to its GPU)."""
    lay = layout(t.dtype, tuple(t.shape))
    nbytes = lay.nbytes
    if t.device.type == "cpu":
        flat = torch.empty(nbytes, dtype=torch.uint8)
        copy_into_bytes(flat, t)
    else:
        flat = _host_bytes(t)
    payload = encode_raw(flat, lay.fdtype, list(lay.fshape))
    if t.device.type != "cpu":
        payload = payload.to(t.device)
    return CompressedTensor(payload, t.dtype, t.shape, "raw", nbytes)


def _on_cpu(ct: CompressedTensor) -> CompressedTensor:
    """``ct`` with its payload on the CPU (a copy of a GPU payload)."""
    if ct.payload.device.type == "cpu":
        return ct
    return CompressedTensor(ct.payload.detach().cpu(), ct.dtype, ct.shape, ct.codec, ct.nbytes)


def _decompress_raw(ct: CompressedTensor, out: torch.Tensor | None, verify: bool) -> torch.Tensor:
    """A raw frame decoded here, on the CPU; the result goes to ``out`` or to the payload's device.

    Raises TzipDaemonError with the code the daemon gives the same frame (TZIP_CORRUPT, TZIP_TRUNCATED,
    TZIP_CHECKSUM, TZIP_UNSUPPORTED: tzip._frame.FrameError), so a caller of decompress sees one kind of error for a
    bad frame whoever decodes it."""
    frame = ct.payload.detach().cpu().contiguous()
    try:
        header = read_header(frame)
        body = decode_raw(frame, header, verify)
    except FrameError as e:
        raise TzipDaemonError(e.code, str(e)) from None
    if header.nbytes != ct.nbytes:
        raise ValueError(f"the frame holds {header.nbytes} bytes, the CompressedTensor says {ct.nbytes}")
    if out is not None and out.device.type == "cpu":
        copy_from_bytes(out, body)
        return out
    flat = torch.empty(body.numel(), dtype=torch.uint8)
    copy_bytes(flat, body)
    host = from_bytes(flat, ct.dtype, ct.shape)
    if out is not None:
        return _place(host, out)
    return host if ct.payload.device.type == "cpu" else _to_device(host, ct.payload.device)


def _place(host: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copies a CPU result into ``out`` on a GPU (as integers, any dtype); returns ``out``."""
    from ._cuda import gpu_copy_from_bytes

    gpu_copy_from_bytes(out, _host_bytes(host).to(out.device))
    return out
