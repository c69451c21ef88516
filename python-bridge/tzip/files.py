"""``.tzip`` files through the in-process codec (libtzip.so, :mod:`tzip._native`): no daemon, CPU or GPU.

:func:`compress_file` writes what ``tzip compress`` writes for a safetensors file (the same bytes, any thread count,
CPU or GPU encoder); :func:`load_file` reads one back as ``safetensors.torch.load_file`` would read the original,
straight onto a GPU: the *compressed* frames cross the disk and PCIe and are decoded on the GPU. :func:`load_folder`
reads a checkpoint folder that ``tzip compress DIR`` wrote (one ``.tzip`` per safetensors shard, the index kept) as a
sharded loader reads the original folder. The container format is docs/container.md; its reading and checks are
:class:`tzip._container.ContainerReader`'s.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import torch

from . import _native
from ._container import ContainerReader, ContainerWriter, atomic_file, reinterpret, torch_dtype_of
from ._safetensors_header import ContainerError, parse_header_length

__all__ = ["compress_file", "load_file", "load_folder", "folder_shards"]


def _device(device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device {dev}: only CUDA and CPU")
    return dev


def _batches(items: list, size_of, limit: int) -> list[list]:
    out, cur, size = [], [], 0
    for it in items:
        if cur and size + _native.align(size_of(it)) > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += _native.align(size_of(it))
    if cur:
        out.append(cur)
    return out


def compress_file(src, dst, codec: str = "auto", device="cpu", *, chunk_bytes: int = 65536,
                  batch_bytes: int = 256 << 20) -> int:
    """Compresses the safetensors file ``src`` into the ``.tzip`` file ``dst`` (written atomically): byte for byte
    what ``tzip compress SRC -o DST --codec CODEC`` writes, its header bytes kept verbatim.

    Args:
        codec: auto, fast, max, bytes or raw, for every tensor (other dtypes than bf16/fp16/fp32 get bytes).
        device: ``"cpu"`` (the C++ encoder on every core) or a CUDA device (the GPU encoder, one launch sequence per
            batch of ``batch_bytes``).

    Returns the size of ``dst`` in bytes. Raises ContainerError for a damaged ``src`` (its header is checked as the
    CLI checks it), ValueError for an unknown codec, OSError from reading or writing, NativeCodecError from the codec.
    """
    dev = _device(device)
    _native.codec_id(codec)
    with open(src, "rb") as f:
        data = f.read()
    n = parse_header_length(data[:8], len(data), src)
    header_bytes = data[: 8 + n]
    body = torch.frombuffer(bytearray(data[8 + n:]), dtype=torch.uint8) if len(data) > 8 + n else \
        torch.empty(0, dtype=torch.uint8)
    del data
    threads = max(1, os.cpu_count() or 1)
    with atomic_file(dst) as fd:
        w = ContainerWriter(fd, header_bytes, body.numel(), dst)

        def view(e) -> torch.Tensor:  # the entry's bytes as the codec sees them (its codec dtype and shape)
            dt = torch_dtype_of(e.dtype)
            b = body[e.begin: e.end]
            # torch views bytes as wider elements only at a multiple of their size; safetensors offsets need not be
            # one (a C64 tensor, coded as F32 pairs, after an odd-sized tensor): such a tensor is copied.
            return (b if e.begin % dt.itemsize == 0 else b.clone()).view(dt).reshape(e.shape)

        if dev.type == "cpu":
            for e in w.entries:
                w.write_frame(_native.cpu_encode(view(e), codec, chunk_bytes, threads))
        else:
            for batch in _batches(w.entries, lambda e: e.nbytes, batch_bytes):
                buf, spans = _native.gpu_encode_frames([view(e).to(dev) for e in batch], codec, chunk_bytes)
                host = buf.cpu()
                for o, n in spans:
                    w.write_frame(host[o: o + n])
        return w.finish()


def load_file(path, device="cuda", *, verify: bool = True, batch_bytes: int = 256 << 20) -> dict[str, torch.Tensor]:
    """Reads a ``.tzip`` file (``tzip compress`` of a safetensors file) into a dict of tensors by name on ``device``,
    decoded in this process: no daemon. On a GPU the *compressed* frames cross the disk and PCIe (read into pinned
    memory, copied while the previous batch decodes) and are decoded there; on the CPU by the C++ core.

    Like ``safetensors.torch.load_file(path, device)``: the same names, dtypes, shapes and bytes as the safetensors
    file that was compressed (data-section order). Every frame header is checked against the file's index before
    anything is copied, and (``verify``) every chunk digest and checksum at decode.

    Args:
        path: the ``.tzip`` file. device: ``"cuda"``, ``"cuda:N"``, a torch.device, or ``"cpu"``.
        verify: check chunk digests (header digests and checksums are always checked).
        batch_bytes: compressed bytes per copy-and-decode batch (two pinned buffers of this size; a larger frame gets
            a batch of its own).

    Raises:
        tzip._container.ContainerError (a ValueError): the file is damaged (TZIP_CORRUPT, TZIP_TRUNCATED,
            TZIP_CHECKSUM, TZIP_UNSUPPORTED), naming the file and the tensor; nothing is returned.
        tzip._native.NativeCodecError: the library is missing, or a CUDA failure.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    out: dict[str, torch.Tensor] = {}
    with ContainerReader(path) as reader:
        entries = [e for e in reader.entries if e.kind == "tensor"]
        dtypes = {}
        for e in entries:
            dt = torch_dtype_of(e.file_dtype)
            if dt is None:
                raise ContainerError("TZIP_UNSUPPORTED", f"safetensors dtype {e.file_dtype} has no torch dtype here",
                                     reader.path, e.name)
            dtypes[e.name] = dt
        # Decoded tensors in the frames' layout (the codec dtype and shape), seen as the file's dtype at the end.
        flat = {e.name: torch.empty(e.nbytes, dtype=torch.uint8, device=dev) for e in entries}
        if dev.type == "cpu":
            threads = max(1, os.cpu_count() or 1)
            for e in entries:
                frame = reader.read_frame(e)
                try:
                    _native.cpu_decode(frame, flat[e.name], verify, threads)
                except _native.NativeCodecError as err:
                    raise ContainerError(err.code, err.detail, reader.path, e.name) from None
        else:
            _load_gpu(reader, entries, flat, dev, verify, batch_bytes)
        for e in entries:
            out[e.name] = reinterpret(flat[e.name], dtypes[e.name], e.file_shape)
    return out


