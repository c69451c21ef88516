"""``tzip.checkpoint``: a ``torch.distributed.checkpoint`` (DCP) storage writer and reader that compress every tensor.

    import torch.distributed.checkpoint as dcp
    import tzip.checkpoint

    dcp.save(state_dict, storage_writer=tzip.checkpoint.Writer("ckpt/step-100"))
    dcp.load(state_dict, storage_reader=tzip.checkpoint.Reader("ckpt/step-100"))

They slot in where DCP's ``FileSystemWriter`` / ``FileSystemReader`` go (read from torch 2.11's
``torch/distributed/checkpoint/filesystem.py``): DCP's planners decide what each rank writes and reads (sharded saves,
deduplicated replicas, resharded loads into another world size or another sharding); these classes store and fetch
the items. Each tensor item (``WriteItemType.TENSOR`` and ``SHARD``: a whole tensor or one rank's chunk of it) is
compressed by the daemon with its own dtype, on the GPU it lives on when it is a CUDA tensor, with no copy to the host
first; each byte item (``BYTE_IO``: DCP's ``torch.save`` of a non-tensor value) is stored with the ``bytes`` codec
(``raw`` when ``codec="raw"``).

The checkpoint folder
---------------------
* ``__R_ID.tzip``: what rank ``R`` wrote, one ``.tzip`` container (docs/container.md) per rank with items to write,
  ``ID`` a fresh id of that save. Each item is one tensor of the container's safetensors header: a whole tensor
  under its fully qualified name (``model.layers.0.weight``), a shard as ``FQN@O0_O1...`` (its chunk offsets), a
  byte item as ``U8 [n]`` under its FQN; ``__metadata__["tzip.dcp"]`` maps every name to its FQN, offsets and kind.
  Tensors of dtypes safetensors lacks are stored as ``U8`` bytes (as ``tzip.save`` does). So the files are ordinary
  ``.tzip`` files: ``tzip verify`` checks them and ``tzip decompress`` makes safetensors files of the shards. Why
  ``.tzip`` and not DCP's ``.distcp`` (a ``torch.save`` per item): the container indexes every frame, so a reader
  that needs a few shards (a resharded load) reads only their frames, and every frame carries its dtype, shape
  and the checksums of the original bytes.
* ``.metadata``: DCP's ``Metadata`` pickled, as ``FileSystemWriter`` writes it, its ``storage_data`` mapping each
  ``MetadataIndex`` to a :class:`TzipStorageInfo` (file, name, dtype, chunk shape), followed by a 24-byte footer:
  ``b"TZDM"``, u32 version 1, u64 length of the pickle, u64 XXH64 of it (little-endian). The reader checks the
  footer and unpickles with an allow-list (DCP's metadata classes, torch dtypes and sizes, this module's
  TzipStorageInfo), never arbitrary classes.

Crash safety: every file is written to a temporary file in the folder, fsynced and renamed (``atomic_file``), and
``.metadata`` last, after every rank's data file (DCP calls ``finish`` on the coordinator once all ranks wrote).
The data files of a save have names no earlier save used, so a save into a folder that holds a checkpoint never
touches the files that checkpoint's ``.metadata`` names: killed at any point, the folder still loads as the old
checkpoint (or, once the new ``.metadata`` is in place, as the new one). After the rename the coordinator removes
the ``__R_ID.tzip`` files the new ``.metadata`` does not name.

On load, a saved chunk whose dtype differs from the tensor it is loaded into raises TypeError (wrapped by DCP in a
``CheckpointException``) instead of being cast. Damaged files raise :class:`tzip._container.ContainerError`.
When the daemon is away, the writer stores raw frames and warns once; ``strict=True`` raises.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import os
import pickle
import re
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ._container import (ContainerReader, TensorItem, atomic_file, byte_view, decode_entries, reinterpret,
                         safetensors_layout, torch_dtype_of, write_tensors)
from ._safetensors_header import ContainerError, Entry
from ._dlpack import int_alias
from .attaching import checkpoint_codec
from .client import Client, tagged

__all__ = ["Writer", "Reader", "TzipStorageInfo", "METADATA_FILE", "DCP_ITEMS_KEY"]

#: The metadata file of a checkpoint folder (DCP's name).
METADATA_FILE = ".metadata"
#: ``__metadata__`` key, in each rank's container, of the JSON map from tensor names to DCP items.
DCP_ITEMS_KEY = "tzip.dcp"
#: DCP's metadata version string written by FileSystemWriter in torch 2.11.
_DCP_VERSION = "1.0.0"
_FOOTER = struct.Struct("<4sIQQ")
_FOOTER_MAGIC = b"TZDM"
_FOOTER_VERSION = 1
_DATA_FILE = re.compile(r"__(\d+)_[0-9a-f]{16}\.tzip")


@dataclass(frozen=True)
class TzipStorageInfo:
    """Where one DCP item lives: ``relative_path`` (the rank's ``.tzip`` file in the checkpoint folder), ``name``
    (its tensor in that file's safetensors header), ``dtype`` (the torch dtype name of a tensor chunk; None for a byte
    item) and ``shape`` (the chunk's sizes; ``(nbytes,)`` for a byte item)."""

    relative_path: str
    name: str
    dtype: str | None
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Prefix:
    prefix: str


def _dtype_from_str(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise ContainerError("TZIP_CORRUPT", f"unknown torch dtype {name!r} in the checkpoint metadata")
    return d


class Writer(StorageWriter):
    """A DCP ``StorageWriter`` into the folder ``path`` (created when missing), compressing through the daemon.

    Args:
        path: the checkpoint folder (``checkpoint_id`` of ``dcp.save`` replaces it when given).
        codec: codec of tensor items: 'auto' | 'fast' | 'max' | 'bytes' | 'raw' (docs/format.md); None (default):
            'fast' for CUDA tensors and 'auto' for CPU tensors (tzip._codec_choice), or 'raw' after
            ``tzip.detach()`` (tzip.attaching), decided at each save.
        client: the daemon client (None: this process's default client). Its requests count as the job's
            checkpoint stream.
        strict: with the default client, raise DaemonUnavailableError when the daemon is away instead of writing
            raw frames with one warning.
        overwrite: False: raise RuntimeError when the folder already holds a checkpoint (``.metadata``).

    Raises (from the DCP calls): OSError (the folder or a file cannot be written; earlier checkpoints in the folder
    stay intact), ValueError (a planner handing over a tensor that does not match its write item),
    DaemonUnavailableError (strict).
    """

    def __init__(self, path: str | os.PathLike, codec: str | None = None, client: Client | None = None,
                 strict: bool = False, overwrite: bool = True):
        super().__init__()
        self.path = Path(path)
        self.codec = codec
        self.client = client
        self.strict = strict
        self.overwrite = overwrite
        self.save_id = secrets.token_hex(8)
        self.rank: int | None = None
        self.use_collectives = True
        self.is_coordinator = False

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.save_id = secrets.token_hex(8)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def _metadata_path(self, rank: int | None = None) -> Path:
        return self.path / (METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.path.mkdir(parents=True, exist_ok=True)
        existing = self._metadata_path(None if self.use_collectives else 0)
        if existing.exists() and not self.overwrite:
            raise RuntimeError(f"{self.path} already holds a checkpoint and overwrite=False")
        if self.rank is not None and not self.use_collectives:  # no global plan: each rank names its own files
            plan = dataclasses.replace(plan, storage_data=_Prefix(f"__{self.rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=_Prefix(f"__{i}_")) if p.storage_data is None else p
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Writes this rank's items as one ``.tzip`` file (none when the plan is empty)."""
        fut: Future[list[WriteResult]] = Future()
        if not plan.items:
            fut.set_result([])
            return fut
        # A name no earlier save used (not even one through this Writer without reset()): the files an existing
        # .metadata names are never replaced.
        relative = f"{plan.storage_data.prefix}{secrets.token_hex(8)}.tzip"
        codec = checkpoint_codec(self.codec)
        items: list[TensorItem] = []
        infos: list[TzipStorageInfo] = []
        described: dict[str, dict[str, Any]] = {}
        names: set[str] = set()

        def unique(base: str) -> str:
            name, k = base, 1
            while name in names or name == "__metadata__":
                k += 1
                name = f"{base}#{k}"
            names.add(name)
            return name

        for wi in plan.items:
            fqn = wi.index.fqn
            if wi.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(wi)
                raw = bytes(data.getbuffer())
                t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                name = unique(fqn)
                items.append(TensorItem(name, t, codec="raw" if codec == "raw" else "bytes"))
                infos.append(TzipStorageInfo(relative, name, None, (len(raw),)))
                described[name] = {"fqn": fqn, "kind": "bytes"}
                continue
            t = planner.resolve_data(wi).detach()
            td = wi.tensor_data
            if td is not None and (t.dtype != td.properties.dtype or tuple(t.shape) != tuple(td.chunk.sizes)):
                raise ValueError(f"{fqn}: the planner gave a {t.dtype} {list(t.shape)} tensor for a "
                                 f"{td.properties.dtype} {list(td.chunk.sizes)} write item")
            offsets = list(td.chunk.offsets) if td is not None else [0] * t.dim()
            name = unique(fqn if wi.type == WriteItemType.TENSOR else f"{fqn}@{'_'.join(map(str, offsets))}")
            items.append(TensorItem(name, t))
            infos.append(TzipStorageInfo(relative, name, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
            described[name] = {"fqn": fqn, "kind": "shard" if wi.type == WriteItemType.SHARD else "tensor",
                               "offsets": offsets}
        metadata = {"format": "pt", DCP_ITEMS_KEY: json.dumps(described, separators=(",", ":"))}
        with tagged("checkpoint"):
            entries = write_tensors(self.path / relative, items, metadata, codec=codec, client=self.client,
                                    strict=self.strict)
        frame_bytes = {e.name: e.frame_bytes for e in entries}
        fut.set_result([WriteResult(index=wi.index, size_in_bytes=frame_bytes[info.name], storage_data=info)
                        for wi, info in zip(plan.items, infos)])
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Writes ``.metadata`` (atomically, after every rank's data), then removes data files of earlier saves."""
        storage = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata = dataclasses.replace(metadata, version=_DCP_VERSION, storage_data=storage, storage_meta=self.storage_meta())
        blob = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        footer = _FOOTER.pack(_FOOTER_MAGIC, _FOOTER_VERSION, len(blob), xxhash.xxh64_intdigest(blob))
        own_rank = None if self.use_collectives or self.rank is None else self.rank
        with atomic_file(self._metadata_path(own_rank)) as fd:
            view = memoryview(blob + footer)
            while view:
                view = view[os.write(fd, view):]
        keep = {info.relative_path for info in storage.values()}
        for p in self.path.iterdir():
            m = _DATA_FILE.fullmatch(p.name)
            if m and p.name not in keep and (own_rank is None or int(m.group(1)) == own_rank):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)  # a str: the reader unpickles no Path

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        from torch.distributed.checkpoint.filesystem import FileSystem

        return FileSystem.validate_checkpoint_id(checkpoint_id)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: DCP's metadata classes, torch dtypes, layouts and sizes, TzipStorageInfo, nothing else."""

    def find_class(self, module: str, name: str):
        if module == _dcp_metadata.__name__ and name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                                         "TensorStorageMetadata", "BytesStorageMetadata",
                                                         "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"):
            return getattr(_dcp_metadata, name)
        if module == __name__ and name == "TzipStorageInfo":
            return TzipStorageInfo
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":  # how torch.layout pickles
            return torch.serialization._get_layout
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"the checkpoint metadata names {module}.{name}, which tzip.checkpoint.Reader does "
                                     "not load (not a DCP metadata class)")


def read_metadata_file(path: str | os.PathLike) -> Metadata:
    """Reads a ``.metadata`` file written by :class:`Writer`: footer and XXH64 checked, allow-listed unpickling.
    Raises ContainerError (TZIP_CORRUPT / TZIP_TRUNCATED), OSError."""
    data = Path(path).read_bytes()
    if len(data) < _FOOTER.size:
        raise ContainerError("TZIP_TRUNCATED", f"{len(data)} bytes: not a tzip.checkpoint metadata file", path)
    magic, version, length, digest = _FOOTER.unpack_from(data, len(data) - _FOOTER.size)
    if magic != _FOOTER_MAGIC:
        raise ContainerError("TZIP_CORRUPT", "no tzip footer (not written by tzip.checkpoint.Writer, or damaged)", path)
    if version != _FOOTER_VERSION:
        raise ContainerError("TZIP_UNSUPPORTED", f"metadata footer version {version}", path)
    if length != len(data) - _FOOTER.size:
        raise ContainerError("TZIP_CORRUPT", f"footer says {length} bytes of metadata, the file has "
                                             f"{len(data) - _FOOTER.size}", path)
    blob = data[:length]
    if xxhash.xxh64_intdigest(blob) != digest:
        raise ContainerError("TZIP_CORRUPT", "metadata digest mismatch", path)
    try:
        md = _MetadataUnpickler(io.BytesIO(blob)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise ContainerError("TZIP_CORRUPT", f"metadata does not unpickle: {e}", path) from None
    if not isinstance(md, Metadata):
        raise ContainerError("TZIP_CORRUPT", f"metadata is a {type(md).__name__}, not DCP Metadata", path)
    return md


@dataclass
class _Unreadable:
    """The storage_data of a placeholder Metadata: the error of reading a damaged ``.metadata`` (Reader.read_metadata)."""

    error: ContainerError


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.size(dim):
            t = t.narrow(dim, o, n)
    return t


class Reader(StorageReader):
    """A DCP ``StorageReader`` of a folder written by :class:`Writer`, decompressing through the daemon.

    Each rank reads only the frames of the chunks its load plan needs (a resharded load: parts of several ranks'
    files). A chunk is decoded on the device of the tensor it is loaded into, straight into it when the whole
    chunk goes to one contiguous tensor, and copied as integers otherwise (bit for bit).

    Args:
        path: the checkpoint folder (``checkpoint_id`` of ``dcp.load`` replaces it when given).
        client: the daemon client (None: the default one; raw frames need none).
        strict: with the default client, raise DaemonUnavailableError early when no daemon can be reached.

    Raises (from the DCP calls): TypeError (a chunk's dtype differs from the tensor loaded into: no silent cast),
    ContainerError (damaged or missing data), OSError.
    """

    def __init__(self, path: str | os.PathLike, client: Client | None = None, strict: bool = False):
        super().__init__()
        self.path = Path(path)
        self.client = client
        self.strict = strict
        self.storage_data: dict[MetadataIndex, TzipStorageInfo] = {}
        self.load_id = secrets.token_hex(8)
        self._metadata_error: ContainerError | None = None  # why the last global read_metadata() failed

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.load_id = secrets.token_hex(8)
        self._metadata_error = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is None:
            try:
                md = read_metadata_file(self.path / METADATA_FILE)
            except ContainerError as e:
                self._metadata_error = e
                raise
        else:
            path = self.path / f"__{rank}{METADATA_FILE}"
            if self._metadata_error is not None and not path.exists():
                # DCP's load swallows any error of the global read_metadata() (it takes it for "no global metadata")
                # and asks for rank-local metadata; with none either it fails with "metadata is None". A damaged
                # .metadata is carried to set_up_storage_reader() instead, which raises its ContainerError.
                md = Metadata(state_dict_metadata={})
                md.storage_data = _Unreadable(self._metadata_error)
                return md
            md = read_metadata_file(path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if isinstance(metadata.storage_data, _Unreadable):
            raise metadata.storage_data.error
        if not isinstance(metadata.storage_data, dict) or not all(isinstance(v, TzipStorageInfo)
                                                                   for v in metadata.storage_data.values()):
            raise ContainerError("TZIP_CORRUPT", "the metadata's storage_data is not tzip.checkpoint's", self.path)
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, dict[MetadataIndex, list]] = {}
        for ri in plan.items:
            info = self.storage_data[ri.storage_index]
            per_file.setdefault(info.relative_path, {}).setdefault(ri.storage_index, []).append(ri)
        with tagged("checkpoint"):
            for relative, by_index in per_file.items():
                self._read_file(relative, by_index, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, relative: str, by_index: dict[MetadataIndex, list], planner: LoadPlanner) -> None:
        with ContainerReader(self.path / relative) as reader:
            jobs: dict[str, tuple[TzipStorageInfo, list, list[torch.Tensor | None]]] = {}
            entries: list[Entry] = []
            for index, ris in by_index.items():
                info = self.storage_data[index]
                e = reader.entry(info.name)
                if info.dtype is None:
                    expected = ("U8", info.shape)
                    targets: list[torch.Tensor | None] = [None] * len(ris)
                else:
                    dtype = _dtype_from_str(info.dtype)
                    st, fshape, _ = safetensors_layout(dtype, info.shape)
                    expected = (st, fshape)
                    targets = []
                    for ri in ris:
                        target = planner.resolve_tensor(ri).detach()
                        if target.dtype != dtype:
                            raise TypeError(f"{ri.dest_index.fqn}: the checkpoint holds {dtype} data, the tensor to load "
                                            f"into is {target.dtype} (tzip.checkpoint.Reader does not cast: load into "
                                            f"a {dtype} tensor and convert)")
                        if tuple(target.shape) != tuple(ri.lengths):
                            raise ValueError(f"{ri.dest_index.fqn}: the planner's target is {list(target.shape)}, the read "
                                             f"item {list(ri.lengths)}")
                        targets.append(target)
                if (e.file_dtype, e.file_shape) != (expected[0], tuple(expected[1])):
                    raise ContainerError("TZIP_CORRUPT", f"the file holds {e.file_dtype} {list(e.file_shape)}, the "
                                         f"metadata says {expected[0]} {list(expected[1])}", reader.path, info.name)
                jobs[e.name] = (info, ris, targets)
                entries.append(e)

            def device(e: Entry) -> torch.device:
                targets = jobs[e.name][2]
                devs = {t.device for t in targets if t is not None}
                return devs.pop() if len(devs) == 1 else torch.device("cpu")

            in_place: set[str] = set()

            def out(e: Entry) -> torch.Tensor | None:
                """The target itself (or its bytes) when the whole chunk goes to one contiguous tensor."""
                info, ris, targets = jobs[e.name]
                if len(ris) != 1 or targets[0] is None:
                    return None
                t, ri = targets[0], ris[0]
                if tuple(ri.lengths) != info.shape or any(ri.storage_offsets) or not t.is_contiguous() or t.numel() == 0:
                    return None
                in_place.add(e.name)
                layout = torch_dtype_of(e.dtype), tuple(e.shape)
                if (t.dtype, tuple(t.shape)) == layout:
                    return t  # the frame's layout is the tensor's own
                # The tensor's memory in the frame's layout: float32 pairs of a complex64 tensor, 1-D beyond 32
                # dimensions, or its bytes (U8 [nbytes]) for a dtype stored as bytes, also where that has the tensor's
                # shape (a 1-D tensor of a 1-byte dtype safetensors lacks, such as float8_e8m0fnu).
                return reinterpret(byte_view(t), *layout)

            for e, flat in decode_entries(reader, entries, self.client, device=device, out=out, strict=self.strict):
                info, ris, targets = jobs[e.name]
                if info.dtype is None:
                    data = flat.cpu().numpy().tobytes()
                    for ri in ris:
                        planner.load_bytes(ri, io.BytesIO(data))
                    continue
                chunk = reinterpret(flat, _dtype_from_str(info.dtype), info.shape)
                for ri, target in zip(ris, targets):
                    if e.name not in in_place:
                        src = _narrow(chunk, ri.storage_offsets, ri.lengths)
                        if src.numel():
                            int_alias(target).copy_(int_alias(src).to(target.device))
                    planner.commit_tensor(ri, target)

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        from torch.distributed.checkpoint.filesystem import FileSystem

        return FileSystem.validate_checkpoint_id(checkpoint_id)
