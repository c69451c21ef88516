"""Inference with weights kept compressed in memory: each block's weights are decoded just before the block runs.

:func:`compress_model` turns the floating weights of a ``torch.nn.Module`` (a Hugging Face transformers model in
particular) into tzip frames held on the model's device, and hooks every *block* so that:

1. before the block's forward runs, its frames are decoded (one batched launch sequence of the in-process codec,
   :mod:`tzip._native`, on the GPU; the C++ core on the CPU) into a scratch buffer that all blocks share, and the
   block's parameters are pointed at views of it;
2. on a GPU, the block that ran after this one last time is decoded meanwhile on a side stream into the second half of
   the scratch buffer (prefetch), ordered by CUDA events only: nothing in the forward waits on the CPU;
3. after the block's forward, its parameters are pointed back at empty placeholders, so the decoded weights exist for
   one block (two with prefetch) at a time.

The outputs are bit-identical to the uncompressed model's: the codec is lossless and every decoded parameter has
the original's dtype, shape and (contiguous) strides, so every kernel sees the same bytes.

Blocks, by default: each element of every ``nn.ModuleList`` / ``nn.Sequential`` with parameters (transformer layers),
and each module outside those that owns parameters directly (embeddings, the LM head, a final norm), unless it has a
block inside it (then its direct parameters stay as they are). A parameter shared by two blocks (tied embedding and
LM head) is compressed once and decoded by each block that uses it.

What stays uncompressed: non-floating parameters, buffers, tensors below ``min_bytes``, and non-contiguous
parameters. What is refused (ValueError, nothing changed): sparse or quantized parameters of a block, a model already
compressed, blocks nested in one another, parameters on more than one device.

Limits, by design: the compressed parameters are for inference: they no longer require grad, and a forward that
builds an autograd graph through a block raises. Outside a block's forward a compressed parameter is an empty tensor
of its dtype (shape ``[0]``): code that reads a weight outside the module that owns it fails loudly instead of
computing with stale bytes. ``model.state_dict()`` returns the original tensors (decoded afresh).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from . import _native
from ._frame import DEFAULT_CHUNK

__all__ = ["compress_model", "load_compressed", "CompressedModel", "default_blocks"]


@dataclass
class _Weight:
    """One compressed parameter: its frame (a view of a block's frame buffer) and what it decodes to."""

    param: nn.Parameter
    name: str                   # a qualified name of it in the model (the first, when tied)
    dtype: torch.dtype
    shape: torch.Size
    nbytes: int
    frame: torch.Tensor | None = None  # 1-D uint8 view, exactly the frame's bytes


@dataclass
class _Block:
    module: nn.Module
    name: str
    weights: list[_Weight]
    offsets: list[int] = field(default_factory=list)  # byte offset of each weight in a scratch slot
    bytes: int = 0                                    # bytes of a scratch slot this block uses
    plans: list = field(default_factory=list)         # per slot: _native.DecodePlan (GPU)
    errors: torch.Tensor | None = None                # per-frame error codes of the last decode (GPU, int32)
    handles: list = field(default_factory=list)
    views: dict = field(default_factory=dict)         # slot -> the weights' views into that slot, made once


def default_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks :func:`compress_model` uses when none are named, as (qualified name, module) pairs: the elements of
    every ``nn.ModuleList`` / ``nn.Sequential`` (not descending into an element), then each other module that owns
    parameters directly and has no such element inside it. Modules without parameters are left out."""
    blocks: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()

    def has_params(m: nn.Module) -> bool:
        return next(m.parameters(), None) is not None

    def visit(prefix: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            q = f"{prefix}.{name}" if prefix else name
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                for el_name, el in child.named_children():
                    eq = f"{q}.{el_name}"
                    if isinstance(el, (nn.ModuleList, nn.ModuleDict)):
                        visit(eq, el)  # a container has no forward of its own: its elements are the blocks
                    elif has_params(el):
                        blocks.append((eq, el))
                        inside.update(id(x) for x in el.modules())
            else:
                visit(q, child)

    if isinstance(model, (nn.ModuleList, nn.Sequential)):
        visit("", nn.ModuleDict({"_": model}))
        blocks = [(n.removeprefix("_."), m) for n, m in blocks]
    else:
        visit("", model)
    block_ids = {id(m) for _, m in blocks}
    for name, m in model.named_modules():
        if id(m) in inside or not any(True for _ in m.parameters(recurse=False)):
            continue
        if any(id(d) in block_ids for d in m.modules()):
            continue  # its direct parameters are used around the blocks inside it: they stay resident
        blocks.append((name, m))
        inside.update(id(x) for x in m.modules())
    return blocks


class CompressedModel:
    """What :func:`compress_model` returns (also at ``model.tzip_compressed``): the figures and the way back.

    ``stats``: ``tensors`` (compressed parameters), ``blocks``, ``original_bytes`` (their bytes before),
    ``compressed_bytes`` (the frames' bytes, 256-byte aligned as held), ``scratch_bytes`` (the shared decode buffer),
    ``freed_bytes`` = original - compressed - scratch, ``ratio`` = compressed / original, ``codec``, ``device``.
    """

    def __init__(self, model: nn.Module, blocks: list[_Block], device: torch.device, codec: str, prefetch: bool,
                 sm_budget: int, verify: bool):
        self._model = weakref.ref(model)
        self._blocks = blocks
        self._by_module = {id(b.module): b for b in blocks}
        self.device = device
        self.codec = codec
        self.prefetch = prefetch and device.type == "cuda"
        self.sm_budget = sm_budget
        self.verify = verify
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self._active: _Block | None = None
        self._last: _Block | None = None
        self._cur_slot = 1
        self._next: dict[int, _Block] = {}      # id(block module) -> the block that ran after it last time
        self._pending: tuple[_Block, int] | None = None  # prefetched block and its slot
        self._scratch: torch.Tensor | None = None
        self._graph_slot: int | None = None     # the slot of CUDA graph captures (compress_model(cuda_graphs=True))
        self._state_hooks: list = []
        self._threads = max(1, os.cpu_count() or 1)
        if device.type == "cuda":
            self._side = torch.cuda.Stream(device)
            self._free_ev = [torch.cuda.Event(), torch.cuda.Event()]
            self._done_ev = [torch.cuda.Event(), torch.cuda.Event()]
        self.stats: dict = {}

    # ------------------------------------------------------------------------------------------------ public

    def check(self) -> None:
        """Waits for the device and raises :class:`tzip._native.NativeCodecError` if the last decode of any block
        reported an error for one of its frames (the code of the first such frame, naming the parameter)."""
        if self.device.type != "cuda":
            return  # CPU decodes raise at once
        torch.cuda.synchronize(self.device)
        for b in self._blocks:
            if b.errors is None:
                continue
            bad = torch.nonzero(b.errors).flatten().tolist()
            if bad:
                i = bad[0]
                raise _native.NativeCodecError(_native.code_name(b.errors[i]),
                                               f"decoding {b.weights[i].name} in block {b.name!r}", i)

    def decompress(self) -> nn.Module:
        """Restores every compressed parameter as an ordinary tensor (decoded once more, bit-identical), removes the
        hooks and frees the frames and the scratch buffer. Returns the model."""
        model = self._model()
        seen: dict[int, torch.Tensor] = {}
        for b in self._blocks:
            for w in b.weights:
                if id(w.param) not in seen:
                    seen[id(w.param)] = self._decode_one(w)
        for b in self._blocks:
            for h in b.handles:
                h.remove()
            for w in b.weights:
                w.param.data = seen[id(w.param)]
        for h in self._state_hooks:
            h.remove()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            for b in self._blocks:
                for p in b.plans:
                    p.close()
        # Every reference to a block goes, or its frames stay allocated for as long as this object lives.
        self._blocks, self._by_module, self._next = [], {}, {}
        self._last = self._pending = None
        self._scratch = None
        if model is not None and getattr(model, "tzip_compressed", None) is self:
            del model.tzip_compressed
        return model

    # ------------------------------------------------------------------------------------------------ decoding

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        p = self._placeholders.get(dtype)
        if p is None:
            p = self._placeholders[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return p

    def _view(self, slot: int, b: _Block, i: int) -> torch.Tensor:
        w = b.weights[i]
        start = slot * self._slot_bytes + b.offsets[i]
        return self._scratch[start: start + w.nbytes].view(w.dtype).view(w.shape)

    def _decode_block(self, b: _Block, slot: int, stream) -> None:
        if self.device.type == "cuda":
            b.plans[slot].run(stream.cuda_stream)
        else:
            for i, w in enumerate(b.weights):
                _native.cpu_decode(w.frame, self._view(slot, b, i), self.verify, self._threads)

    def _decode_one(self, w: _Weight) -> torch.Tensor:
        """A fresh tensor with the weight's original contents."""
        out = torch.empty(w.shape, dtype=w.dtype, device=self.device)
        if self.device.type == "cuda":
            arrays = _native.PointerArrays([w.frame.data_ptr()], [w.frame.numel()], [out.data_ptr()], [w.nbytes])
            err = torch.zeros(1, dtype=torch.int32, device=self.device)
            stream = torch.cuda.current_stream(self.device)
            _native.gpu_decode(arrays, err, stream.cuda_stream, self.sm_budget, True)
            if int(err[0]):  # synchronises
                raise _native.NativeCodecError(_native.code_name(err[0]), f"decoding {w.name}")
        else:
            _native.cpu_decode(w.frame, out, True, self._threads)
        return out

    # ------------------------------------------------------------------------------------------------ hooks

    def _other(self, slot: int) -> int:
        """The slot a block decodes into when the last block used ``slot``: the other one with prefetch (the two
        alternate), else the only one (stream order keeps the previous block's kernels before the decode)."""
        return 1 - slot if self.prefetch else 0

    def _pre(self, module: nn.Module, args, kwargs):
        b = self._by_module[id(module)]
        if self._active is not None:
            raise RuntimeError(f"tzip.inference: block {b.name!r} ran inside block {self._active.name!r}; blocks must "
                               "not nest (name other blocks with compress_model(blocks=...))")
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in (*args, *kwargs.values())):
            raise RuntimeError(f"tzip.inference: block {b.name!r} got inputs that require grad; a compressed model is "
                               "for inference (run it under torch.no_grad() or torch.inference_mode())")
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # CUDA graph capture (torch.cuda.graph synchronises the device first, so no prefetch is in flight): the
            # graph gets this block's decode on the capturing stream itself (a prefetch on another stream would leave
            # that stream unjoined at the end of capture), into a slot of its own: a replay runs whenever the caller
            # says, so it must never write a slot that eager forwards use (a prefetched block waiting there would be
            # overwritten). The eager state (prefetch, order) is left as it was.
            if self._graph_slot is None:
                raise RuntimeError("tzip.inference: a forward is being captured in a CUDA graph; compress the model "
                                   "with compress_model(..., cuda_graphs=True) so that graphs get a scratch slot of "
                                   "their own")
            self._decode_block(b, self._graph_slot, torch.cuda.current_stream(self.device))
            self._bind(b, self._graph_slot)
            return None
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            pending, self._pending = self._pending, None
            if pending is not None and pending[0] is b:
                slot = pending[1]
                stream.wait_event(self._done_ev[slot])
            else:
                if pending is not None:  # a prefetch that guessed wrong still writes the other slot: wait for it
                    stream.wait_event(self._done_ev[pending[1]])
                slot = self._other(self._cur_slot)
                self._decode_block(b, slot, stream)
        else:
            slot = 0  # decoded at once, in the caller's thread: one slot
            self._decode_block(b, slot, None)
        self._bind(b, slot)
        self._cur_slot = slot
        if self._last is not None and self._last is not b:
            self._next[id(self._last.module)] = b
        self._last = b
        nb = self._next.get(id(module))
        if self.prefetch and nb is not None and nb is not b:
            # The other slot holds the block before this one, whose kernels are all queued before this point.
            other = 1 - slot
            self._free_ev[other].record(stream)
            self._side.wait_event(self._free_ev[other])
            self._decode_block(nb, other, self._side)
            self._done_ev[other].record(self._side)
            self._pending = (nb, other)
        return None

    def _bind(self, b: _Block, slot: int) -> None:
        """Points the block's parameters at their decoded bytes in ``slot``."""
        views = b.views.get(slot)
        if views is None:  # made once per block and slot: three tensor ops a weight per forward are a token's CPU time
            views = b.views[slot] = [self._view(slot, b, i) for i in range(len(b.weights))]
        for w, v in zip(b.weights, views):
            w.param.data = v
        self._active = b

    def _post(self, module: nn.Module, args, kwargs, output):
        b = self._by_module[id(module)]
        for w in b.weights:
            w.param.data = self._placeholder(w.dtype)
        self._active = None
        return None

    def _state_dict_hook(self, owned: dict[str, _Weight]):
        def hook(module, state_dict, prefix, local_metadata):
            for local, w in owned.items():
                key = prefix + local
                if key in state_dict:
                    state_dict[key] = self._decode_one(w)
        return hook


def _eligible(p: nn.Parameter, min_bytes: int) -> bool:
    return p.is_floating_point() and p.layout == torch.strided and p.is_contiguous() and \
        p.numel() * p.element_size() >= min_bytes


def compress_model(model: nn.Module, codec: str = "fast", *, blocks: list | None = None, min_bytes: int = 16384,
                   prefetch: bool = True, sm_budget: int = 0, verify: bool = False, cuda_graphs: bool = False,
                   chunk_bytes: int = DEFAULT_CHUNK) -> CompressedModel:
    """Keeps ``model``'s floating weights compressed in memory on their device and decodes each block's weights just
    before it runs (module docstring). Works in place and returns the :class:`CompressedModel` handle, also set as
    ``model.tzip_compressed``.

    Args:
        model: a module whose parameters all lie on one device (a CUDA GPU, or the CPU).
        codec: ``"fast"`` (fixed-width exponent codes: the fastest decode), ``"max"`` (rANS: smallest), ``"auto"``
            (per tensor, from the data) or ``"bytes"`` / ``"raw"``.
        blocks: the modules to decode one at a time (modules, or qualified names as in ``named_modules()``); default
            :func:`default_blocks`. They must not nest.
        min_bytes: parameters smaller than this stay uncompressed (norms, biases: their decode would cost more time
            than their bytes are worth). Default 16 KiB.
        prefetch: on a GPU, decode the next block on a side stream while this one computes (two scratch slots).
        sm_budget: SMs each decode may occupy (<= 0: all).
        cuda_graphs: the forward may be captured in CUDA graphs (``torch.cuda.graph``,
            ``torch.compile(mode="reduce-overhead")``): one more scratch slot, for the captured decodes alone, so that a
            replay never overwrites what eager forwards prefetched. A capture without it raises RuntimeError.
        verify: check every chunk digest at every decode (the frames are checked once at compression anyway, and
            every round trip is compared by bytes then).
        chunk_bytes: the frames' chunk size (docs/format.md).

    Raises:
        ValueError: the model is compressed already, its parameters lie on several devices, a named block is not a
            submodule or blocks nest, or a block has a sparse or quantized parameter.
        tzip._native.NativeCodecError: the in-process codec library is missing (TZIP_UNSUPPORTED) or failed; the model is
            then unchanged.
    """
    if getattr(model, "tzip_compressed", None) is not None:
        raise ValueError("tzip.inference.compress_model: this model is compressed already "
                         "(model.tzip_compressed.decompress() first)")
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(f"tzip.inference.compress_model: parameters lie on several devices {sorted(map(str, devices))}")
    if not devices:
        raise ValueError("tzip.inference.compress_model: the model has no parameters")
    device = devices.pop()
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"tzip.inference.compress_model: parameters on {device}: only CUDA and CPU are supported")
    _native.codec_id(codec)  # ValueError for an unknown name
    _native.library()       # a missing library raises before anything changes

    plan, weights = _blocks_and_weights(model, blocks, min_bytes)
    order = list(weights.values())

    # ---- encode (the model stays unchanged until every frame is made and checked)
    frames = _encode(order, codec, device, chunk_bytes, sm_budget)
    for w, f in zip(order, frames):
        w.frame = f
    cm = _prepared(model, plan, device, codec, prefetch, sm_budget, verify, cuda_graphs)
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    for b in plan:  # every frame decodes back to the parameter's bytes before any parameter is touched
        cm._decode_block(b, 0, stream)
        for i, w in enumerate(b.weights):
            if not torch.equal(cm._view(0, b, i).reshape(-1).view(torch.uint8),
                               w.param.detach().reshape(-1).view(torch.uint8)):
                raise _native.NativeCodecError("TZIP_INTERNAL", f"round trip of {w.name} differs from the original")
    cm.check()
    return _switch_over(model, cm, weights)


