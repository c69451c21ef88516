"""Checkpoint benchmark: save and load time and size of ``tzip.save`` / ``tzip.load`` and of DCP with
``tzip.checkpoint.Writer`` / ``Reader``, against ``torch.save``, safetensors and DCP's own ``FileSystemWriter`` (and
its ZStandard extension, when the ``zstandard`` package is installed).

    python -m tzip.bench.checkpoint [--socket PATH] [--gb 1.0] [--repeat 3] [--codec auto] [--dir DIR] [--json]
                                    [--inputs minilm-f32,minilm-bf16,tiled-f32] [--device cpu|cuda] [--source FILE]

Inputs, all real data (never zeros or constants):

* ``minilm-f32``: the trained all-MiniLM-L6-v2 weights as shipped (103 F32 tensors and one I64 buffer, 90.9 MB);
* ``minilm-bf16``: the same rounded to bf16 (``tensor.to(torch.bfloat16)``; the I64 buffer kept), 45.4 MB;
* ``tiled-f32``: the F32 weights repeated in order into 4 MB tensors, ``--gb`` GB (10**9 bytes) in all;
  ``tiled-bf16``: the same of the bf16 weights.

``--source FILE`` takes the weights from another safetensors file of real tensors instead of the demo package (on a
GPU host without it). ``--device cuda`` puts the state dicts on the GPU first: each library saves CUDA tensors (tzip
compresses them on the GPU) and loads onto the GPU (``map_location`` / ``device=`` / DCP targets there); times end
with a ``torch.cuda.synchronize()`` and the page touch is left out.

What is timed (wall clock, median of ``--repeat`` runs, the methods interleaved within each run):

* save: the library call writing the file or folder as the library does by default. torch.save and safetensors
  do not fsync; DCP's FileSystemWriter fsyncs each file (``sync_files=True``); tzip fsyncs the file and its folder
  (atomic write). ``save+fsync`` adds, for the first two, an fsync of what they wrote, measured right after.
* load: the call until it returns, then ``load+touch``: plus reading one byte of every 4 KiB page of every tensor
  (safetensors' ``load_file`` returns tensors over an mmap of the file; the touch makes them count their page
  faults; for tensors already in memory it costs next to nothing). DCP loads into tensors allocated before the
  clock starts, as a training job has its model; the others allocate inside the call.
* The files stay in the page cache between save and load (a shared machine: caches are not dropped), so these are
  warm-cache figures and, on the load side, CPU-bound.

Sizes are bytes on disk (MB = 10**6 bytes); ``ratio`` is size / tensor bytes; GB/s counts tensor (uncompressed)
bytes per second. Every load is checked bit for bit against the input. Unless ``--socket`` is given, a private
daemon is started for the run and stopped afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from statistics import median
from typing import Callable

import numpy as np
import torch

from .._dlpack import int_alias
from .daemon import _daemon_socket
from ..client import Client

__all__ = ["main", "measure", "parse_args"]

PAGE = 4096


def _inputs(names: list[str], gb: float, source: str | None = None) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    if source is None:
        from ..demo_data import source_weights_path

        source = str(source_weights_path())
    w = load_file(source)
    bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in w.items()}
    out = {}
    if "minilm-f32" in names:
        out["minilm-f32"] = w
    if "minilm-bf16" in names:
        out["minilm-bf16"] = bf16
    for name, sd in (("tiled-f32", w), ("tiled-bf16", bf16)):
        if name in names:
            flat = torch.cat([v.reshape(-1) for v in sd.values() if v.is_floating_point()])
            n = int(gb * 1e9) // flat.element_size()
            data = flat.repeat(-(-n // flat.numel()))[:n]
            per = 4_000_000 // flat.element_size()
            out[name] = {f"layer{i}.weight": c.clone() for i, c in enumerate(data.split(per))}
    return out


def _nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def _bytes_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _fsync_all(path: Path) -> None:
    for p in ([q for q in path.rglob("*") if q.is_file()] if path.is_dir() else [path]):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _touch(sd: dict[str, torch.Tensor]) -> int:
    s = 0
    for v in sd.values():
        if v.device.type == "cuda":
            torch.cuda.synchronize(v.device)
        elif v.numel():
            u8 = int_alias(v.detach()).reshape(-1).view(torch.uint8).numpy()
            s += int(np.add.reduce(u8[::PAGE], dtype=np.uint64))
    return s


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(int_alias(a[k]), int_alias(b[k].contiguous()))
        for k in a)


class _Method:
    """One way to write and read a checkpoint: ``save(sd, path)``, ``load(path, template) -> dict`` and whether it
    fsyncs by itself."""

    def __init__(self, name: str, save: Callable, load: Callable, syncs: bool, folder: bool = False):
        self.name, self.save, self.load, self.syncs, self.folder = name, save, load, syncs, folder


def _methods(client: Client, codec: str, device: str = "cpu", notes: list[str] | None = None) -> list[_Method]:
    """The methods in table order; ``notes`` (when given) gets a line for each one left out and why."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from .. import checkpoint as tzc
    from ..saving import load, save

    def dcp_load(reader_of):
        def run(path, template):
            dcp.load(template, storage_reader=reader_of(path))
            return template
        return run

    ms = [
        _Method("torch.save", lambda sd, p: torch.save(sd, p),
                lambda p, t: torch.load(p, weights_only=True, map_location=device), False),
        _Method("safetensors", lambda sd, p: save_file(sd, str(p)), lambda p, t: load_file(str(p), device=device), False),
        _Method("DCP FileSystemWriter", lambda sd, p: dcp.save(sd, storage_writer=FileSystemWriter(p)),
                dcp_load(FileSystemReader), True, folder=True),
    ]
    try:
        from torch.distributed.checkpoint._extension import ZStandard

        ZStandard()  # raises ValueError without the zstandard / pyzstd package
        ms.append(_Method("DCP FileSystemWriter+ZStandard",
                          lambda sd, p: dcp.save(sd, storage_writer=FileSystemWriter(p, _extensions=[ZStandard()])),
                          dcp_load(FileSystemReader), True, folder=True))
    except (ImportError, ValueError) as e:
        print(f"(DCP ZStandard left out: {e})", file=sys.stderr)
        if notes is not None:
            notes.append(f"DCP FileSystemWriter+ZStandard left out: {e}")
    ms += [
        _Method(f"tzip.save ({codec})", lambda sd, p: save(sd, p, codec=codec, client=client),
                lambda p, t: load(p, map_location=device, client=client), True),
        _Method(f"DCP tzip.checkpoint ({codec})",
                lambda sd, p: dcp.save(sd, storage_writer=tzc.Writer(p, codec=codec, client=client)),
                dcp_load(lambda p: tzc.Reader(p, client=client)), True, folder=True),
    ]
    return ms


