"""Lossless compressed collectives for FSDP2 (``torch.distributed.fsdp.fully_shard``).

:func:`use_lossless_collectives` installs a compressed ``AllGather`` (parameters, forward and backward) and a
compressed ``ReduceScatter`` (gradients) on an FSDP2 module and its FSDP submodules, through
``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``::

    from torch.distributed.fsdp import fully_shard
    import tzip.fsdp

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    comms = tzip.fsdp.use_lossless_collectives(model)     # codec=None: fast on a GPU
    ...                                                   # train as usual
    print(comms.bytes_sent / comms.bytes_raw)

The collectives are :func:`tzip.distributed.all_gather` and :func:`tzip.distributed.reduce_scatter` over the views
FSDP hands over (no extra copy of the flat buffers): each rank compresses what it sends through the daemon,
decompresses what it receives, and the reduce-scatter reduces the shards **in rank order**. So a training run is
bit-identical to the same run with ``codec="raw"`` (the same algorithm uncompressed) for any world size, and, with
two ranks (where the order of a sum cannot matter), to plain FSDP2.

Reduce ops (torch 2.11, ``_fsdp_collectives._get_gradient_divide_factors``): FSDP itself divides the gradients
before and after the reduce-scatter where it needs to (fp16 and other reduce dtypes, or
``set_force_sum_reduction_for_comms(True)``: pre/post divide factors around a SUM); for fp32 and bf16 it asks the
collective for AVG, which here is the SUM in rank order followed by one division by the world size.
``set_gradient_divide_factor(f)`` with ``f`` other than the world size makes FSDP pass NCCL's PREMUL_SUM, whose
factor Python cannot read: that raises ValueError on every rank before any data moves (use
``set_force_sum_reduction_for_comms(True)`` with it: FSDP then divides by ``f`` itself and passes SUM).

When the daemon is away the collectives send the tensors' bytes uncompressed and warn once (the lenient default
client); ``strict=True`` raises :class:`tzip.DaemonUnavailableError` instead. Values are never altered.

CUDA tensors are compressed through CUDA IPC on FSDP's all-gather / reduce-scatter streams (the client orders its
work after what is queued on the current stream); with gloo, frames travel through the host.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from . import distributed as tzd
from ._codec_choice import check_codec
from .client import Client, tagged

__all__ = ["LosslessCollectives", "LosslessAllGather", "LosslessReduceScatter", "use_lossless_collectives"]

# tzd.counters() is process-wide: one lock so that this module's before/after snapshots of one call kind do not
# interleave (FSDP issues its collectives from one thread at a time: forward from the caller, backward from the
# autograd engine's thread while the caller waits).
_count_lock = threading.Lock()


class LosslessCollectives:
    """What :func:`use_lossless_collectives` installed, and its statistics (this rank, since installation).

    Attributes:
        codec, client, strict: as given to :func:`use_lossless_collectives`.
        all_gather, reduce_scatter: the installed :class:`LosslessAllGather` / :class:`LosslessReduceScatter`.
        modules: the FSDP modules they were installed on (the root first).
        bytes_raw: bytes of tensor data plain FSDP2 would have sent (all-gather: ``(n-1)`` times the local shard;
            reduce-scatter: the ``n-1`` shards that leave the rank), in bytes.
        bytes_sent: bytes this rank really sent for them (frames, or raw bytes, plus tzip.distributed's headers).
        all_gathers, reduce_scatters: calls made.
    """

    def __init__(self, codec: str | None, client: Client | None, strict: bool):
        self.codec = codec
        self.client = client
        self.strict = strict
        self.bytes_raw = 0
        self.bytes_sent = 0
        self.all_gathers = 0
        self.reduce_scatters = 0
        self.modules: list[FSDPModule] = []
        self.all_gather = LosslessAllGather(self)
        self.reduce_scatter = LosslessReduceScatter(self)

    @property
    def ratio(self) -> float:
        """bytes_sent / bytes_raw (lower is better; NaN before the first call)."""
        return self.bytes_sent / self.bytes_raw if self.bytes_raw else float("nan")

    def _counted(self, kind: str, fn) -> None:
        with _count_lock:
            before = tzd.counters().get(kind, tzd.Traffic())
            fn()
            after = tzd.counters().get(kind, tzd.Traffic())
        self.bytes_raw += after.bytes_raw - before.bytes_raw
        self.bytes_sent += after.bytes_sent - before.bytes_sent
        if kind == "all_gather":
            self.all_gathers += 1
        else:
            self.reduce_scatters += 1


def _done_work() -> dist.Work:
    """A completed Work, for callers that asked for async_op=True (the call itself ran synchronously)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _allocate(size: Sequence[int | torch.SymInt], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # FSDP's DefaultAllocMixin: plain caching-allocator buffers (frames are staged by the client, not in these)
    return torch.empty(*size, dtype=dtype, device=device)


class LosslessAllGather(AllGather):
    """FSDP2 ``AllGather``: ``output_tensor`` (1-D, ``n * k`` elements) = every rank's ``input_tensor`` (1-D, ``k``
    elements, FSDP's view of this rank's slot of ``output_tensor``) in rank order, through
    :func:`tzip.distributed.all_gather` (each rank's shard compressed once). Any dtype FSDP gathers (the parameter
    dtype, or uint8 when the parameters' dtypes differ)."""

    def __init__(self, state: LosslessCollectives):
        self.state = state

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return _allocate(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        n = group.size()
        if output_tensor.numel() != n * input_tensor.numel():
            raise ValueError(f"tzip.fsdp all-gather: output has {output_tensor.numel()} elements for {n} ranks of "
                             f"{input_tensor.numel()}")
        s = self.state
        outs = list(output_tensor.view(-1).chunk(n)) if input_tensor.numel() else [output_tensor[:0]] * n
        s._counted("all_gather", lambda: tzd.all_gather(outs, input_tensor.reshape(-1), group=group, codec=s.codec,
                                                        client=s.client, strict=s.strict))
        return _done_work() if async_op else None


class LosslessReduceScatter(ReduceScatter):
    """FSDP2 ``ReduceScatter``: ``output_tensor`` (1-D, ``k`` elements) = chunk ``rank`` of every rank's
    ``input_tensor`` (1-D, ``n * k``), reduced with ``op`` in rank order, through
    :func:`tzip.distributed.reduce_scatter` (the n-1 outgoing chunks compressed in one request).

    ``op``: SUM, AVG (SUM then one division by n), MIN, MAX or PRODUCT; PREMUL_SUM raises ValueError (its factor is
    not readable from Python; see the module docstring)."""

    def __init__(self, state: LosslessCollectives):
        self.state = state

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return _allocate(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False) -> dist.Work | None:
        if int(getattr(op, "op", op)) == int(dist.ReduceOp.PREMUL_SUM):
            # every rank gets the same op from FSDP: all raise here, none waits for the others
            raise ValueError("tzip.fsdp reduce-scatter: FSDP asked for PREMUL_SUM (set_gradient_divide_factor with a "
                             "factor other than the world size); call set_force_sum_reduction_for_comms(True) on the "
                             "module so that FSDP divides the gradients itself and reduces with SUM")
        n = group.size()
        if input_tensor.numel() != n * output_tensor.numel():
            raise ValueError(f"tzip.fsdp reduce-scatter: input has {input_tensor.numel()} elements for {n} ranks of "
                             f"{output_tensor.numel()}")
        s = self.state
        flat = input_tensor.view(-1)
        ins = list(flat.chunk(n)) if output_tensor.numel() else [flat[:0]] * n
        with tagged("gradients"):  # the daemon counts these requests as the job's gradients (all-gathers: sendrecv)
            s._counted("reduce_scatter", lambda: tzd.reduce_scatter(output_tensor, ins, op=op, group=group,
                                                                    codec=s.codec, client=s.client, strict=s.strict))
        return _done_work() if async_op else None


def use_lossless_collectives(module: torch.nn.Module, codec: str | None = None, client: Client | None = None,
                             strict: bool = False) -> LosslessCollectives:
    """Installs lossless compressed all-gather and reduce-scatter on ``module`` (an FSDP2 module, or a module that
    contains some) and on every FSDP2 module inside it; returns their :class:`LosslessCollectives` (bytes counters).

    Call it after ``fully_shard`` and before training. All FSDP modules share the one pair of collectives.

    Args:
        module: a module made by ``fully_shard``, or one containing such modules.
        codec: "auto", "fast", "max", "bytes", or "raw" (uncompressed, no daemon: the reference every codec is
            bit-identical to); None (default): "fast" for CUDA shards, "auto" for CPU shards (tzip._codec_choice).
        client: the daemon client (default: the process-wide one of :mod:`tzip._default`).
        strict: for the default client: raise DaemonUnavailableError instead of sending uncompressed (one warning)
            when the daemon is away.

    Raises:
        TypeError: no FSDP2 module in ``module``.
        ValueError: an unknown codec.
    """
    check_codec(codec)
    state = LosslessCollectives(codec, client, strict)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(state.all_gather)
            m.set_custom_reduce_scatter(state.reduce_scatter)
            state.modules.append(m)
    if not state.modules:
        raise TypeError(f"{type(module).__name__} holds no FSDP2 module: call torch.distributed.fsdp.fully_shard "
                        "on it (and its submodules) first")
    return state