def load_compressed(model: nn.Module, path, device="cuda", *, blocks: list | None = None, min_bytes: int = 16384,
                    prefetch: bool = True, sm_budget: int = 0, verify: bool = False,
                    cuda_graphs: bool = False) -> CompressedModel:
    """Loads the weights of a ``.tzip`` file (``tzip compress`` of the model's safetensors file, or
    :func:`tzip.files.compress_file`), or of a folder of shards (``tzip compress DIR`` of a sharded Hugging Face
    checkpoint: :func:`tzip.files.folder_shards`), into ``model`` on ``device`` and keeps them compressed there, as
    :func:`compress_model` would have, without ever holding the decoded model on the device: the frames of the weights
    that stay compressed are copied from the file as they are (with the file's codec and chunk size), every other
    parameter is decoded onto the device, and the buffers are moved there. The peak memory on the device is the frames,
    the uncompressed parameters, the buffers and the scratch slots: a model whose bf16 weights do not fit the GPU
    can be loaded and run if its frames do.

    ``model`` is the architecture with any parameter values, on the CPU or the ``meta`` device (e.g. built under
    ``torch.device("meta")``); its buffers must hold real values (a ``meta`` buffer is refused: a model built on the
    CPU has them). Each parameter is matched to the file's tensor of one of its names (``named_parameters`` with
    duplicates, so a tied LM head finds the embedding's tensor) and must have its dtype and shape there.

    Args:
        model: the module to fill; ``model.tzip_compressed`` is set as by compress_model.
        path: the ``.tzip`` file, or the folder. device: ``"cuda"``, ``"cuda:N"``, a torch.device, or ``"cpu"``.
        blocks, min_bytes, prefetch, sm_budget, verify, cuda_graphs: as :func:`compress_model`.

    Returns the :class:`CompressedModel` handle (``stats["codec"]`` is ``"file"``).

    Raises:
        ValueError: a parameter has no tensor in the file, or one of another dtype or shape; a buffer is on the meta
            device; a tensor name in two shards; and what compress_model raises for blocks (and folder_shards for
            a folder).
        tzip._container.ContainerError (a ValueError): the file is damaged (its codes as tzip.files.load_file),
            naming the tensor; every frame is decoded once, all digests checked, before the model is touched.
        tzip._native.NativeCodecError: the library is missing, or a CUDA failure.
    """
    from contextlib import ExitStack
    from pathlib import Path
    from ._container import ContainerError, ContainerReader, SAFETENSORS_DTYPES, reinterpret
    from .files import _device, folder_shards
    dev = _device(device)
    if getattr(model, "tzip_compressed", None) is not None:
        raise ValueError("tzip.inference.load_compressed: this model is compressed already")
    for n, b in model.named_buffers():
        if b.is_meta:
            raise ValueError(f"tzip.inference.load_compressed: buffer {n!r} is on the meta device; build the model "
                             "on the CPU (its buffers are computed at construction), then load")
    _native.library()
    plan, weights = _blocks_and_weights(model, blocks, min_bytes)
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
        params[id(p)] = p
    threads = max(1, os.cpu_count() or 1)
    loaded: dict[int, torch.Tensor] = {}  # id(parameter) -> its decoded tensor on dev (the uncompressed ones)
    source: dict[int, tuple] = {}  # id(weight kept compressed) -> (its file, its tensor name), for errors
    files = folder_shards(Path(path))[0] if Path(path).is_dir() else [Path(path)]
    with ExitStack() as opened:
        by_name: dict[str, tuple] = {}  # tensor name -> (its shard's reader, entry)
        for f in files:
            reader = opened.enter_context(ContainerReader(f))
            for e in reader.entries:
                if e.kind != "tensor":
                    continue
                if e.name in by_name:
                    raise ValueError(f"tzip.inference.load_compressed: tensor {e.name!r} is in "
                                     f"{by_name[e.name][0].path} and in {reader.path}")
                by_name[e.name] = (reader, e)
        for pid, p in params.items():
            found = next((by_name[n] for n in names[pid] if n in by_name), None)
            if found is None:
                raise ValueError(f"tzip.inference.load_compressed: parameter {names[pid][0]!r} has no tensor in "
                                 f"{path}")
            reader, e = found
            if e.file_dtype != SAFETENSORS_DTYPES.get(p.dtype) or tuple(e.file_shape) != tuple(p.shape):
                raise ValueError(f"tzip.inference.load_compressed: parameter {names[pid][0]!r} is {p.dtype} "
                                 f"{list(p.shape)}, the file's tensor {e.name!r} is {e.file_dtype} {list(e.file_shape)}")
            frame = reader.read_frame(e)
            w = weights.get(pid)
            if w is not None and (e.dtype, tuple(e.shape)) == (e.file_dtype, tuple(e.file_shape)):
                w.frame = frame.to(dev)  # kept compressed: decodes straight to the parameter's bytes
                source[id(w)] = (reader.path, e.name)
                continue
            # Decoded now: a parameter that stays uncompressed (or a frame in another codec layout, which a plan
            # would not decode into the parameter's own dtype and shape).
            flat = torch.empty(e.nbytes, dtype=torch.uint8)
            try:
                _native.cpu_decode(frame, flat, True, threads)
            except _native.NativeCodecError as err:
                raise ContainerError(err.code, err.detail, reader.path, e.name) from None
            loaded[pid] = reinterpret(flat, p.dtype, p.shape).to(dev)
            if w is not None:
                w.frame = None
    # Weights whose frame could not be kept become ordinary parameters (loaded above).
    for b in plan:
        b.weights = [w for w in b.weights if w.frame is not None]
    plan = [b for b in plan if b.weights]
    weights = {pid: w for pid, w in weights.items() if w.frame is not None}
    if not plan:
        raise ValueError("tzip.inference.load_compressed: no parameter to keep compressed")
    cm = _prepared(model, plan, dev, "file", prefetch, sm_budget, verify, cuda_graphs)
    for w in weights.values():  # every frame decoded once, digests checked, before the model is touched
        try:
            cm._decode_one(w)
        except _native.NativeCodecError as err:
            raise ContainerError(err.code, err.detail, *source[id(w)]) from None
    # Swapped rather than assigned through .data: a meta parameter cannot take a real tensor that way. The Parameter
    # objects stay the ones the modules (and tied names) hold.
    for pid, t in loaded.items():
        torch.utils.swap_tensors(params[pid], nn.Parameter(t, requires_grad=params[pid].requires_grad))
    for w in weights.values():
        torch.utils.swap_tensors(w.param, nn.Parameter(torch.empty(0, dtype=w.dtype, device=dev), requires_grad=False))
    for m in model.modules():
        for n, b in m.named_buffers(recurse=False):
            m._buffers[n] = b.to(dev)
    return _switch_over(model, cm, weights)


