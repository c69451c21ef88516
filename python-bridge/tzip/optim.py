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

* Chunks: the state tensors of one device, dtype and state key (``exp_avg``, ...), in parameter order, are packed
  into flat buffers of at most ``chunk_bytes`` (64 MiB by default; each tensor at a multiple of 256 bytes), and
  each chunk is one frame: one tensor per compress or decompress request, whatever the number of parameters.
* Between steps ``opt.state[param][key]`` (the wrapped optimizer's own ``state`` dict) holds an
  :class:`OffloadedTensor` (dtype, shape, strides, device, and the chunk's frame) in place of each state tensor,
  and the frames lie in host memory. A CUDA chunk's frame lies in page-locked (pinned) host memory that this
  object holds: one slab per chunk, sized to the frame plus 1/8 when it is made and made again when the frame
  outgrows it or fills less than 2/3 of it, so at most 1.5 times the frames' bytes (registered with
  ``cudaHostRegister``, as ``torch.distributed.checkpoint``'s staging does: PyTorch's pinned allocator would round
  every block up to a power of two). The state's GPU memory is released to PyTorch's caching allocator
  (``torch.cuda.memory_allocated`` drops by the state's bytes; ``memory_reserved`` stays, and the cache hands that
  memory to activations). A CPU chunk's frame is an ordinary CPU tensor.
* :meth:`step`: each chunk comes back (CUDA: its frame copied host to device on a side stream, then decoded by the
  daemon on the GPU, while the next chunk's frame is uploaded; CPU: all chunks in one request), and the state
  tensors are views of the chunk's flat buffer while the wrapped optimizer steps on them. Then each chunk's flat
  buffer (the same one, updated in place; or a new one the tensors are copied into when the state changed, e.g.
  on the first step) is compressed again (CUDA: encoded by the daemon on the GPU, the frame copied device to host
  on the side stream while the next chunk is encoded). During a step the whole state is resident, as with the
  plain optimizer, plus the frames in flight (CUDA: two chunks' while restoring, those not yet copied to the host
  while offloading; on the first step, or when the state changed, a chunk's tensors are also copied once).
  :meth:`step` returns once the frames are in host memory.
* The client's own buffers: CPU chunks are decoded by the daemon into shared memory, and the client keeps up to
  its ``result_pool_keep_bytes`` (512 MiB by default) of idle shared memory for reuse, freed after 30 s idle; CUDA
  requests are staged in the client's GPU arena, of which it keeps up to ``gpu_arena_keep_bytes`` (128 MiB) per GPU
  allocated between requests (tzip.client). Where memory is what is short, pass a client made with
  ``tzip.connect(result_pool_keep_bytes=0, gpu_arena_keep_bytes=0)``.

Steps are bit-identical to the wrapped optimizer run alone: the codecs are lossless, a state tensor comes back
with its dtype, shape, strides and device, and the wrapped optimizer's own ``step`` does the arithmetic.

DTensor state (FSDP2, tensor parallelism): what is offloaded is each DTensor's local shard, an ordinary tensor; the
state holds an OffloadedTensor between steps, and at each step a DTensor with the same mesh, placements, shape and
strides around the restored shard. Each rank offloads its own shards.

Which state is offloaded: a tensor value of ``state[param]`` (not a tensor inside a list or dict) that is strided,
on the CPU or a GPU, has at least one dimension and ``min_bytes`` bytes (1 KiB by default), does not require grad,
is dense (contiguous or a permutation of a contiguous layout) and shares its storage with no parameter and no other
state tensor (replacing such a tensor would break the sharing; the views of a chunk that this object made are
its own). Everything else stays as the optimizer put it: Adam's 0-dim ``step`` counters, ``None`` momentum
buffers, lists, small tensors.

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
from collections import OrderedDict
from typing import Any, Callable

import torch

from ._default import resolve_client
from ._dlpack import int_alias
from ._codec_choice import check_codec
from ._job import _checked_sm_budget
from .client import Client, tagged
from ._offload_copies import OffloadCopies
from ._offload_state import (OffloadedTensor, _align, _check_plain_parameters, _Chunk, _dense_permutation, _is_wrapper,
                             _local, _storage_key)

__all__ = ["CompressedOffload", "OffloadedTensor", "AttachedOffload", "DEFAULT_CHUNK_BYTES", "DEFAULT_MIN_BYTES"]

#: Most uncompressed state bytes in a chunk (one flat buffer, one frame, one compress or decompress request). On a GPU
#: a chunk's frame is the unit of the host<->device copies: this bounds the frame memory in flight and sets the
#: pipeline's grain.
DEFAULT_CHUNK_BYTES = 64 << 20
#: State tensors smaller than this stay as they are (Adam's 0-dim ``step`` counters).
DEFAULT_MIN_BYTES = 1024
def _zero_class():
    """torch.distributed.optim.ZeroRedundancyOptimizer, or None where torch was built without distributed."""
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:
        return None
    return ZeroRedundancyOptimizer


def optimizer_holding_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose ``state`` holds the tensors and whose ``step()`` runs the hooks of
    ``register_step_pre_hook`` / ``register_step_post_hook``: ``optimizer`` itself, or the one a wrapper that passes
    ``isinstance(optimizer, torch.optim.Optimizer)`` steps for it. Hooks go on that one, so every call of the
    wrapper (which calls the inner ``step``, ``state_dict``, ``load_state_dict``) keeps doing what it does.

    * Accelerate's ``AcceleratedOptimizer`` (what Hugging Face Trainer and ``accelerator.prepare`` hand out) never
      runs ``torch.optim.Optimizer.__init__``: it has no hook dicts and its ``step`` runs no hooks; its ``state``
      and ``param_groups`` are the wrapped optimizer's (``.optimizer``). Any such delegating wrapper, however deep,
      is unwrapped to its ``.optimizer``.
    * ``torch.distributed.optim.ZeroRedundancyOptimizer``: its own ``state`` is not the live one (empty, or the
      consolidated copy after ``load_state_dict``); this rank's shard is stepped by its local optimizer
      (``.optim``), inside ZeRO's ``step()`` before the parameters are broadcast.

    Raises TypeError naming the wrapper when the state's optimizer cannot be found (a wrapper without hooks that
    does not delegate ``state`` to ``.optimizer``; ZeRO with ``overlap_with_ddp=True``, whose local optimizer is a
    functional one stepped inside DDP's hook).
    """
    seen = []
    opt = optimizer
    while True:
        seen.append(type(opt).__name__)
        zero = _zero_class()
        if zero is not None and isinstance(opt, zero):
            inner = getattr(opt, "optim", None)
            if getattr(opt, "_overlap_with_ddp", False) or not isinstance(inner, torch.optim.Optimizer):
                raise TypeError("ZeroRedundancyOptimizer(overlap_with_ddp=True) steps a functional optimizer inside "
                                "DDP's comm hook: tzip cannot offload its state (overlap_with_ddp=False can)")
            opt = inner
            continue
        if "_optimizer_step_pre_hooks" in vars(opt):  # torch.optim.Optimizer.__init__ ran: hooks work on it
            return opt
        inner = getattr(opt, "optimizer", None)
        if (isinstance(inner, torch.optim.Optimizer) and inner is not opt and len(seen) < 8
                and getattr(opt, "state", None) is getattr(inner, "state", None)):
            opt = inner  # a delegating wrapper (AcceleratedOptimizer): its state is the inner optimizer's
            continue
        chain = " -> ".join(seen)
        raise TypeError(f"{chain}: a {type(opt).__name__} never ran torch.optim.Optimizer.__init__ (so its step() "
                        "runs no hooks) and does not keep its state in a .optimizer it wraps; tzip cannot offload "
                        "its state without changing what it does")


class CompressedOffload(torch.optim.Optimizer):
    """Keeps ``optimizer``'s state compressed between steps (see the module docstring for what lies where when).

    ``isinstance(opt, torch.optim.Optimizer)`` holds; ``param_groups``, ``state`` and ``defaults`` are the wrapped
    optimizer's own objects, so LR schedulers, ``add_param_group``, ``zero_grad``, hooks and frozen parameters work
    as with the optimizer alone. Call :meth:`step` of this object, never the wrapped optimizer's (it would find
    OffloadedTensors in its state).

    Args:
        optimizer: a constructed ``torch.optim.Optimizer`` (Adam, AdamW, SGD, ... or your own), not yet stepped or
            already stepped (its state is offloaded now).
        codec: 'auto' | 'fast' | 'max' | 'bytes' | 'raw' (README, "Codecs"); 'raw' runs the same offload without
            compression (a baseline). None (default): 'fast' for state on a GPU, 'auto' for state on the CPU
            (tzip._codec_choice).
        client: a :class:`~tzip.Client`; None: the process-wide default (tzip._default), strict or lenient as
            ``strict`` says.
        strict: raise DaemonUnavailableError instead of storing uncompressed frames when the daemon is away. With a
            client given, that client must itself be strict (``tzip.connect(strict=True)``).
        min_bytes: state tensors of fewer bytes stay resident (see "Which state is offloaded").
        chunk_bytes: most uncompressed state bytes per chunk (one frame, one request, one host<->device copy on a
            GPU); None: one chunk per device, dtype and state key.
        sm_budget: SMs the daemon's GPU codec may use for the requests of state on a GPU (0: all SMs: the training
            step waits for them, and the rest of the GPU is idle during the optimizer step); None (default): the
            daemon's budget (``tzip serve --sm-budget``, 10), as for ``Client.compress``. A job's budget wins over it.

    Raises:
        TypeError: ``optimizer`` is not a torch.optim.Optimizer, or is a CompressedOffload or a
            ZeroRedundancyOptimizer (:func:`tzip.attach` takes that one), or has parameters of a tensor subclass
            other than DTensor (DTensor parameters, as FSDP2 and tensor parallelism make, are taken: the local
            shards of their state are offloaded and the DTensors rebuilt around them at each step).
        ValueError: unknown codec, negative sizes, an sm_budget that is not an int in 0..1024, or ``strict=True``
            with a lenient client.
        DaemonUnavailableError: ``strict=True``, ``client=None`` and no daemon can be reached or started.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, codec: str | None = None, client: Client | None = None,
                 strict: bool = False, *, min_bytes: int = DEFAULT_MIN_BYTES,
                 chunk_bytes: int | None = DEFAULT_CHUNK_BYTES, sm_budget: int | None = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"CompressedOffload wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, CompressedOffload):
            raise TypeError("this optimizer is already a CompressedOffload")
        zero = _zero_class()
        if zero is not None and isinstance(optimizer, zero):
            # its own state is not the live one (optimizer_holding_state): the offload would hold nothing
            raise TypeError("CompressedOffload cannot wrap a ZeroRedundancyOptimizer (its shard's state lives in its "
                            ".optim); keep stepping it and call tzip.attach(optimizer=zero) instead")
        _check_plain_parameters(optimizer)
        check_codec(codec)
        sm_budget = _checked_sm_budget(sm_budget)
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
        self.sm_budget = sm_budget
        self.client = resolve_client(client, strict)
        self._patch_step_function()
        self._chunks: list[_Chunk] = []  # offloaded now, between steps
        # During a step: the flat buffers of the restore, each with {(id(state dict), key): (state dict, placeholder,
        # view)}, the views it put into the state.
        self._flats: dict[tuple[int, int], tuple[_Chunk, torch.Tensor, dict]] = {}
        self._copies = OffloadCopies(self.client)  # a GPU state's pinned host slabs and copy streams
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
        {key: value}}, "param_groups": [...]}``; offloaded tensors decompressed onto the CPU (one request), with their
        dtype, shape and strides, other tensors cloned, other values as they are. The state tensors cost their full
        size in host memory while the dict lives. Hooks registered on this object run around it, the wrapped
        optimizer's inside.

        Raises DaemonUnavailableError when frames of a codec other than raw cannot be decoded (no daemon)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        inner = self.optimizer.state_dict()
        state_dict = {**inner, "state": self._materialize(inner["state"])}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of the wrapped optimizer's (the wrapped optimizer's
        ``load_state_dict``: state cast and moved to each parameter's device, as torch.optim does), then offloads
        it. While this runs the whole state is resident on the parameters' devices. OffloadedTensors among the
        state values (the wrapped optimizer's own state dict between steps) are decompressed first. The state
        offloaded before is dropped."""
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        state = state_dict.get("state")
        if isinstance(state, dict) and any(isinstance(v, OffloadedTensor) for d in state.values() if isinstance(d, dict)
                                           for v in d.values()):
            state_dict["state"] = self._materialize(state, clone=False)
        self._copies.settle()
        self._chunks = []
        self._flats = {}
        self.optimizer.load_state_dict(state_dict)
        self._offload()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # --- figures ------------------------------------------------------------------------------------------
    def offload_stats(self) -> dict[str, Any]:
        """What is offloaded now, in bytes:

        ``tensors`` (count), ``chunks`` (frames), ``state_bytes`` (the tensors' uncompressed bytes),
        ``compressed_bytes`` (bytes of the frames), ``ratio`` (compressed / state; NaN when nothing is offloaded),
        ``pinned_bytes`` (page-locked host memory held for CUDA state, slab headroom included), ``host_bytes``
        (host memory holding frames: the slabs plus the frames of CPU state), ``resident_bytes`` (state tensors kept
        as they are, every device), ``codecs`` (frame codec -> number of frames), ``restore_s`` / ``offload_s``
        (wall-clock seconds of the last restore and offload, each ending when its copies are done)."""
        n = state = comp = cpu_frames = 0
        codecs: dict[str, int] = {}
        for c in self._chunks:
            n += len(c.entries)
            state += sum(ph.nbytes for _, _, ph in c.entries)
            comp += c.ct.compressed_nbytes  # type: ignore[union-attr]
            codecs[c.ct.codec] = codecs.get(c.ct.codec, 0) + 1  # type: ignore[union-attr]
            if c.device.type == "cpu":
                cpu_frames += c.ct.compressed_nbytes  # type: ignore[union-attr]
        slabs = self._copies.held()
        pinned = sum(s.capacity for s in slabs if s.pinned)
        resident = sum(_local(v).numel() * v.element_size() for d in self.state.values() for v in d.values()
                       if isinstance(v, torch.Tensor))  # (a DTensor: this rank's shard)
        return {"tensors": n, "chunks": len(self._chunks), "state_bytes": state, "compressed_bytes": comp,
                "ratio": comp / state if state else float("nan"), "pinned_bytes": pinned,
                "host_bytes": sum(s.capacity for s in slabs) + cpu_frames, "resident_bytes": resident,
                "codecs": codecs, **self._timings}

    # --- offload ------------------------------------------------------------------------------------------
    def _plan(self) -> list[tuple[_Chunk, list[tuple[dict, Any, torch.Tensor, int]], None]]:
        """The state tensors to offload, in parameter order, grouped by device, dtype and state key and cut into
        chunks of at most ``chunk_bytes``: (chunk, [(state dict, key, tensor, element offset in the flat buffer)],
        None: no flat buffer yet)."""
        params = [p for g in self.param_groups for p in g["params"]]
        on_storage: dict[tuple[int, int], int] = {}  # tensors (parameters and state) per storage
        for p in params:
            k = _storage_key(p)
            on_storage[k] = on_storage.get(k, 0) + 1
        candidates: list[tuple[dict, Any, torch.Tensor]] = []
        for p in dict.fromkeys(params):  # a parameter listed twice has one state
            st = self.state.get(p)
            if not isinstance(st, dict):
                continue
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    k = _storage_key(v)
                    on_storage[k] = on_storage.get(k, 0) + 1
                    candidates.append((st, key, v))
        # Views of the flat buffers of the last restore share a storage by design: they count as one tensor each
        # as long as every tensor on that storage is one of them, where it was put.
        views: dict[tuple[int, int], int] = {}
        for st, key, v in candidates:
            k = _storage_key(v)
            if k in self._flats and self._is_flat_view(st, key, v):
                views[k] = views.get(k, 0) + 1
        groups: dict[tuple[int, torch.dtype, Any], list[tuple[_Chunk, list]]] = {}
        for st, key, v in candidates:
            lv = _local(v)
            nbytes = lv.numel() * lv.element_size()
            if (lv.layout != torch.strided or lv.device.type not in ("cpu", "cuda") or lv.dim() == 0
                    or nbytes < self.min_bytes or v.requires_grad or lv.is_quantized or not _dense_permutation(lv)
                    or (lv is v and _is_wrapper(v))):
                continue
            k = _storage_key(v)
            if on_storage[k] > 1 and views.get(k) != on_storage[k]:
                continue  # shares its storage with a parameter or other state: replacing it would break that
            lst = groups.setdefault((lv.get_device(), lv.dtype, key), [])
            if not lst or (self.chunk_bytes is not None and lst[-1][0].numel * lv.element_size() + nbytes > self.chunk_bytes):
                lst.append((_Chunk(lv.device, lv.dtype), []))
            chunk, items = lst[-1]
            items.append((st, key, v, chunk.numel))
            chunk.numel += _align(nbytes) // lv.element_size()
        return [(c, items, None) for lst in groups.values() for c, items in lst]

    def _plan_unchanged(self) -> list | None:
        """The layout of the last restore again, with its flat buffers, when the state holds exactly the views it put
        there and no other tensor that could be offloaded: the optimizer updated them in place (every step after
        the first, with torch.optim's optimizers). None otherwise (then :meth:`_plan` decides from scratch)."""
        if not self._flats or self._chunks:
            return None
        views: set[int] = set()
        for _, _, placed in self._flats.values():
            for (_, key), (st, _, view) in placed.items():
                if st.get(key) is not view:
                    return None
                views.add(id(view))
        for st in self.state.values():
            if isinstance(st, dict):
                for v in st.values():
                    if (isinstance(v, torch.Tensor) and id(v) not in views and v.dim() > 0
                            and v.numel() * v.element_size() >= self.min_bytes):
                        return None  # new state: plan it
        return [(_Chunk(c.device, c.dtype, c.numel), [(st, key, view, ph.offset) for (_, key), (st, ph, view) in placed.items()], flat)
                for c, flat, placed in self._flats.values()]

    def _is_flat_view(self, st: dict, key: Any, v: torch.Tensor) -> bool:
        """Whether ``v`` is the view of a restored flat buffer that a restore put at ``st[key]``."""
        found = self._flats.get(_storage_key(v))
        if found is None:
            return False
        _, flat, placed = found
        ph = placed.get((id(st), key), (None, None, None))[1]
        v = _local(v)
        return (ph is not None and v.storage_offset() == flat.storage_offset() + ph.offset and v.shape == ph.shape
                and tuple(v.stride()) == ph.stride and v.dtype == flat.dtype)

    def _flat(self, chunk: _Chunk, items: list[tuple[dict, Any, torch.Tensor, int]]) -> torch.Tensor:
        """The chunk's values as one 1-D tensor: the restored flat buffer itself when the chunk is laid out as it
        was (the optimizer updated its views in place), else a new buffer the tensors are copied into (bits)."""
        k = _storage_key(items[0][2])
        if k in self._flats:
            _, flat, placed = self._flats[k]
            if (flat.numel() == chunk.numel and len(placed) == len(items)
                    and all(_storage_key(v) == k and self._is_flat_view(st, key, v) and placed[(id(st), key)][1].offset == off
                            for st, key, v, off in items)):
                return flat
        if chunk.device.type == "cpu":
            flat = self.client.empty((chunk.numel,), chunk.dtype)  # shared memory: the daemon reads it in place
        else:
            flat = torch.empty(chunk.numel, dtype=chunk.dtype, device=chunk.device)
        int_alias(flat).zero_()  # the alignment gaps: defined bytes, so that the frame is a function of the state
        for st, key, v, off in items:
            v = _local(v)
            int_alias(flat.as_strided(v.shape, v.stride(), flat.storage_offset() + off)).copy_(int_alias(v))
        return flat

    def _place(self, chunk: _Chunk, items: list[tuple[dict, Any, torch.Tensor, int]], flat: torch.Tensor) -> None:
        """Puts the compressed chunk's placeholders into the state (its tensors go, and their memory with them)."""
        self._flats.pop(_storage_key(flat), None)
        for st, key, v, off in items:
            ph = OffloadedTensor(chunk, off, v)
            chunk.entries.append((st, key, ph))
            st[key] = ph
        items.clear()
        self._chunks.append(chunk)

    @torch.no_grad()
    def _offload(self) -> None:
        """Compresses the state tensors of :meth:`_plan`, one frame per chunk, and puts placeholders in their place.
        The frames are raw (uncompressed, still offloaded) while the job's codec setting is "off" (``tzip set``);
        the requests count as the job's optimizer stream."""
        t0 = time.perf_counter()
        gpu: dict[int, list] = {}
        codec = self.client.job_codec(self.codec)
        plan = self._plan_unchanged()
        with tagged("optimizer"):
            for chunk, items, flat in plan if plan is not None else self._plan():
                if chunk.device.type == "cpu":
                    flat = flat if flat is not None else self._flat(chunk, items)
                    chunk.ct = self.client.compress(flat, codec=codec)
                    self._place(chunk, items, flat)
                    del flat
                else:
                    gpu.setdefault(chunk.device.index or 0, []).append((chunk, items, flat))
            for index, planned in gpu.items():
                self._copies.offload(index, planned, codec, self._flat, self._place, self.sm_budget)
        # Kept after a failure (strict, daemon away): the views still in the state are then offloaded next time.
        self._flats = {}
        self._timings["offload_s"] = time.perf_counter() - t0

    # --- restore ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _restore(self) -> None:
        """Decompresses every chunk and puts views of its flat buffer back into the state; all or nothing (an error
        leaves the state offloaded)."""
        t0 = time.perf_counter()
        chunks = [c for c in self._chunks if any(st.get(key) is ph for st, key, ph in c.entries)]
        cpu = [c for c in chunks if c.device.type == "cpu"]
        flats: list[tuple[_Chunk, torch.Tensor]] = []
        with tagged("optimizer"):
            if cpu:
                flats.extend(zip(cpu, self.client.decompress([c.ct for c in cpu])))
            gpu: dict[int, list[_Chunk]] = {}
            for c in chunks:
                if c.device.type != "cpu":
                    gpu.setdefault(c.device.index or 0, []).append(c)
            for index, cs in gpu.items():
                flats.extend(self._copies.restore(index, cs, self.sm_budget))
        for c, flat in flats:
            placed = {}
            for st, key, ph in c.entries:
                if st.get(key) is ph:
                    view = st[key] = ph.wrap(ph.view_of(flat))
                    placed[(id(st), key)] = (st, ph, view)
            self._flats[_storage_key(flat)] = (c, flat, placed)
        self._chunks = []
        self._timings["restore_s"] = time.perf_counter() - t0

    # --- helpers ------------------------------------------------------------------------------------------
    def _materialize(self, state: dict, clone: bool = True, on_device: bool = False) -> dict:
        """``{index: {key: value}}`` with OffloadedTensors as CPU tensors (their chunks decompressed in one request;
        ``on_device``: then copied to the tensor's own device, as the plain optimizer's state dict holds them) and,
        when ``clone``, other tensors cloned (a snapshot that later steps leave alone)."""
        self._copies.settle()
        chunks: dict[int, _Chunk] = {}
        for d in state.values():
            if isinstance(d, dict):
                for v in d.values():
                    if isinstance(v, OffloadedTensor):
                        chunks[id(v.chunk)] = v.chunk
        flats = {}
        if chunks:  # the frames are in host memory: decoded on the CPU
            with tagged("optimizer"):
                flats = dict(zip(chunks, self.client.decompress([c.ct for c in chunks.values()])))
        out: dict[Any, Any] = {}
        for i, d in state.items():
            if not isinstance(d, dict):
                out[i] = d
                continue
            nd = {}
            for k, v in d.items():
                if isinstance(v, OffloadedTensor):
                    t = v.view_of(flats[id(v.chunk)])
                    # (a DTensor's shard goes back to its own device: its mesh says where the shard lies)
                    move = (on_device or v.spec is not None) and v.device != t.device
                    nd[k] = v.wrap(t.to(v.device) if move else t.clone())
                elif isinstance(v, torch.Tensor) and clone:
                    nd[k] = v.detach().clone()
                else:
                    nd[k] = v
            out[i] = nd
        return out


class AttachedOffload:
    """Compressed offload switched on for an optimizer that a job already steps itself (``tzip.attach(optimizer=
    opt)``): the same offload as :class:`CompressedOffload`, done by hooks on ``optimizer`` instead of a wrapper, so
    the job's own ``opt.step()``, its LR schedulers and its checkpoint code go on unchanged.

    From construction on, ``optimizer.state`` holds :class:`OffloadedTensor` placeholders between steps (the state
    is offloaded at once); a step pre-hook (run before the other pre-hooks) restores the state and a step
    post-hook (run after the others) offloads it again, so the step, and every hook around it, sees plain tensors.
    ``optimizer.state_dict()`` holds plain tensors on their own devices (a state-dict post-hook decompresses the
    placeholders), as without the offload; ``load_state_dict`` drops the offloaded state and offloads the loaded
    one. Steps are bit-identical to the optimizer without it (see :class:`CompressedOffload`).

    :meth:`remove` switches it off: the state comes back uncompressed, each tensor in storage of its own as before,
    and the hooks go.

    Args: as :class:`CompressedOffload` (``codec``, ``client``, ``strict``, ``min_bytes``, ``chunk_bytes``).

    Raises:
        TypeError: ``optimizer`` is not a torch.optim.Optimizer, or is a CompressedOffload (already offloaded), or
            has parameters of a tensor subclass other than DTensor (as CompressedOffload).
        ValueError, DaemonUnavailableError: as :class:`CompressedOffload`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, codec: str | None = None, client: Client | None = None,
                 strict: bool = False, *, min_bytes: int = DEFAULT_MIN_BYTES,
                 chunk_bytes: int | None = DEFAULT_CHUNK_BYTES, sm_budget: int | None = None):
        if isinstance(optimizer, torch.optim.Optimizer) and optimizer_holding_state(optimizer) is not optimizer:
            # Hooks on a wrapper that runs none (AcceleratedOptimizer) failed after the state was offloaded, leaving
            # placeholders its next step crashed on: refused before anything changes (tzip.attach unwraps it).
            raise TypeError(f"AttachedOffload hooks the optimizer that holds the state, not a "
                            f"{type(optimizer).__name__} around it: pass tzip.optim.optimizer_holding_state(opt)")
        self.optimizer = optimizer
        # The offload's machinery (plan, chunks, pinned slabs, restore and offload): its step() is never called,
        # the optimizer's own step is, between the hooks below.
        self._engine = CompressedOffload(optimizer, codec, client, strict, min_bytes=min_bytes, chunk_bytes=chunk_bytes,
                                         sm_budget=sm_budget)
        pre = optimizer.register_step_pre_hook(self._before_step)
        optimizer._optimizer_step_pre_hooks.move_to_end(pre.id, last=False)  # first: other pre-hooks see tensors
        self._handles = [
            pre,
            optimizer.register_step_post_hook(self._after_step),
            optimizer.register_state_dict_post_hook(self._state_dict_post),
            optimizer.register_load_state_dict_pre_hook(self._load_pre),
            optimizer.register_load_state_dict_post_hook(self._load_post),
        ]
        self.removed = False

    @property
    def codec(self) -> str:
        return self._engine.codec

    @property
    def client(self) -> Client:
        return self._engine.client

    def offload_stats(self) -> dict[str, Any]:
        """:meth:`CompressedOffload.offload_stats` of this optimizer's state."""
        return self._engine.offload_stats()

    def _before_step(self, optimizer, args, kwargs) -> None:
        self._engine._restore()

    def _after_step(self, optimizer, args, kwargs) -> None:
        self._engine._offload()

    def _state_dict_post(self, optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        # torch's state dict shares the per-parameter dicts with optimizer.state: new dicts, placeholders decoded
        return {**state_dict, "state": self._engine._materialize(state_dict["state"], clone=False, on_device=True)}

    def _load_pre(self, optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        e = self._engine
        state = state_dict.get("state")
        if isinstance(state, dict) and any(isinstance(v, OffloadedTensor) for d in state.values() if isinstance(d, dict)
                                           for v in d.values()):
            state_dict = {**state_dict, "state": e._materialize(state, clone=False, on_device=True)}
        e._copies.settle()
        e._chunks = []
        e._flats = {}
        return state_dict

    def _load_post(self, optimizer) -> None:
        self._engine._offload()

    def remove(self) -> None:
        """Brings the state back uncompressed (each tensor in its own storage, with its dtype, shape, strides and
        device) and removes the hooks. Idempotent.

        Raises DaemonUnavailableError when frames of a codec other than raw cannot be decoded (no daemon); the
        offload then stays on (call it again once a daemon serves the socket)."""
        if self.removed:
            return
        e = self._engine
        e._restore()
        for _, _, placed in e._flats.values():
            for (_, key), (st, _, view) in placed.items():
                if st.get(key) is view:
                    # a view of the chunk's flat buffer (the client's shared memory for CPU state): a copy of its own
                    st[key] = view.clone(memory_format=torch.preserve_format)
        e._flats = {}
        e._copies.settle()
        for h in self._handles:
            h.remove()
        self._handles = []
        e._copies.release()
        self.removed = True

    def __repr__(self) -> str:
        return f"AttachedOffload({type(self.optimizer).__name__}, codec={self.codec!r}{', removed' if self.removed else ''})"
