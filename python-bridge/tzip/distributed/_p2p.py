"""Point to point: send, recv, isend, irecv (a header handshake, then the frame; the module docstring of
tzip.distributed gives the matching rules)."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Callable

import torch
import torch.distributed as dist

from ..client import Client
from ._call import (_Call, _Head, _KINDS, _MAGIC, _OK, _Wire, _check_tensor, _desc_or_none, _header, _key, _show,
                    _slots, MismatchError)

# --- point to point ---------------------------------------------------------------------------------

_TAG_BASE = 0x2A00_0000  # far from the small tags programs give their own messages
_TAG_SEQS = 1 << 20
_seq_lock = threading.Lock()
_seqs: dict[tuple[str, int, str], int] = {}
_fifo: dict[str, concurrent.futures.ThreadPoolExecutor] = {}


def _group_key(group) -> str:
    g = group if group is not None else dist.group.WORLD
    return str(getattr(g, "group_name", id(g)))


def _next_seq(group, peer: int, way: str) -> int:
    key = (_group_key(group), peer, way)
    with _seq_lock:
        s = _seqs.get(key, 0)
        _seqs[key] = s + 1
    return s


def _tag(seq: int, part: int) -> int:
    """part 0: the sender's header, 1: the receiver's header, 2: the payload."""
    return _TAG_BASE + (seq % _TAG_SEQS) * 4 + part


class Work:
    """A pending :func:`isend` or :func:`irecv`. ``wait(timeout=None)`` returns the received tensor (irecv) or None
    (isend) once the message is done, and raises what the operation raised (MismatchError, ...)."""

    def __init__(self) -> None:
        self._future: concurrent.futures.Future = concurrent.futures.Future()

    def wait(self, timeout: float | None = None):
        """Blocks until done (``timeout`` seconds at most: then concurrent.futures.TimeoutError)."""
        future = self._future
        try:
            return future.result(timeout)
        finally:
            del self, future  # the error's traceback holds this frame: no cycle back to it (_Call.raise_own)

    def is_completed(self) -> bool:
        return self._future.done()


def _start(group, fn: Callable[[], object], device: torch.device) -> Work:
    """Runs ``fn`` off the caller's thread: a thread per message on gloo (tags keep messages apart), one FIFO thread
    per group on NCCL (messages matched by order). CUDA work runs on the caller's current stream."""
    work = Work()
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    g = group if group is not None else dist.group.WORLD
    if "nccl" in str(dist.get_backend(g)).lower():
        key = _group_key(g)
        with _seq_lock:
            ex = _fifo.get(key)
            if ex is None:
                ex = _fifo[key] = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tzip-p2p")
        ex.submit(_run, work._future, fn, stream)
    else:
        threading.Thread(target=_run, args=(work._future, fn, stream), name="tzip-p2p", daemon=True).start()
    return work