def _blocks_and_weights(model: nn.Module, blocks, min_bytes: int) -> tuple[list[_Block], dict[int, _Weight]]:
    """The blocks (``blocks=`` of compress_model, or default_blocks) and, per block, the parameters to keep
    compressed (id(parameter) -> _Weight; a parameter shared by blocks is one weight). Raises ValueError as
    compress_model says."""
    if blocks is None:
        chosen = default_blocks(model)
    else:
        names = {id(m): n for n, m in model.named_modules()}
        mods = dict(model.named_modules())
        chosen = []
        for x in blocks:
            if isinstance(x, str):
                if x not in mods:
                    raise ValueError(f"tzip.inference.compress_model: no submodule named {x!r}")
                chosen.append((x, mods[x]))
            elif isinstance(x, nn.Module) and id(x) in names:
                chosen.append((names[id(x)], x))
            else:
                raise ValueError(f"tzip.inference.compress_model: block {x!r} is not a submodule of the model")
    ids = {id(m) for _, m in chosen}
    for name, m in chosen:
        for sub_name, sub in m.named_modules():
            if sub is not m and id(sub) in ids:
                raise ValueError(f"tzip.inference.compress_model: block {name!r} contains block "
                                 f"{name + '.' + sub_name if name else sub_name!r}; blocks must not nest")
    qual = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        qual.setdefault(id(p), n)
    weights: dict[int, _Weight] = {}
    plan: list[_Block] = []
    for name, m in chosen:
        ws = []
        for pn, p in m.named_parameters():  # unique within the block
            if p.is_sparse or p.layout != torch.strided or p.is_quantized:
                raise ValueError(f"tzip.inference.compress_model: parameter {qual.get(id(p), pn)!r} is "
                                 f"{'quantized' if p.is_quantized else 'sparse'} ({p.layout}); only dense tensors "
                                 "can be kept compressed (leave its module out of blocks=)")
            if not _eligible(p, min_bytes):
                continue
            w = weights.get(id(p))
            if w is None:
                w = weights[id(p)] = _Weight(p, qual.get(id(p), pn), p.dtype, p.shape, p.numel() * p.element_size())
            ws.append(w)
        if ws:
            plan.append(_Block(m, name, ws))
    if not plan:
        raise ValueError("tzip.inference.compress_model: no parameter to compress (all below min_bytes, "
                         "non-floating or non-contiguous)")
    return plan, weights


