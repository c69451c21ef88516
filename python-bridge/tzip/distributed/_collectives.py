"""broadcast, all_gather and reduce_scatter, and the exchanges all_reduce shares with them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..client import Client
from ._call import (_AVG, _OP_NAMES, _PLAIN, MismatchError, ReduceOp, _Call, _Head, _Wire, _check_op, _check_tensor,
                    _combine, _copy_bits, _desc, _desc_or_none, _digest, _header, _key, _op_code, _show, _slots)

# --- collectives ------------------------------------------------------------------------------------


def broadcast(tensor: torch.Tensor, src: int, group=None, codec: str | None = None, client: Client | None = None,
              strict: bool = False) -> torch.Tensor:
    """Copies ``tensor`` of global rank ``src`` into ``tensor`` of every rank of ``group`` (compressed once, at
    ``src``); returns ``tensor``.

    Every rank's tensor must have src's dtype and shape, and every rank must name the same ``src``, else
    :class:`MismatchError` on every rank.
    """
    call = _Call("broadcast", group, tensor, codec, client, strict)
    if not call.member:
        return tensor

    def prepare():
        call.check_codec()
        _check_tensor(tensor, "tensor")
        g_src = dist.get_group_rank(call.group, src)
        return g_src, (call.encode([tensor])[0] if g_src == call.me else None)

    got = call.attempt(prepare)
    g_src, w = got if got is not None else (-1, None)
    frames = _slots(w)
    heads = call.exchange(_header("broadcast", call.status, call.n, _desc_or_none(tensor), src, 0,
                                  frames, call.n))
    call.raise_failed(heads)
    srcs = {h.aux0 for h in heads}
    if len(srcs) > 1:
        raise MismatchError("tzip.distributed.broadcast: the ranks name different sources: " +
                            ", ".join(f"rank {r}: src {h.aux0}" for r, h in enumerate(heads)))
    ref = heads[g_src].desc
    odd = [r for r, h in enumerate(heads) if _key(h.desc) != _key(ref)]
    if odd:
        raise MismatchError(f"tzip.distributed.broadcast: rank {src} sends {_show(ref)}; " +
                            ", ".join(f"rank {r} has {_show(heads[r].desc)}" for r in odd))
    size, codec = heads[g_src].frames[0]
    nbytes = tensor.numel() * tensor.element_size()
    if call.me == g_src:
        buf = w.data
        call.traffic.bytes_raw += nbytes * (call.n - 1)
        call.traffic.bytes_sent += size * (call.n - 1)
    else:
        buf = call.wire_buffer(size)
    if size:
        dist.broadcast(buf, src=src, group=call.group)
    if call.me != g_src:
        call.decode([_Wire(buf, codec)], [(tensor.dtype, tensor.shape)], [tensor])
    call.done()
    return tensor


def _gather_frames(call: _Call, w: _Wire, sizes: list[int]) -> list[torch.Tensor]:
    """Every rank's frame (rank r's is sizes[r] bytes long; ours is ``w``): :func:`_start_gather`, waited for."""
    work, parts = _start_gather(call, w, sizes)
    if work is not None:
        work.wait()
    return parts


def _start_gather(call: _Call, w: _Wire, sizes: list[int]):
    """Starts sending our frame ``w`` to every other rank and receiving theirs (rank r's is sizes[r] bytes long) with
    one all_to_all_single, so uneven frames travel without padding (gloo's all_gather is also far slower than its
    all_to_all for large buffers). Returns (the collective's work, or None when no rank has bytes; every rank's frame,
    to be read once the work is done)."""
    n, me = call.n, call.me
    if not any(sizes):
        return None, [w.data if r == me else w.data[:0] for r in range(n)]
    mine = w.data.numel()
    send_sizes = [0 if r == me else mine for r in range(n)]
    recv_sizes = [0 if r == me else sizes[r] for r in range(n)]
    send = w.data if n == 2 else torch.cat([w.data] * (n - 1)) if mine else w.data
    out = call.wire_buffer(sum(recv_sizes))
    work = dist.all_to_all_single(out, send, recv_sizes, send_sizes, group=call.group, async_op=True)
    call.traffic.bytes_sent += mine * (n - 1)
    parts, off = [], 0
    for r in range(n):
        parts.append(w.data if r == me else out[off : off + recv_sizes[r]])
        off += recv_sizes[r]
    return work, parts


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, codec: str | None = None,
               client: Client | None = None, strict: bool = False) -> list[torch.Tensor]:
    """Gathers every rank's ``tensor`` into ``tensor_list`` (entry r: rank r's tensor, of its dtype and shape; the
    ranks' tensors may differ in shape); returns ``tensor_list``. Each rank's tensor is compressed once.

    A ``tensor_list`` of the wrong length, or an entry whose dtype or shape is not that of the matching rank's
    tensor, raises :class:`MismatchError` on every rank.
    """
    call = _Call("all_gather", group, tensor, codec, client, strict)
    if not call.member:
        return tensor_list

    def prepare():
        call.check_codec()
        _check_tensor(tensor, "tensor")
        for i, t in enumerate(tensor_list):
            _check_tensor(t, f"tensor_list[{i}]")
        layout = _digest([x for t in tensor_list for x in _key(_desc(t))] + [len(tensor_list)])
        return layout, call.encode([tensor])[0]

    got = call.attempt(prepare)
    layout, w = got if got is not None else (0, None)
    frames = _slots(w)
    heads = call.exchange(_header("all_gather", call.status, call.n, _desc_or_none(tensor), 0, layout,
                                  frames, call.n))
    call.raise_failed(heads)
    want = _digest([x for h in heads for x in _key(h.desc)] + [call.n])
    odd = [r for r, h in enumerate(heads) if h.aux1 != want]
    if odd:
        raise MismatchError(f"tzip.distributed.all_gather: the tensor_list of rank(s) {odd} does not match the ranks' "
                            f"tensors (entry r must have rank r's dtype and shape; {call.n} entries): " +
                            ", ".join(f"rank {r} sends {_show(h.desc)}" for r, h in enumerate(heads)))
    sizes = [h.frames[0][0] for h in heads]
    got_frames = _gather_frames(call, w, sizes)
    others = [r for r in range(call.n) if r != call.me]
    call.decode([_Wire(got_frames[r], heads[r].frames[0][1]) for r in others],
                [(tensor_list[r].dtype, tensor_list[r].shape) for r in others], [tensor_list[r] for r in others])
    _copy_bits(tensor_list[call.me], tensor)
    call.traffic.bytes_raw += tensor.numel() * tensor.element_size() * (call.n - 1)
    call.done()
    return tensor_list


def _exchange_shards(call: _Call, heads: list[_Head], send_buf: torch.Tensor) -> list[torch.Tensor]:
    """all_to_all_single: the frames of each rank's header slot j (ours: in ``send_buf``, in rank order) to rank j;
    returns what each rank sent here."""
    work, parts = _start_exchange(call, [[f[0] for f in h.frames[:call.n]] for h in heads], send_buf)
    if work is not None:
        work.wait()
    return parts


def _start_exchange(call: _Call, sizes: list[list[int]], send_buf: torch.Tensor):
    """Starts an all_to_all_single in which rank r sends sizes[r][j] bytes to rank j (ours: of ``send_buf``, in rank
    order). Returns (the collective's work, or None when no rank sends a byte; what each rank sent here, to be read
    once the work is done)."""
    me = call.me
    send_sizes = sizes[me]
    recv_sizes = [row[me] for row in sizes]
    out = call.wire_buffer(sum(recv_sizes))
    work = None
    if any(any(row) for row in sizes):
        work = dist.all_to_all_single(out, send_buf, recv_sizes, send_sizes, group=call.group, async_op=True)
    call.traffic.bytes_sent += sum(s for j, s in enumerate(send_sizes) if j != me)
    parts, off = [], 0
    for s in recv_sizes:
        parts.append(out[off : off + s])
        off += s
    return work, parts


def _reduce_in_rank_order(code: int, parts: list[torch.Tensor], owned: list[bool], n: int) -> torch.Tensor:
    """parts[0] op parts[1] op ... in rank order (AVG: then div_(n)); the result is parts[0] when owned, else new."""
    acc = parts[0] if owned[0] else parts[0].clone()
    for x in parts[1:]:
        _combine(code, acc, x)
    if code == _AVG:
        acc.div_(n)
    return acc


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op=ReduceOp.SUM, group=None,
                   codec: str | None = None, client: Client | None = None, strict: bool = False) -> torch.Tensor:
    """Rank j's ``output`` = input_list[j] of rank 0 op ... op input_list[j] of rank n-1, reduced in rank order (the
    module docstring defines the ops); returns ``output``. Every input_list[j] must have rank j's output dtype and
    shape, else :class:`MismatchError` on every rank. Each rank compresses its n-1 outgoing entries in one request.
    """
    call = _Call("reduce_scatter", group, output, codec, client, strict)
    if not call.member:
        return output

    def prepare():
        call.check_codec()
        code = _op_code(op)
        _check_tensor(output, "output")
        if len(input_list) != call.n:
            raise ValueError(f"input_list has {len(input_list)} tensors for a group of {call.n}")
        for i, t in enumerate(input_list):
            _check_tensor(t, f"input_list[{i}]")
        _check_op(code, output.dtype, output.device)
        layout = _digest([x for t in input_list for x in _key(_desc(t))] + [len(input_list)])
        sent = call.encode([t for j, t in enumerate(input_list) if j != call.me])
        sent.insert(call.me, _Wire(torch.empty(0, dtype=torch.uint8, device=call.wire), _PLAIN))
        return code, layout, sent

    got = call.attempt(prepare)
    code, layout, sent = got if got is not None else (0, 0, [])
    frames = [(w.data.numel(), w.codec) for w in sent]
    heads = call.exchange(_header("reduce_scatter", call.status, call.n, _desc_or_none(output), code,
                                  layout, frames, call.n))
    call.raise_failed(heads)
    _check_ops(call, heads)
    want = _digest([x for h in heads for x in _key(h.desc)] + [call.n])
    odd = [r for r, h in enumerate(heads) if h.aux1 != want]
    if odd:
        raise MismatchError(f"tzip.distributed.reduce_scatter: the input_list of rank(s) {odd} does not match the "
                            "ranks' outputs (entry j must have rank j's dtype and shape): " +
                            ", ".join(f"rank {r} receives {_show(h.desc)}" for r, h in enumerate(heads)))
    send_buf = torch.cat([w.data for w in sent]) if sent else torch.empty(0, dtype=torch.uint8, device=call.wire)
    got_parts = _exchange_shards(call, heads, send_buf)
    others = [r for r in range(call.n) if r != call.me]
    decoded = call.decode([_Wire(got_parts[r], heads[r].frames[call.me][1]) for r in others],
                          [(output.dtype, output.shape)] * len(others), [None] * len(others))
    parts = list(decoded)
    parts.insert(call.me, input_list[call.me].reshape(output.shape))
    owned = [r != call.me for r in range(call.n)]
    acc = _reduce_in_rank_order(code, parts, owned, call.n)
    _copy_bits(output, acc)
    call.traffic.bytes_raw += sum(t.numel() * t.element_size() for j, t in enumerate(input_list) if j != call.me)
    call.done()
    return output


def _check_ops(call: _Call, heads: list[_Head]) -> None:
    ops = {h.aux0 for h in heads}
    if len(ops) > 1:
        raise MismatchError(f"tzip.distributed.{call.kind}: the ranks reduce with different ops: " +
                            ", ".join(f"rank {r}: {_OP_NAMES.get(h.aux0, h.aux0)}" for r, h in enumerate(heads)))