def _clear(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def run(inputs: dict[str, dict[str, torch.Tensor]], methods: list[_Method], work: Path, repeat: int,
        device: str = "cpu") -> list[dict]:
    rows = []
    for data_name, sd in inputs.items():
        raw = _nbytes(sd)
        times: dict[str, dict[str, list[float]]] = {m.name: {"save": [], "fsync": [], "load": [], "touch": []} for m in methods}
        sizes: dict[str, int] = {}
        ok: dict[str, bool] = {}
        for rep in range(repeat):
            for i, m in enumerate(methods):
                path = work / f"{data_name}.{i}"
                _clear(path)
                t0 = time.perf_counter()
                m.save(sd, path)
                if device == "cuda":
                    torch.cuda.synchronize()
                t1 = time.perf_counter()
                if not m.syncs:
                    _fsync_all(path)
                t2 = time.perf_counter()
                sizes[m.name] = _bytes_on_disk(path)
                template = {k: torch.empty_like(v) for k, v in sd.items()} if m.folder else None
                t3 = time.perf_counter()
                back = m.load(path, template)
                t4 = time.perf_counter()
                _touch(back)
                t5 = time.perf_counter()
                if rep == 0:
                    ok[m.name] = _same(sd, back)
                del back, template
                _clear(path)
                tm = times[m.name]
                tm["save"].append(t1 - t0)
                tm["fsync"].append(t2 - t1)
                tm["load"].append(t4 - t3)
                tm["touch"].append(t5 - t3)
        for m in methods:
            tm = {k: median(v) for k, v in times[m.name].items()}
            rows.append({"input": data_name, "method": m.name, "tensor_bytes": raw, "bytes": sizes[m.name],
                         "ratio": sizes[m.name] / raw, "save_s": tm["save"], "save_fsync_s": tm["save"] + tm["fsync"],
                         "load_s": tm["load"], "load_touch_s": tm["touch"], "bit_exact": ok[m.name]})
    return rows


def _table(rows: list[dict]) -> str:
    head = (f"{'input':12s} {'method':32s} {'MB':>9s} {'ratio':>6s} {'save s':>7s} {'GB/s':>6s} {'+fsync s':>8s} {'GB/s':>6s} "
            f"{'load s':>7s} {'+touch s':>8s} {'GB/s':>6s} {'exact':>5s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        gb = r["tensor_bytes"] / 1e9
        lines.append(f"{r['input']:12s} {r['method']:32s} {r['bytes'] / 1e6:9.2f} {r['ratio']:6.3f} {r['save_s']:7.3f} "
                     f"{gb / r['save_s']:6.2f} {r['save_fsync_s']:8.3f} {gb / r['save_fsync_s']:6.2f} {r['load_s']:7.3f} "
                     f"{r['load_touch_s']:8.3f} {gb / r['load_touch_s']:6.2f} {'yes' if r['bit_exact'] else 'NO':>5s}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's options (see the module docstring); ``argv`` None reads sys.argv."""
    ap = argparse.ArgumentParser(prog="python -m tzip.bench.checkpoint", description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=None, help="a running daemon's socket (default: a private daemon for the run)")
    ap.add_argument("--gb", type=float, default=1.0, help="GB (10**9 bytes) of the tiled input (default 1.0)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per method; medians are printed (default 3)")
    ap.add_argument("--codec", default="auto", help="tzip codec (default auto)")
    ap.add_argument("--inputs", default="minilm-f32,minilm-bf16,tiled-f32", help="comma-separated inputs")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state dicts live (default cpu)")
    ap.add_argument("--source", default=None, help="safetensors file of real weights (default: the demo model's)")
    ap.add_argument("--dir", default=None, help="folder for the files (default: a temporary folder here)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    return ap.parse_args(argv)


def measure(args: argparse.Namespace) -> dict:
    """Runs the benchmark ``args`` (:func:`parse_args`) describe: {"machine": text, "command": text, "rows": one dict
    per (input, method) as :func:`run` returns them, "notes": methods left out and why}. Starts a private daemon
    unless ``args.socket`` names one (RuntimeError when it cannot start)."""
    warnings.filterwarnings("ignore", message=".*single process.*")  # DCP without a process group
    names = [n for n in args.inputs.split(",") if n]
    inputs = _inputs(names, args.gb, args.source)
    if args.device == "cuda":
        inputs = {n: {k: v.cuda() for k, v in sd.items()} for n, sd in inputs.items()}
    notes: list[str] = []
    with _daemon_socket(args.socket) as sock, Client(sock, spawn=False, strict=True) as client, \
            tempfile.TemporaryDirectory(prefix="tzip-bench-ckpt-", dir=args.dir) as work:
        rows = run(inputs, _methods(client, args.codec, args.device, notes), Path(work), args.repeat, args.device)
    machine = (f"{platform.node()}: {platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
               f"torch {torch.__version__}, Python {platform.python_version()}")
    if args.device == "cuda":
        machine += f", {torch.cuda.get_device_name()}"
    return {"machine": machine, "command": " ".join(sys.argv), "rows": rows, "notes": notes}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    r = measure(args)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"machine: {r['machine']}\ncommand: {r['command']}\n"
              f"state dicts on {args.device}, warm page cache, medians of {args.repeat} runs, GB/s of tensor bytes\n")
        print(_table(r["rows"]))
    return 0 if all(row["bit_exact"] for row in r["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