def _prepared(model: nn.Module, plan: list[_Block], device: torch.device, codec: str, prefetch: bool,
              sm_budget: int, verify: bool, cuda_graphs: bool) -> CompressedModel:
    """The handle over ``plan``'s weights, whose frames are set: scratch slots, each block's offsets in a slot and
    (GPU) its decode plan per slot. Touches no parameter."""
    slot_bytes = 0
    for b in plan:
        off = 0
        for w in b.weights:
            b.offsets.append(off)
            off += _native.align(w.nbytes)
        b.bytes = off
        slot_bytes = max(slot_bytes, off)
    cm = CompressedModel(model, plan, device, codec, prefetch, sm_budget, verify)
    slots = 2 if cm.prefetch else 1
    if cuda_graphs and device.type == "cuda":
        cm._graph_slot = slots
        slots += 1
    cm._slot_bytes = slot_bytes
    cm._scratch = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=device)
    for b in plan:
        if device.type == "cuda":
            b.errors = torch.zeros(len(b.weights), dtype=torch.int32, device=device)
            for s in range(slots):
                base = cm._scratch.data_ptr() + s * slot_bytes
                arrays = _native.PointerArrays(
                    [w.frame.data_ptr() for w in b.weights], [w.frame.numel() for w in b.weights],
                    [base + o for o in b.offsets], [w.nbytes for w in b.weights])
                b.plans.append(_native.DecodePlan(arrays, b.errors, sm_budget, verify,
                                                  tensors=(cm._scratch, *(w.frame for w in b.weights))))
    return cm