_INDEX = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME
_INDEX_SUFFIX = ".safetensors.index.json"


def _folder_index(folder: Path) -> Path | None:
    """The folder's index: ``model.safetensors.index.json``, else its only ``*.safetensors.index.json`` (diffusers names
    its own), else None. Several others and no ``model.`` one are ambiguous: refused rather than guessed."""
    if (folder / _INDEX).is_file():
        return folder / _INDEX
    found = sorted(p for p in folder.iterdir() if p.name.endswith(_INDEX_SUFFIX) and p.is_file())
    if len(found) > 1:
        raise ValueError(f"{folder}: several indexes ({', '.join(p.name for p in found)}) and no {_INDEX}: load the "
                         f"shards of the one you mean with load_file")
    return found[0] if found else None


def load_folder(path, device="cpu", *, verify: bool = True, batch_bytes: int = 256 << 20) -> dict[str, torch.Tensor]:
    """Reads a checkpoint folder that ``tzip compress DIR -o PATH`` wrote into one dict of every tensor of every shard
    on ``device``: what a sharded loader (transformers) sees of the original folder, and what
    ``safetensors.torch.load_file`` of each original shard gives, merged. Each shard is read as :func:`load_file`
    reads it.

    With an index (``model.safetensors.index.json``, carried unchanged by tzip, naming each tensor's shard by its
    safetensors name ``NAME.safetensors``, read from ``NAME.tzip``), the index and the shards must agree: every tensor
    it names is in the shard it names, and in no other, and no shard holds a tensor it does not name. Without one,
    every ``*.tzip`` file of the folder is a shard and a tensor name may appear in only one.

    Args:
        path: the folder. device: ``"cpu"`` (default), ``"cuda"``, ``"cuda:N"`` or a torch.device.
        verify, batch_bytes: as :func:`load_file`, for every shard.

    Raises:
        FileNotFoundError: the folder, or a shard the index names, is missing.
        tzip._container.ContainerError (a ValueError): a damaged shard (as :func:`load_file`), or an index that
            disagrees with the shards (TZIP_CORRUPT, naming the index and the tensor).
        ValueError: an index that is not a ``weight_map`` of names to ``NAME.safetensors``, or a folder without shards.
    """
    folder = Path(path)
    shards, index, weight_map = folder_shards(folder)
    out: dict[str, torch.Tensor] = {}
    if index is None:
        where: dict[str, str] = {}
        for shard in shards:
            for name, t in load_file(shard, device, verify=verify, batch_bytes=batch_bytes).items():
                if name in where:
                    raise ContainerError("TZIP_CORRUPT", f"also in {where[name]}: a tensor may be in one shard only",
                                         shard, name)
                where[name] = shard.name
                out[name] = t
        return out
    for tz in shards:
        shard = tz.name[: -len(".tzip")] + ".safetensors"
        for name, t in load_file(tz, device, verify=verify, batch_bytes=batch_bytes).items():
            named = weight_map.get(name)
            if named != shard:
                # Found in a shard the index does not name for it: a second copy, or a tensor the index left out.
                raise ContainerError("TZIP_CORRUPT", f"is in {tz.name}, but the index names "
                                     f"{named if named is not None else 'no shard'} for it", index, name)
            out[name] = t
    missing = [name for name in weight_map if name not in out]
    if missing:
        raise ContainerError("TZIP_CORRUPT", f"not in its shard {weight_map[missing[0]]} "
                             f"({len(missing)} tensors the index names are missing)", index, missing[0])
    return out


