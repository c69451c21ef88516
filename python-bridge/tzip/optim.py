"""Compressed optimizer-state offload: :class:`CompressedOffload`, a ``torch.optim.Optimizer`` around another one.

    import tzip.optim
    opt = tzip.optim.CompressedOffload(torch.optim.AdamW(model.parameters(), lr=1e-3))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=1000)
    for batch in data:
        loss = model(batch).loss
        loss.backward()
        opt.step()            # state decompressed, the wrapped AdamW steps, state compressed again
        sched.step()
        opt.zero_grad()

What is where, and when (the "state tensors" are the tensors the wrapped optimizer keeps per parameter, e.g.
Adam/AdamW's fp32 ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``; see "Which state is offloaded"):

* Between steps each state tensor lives as a :class:`~tzip.CompressedTensor` in ``opt.state[param][key]`` (the
  wrapped optimizer's own ``state`` dict), its frame in host memory. For a CUDA tensor the frame lies in page-locked
  (pinned) host memory that this object holds, exactly sized per chunk plus up to 1/8 headroom (registered with
  ``cudaHostRegister``, as ``torch.distributed.checkpoint``'s staging does: PyTorch's pinned allocator would round
  every block up to a power of two), and the tensor's GPU memory is released to PyTorch's caching allocator
  (``torch.cuda.memory_allocated`` drops by the state's bytes; ``memory_reserved`` stays, and the cache hands that
  memory to activations). For a CPU tensor the frame is an ordinary CPU tensor.
* :meth:`step`: the state comes back (one decompress request per chunk of ``chunk_bytes`` of state; for CUDA state
  the chunk's frames are copied host to device in one copy on a side stream, then the daemon decodes them on the
  GPU, while the next chunk's frames are uploaded), the wrapped optimizer steps on plain tensors, then the state is
  compressed again (one compress request per chunk; on a GPU the daemon encodes on the GPU and the frames are
  copied device to host on the side stream while the next chunk is encoded). During a step the whole state is
  resident, as with the plain optimizer, plus the frames of at most two chunks (GPU) or of one request (CPU).
  :meth:`step` returns once the frames are in host memory.
* CPU state is decoded by the daemon into shared memory (tzip.client); the client keeps up to its
  ``result_pool_keep_bytes`` (512 MiB by default) of idle shared memory for reuse between steps, freed after 30 s
  idle: pass ``client=tzip.connect(result_pool_keep_bytes=0)`` where host memory is what is short.

Steps are bit-identical to the wrapped optimizer run alone: the codecs are lossless, a state tensor comes back
with its dtype, shape, strides and device, and the wrapped optimizer's own ``step`` does the arithmetic.

Which state is offloaded: a tensor value of ``state[param]`` (not a tensor inside a list or dict) that is strided,
on the CPU or a GPU, has at least one dimension and ``min_bytes`` bytes (1 KiB by default), does not require grad,
is dense (contiguous or a permutation of a contiguous layout) and shares its storage with no parameter and no other
state tensor (replacing such a tensor would break the sharing). Everything else stays as the optimizer put it:
Adam's 0-dim ``step`` counters, ``None`` momentum buffers, lists, small tensors.

The daemon away: with a lenient client (``strict=False``, the default) the client stores frames uncompressed
(codec ``raw``) and warns once (tzip.client), and training goes on bit-identically. With ``strict=True``
(a strict client) compress raises :class:`~tzip.DaemonUnavailableError` after the wrapped optimizer stepped; the
state then stays resident, uncompressed, and the next step compresses it again. Frames of other codecs need a
daemon to decode: if it went away between two steps, :meth:`step` raises DaemonUnavailableError before anything
changed (the state stays compressed; call it again once a daemon serves the socket; the default client starts one).

:meth:`state_dict` gives what the wrapped optimizer's would, with plain tensors: every state tensor decompressed
(a CUDA parameter's state onto the CPU, so that a checkpoint needs no GPU memory; ``load_state_dict`` of any
optimizer moves state to its parameter's device, as torch.optim does) or cloned, so the dict is a snapshot that
later steps do not change. It loads into a plain optimizer of the same kind, and a plain optimizer's state dict
loads into a CompressedOffload; either way training continues bit-identically.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from ._default import resolve_client
from .client import CODECS, Client
from .compressed import CompressedTensor

__all__ = ["CompressedOffload", "DEFAULT_CHUNK_BYTES", "DEFAULT_MIN_BYTES"]

#: Uncompressed state bytes per compress/decompress request (a chunk). A chunk's frames are the unit of the
#: host<->device copies, so on a GPU this bounds the frame memory in flight and sets the pipeline's grain.
DEFAULT_CHUNK_BYTES = 64 << 20
#: State tensors smaller than this stay as they are (Adam's 0-dim ``step`` counters).
DEFAULT_MIN_BYTES = 1024
#: Frames start at multiples of this in the pinned slabs and in the GPU upload buffers (the daemon reads a frame
#: at its storage offset; 256 is cudaMalloc's alignment).
_FRAME_ALIGN = 256
#: A slab is reallocated when the frames of its chunk need more than it has, or less than half of it.
_SLAB_GRAIN = 1 << 16


def _align(n: int) -> int:
    return (n + _FRAME_ALIGN - 1) & ~(_FRAME_ALIGN - 1)


def _dense_permutation(t: torch.Tensor) -> bool:
    """Whether ``t`` covers exactly ``numel`` elements with no overlap (contiguous in some order of its dims)."""
    if t.is_contiguous():
        return True
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
    return t.permute(order).is_contiguous()


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


# --------------------------------------------------------------------------- pinned host memory


def _unpin(u8: torch.Tensor, holder: dict) -> None:
    ev = holder.get("event")
    if ev is not None:
        ev.synchronize()  # no copy may still read or write the pages
    if holder.get("pinned"):
        torch.cuda.cudart().cudaHostUnregister(u8.data_ptr())
        holder["pinned"] = False


class _HostSlab:
    """``capacity`` bytes of host memory page-locked with cudaHostRegister (exact size, unlike PyTorch's pinned
    allocator, which rounds to a power of two). ``holder["event"]``: the last CUDA copy that uses it; the pages are
    unregistered once it is done, when the slab is released or collected. Where registering fails (e.g. a locked-
    memory limit) the slab stays pageable: copies are then synchronous, and still correct."""

    _warned = False

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.u8 = torch.empty(self.capacity, dtype=torch.uint8)
        self.holder: dict[str, Any] = {"event": None, "pinned": False}
        if self.capacity:
            err = int(torch.cuda.cudart().cudaHostRegister(self.u8.data_ptr(), self.capacity, 1))  # 1: portable
            if err == 0:
                self.holder["pinned"] = True
            elif not _HostSlab._warned:
                _HostSlab._warned = True
                warnings.warn(f"tzip.optim: cudaHostRegister of {self.capacity} bytes failed (cudaError {err}); the "
                              "offloaded frames stay in pageable host memory (synchronous copies)", RuntimeWarning,
                              stacklevel=4)
        self._finalizer = weakref.finalize(self, _unpin, self.u8, self.holder)

    @property
    def pinned(self) -> bool:
        return bool(self.holder["pinned"])

    def release(self) -> None:
        self._finalizer()


# --------------------------------------------------------------------------- bookkeeping


@dataclass
class _Entry:
    """One offloaded state tensor: ``state[key]`` holds ``ct`` until the next restore."""

    state: dict
    key: Any
    ct: CompressedTensor
    device: torch.device
    stride: tuple[int, ...] | None  # None: contiguous


@dataclass
class _Chunk:
    """State tensors of one device compressed in one request (and, on a GPU, copied in one slab)."""

    device: torch.device
    entries: list[_Entry] = field(default_factory=list)
    slab: _HostSlab | None = None
    used: int = 0  # bytes of the slab holding frames (GPU)
    offsets: list[int] = field(default_factory=list)


class CompressedOffload(torch.optim.Optimizer):
    """Keeps ``optimizer``'s state compressed between steps (see the module docstring for what lies where when).

    ``isinstance(opt, torch.optim.Optimizer)`` holds; ``param_groups``, ``state`` and ``defaults`` are the wrapped
    optimizer's own objects, so LR schedulers, ``add_param_group``, ``zero_grad``, hooks and frozen parameters work
    as with the optimizer alone. Call :meth:`step` of this object, never the wrapped optimizer's (it would find
    CompressedTensors in its state).

    Args:
        optimizer: a constructed ``torch.optim.Optimizer`` (Adam, AdamW, SGD, ... or your own), not yet stepped or
            already stepped (its state is offloaded now).
        codec: 'auto' | 'fast' | 'max' | 'bytes' | 'raw' (README, "Codecs"); 'raw' runs the same offload without
            compression (a baseline).
        client: a :class:`~tzip.Client`; None: the process-wide default (tzip._default), strict or lenient as
            ``strict`` says.
        strict: raise DaemonUnavailableError instead of storing uncompressed frames when the daemon is away. With a
            client given, that client must itself be strict (``tzip.connect(strict=True)``).
        min_bytes: state tensors of fewer bytes stay resident (see "Which state is offloaded").
        chunk_bytes: uncompressed state bytes per compress/decompress request (and per host<->device copy on a GPU);
            None: one request per device for the whole state.

    Raises:
        TypeError: ``optimizer`` is not a torch.optim.Optimizer, or is a CompressedOffload.
        ValueError: unknown codec, negative sizes, or ``strict=True`` with a lenient client.
        DaemonUnavailableError: ``strict=True``, ``client=None`` and no daemon can be reached or started.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, codec: str = "auto", client: Client | None = None,
                 strict: bool = False, *, min_bytes: int = DEFAULT_MIN_BYTES,
                 chunk_bytes: int | None = DEFAULT_CHUNK_BYTES):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"CompressedOffload wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, CompressedOffload):
            raise TypeError("this optimizer is already a CompressedOffload")
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; one of {', '.join(CODECS)}")
        if min_bytes < 1 or (chunk_bytes is not None and chunk_bytes < 1):
            raise ValueError(f"min_bytes ({min_bytes}) and chunk_bytes ({chunk_bytes}) must be positive")
        if client is not None and strict and not client.strict:
            raise ValueError("strict=True needs a strict client (tzip.connect(strict=True)), or client=None")
        # torch.optim.Optimizer.__init__ is not called: it would add the parameters a second time. These are the
        # attributes it sets (torch 2.11); param_groups, state and defaults are properties over the wrapped optimizer.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._warned_capturable_if_run_uncaptured = True
        self.optimizer = optimizer
        self.codec = codec
        self.strict = bool(strict or (client is not None and client.strict))
        self.min_bytes = int(min_bytes)
        self.chunk_bytes = None if chunk_bytes is None else int(chunk_bytes)
        self.client = resolve_client(client, strict)
        self._patch_step_function()
        self._chunks: list[_Chunk] = []
        self._slabs: dict[int, list[_HostSlab | None]] = {}  # per GPU index: one slab per chunk position
        self._copy_streams: dict[int, torch.cuda.Stream] = {}
        self._timings = {"restore_s": 0.0, "offload_s": 0.0}
        self._offload()

    # --- the wrapped optimizer's objects ----------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a CompressedOffload does not pickle (it holds pinned memory and a daemon client); save "
                        "opt.state_dict() instead")

    def __repr__(self) -> str:
        return f"CompressedOffload({self.optimizer!r}, codec={self.codec!r})"

    # --- the optimizer protocol ---------------------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None):
        """Restores the state, runs the wrapped optimizer's ``step(closure)`` and offloads the state again.

        Returns what the wrapped step returns (the closure's loss, or None). With a closure, the state is resident
        while it runs (the wrapped optimizer calls it).

        Raises:
            DaemonUnavailableError: before anything changed, when frames of a codec other than raw cannot be
                decoded (no daemon); after the wrapped step, with ``strict``, when they cannot be encoded (the
                state then stays resident, uncompressed). TzipDaemonError: the daemon refused a request.
        """
        self._restore()
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self._offload()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The wrapped optimizer's ``add_param_group`` (its defaults fill the group's missing options)."""
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict with plain tensors (see the module docstring): ``{"state": {index:
        {key: value}}, "param_groups": [...]}``; offloaded tensors decompressed onto the CPU in one request, other
        tensors cloned, other values as they are. The state tensors cost their full size in host memory while the
        dict lives. Hooks registered on this object run around it, the wrapped optimizer's inside.

        Raises DaemonUnavailableError when frames of a codec other than raw cannot be decoded (no daemon)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._settle_copies()
        inner = self.optimizer.state_dict()
        packed: dict[Any, Any] = {}
        cts: list[CompressedTensor] = []
        where: list[tuple[dict, Any]] = []
        for idx, per_param in inner["state"].items():
            d = {}
            for k, v in per_param.items():
                if isinstance(v, CompressedTensor):
                    cts.append(v)
                    where.append((d, k))
                    d[k] = None
                elif isinstance(v, torch.Tensor):
                    d[k] = v.detach().clone()
                else:
                    d[k] = v
            packed[idx] = d
        if cts:
            for (d, k), t in zip(where, self._decompress_host(cts)):
                d[k] = t
        state_dict = {**inner, "state": packed}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of the wrapped optimizer's (the wrapped optimizer's
        ``load_state_dict``: state cast and moved to each parameter's device, as torch.optim does), then offloads
        it. While this runs the whole state is resident on the parameters' devices. CompressedTensors found as
        state values are decompressed first. The state offloaded before is dropped."""
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        state = state_dict.get("state")
        if isinstance(state, dict) and any(isinstance(v, CompressedTensor) for d in state.values() if isinstance(d, dict)
                                           for v in d.values()):
            state = {i: dict(d) if isinstance(d, dict) else d for i, d in state.items()}
            where = [(d, k) for d in state.values() if isinstance(d, dict) for k, v in d.items() if isinstance(v, CompressedTensor)]
            for (d, k), t in zip(where, self._decompress_host([d[k] for d, k in where])):
                d[k] = t
            state_dict["state"] = state
        self._settle_copies()
        self._chunks = []
        self.optimizer.load_state_dict(state_dict)
        self._offload()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # --- figures ------------------------------------------------------------------------------------------
    def offload_stats(self) -> dict[str, Any]:
        """What is offloaded now, in bytes:

        ``tensors`` (count), ``state_bytes`` (their uncompressed bytes), ``compressed_bytes`` (bytes of their
        frames), ``ratio`` (compressed / state; NaN when nothing is offloaded), ``pinned_bytes`` (page-locked host
        memory held for CUDA state, slab headroom included), ``host_bytes`` (host memory holding frames: the pinned
        slabs plus the frames of CPU state), ``resident_bytes`` (state tensors kept as they are, every device),
        ``codecs`` (frame codec -> tensor count), ``restore_s`` / ``offload_s`` (wall-clock seconds of the last
        restore and offload, each ending when its copies are done)."""
        n = state = comp = cpu_frames = 0
        codecs: dict[str, int] = {}
        for c in self._chunks:
            for e in c.entries:
                n += 1
                state += e.ct.nbytes
                comp += e.ct.compressed_nbytes
                codecs[e.ct.codec] = codecs.get(e.ct.codec, 0) + 1
                if c.device.type == "cpu":
                    cpu_frames += e.ct.compressed_nbytes
        pinned = sum(s.capacity for slabs in self._slabs.values() for s in slabs if s is not None and s.pinned)
        pageable = sum(s.capacity for slabs in self._slabs.values() for s in slabs if s is not None and not s.pinned)
        resident = sum(v.numel() * v.element_size() for d in self.state.values() for v in d.values()
                       if isinstance(v, torch.Tensor))
        return {"tensors": n, "state_bytes": state, "compressed_bytes": comp,
                "ratio": comp / state if state else float("nan"), "pinned_bytes": pinned,
                "host_bytes": pinned + pageable + cpu_frames, "resident_bytes": resident, "codecs": codecs,
                **self._timings}

    # --- offload ------------------------------------------------------------------------------------------
    def _plan(self) -> list[_Chunk]:
        """The state tensors to offload, in parameter order, cut into chunks per device."""
        seen: dict[tuple[str, int], int] = {}
        params = [p for g in self.param_groups for p in g["params"]]
        for p in params:
            k = _storage_key(p)
            seen[k] = seen.get(k, 0) + 1
        candidates: list[tuple[dict, Any, torch.Tensor]] = []
        for p in dict.fromkeys(params):  # a parameter listed twice has one state
            st = self.state.get(p)
            if not isinstance(st, dict):
                continue
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    k = _storage_key(v)
                    seen[k] = seen.get(k, 0) + 1
                    candidates.append((st, key, v))
        chunks: dict[str, list[_Chunk]] = {}
        sizes: dict[str, int] = {}
        for st, key, v in candidates:
            nbytes = v.numel() * v.element_size()
            if (v.layout != torch.strided or v.device.type not in ("cpu", "cuda") or v.dim() == 0 or nbytes < self.min_bytes
                    or v.requires_grad or v.is_quantized or seen[_storage_key(v)] > 1 or not _dense_permutation(v)):
                continue
            dev = str(v.device)
            lst = chunks.setdefault(dev, [])
            if not lst or (self.chunk_bytes is not None and sizes[dev] + nbytes > self.chunk_bytes and lst[-1].entries):
                lst.append(_Chunk(v.device))
                sizes[dev] = 0
            sizes[dev] += nbytes
            lst[-1].entries.append(_Entry(st, key, None, v.device, None if v.is_contiguous() else tuple(v.stride())))  # type: ignore[arg-type]
        return [c for lst in chunks.values() for c in lst]

    @torch.no_grad()
    def _offload(self) -> None:
        """Compresses the state tensors of :meth:`_plan` and puts CompressedTensors in their place."""
        t0 = time.perf_counter()
        plan = self._plan()
        gpu_chunks: dict[int, list[_Chunk]] = {}
        for chunk in plan:
            if chunk.device.type == "cpu":
                tensors = [e.state[e.key] for e in chunk.entries]
                cts = self.client.compress(tensors, codec=self.codec)
                for e, ct in zip(chunk.entries, cts):
                    e.ct = ct
                    e.state[e.key] = ct
                self._chunks.append(chunk)
            else:
                gpu_chunks.setdefault(chunk.device.index or 0, []).append(chunk)
        for index, chunks in gpu_chunks.items():
            self._offload_gpu(index, chunks)
        self._timings["offload_s"] = time.perf_counter() - t0

    def _copy_stream(self, index: int) -> torch.cuda.Stream:
        s = self._copy_streams.get(index)
        if s is None:
            s = self._copy_streams[index] = torch.cuda.Stream(device=index)
        return s

    def _slab(self, index: int, k: int, need: int) -> _HostSlab:
        slabs = self._slabs.setdefault(index, [])
        while len(slabs) <= k:
            slabs.append(None)
        s = slabs[k]
        if s is None or s.capacity < need or s.capacity > 2 * need + _SLAB_GRAIN:
            if s is not None:
                s.release()  # waits for the copies that use it
            cap = need + need // 8
            s = slabs[k] = _HostSlab((cap + _SLAB_GRAIN - 1) // _SLAB_GRAIN * _SLAB_GRAIN)
        return s

    def _offload_gpu(self, index: int, chunks: list[_Chunk]) -> None:
        """Per chunk: the daemon encodes on the GPU (current stream order), then the frames are copied into the
        chunk's pinned slab on the side stream while the next chunk is encoded. Returns when the copies are done."""
        with torch.cuda.device(index):
            compute = torch.cuda.current_stream(index)
            side = self._copy_stream(index)
            in_flight: list[list[CompressedTensor]] = []  # GPU frames kept alive until their copy is done
            done_with: torch.cuda.Event | None = None
            try:
                for k, chunk in enumerate(chunks):
                    tensors = [e.state[e.key] for e in chunk.entries]
                    gpu_cts = self.client.compress(tensors, codec=self.codec)
                    del tensors
                    offsets, used = [], 0
                    for ct in gpu_cts:
                        offsets.append(used)
                        used += _align(ct.compressed_nbytes)
                    slab = self._slab(index, k, used)
                    side.wait_stream(compute)  # the frames are ready in the compute stream's order
                    with torch.cuda.stream(side):
                        for ct, off in zip(gpu_cts, offsets):
                            n = ct.compressed_nbytes
                            if ct.payload.device.type == "cuda":
                                slab.u8[off : off + n].copy_(ct.payload, non_blocking=True)
                            else:  # not expected from the client, but a frame is a frame
                                slab.u8[off : off + n].copy_(ct.payload)
                    done_with = side.record_event()
                    slab.holder["event"] = done_with
                    in_flight.append(gpu_cts)
                    chunk.slab, chunk.used, chunk.offsets = slab, used, offsets
                    for e, ct, off in zip(chunk.entries, gpu_cts, offsets):
                        e.ct = CompressedTensor(slab.u8[off : off + ct.compressed_nbytes], ct.dtype, ct.shape, ct.codec, ct.nbytes)
                        e.state[e.key] = e.ct  # the GPU tensor goes back to the caching allocator
                    self._chunks.append(chunk)
            finally:
                if done_with is not None:
                    done_with.synchronize()
                in_flight.clear()
            slabs = self._slabs.get(index, [])
            for s in slabs[len(chunks):]:
                if s is not None:
                    s.release()
            del slabs[len(chunks):]

    # --- restore ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _restore(self) -> None:
        """Decompresses every offloaded tensor back into ``state``; all or nothing (an error leaves it offloaded)."""
        t0 = time.perf_counter()
        chunks = [c for c in self._chunks if any(e.state.get(e.key) is e.ct for e in c.entries)]
        results: list[tuple[_Entry, torch.Tensor]] = []
        gpu: dict[int, list[_Chunk]] = {}
        for c in chunks:
            if c.device.type == "cpu":
                outs = [None if e.stride is None else torch.empty_strided(e.ct.shape, e.stride, dtype=e.ct.dtype)
                        for e in c.entries]
                results.extend(zip(c.entries, self.client.decompress([e.ct for e in c.entries], out=outs)))
            else:
                gpu.setdefault(c.device.index or 0, []).append(c)
        for index, cs in gpu.items():
            results.extend(self._restore_gpu(index, cs))
        for e, t in results:
            if e.state.get(e.key) is e.ct:
                e.state[e.key] = t
        self._chunks = []
        self._timings["restore_s"] = time.perf_counter() - t0

    def _restore_gpu(self, index: int, chunks: list[_Chunk]) -> list[tuple[_Entry, torch.Tensor]]:
        """Per chunk: one host-to-device copy of its frames on the side stream (the next chunk's runs while the
        daemon decodes this one on the GPU), then one decompress request in the compute stream's order."""
        out: list[tuple[_Entry, torch.Tensor]] = []
        device = torch.device("cuda", index)
        with torch.cuda.device(index):
            compute = torch.cuda.current_stream(index)
            side = self._copy_stream(index)

            def upload(c: _Chunk) -> tuple[torch.Tensor, torch.cuda.Event]:
                buf = torch.empty(c.used, dtype=torch.uint8, device=device)  # compute stream's memory
                side.wait_stream(compute)  # earlier users of that memory are done before the copy writes it
                with torch.cuda.stream(side):
                    buf.copy_(c.slab.u8[: c.used], non_blocking=True)  # type: ignore[union-attr]
                ev = side.record_event()
                c.slab.holder["event"] = ev  # type: ignore[union-attr]
                return buf, ev

            nxt = upload(chunks[0])
            for k, c in enumerate(chunks):
                buf, ev = nxt
                if k + 1 < len(chunks):
                    nxt = upload(chunks[k + 1])
                compute.wait_event(ev)
                cts = [CompressedTensor(buf[off : off + e.ct.compressed_nbytes], e.ct.dtype, e.ct.shape, e.ct.codec, e.ct.nbytes)
                       for e, off in zip(c.entries, c.offsets)]
                outs = [None if e.stride is None else torch.empty_strided(e.ct.shape, e.stride, dtype=e.ct.dtype, device=device)
                        for e in c.entries]
                out.extend(zip(c.entries, self.client.decompress(cts, out=outs)))
                del buf, cts
        return out

    # --- helpers ------------------------------------------------------------------------------------------
    def _settle_copies(self) -> None:
        """Waits for the copies into and out of the pinned slabs (before the host reads them)."""
        for slabs in self._slabs.values():
            for s in slabs:
                ev = None if s is None else s.holder.get("event")
                if ev is not None:
                    ev.synchronize()

    def _decompress_host(self, cts: Iterable[CompressedTensor]) -> list[torch.Tensor]:
        """CompressedTensors decompressed onto the CPU in one request (frames of CUDA state are in host memory)."""
        cts = [ct if ct.payload.device.type == "cpu" else CompressedTensor(ct.payload.cpu(), ct.dtype, ct.shape, ct.codec, ct.nbytes)
               for ct in cts]
        return self.client.decompress(cts)