def _switch_over(model: nn.Module, cm: CompressedModel, weights: dict[int, _Weight]) -> CompressedModel:
    """Parameters to placeholders, hooks on, statistics; the handle set as ``model.tzip_compressed``."""
    plan, order = cm._blocks, list(weights.values())
    original = sum(w.nbytes for w in order)
    held = sum(_native.align(w.frame.numel()) for w in order)
    for w in order:
        w.param.requires_grad_(False)
        w.param.data = cm._placeholder(w.dtype)
    for b in plan:
        b.handles.append(b.module.register_forward_pre_hook(cm._pre, with_kwargs=True))
        b.handles.append(b.module.register_forward_hook(cm._post, with_kwargs=True, always_call=True))
    owners: dict[int, tuple[nn.Module, dict[str, _Weight]]] = {}
    for m in model.modules():
        for local, p in m.named_parameters(recurse=False):
            if id(p) in weights:
                owners.setdefault(id(m), (m, {}))[1][local] = weights[id(p)]
    for m, owned in owners.values():
        cm._state_hooks.append(m.register_state_dict_post_hook(cm._state_dict_hook(owned)))
    scratch = cm._scratch.numel()
    cm.stats = {"tensors": len(order), "blocks": len(plan), "original_bytes": original, "compressed_bytes": held,
                "scratch_bytes": scratch, "freed_bytes": original - held - scratch,
                "ratio": held / original if original else 1.0, "codec": cm.codec, "device": str(cm.device)}
    model.tzip_compressed = cm
    return cm


def _encode(order: list[_Weight], codec: str, device: torch.device, chunk_bytes: int,
            sm_budget: int) -> list[torch.Tensor]:
    """One frame per weight, each its own exactly sized uint8 tensor on ``device``."""
    if device.type == "cpu":
        threads = max(1, os.cpu_count() or 1)
        return [_native.cpu_encode(w.param.detach(), codec, chunk_bytes, threads) for w in order]
    out: list[torch.Tensor] = []
    # Batches of up to 1 GiB of input: one launch sequence each, frames compacted into exactly sized buffers.
    batch: list[_Weight] = []
    budget = 1 << 30

    def flush():
        if not batch:
            return
        buf, spans = _native.gpu_encode_frames([w.param.detach() for w in batch], codec, chunk_bytes, sm_budget)
        out.extend(buf[o: o + n].clone() for o, n in spans)
        batch.clear()

    acc = 0
    for w in order:
        if batch and acc + w.nbytes > budget:
            flush()
            acc = 0
        batch.append(w)
        acc += w.nbytes
    flush()
    return out