def folder_shards(folder: Path) -> tuple[list[Path], Path | None, dict[str, str] | None]:
    """The ``.tzip`` shards of a folder that ``tzip compress DIR`` wrote, in name order, with its index and the index's
    ``weight_map`` (tensor name -> ``NAME.safetensors``) when it has one (then the shards are the ones it names),
    else (every ``*.tzip`` file, None, None).

    Raises FileNotFoundError (the folder, or a shard the index names, is missing) and ValueError (an index that is
    not a ``weight_map`` of names to ``NAME.safetensors``, or a folder without shards)."""
    if not folder.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such folder", str(folder))
    index = _folder_index(folder)
    if index is None:
        shards = sorted(p for p in folder.iterdir() if p.name.endswith(".tzip") and p.is_file())
        if not shards:
            raise ValueError(f"{folder}: no .tzip file and no {_INDEX}: not a folder that tzip compress wrote")
        return shards, None, None
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{index}: not an index with a weight_map ({err})") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and v.endswith(".safetensors") and "/" not in v for v in weight_map.values()):
        raise ValueError(f"{index}: weight_map must map tensor names to shard names NAME.safetensors of this folder")
    shards = []
    for shard in sorted(set(weight_map.values())):
        tz = folder / (shard[: -len(".safetensors")] + ".tzip")
        if not tz.is_file():
            raise FileNotFoundError(errno.ENOENT, f"the shard {shard} that {index.name} names is missing", str(tz))
        shards.append(tz)
    return shards, index, weight_map


def _load_gpu(reader, entries, flat: dict[str, torch.Tensor], dev: torch.device, verify: bool,
              batch_bytes: int) -> None:
    """Batches of frames: read into one of two pinned buffers, copied to the GPU on a side stream, decoded on the
    current stream; the next batch is read from disk meanwhile. One synchronisation at the end reads every error."""
    batches = _batches(entries, lambda e: e.frame_bytes, batch_bytes)
    cap = max((sum(_native.align(e.frame_bytes) for e in b) for b in batches), default=0)
    pinned = [torch.empty(cap, dtype=torch.uint8, pin_memory=True) for _ in range(min(2, len(batches)))]
    staged = [torch.empty(cap, dtype=torch.uint8, device=dev) for _ in range(min(2, len(batches)))]
    copied = [torch.cuda.Event() for _ in pinned]   # pinned[k] may be refilled once this passed
    decoded = [torch.cuda.Event() for _ in pinned]  # staged[k] may be overwritten once this passed
    copy_stream = torch.cuda.Stream(dev)
    stream = torch.cuda.current_stream(dev)
    errors = torch.zeros(len(entries), dtype=torch.int32, device=dev)
    first = 0
    keep = []  # pointer arrays of queued decodes stay alive until the end
    for n, batch in enumerate(batches):
        k = n % 2
        if n >= 2:
            copied[k].synchronize()  # the copy out of pinned[k], queued two batches ago
        offs, o = [], 0
        for e in batch:
            offs.append(o)
            reader.read_frame(e, out=pinned[k][o: o + e.frame_bytes])  # header checked against the index
            o += _native.align(e.frame_bytes)
        with torch.cuda.stream(copy_stream):
            if n >= 2:
                copy_stream.wait_event(decoded[k])
            staged[k][:o].copy_(pinned[k][:o], non_blocking=True)
            copied[k].record(copy_stream)
        stream.wait_event(copied[k])
        arrays = _native.PointerArrays([staged[k].data_ptr() + x for x in offs], [e.frame_bytes for e in batch],
                                       [flat[e.name].data_ptr() for e in batch], [e.nbytes for e in batch])
        keep.append(arrays)
        _native.gpu_decode(arrays, errors[first: first + len(batch)], stream.cuda_stream, 0, verify)
        decoded[k].record(stream)
        first += len(batch)
    for t in staged:
        t.record_stream(stream)
    bad = torch.nonzero(errors).flatten().tolist()  # synchronises
    if bad:
        i = bad[0]
        raise ContainerError(_native.code_name(errors[i]), "the frame does not decode on the GPU", reader.path,
                             entries[i].name)