def _run(future: concurrent.futures.Future, fn: Callable[[], object], stream) -> None:
    """_start's worker: fn()'s value or exception into ``future`` (on ``stream`` when not None)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        if stream is not None:
            with torch.cuda.stream(stream):
                value = fn()
        else:
            value = fn()
    except BaseException as e:  # noqa: BLE001 - handed to wait()
        future.set_exception(e)
        future = None  # the error's traceback holds this frame: no cycle through the future (_Call.raise_own)
    else:
        future.set_result(value)


_P2P_SLOTS = 1


def _p2p_mismatch(s_rank: int, s_desc, r_rank: int, r_desc) -> MismatchError:
    return MismatchError(f"tzip.distributed.send/recv: rank {s_rank} sends {_show(s_desc)}, rank {r_rank} receives "
                         f"into {_show(r_desc)}; nothing was copied")


def _p2p(kind: str, tensor, peer: int, group, codec: str | None, client: Client | None, strict: bool, body) -> Work:
    """A :class:`Work` running ``body(call, seq)`` off the caller's thread, with this message's sequence number."""
    call = _Call(kind, group, tensor, codec, client, strict)
    if not call.member:  # as torch.distributed: a rank outside the group takes no part
        work = Work()
        work._future.set_result(None if kind == "send" else tensor)
        return work
    seq = _next_seq(call.group, peer, kind)
    return _start(call.group, lambda: body(call, seq), call.device)


def _handshake(call: _Call, peer: int, seq: int, row: list[int]) -> _Head:
    """Sends this side's header and receives the peer's (both in flight at once); raises this side's own error
    (``call.error``), or when the peer is not the matching call or failed before the transfer."""
    mine, theirs = (0, 1) if call.kind == "send" else (1, 0)  # the sender's header is part 0, the receiver's part 1
    want = "recv" if call.kind == "send" else "send"
    head = torch.empty(len(row), dtype=torch.int64, device=call.wire)
    pending = dist.irecv(head, src=peer, group=call.group, tag=_tag(seq, theirs))
    dist.send(call.to_wire(torch.tensor(row, dtype=torch.int64)), peer, group=call.group, tag=_tag(seq, mine))
    pending.wait()
    call.traffic.bytes_sent += 2 * len(row) * 8
    call.raise_own()
    got = _Head.parse(head.cpu().tolist())
    if got.magic != _MAGIC or got.kind != _KINDS[want]:
        raise MismatchError(f"tzip.distributed.{call.kind}: rank {peer} is not in tzip.distributed.{want}")
    if got.status != _OK:
        raise RuntimeError(f"tzip.distributed.{call.kind}: rank {peer} failed before the transfer (the error is raised "
                           "there); nothing was sent")
    return got


def isend(tensor: torch.Tensor, dst: int, group=None, codec: str | None = None, client: Client | None = None,
          strict: bool = False) -> Work:
    """Sends ``tensor`` (any shape, a dtype of the module docstring, CPU or CUDA) to global rank ``dst``,
    compressed with ``codec``; returns a :class:`Work` (``wait()`` -> None).

    The header goes first and the receiver answers with its own: a dtype or shape that differs from the receiving
    tensor's raises :class:`MismatchError` on both ranks. Messages to one peer are matched in the order of the calls.
    Do not modify ``tensor`` until ``wait()`` returned.

    Raises (from wait()): MismatchError; RuntimeError (the receiver failed, or torch.distributed's timeout);
    DaemonUnavailableError (``strict=True`` and no daemon); ValueError (unknown codec); TypeError (a tensor of
    another dtype or layout than carried).
    """
    return _p2p("send", tensor, dst, group, codec, client, strict, lambda call, seq: _send(call, tensor, dst, seq))


def _send(call: _Call, tensor: torch.Tensor, dst: int, seq: int) -> None:
    def prepare():
        call.check_codec()
        _check_tensor(tensor, "tensor")
        return call.encode([tensor])[0]

    w = call.attempt(prepare)
    desc = _desc_or_none(tensor) if isinstance(tensor, torch.Tensor) else None
    frames = _slots(w)
    peer = _handshake(call, dst, seq, _header("send", call.status, 0, desc, 0, 0, frames, _P2P_SLOTS))
    if _key(peer.desc) != _key(desc):
        raise _p2p_mismatch(dist.get_rank(), desc, dst, peer.desc)
    if w.data.numel():
        dist.send(w.data, dst, group=call.group, tag=_tag(seq, 2))
    call.traffic.bytes_raw += tensor.numel() * tensor.element_size()
    call.traffic.bytes_sent += w.data.numel()
    call.done()


def irecv(tensor: torch.Tensor, src: int, group=None, client: Client | None = None, strict: bool = False) -> Work:
    """Receives into ``tensor`` from global rank ``src`` (a message sent with :func:`send`/:func:`isend`); returns a
    :class:`Work` whose ``wait()`` gives ``tensor``, filled. ``src`` is required (the header exchange names the peer).

    Raises (from wait()): MismatchError (the sender's dtype or shape differs; ``tensor`` is left as it was);
    RuntimeError (the sender failed, or torch.distributed's timeout); DaemonUnavailableError (a compressed frame and
    no daemon to decode it).
    """
    return _p2p("recv", tensor, src, group, "raw", client, strict, lambda call, seq: _recv(call, tensor, src, seq))


def _recv(call: _Call, tensor: torch.Tensor, src: int, seq: int) -> torch.Tensor:
    call.attempt(lambda: _check_tensor(tensor, "tensor"))
    desc = _desc_or_none(tensor) if isinstance(tensor, torch.Tensor) else None
    peer = _handshake(call, src, seq, _header("recv", call.status, 0, desc, 0, 0, [], _P2P_SLOTS))
    if _key(peer.desc) != _key(desc):
        raise _p2p_mismatch(src, peer.desc, dist.get_rank(), desc)
    size, codec = peer.frames[0]
    buf = call.wire_buffer(size)
    if size:
        dist.recv(buf, src, group=call.group, tag=_tag(seq, 2))
    call.decode([_Wire(buf, codec)], [(tensor.dtype, tensor.shape)], [tensor])
    call.traffic.bytes_raw += tensor.numel() * tensor.element_size()
    call.traffic.bytes_sent += size
    call.done()
    return tensor


def send(tensor: torch.Tensor, dst: int, group=None, codec: str | None = None, client: Client | None = None,
         strict: bool = False) -> None:
    """:func:`isend` and wait: returns once the receiver has the data. Raises as isend."""
    isend(tensor, dst, group, codec, client, strict).wait()


def recv(tensor: torch.Tensor, src: int, group=None, client: Client | None = None, strict: bool = False) -> torch.Tensor:
    """:func:`irecv` and wait: returns ``tensor``, filled. Raises as irecv."""
    return irecv(tensor, src, group, client, strict).wait()
