"""A lossless compressed DDP communication hook.

``DistributedDataParallel.register_comm_hook(state, hook)`` with :class:`LosslessState` and
:func:`lossless_allreduce_hook` all-reduces every gradient bucket through :func:`tzip.distributed.all_reduce`:
the shards travel compressed, are reduced in rank order, and training stays bit-identical to the same run with
``codec="raw"`` (any world size) and to plain DDP (two ranks)::

    import tzip.ddp
    model = DistributedDataParallel(model)
    state = tzip.ddp.LosslessState()
    model.register_comm_hook(state, tzip.ddp.lossless_allreduce_hook)
    ...
    print(state.bytes_sent / state.bytes_raw)

Written in the style of ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook``. The bucket is
averaged as DDP averages it (divided by the world size, then summed: with a power-of-two world size the division is
exact, the same as DDP's multiplication by its reciprocal), so with two ranks the reduced gradients, and the whole
training run, are bit-identical to plain DDP. Works with ``gradient_as_bucket_view=True``, ``no_sync()``
accumulation, any ``bucket_cap_mb`` and DDP's bucket rebuild after the first iteration (the hook sees each bucket as
DDP hands it over).

The all-reduce of a bucket runs on the state's worker thread, so backward keeps computing the next buckets meanwhile;
DDP calls the hook for the buckets in the same order on every rank, and the one thread keeps that order on the wire.
The thread's collectives go over a process group of their own (the same ranks and backend as ``process_group``, made
with ``torch.distributed.new_group``): DDP issues collectives of its own on ``process_group`` from the autograd thread
during backward (with ``find_unused_parameters=True``, the map of the parameters used), and two threads' collectives
on one group reach the ranks in different orders, which deadlocks until the group's timeout (an adversarial pass
found every run with ``find_unused_parameters=True`` hung so, also with ``codec="raw"``).

Switching (``tzip.attach`` / ``tzip.detach``): DDP takes one comm hook per model, for good (``register_comm_hook``
can be called only once), so the hook consults ``state.enabled`` at every bucket: False sends the bucket through
DDP's own all-reduce (``torch.distributed.all_reduce`` of the averaged bucket, as torch's ``allreduce_hook``), the
same arithmetic as DDP without a hook. Flip it between iterations, on every rank at the same iteration (all ranks
must take the same path for a bucket). The daemon's requests are tagged as the job's gradients stream, and a job
whose codec is set "off" (``tzip set JOB codec=off``) sends its shards plain (tzip.distributed's codec="raw").

Errors: what a bucket's all-reduce raises (MismatchError, DaemonUnavailableError with ``strict=True``, ...) DDP
raises from ``backward()`` as RuntimeError, its message "Got the following error when running the callback:
<type>: <message>" (DDP's reducer rethrows errors in C++, so the original type survives only in the message).
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook compares the hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] themselves, not with their names.
import concurrent.futures
import contextlib
import datetime
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from .client import Client, tagged
from .distributed._all_reduce import _all_reduce

__all__ = ["LosslessState", "lossless_allreduce_hook"]


class LosslessState:
    """State of :func:`lossless_allreduce_hook`: hyperparameters, internal state and statistics.

    Args:
        process_group: the group to all-reduce over (default: the world).
        codec: the tzip codec of the shards: "auto", "fast", "max", "bytes", or "raw" (uncompressed, the reference
            the others are bit-identical to); None (default): "fast" for CUDA buckets, "auto" for CPU buckets
            (tzip._codec_choice).
        client: the daemon client (default: the process-wide one of :mod:`tzip._default`).
        strict: for the default client: raise DaemonUnavailableError instead of sending raw frames (one warning) when
            the daemon is away.

        enabled: True (default): buckets go through tzip's lossless all-reduce; False: through DDP's own all-reduce
            (see the module docstring, "Switching").

    Statistics (this rank, since construction; see :class:`tzip.distributed.Traffic` for what is counted):
        ``bytes_raw``: bytes plain DDP's ring all-reduce would have sent for the same buckets (``2 * (n-1)/n`` of each
        bucket); ``bytes_sent``: bytes this rank sent (frames and headers); ``buckets``: buckets all-reduced by tzip
        (not those that took DDP's own all-reduce).
    """

    __slots__ = ["process_group", "codec", "client", "strict", "enabled", "bytes_raw", "bytes_sent", "buckets",
                 "_lock", "_executor", "_wire"]

    def __init__(self, process_group: dist.ProcessGroup | None = None, codec: str | None = None,
                 client: Client | None = None, strict: bool = False, enabled: bool = True):
        self.process_group = process_group
        self.codec = codec
        self.client = client
        self.strict = strict
        self.enabled = bool(enabled)
        self.bytes_raw = 0
        self.bytes_sent = 0
        self.buckets = 0
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        # The worker thread's own group (module docstring): made here when the process group exists (every member
        # rank builds its state in the same order), else at the first bucket. Held weakly: torch.distributed's
        # registry owns it, so destroy_process_group() frees it while the model and this state live on. Held
        # strongly, gloo's threads outlived the group's destruction and one of them sometimes took the GIL during
        # interpreter shutdown: "terminate called without an active exception" (SIGABRT) at exit.
        self._wire: weakref.ref[dist.ProcessGroup] | None = None
        if dist.is_available() and dist.is_initialized():
            self._wire_group()

    def _wire_group(self) -> dist.ProcessGroup:
        """The process group the worker thread's collectives use: the ranks, backend and timeout of
        ``process_group``, a group of its own (``use_local_synchronization``: only its members take part in making
        it; each waits for the others up to the timeout)."""
        wire = self._wire() if self._wire is not None else None
        if wire is None:  # not made yet, or destroyed with the others (a new group after init_process_group again)
            pg = self.process_group if self.process_group is not None else dist.group.WORLD
            wire = dist.new_group(dist.get_process_group_ranks(pg), backend=dist.get_backend(pg),
                                  timeout=_timeout_of(pg), use_local_synchronization=True)
            self._wire = weakref.ref(wire)
        return wire

    @property
    def ratio(self) -> float:
        """bytes_sent / bytes_raw (NaN before the first bucket)."""
        return self.bytes_sent / self.bytes_raw if self.bytes_raw else float("nan")

    def __getstate__(self) -> dict[str, Any]:
        # as PowerSGDState: the process group, the client and the thread do not pickle; defaults are used on load
        return {k: getattr(self, k) for k in ("codec", "strict", "enabled", "bytes_raw", "bytes_sent", "buckets")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(None, state["codec"], None, state["strict"], state.get("enabled", True))
        self.bytes_raw, self.bytes_sent, self.buckets = state["bytes_raw"], state["bytes_sent"], state["buckets"]

    def _all_reduce_async(self, tensor: torch.Tensor) -> torch.futures.Future:
        """SUM-all-reduces ``tensor`` in place on the worker thread; the Future's value is ``tensor``."""
        cuda = tensor.device.type == "cuda"
        fut: torch.futures.Future = torch.futures.Future(devices=[tensor.device] if cuda else None)
        stream = torch.cuda.current_stream(tensor.device) if cuda else None  # ordered after the bucket's producers
        # Weakly, like the state: the job may destroy the group as soon as the last bucket's Future completes, while
        # this thread is still on its way out of run().
        wire = weakref.ref(self._wire_group())

        def run(fut: torch.futures.Future) -> None:
            try:
                group = wire()
                if group is None:
                    raise RuntimeError("tzip.ddp: the hook's process group was destroyed before this bucket was "
                                       "all-reduced (destroy_process_group during backward?)")
                with torch.cuda.stream(stream) if cuda else contextlib.nullcontext(), tagged("gradients"):
                    traffic = _all_reduce(tensor, dist.ReduceOp.SUM, group, self.codec, self.client, self.strict)
                    group = None
                    with self._lock:
                        self.bytes_raw += traffic.bytes_raw
                        self.bytes_sent += traffic.bytes_sent
                        self.buckets += 1
                    fut.set_result(tensor)
            except BaseException as e:  # noqa: BLE001 - DDP raises it from backward
                fut.set_exception(e)
                # the error's traceback holds this frame: without this, error -> frame -> future -> error is a cycle
                # through a C++ object that no collector frees (the bucket and the process group would leak)
                fut = None

        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tzip-ddp")
            self._executor.submit(run, fut)
        # DDP's reducer reads the Future's value in C++ and takes an error only from there: an exception set from
        # Python (set_exception) reached the user as "RuntimeError: Unable to cast <message> to Tensor". A callback
        # that raises it turns it into the C++ error, whose message keeps the exception's type and text.
        return fut.then(_bucket_value)


def _timeout_of(pg: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout ``pg``'s collectives were given (init_process_group's or new_group's), or None (torch's default)
    where this torch keeps it elsewhere. Without it the hook's group had torch's default of 30 minutes whatever the
    job asked for: a stalled peer held the other ranks for 30 minutes instead of raising after the job's timeout."""
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def _bucket_value(fut: torch.futures.Future) -> torch.Tensor:
    """The worker's result: the reduced bucket, or the error it raised (raised here, so it reaches DDP)."""
    return fut.value()


def lossless_allreduce_hook(state: LosslessState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """
    All-reduce a ``GradBucket`` losslessly compressed (``tzip.distributed.all_reduce``) and average it as DDP does.

    1. Divide the bucket by the group's world size, in place (as ``allreduce_hook`` does: before the sum, so fp16
       does not overflow).
    2. ``state.enabled`` False: all-reduce it with ``torch.distributed.all_reduce`` (DDP's own path) and return
       that Future; done.
    3. On the state's worker thread: split the flat bucket into world-size shards, compress them (one daemon
       request), exchange them with all-to-all, sum the shards of this rank's part in rank order, compress that sum,
       all-gather it, decompress into the bucket.
    4. Return a Future whose value is the bucket, reduced in place (DDP copies it into the gradients, or they are
       its views with ``gradient_as_bucket_view=True``).

    Example::
        >>> # xdoctest: +SKIP
        >>> state = LosslessState(process_group, codec="fast")
        >>> ddp_model.register_comm_hook(state, lossless_allreduce_hook)
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(group.size())
    if not state.enabled:
        work = dist.all_reduce(tensor, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    return state._all_reduce_async(tensor)
