"""The ZeroMQ route of a compress or decompress call: the request as ZeroMQ messages to the daemon, one per batch of
CPU tensors (:class:`tzip._cpu_path.CpuPath`, shared memory) and per batch of each GPU's (:class:`tzip._gpu_path.GpuPath`,
CUDA IPC), with one retry after spawning a daemon; raw frames made or decoded here when no daemon serves. A call
takes it when the session has no ring, or when a ring route hands its request over. :class:`ZmqPath` is a part of
:class:`tzip.client.Client` (it uses the Client's session and GPU state)."""

from __future__ import annotations

import torch

from ._codec_choice import codec_for
from ._cpu_path import CpuPath
from ._errors import DaemonUnavailableError
from ._fallback import _compress_raw, _decompress_raw, _on_cpu
from ._gpu_path import GpuPath, _stream_for
from ._request import Request
from ._call_args import _into_outs
from .compressed import CompressedTensor


class ZmqPath(CpuPath, GpuPath):
    """Compress and decompress through ZeroMQ requests."""

    def _compress_zmq(self, req: Request):
        """The ZeroMQ route of ``req`` (its arguments checked): requests through the daemon (one retry after spawning
        one), else raw frames made here (with a warning; DaemonUnavailableError when strict)."""
        self._check_pid()
        items, single, outs = req.items, req.single, req.outs
        out = None
        for attempt in range(2):
            try:
                # The retry skips the reconnect back-off: it is the one extra attempt a spawning client makes.
                if not self._session.ensure(force=attempt > 0):
                    raise self._session.unavailable()
                out = self._compress_remote(req)
                break
            except DaemonUnavailableError:
                # The daemon went away during the call: with spawn, start one and try once more.
                if attempt == 0 and self.spawn:
                    continue
                if self.strict:
                    raise
                self._session.warn_fallback()
                out = [_compress_raw(t) for t in items]
        return _into_outs(out[0] if single else out, outs, single)

    def _compress_remote(self, req: Request) -> list[CompressedTensor]:
        """One ZeroMQ request per batch of CPU tensors and per batch of each GPU's tensors (codec None: each device's
        default, :func:`tzip._codec_choice.codec_for`)."""
        tensors, codec, streams = req.items, req.codec, req.streams
        groups: dict[int | None, list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault(None if t.device.type == "cpu" else (t.device.index or 0), []).append(i)
        out: list[CompressedTensor] = [None] * len(tensors)  # type: ignore[list-item]
        for key, idx in groups.items():
            part = [tensors[i] for i in idx]
            if key is None:
                done = self._compress_cpu(part, codec_for(codec, False), req)
            else:
                done = self._compress_gpu(self._gpu(key), part, codec_for(codec, True), _stream_for(streams, key), req)
            for i, ct in zip(idx, done):
                out[i] = ct
        return out

    def _decompress_zmq(self, req: Request):
        """The ZeroMQ route of ``req`` (its arguments checked): raw frames are decoded here where that needs no
        daemon, the rest through the daemon (one retry after spawning one)."""
        self._check_pid()
        items, outs, single, verify = req.items, req.outs, req.single, req.verify
        results: list[torch.Tensor | None] = [None] * len(items)
        remote = []
        for i, (ct, o) in enumerate(zip(items, outs)):
            target = o.device if o is not None else ct.payload.device
            if ct.codec == "raw" and (target.type == "cpu" or not self.connected or not self._gpu_reachable(self._gpu(target.index or 0))):
                results[i] = _decompress_raw(ct, o, verify)
            else:
                remote.append(i)
        if remote:
            for attempt in range(2):
                try:
                    if not self._session.ensure(force=attempt > 0):
                        raise self._session.unavailable()
                    self._decompress_remote(req, remote, results)
                    break
                except DaemonUnavailableError as e:
                    if attempt == 0 and self.spawn:
                        continue  # the daemon went away during the call: start one and try once more
                    for i in remote:
                        if results[i] is None and items[i].codec == "raw":
                            results[i] = _decompress_raw(items[i], outs[i], verify)
                    rest = [i for i in remote if results[i] is None]
                    if rest:
                        raise DaemonUnavailableError(f"cannot decompress codec {items[rest[0]].codec!r} frames: {e}") from None
                    break
        return results[0] if single else results

    def _decompress_remote(self, req: Request, idx: list[int], results: list) -> None:
        """Fills ``results[i]`` for ``i`` in ``idx``: one ZeroMQ request per batch of CPU destinations and per batch
        of each GPU's."""
        items, outs, verify, streams = req.items, req.outs, req.verify, req.streams
        groups: dict[int | None, list[int]] = {}
        for i in idx:
            if results[i] is not None:
                continue
            o = outs[i]
            target = o.device if o is not None else items[i].payload.device
            groups.setdefault(None if target.type == "cpu" else (target.index or 0), []).append(i)
        for key, part in groups.items():
            cts = [items[i] for i in part]
            os_ = [outs[i] for i in part]
            if key is None:
                done = self._decompress_cpu([_on_cpu(ct) for ct in cts], os_, verify, req)
            else:
                done = self._decompress_gpu(self._gpu(key), cts, os_, verify, _stream_for(streams, key), req)
            for i, t in zip(part, done):
                results[i] = t
