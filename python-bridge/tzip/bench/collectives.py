"""Benchmark of tzip's lossless compressed all-reduce against plain ``dist.all_reduce``, and of the DDP hook's bytes.

    python -m tzip.bench.collectives [--ranks 2] [--sizes 25,100] [--repeat 5] [--codec CODEC] [--socket PATH]
                                     [--device cpu|cuda] [--backend gloo|nccl] [--links 25,50,100]
                                     [--codec-rates C,D] [--piece-mb MB] [--no-ddp] [--json]

Measures, with ``--ranks`` processes in one process group on 127.0.0.1 (one intra-op thread each; gloo by default,
``--backend nccl`` with ``--device cuda`` and one GPU per rank). ``--device cuda`` puts every tensor on the GPU
(rank r on ``cuda:r % device_count``: with gloo several ranks may share one GPU, the frames crossing the host) and
ends each timed call with ``torch.cuda.synchronize()``:

* the time of one all-reduce (SUM) of a 25 MB and a 100 MB bucket of real gradients, bf16 and fp32: plain
  ``dist.all_reduce``, ``tzip.distributed.all_reduce`` with ``codec="raw"`` (the same algorithm uncompressed) and with
  ``--codec``, each in pieces of ``--piece-mb`` (default: all_reduce's own) and, where that is more than one, in one
  piece (``piece_bytes=0``); the bytes each rank sent (tzip's counters) and their ratio to the raw bytes. Median over
  ``--repeat`` runs of rank 0's wall clock, the methods interleaved so that load changes hit them alike; every rank
  reduces its own gradients of the same parameters. Each method's result (of the first, untimed round) is compared bit
  for bit (integer views) on every rank: tzip raw and tzip ``--codec`` with each other, and with plain
  ``dist.all_reduce`` (which only two ranks must match: with more, the backend's reduction order differs);
* the codec's rates through the daemon (``--in-process``: in the rank's own process, tzip.in_process) on the same data, rank 0 alone (the others wait at a barrier): compress of
  the n-1 shards a rank sends and decompress of the n-1 shards it receives, GB/s of original bytes;
* bytes on the wire per DDP step of the real model (all-MiniLM-L6-v2, fp32, real text, 4 sentence pairs of 32
  tokens per rank; the last of 4 steps) with and without the hook, and the step time (forward and backward, median
  of the steps after DDP's bucket rebuild) of plain DDP, the hook with codec ``raw`` and the hook with ``--codec``;
  the gradients after the last step of the three compared bit for bit on every rank (unless ``--no-ddp``);
* a PROJECTION, not a measurement, of the all-reduce time per rank at ``--links`` GB/s: plain ring
  ``2 (n-1)/n S / B``; tzip ``(n-1)/n S / Rc + S/n / Rc + 2 (n-1)/n S / Rd + 2 (n-1)/n ratio S / B`` (compress the
  outgoing shards, then the reduced one; decompress the incoming and the gathered ones; the compressed bytes over
  the link; no overlap; the adds, the same in both, left out), and the same in P pieces of ``--piece-mb`` (default
  PIECE_BYTES) with codec and link overlapped: ``max(C, L) + (C + L) / P`` (C: the codec terms, L: the link term),
  with the codec rates Rc and Rd measured here, or given with ``--codec-rates`` (e.g. GPU rates measured elsewhere:
  then labelled as given).

Gradients: every rank computes its own, as data-parallel ranks do: one backward pass of the real model (tzip.demo_data's
objective, dropout off, 128 tokens) on its own 4 sentence pairs of the model card; all parameters' gradients flat in
the order DDP fills its buckets (last encoder layer first, word embeddings last), fp32 and .to(bf16); a bucket is
their first values, tiled when it is larger (fp32 100 MB).
Unless ``--socket`` is given, a private daemon is started for the run and stopped afterwards.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
import traceback
from statistics import median

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._dlpack import int_alias
from .._codec_choice import codec_for
from ..distributed import PIECE_BYTES
from ..distributed._all_reduce import _checked_piece_bytes
from ..distributed._call import _shards
from ..in_process import InProcessCodec
from .daemon import _daemon_socket

MB = 1_000_000


def _machine() -> str:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return (f"{platform.node()} {platform.machine()}, {cpu or 'unknown CPU'}, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def _rank_gradients(rank: int, world: int) -> torch.Tensor:
    """This rank's real gradients: one backward pass of all-MiniLM-L6-v2 (tzip.demo_data's objective, dropout off,
    128 tokens per sentence) on its own 4 sentence pairs of the model card; the parameters' .grad flat, fp32, in the
    order DDP fills its buckets (the reverse of model.parameters(): the last encoder layer first, the embeddings last;
    the pooler, unused by the objective, has none)."""
    from .. import demo_data

    pairs = demo_data.sentence_pairs(demo_data.readme_sentences())
    chosen = [pairs[(rank * 4 + i) % len(pairs)] for i in range(4)]
    enc = demo_data.tokenize([a for a, _ in chosen] + [b for _, b in chosen], demo_data.load_tokenizer())
    model = demo_data.load_model()
    model.eval()
    emb = demo_data.mean_pool_normalize(model(**enc).last_hidden_state, enc["attention_mask"])
    demo_data.contrastive_loss(emb[:4], emb[4:]).backward()
    return torch.cat([p.grad.reshape(-1) for p in reversed(list(model.parameters())) if p.grad is not None])


def _sync() -> None:
    """Waits for the current GPU's queued work (timed calls end there); nothing on the CPU."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(int_alias(a), int_alias(b))


def _all_ranks(flags: dict[str, bool], device: torch.device) -> dict[str, bool]:
    """``flags`` with each value true only when it is true on every rank (one MIN all-reduce, in sorted key order;
    on ``device`` for NCCL, on the CPU for gloo)."""
    keys = sorted(flags)
    nccl = "nccl" in str(dist.get_backend()).lower()
    t = torch.tensor([int(flags[k]) for k in keys], dtype=torch.int32, device=device if nccl else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return {k: bool(v) for k, v in zip(keys, t.tolist())}


#: --data: scripts/gpu-data.sh's samples of the same gradients (6 blocks of 32768 values across the network).
_SAMPLES = {"bfloat16": "minilm-grads-bf16.BF16.bin", "float32": "minilm-grads-f32.F32.bin"}


def _sample_gradients(data_dir: str, dtype: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s gradients from the samples in ``data_dir`` (:data:`_SAMPLES`, raw little-endian): the file's
    values rolled by ``rank * 4099`` elements, so that the ranks' buckets differ as data-parallel ranks' do (a bucket
    is then these values tiled, :func:`_window`). FileNotFoundError when the file is missing."""
    raw = np.fromfile(os.path.join(data_dir, _SAMPLES[dtype]), dtype=np.uint8)
    return torch.from_numpy(raw).view(getattr(torch, dtype)).roll(rank * 4099)


def _in_pieces(piece_bytes: int | None, device: torch.device, nbytes: int) -> bool:
    """Whether tzip.distributed.all_reduce(piece_bytes=...) splits a bucket of ``nbytes`` on ``device`` into more
    than one piece (None: its default, PIECE_BYTES for CUDA tensors and one piece for CPU tensors)."""
    piece_bytes = _checked_piece_bytes(piece_bytes, device)
    return 0 < piece_bytes < nbytes


def _window(flat: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` values of ``flat``, tiled when numel > flat.numel()."""
    reps = -(-numel // flat.numel())
    return (flat.repeat(reps) if reps > 1 else flat)[:numel].clone()


def _ddp_step(codec: str, device: torch.device, client=None, steps: int = 4) -> dict:
    """DDP training steps (forward, backward) of the real model on ``device``: plain, with the hook and codec raw, with
    the hook and ``codec``: this rank's bytes per step, the median step time after DDP's bucket rebuild (steps 2 on)
    and whether the gradients after the last step are bit-identical across the three, on every rank
    (``identical``: {"raw_vs_plain", "hook_vs_raw", "hook_vs_plain"})."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from .. import ddp as tzddp
    from .. import demo_data

    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = demo_data.sentence_pairs(demo_data.readme_sentences())
    tok = demo_data.load_tokenizer(32)
    model = demo_data.load_model()
    model.pooler = None  # not part of the objective
    model.eval()  # dropout off: the three modes compute the same gradients
    out = {"params": sum(p.numel() for p in model.parameters())}
    grads = {}
    cuda = device.type == "cuda"
    for mode in ("plain", "raw", "hook"):
        ddp = DDP(copy.deepcopy(model).to(device), gradient_as_bucket_view=True, device_ids=[device] if cuda else None)
        state = None
        if mode != "plain":
            state = tzddp.LosslessState(codec="raw" if mode == "raw" else codec, client=client)
            ddp.register_comm_hook(state, tzddp.lossless_allreduce_hook)
        times, per_step = [], []
        for step in range(steps):
            chosen = [pairs[(step * world * 4 + rank * 4 + i) % len(pairs)] for i in range(4)]
            enc = {k: v.to(device) for k, v in
                   demo_data.tokenize([a for a, _ in chosen] + [b for _, b in chosen], tok).items()}
            before = (state.bytes_raw, state.bytes_sent, state.buckets) if state else (0, 0, 0)
            ddp.zero_grad(set_to_none=False)
            _sync()
            dist.barrier()
            t0 = time.perf_counter()
            emb = demo_data.mean_pool_normalize(ddp(**enc).last_hidden_state, enc["attention_mask"])
            demo_data.contrastive_loss(emb[:4], emb[4:]).backward()
            _sync()
            times.append(time.perf_counter() - t0)
            if state:
                per_step.append((state.bytes_raw - before[0], state.bytes_sent - before[1], state.buckets - before[2]))
        out[f"step_s_{mode}"] = median(times[1:])
        grads[mode] = [p.grad.detach().clone() for p in ddp.module.parameters() if p.grad is not None]
        if mode == "hook":
            out["bytes_plain"], out["bytes_hook"], out["buckets"] = per_step[-1]
        del ddp

    def same(a: str, b: str) -> bool:
        return len(grads[a]) == len(grads[b]) and all(_same_bits(x, y) for x, y in zip(grads[a], grads[b]))

    out["identical"] = _all_ranks({"raw_vs_plain": same("raw", "plain"), "hook_vs_raw": same("hook", "raw"),
                                   "hook_vs_plain": same("hook", "plain")}, device)
    return out


def _rank_main(rank: int, world: int, args, store: str, socket: str, out: str) -> None:
    os.environ["TZIP_SOCKET"] = socket
    torch.set_num_threads(1)
    # the same computation gives the same bits in every mode (the GPU's embedding backward adds with atomics
    # otherwise); CUBLAS_WORKSPACE_CONFIG before the first cuBLAS handle
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        from .. import distributed as tzd
        from .._default import default_client

        # --in-process: the codec in this process (tzip.in_process) instead of the daemon, for every tzip row
        client = InProcessCodec() if args.in_process else default_client()
        via = {"client": client} if args.in_process else {}
        grads = None if args.data else _rank_gradients(rank, world).to(device)
        results = []
        for dtype in ("bfloat16", "float32"):
            flat = _sample_gradients(args.data, dtype, rank).to(device) if args.data else grads.to(getattr(torch, dtype))
            for size in args.sizes:
                numel = int(size * MB) // flat.element_size()
                data = _window(flat, numel)
                pb = None if args.piece_mb is None else int(args.piece_mb * MB)
                methods = {
                    "plain": lambda x: dist.all_reduce(x),
                    "raw": lambda x: tzd.all_reduce(x, codec="raw", piece_bytes=pb),
                    args.codec: lambda x, c=args.codec: tzd.all_reduce(x, codec=c, piece_bytes=pb, **via),
                }
                if _in_pieces(pb, device, numel * data.element_size()):  # and in one piece, to compare
                    methods["raw/1"] = lambda x: tzd.all_reduce(x, codec="raw", piece_bytes=0)
                    methods[f"{args.codec}/1"] = lambda x, c=args.codec: tzd.all_reduce(x, codec=c, piece_bytes=0, **via)
                times: dict[str, list[float]] = {m: [] for m in methods}
                traffic = {}
                first: dict[str, torch.Tensor] = {}
                for it in range(args.repeat + 1):  # the first round warms up (arena, mappings) and is not counted
                    for m, fn in methods.items():
                        x = data.clone()
                        tzd.counters(reset=True)
                        _sync()
                        dist.barrier()
                        t0 = time.perf_counter()
                        fn(x)
                        _sync()
                        dt = time.perf_counter() - t0
                        if it:
                            times[m].append(dt)
                        else:
                            first[m] = x
                        c = tzd.counters().get("all_reduce")
                        if c is not None:
                            traffic[m] = (c.bytes_raw, c.bytes_sent)
                        del x
                flags = {"raw_vs_plain": _same_bits(first["raw"], first["plain"]),
                         "codec_vs_raw": _same_bits(first[args.codec], first["raw"]),
                         "codec_vs_plain": _same_bits(first[args.codec], first["plain"])}
                if "raw/1" in first:
                    flags["pieces_vs_one"] = (_same_bits(first[args.codec], first[f"{args.codec}/1"])
                                              and _same_bits(first["raw"], first["raw/1"]))
                identical = _all_ranks(flags, device)
                del first
                # the codec alone, on rank 0 with the others waiting: what one all-reduce asks of it
                bounds = _shards(numel, world)
                shards = [data[a:b] for j, (a, b) in enumerate(bounds) if j != 0]
                rates = None
                if rank == 0:
                    cts = client.compress(shards, args.codec)
                    tc, td = [], []
                    for _ in range(args.repeat):
                        t0 = time.perf_counter()
                        cts = client.compress(shards, args.codec)
                        tc.append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        client.decompress(cts)
                        td.append(time.perf_counter() - t0)
                    nbytes = sum(s.numel() for s in shards) * data.element_size()
                    rates = {"compress_gbps": nbytes / median(tc) / 1e9, "decompress_gbps": nbytes / median(td) / 1e9,
                             "ratio": sum(c.compressed_nbytes for c in cts) / nbytes,
                             "codecs": sorted({c.codec for c in cts})}
                dist.barrier()
                results.append({"dtype": dtype, "mb": size, "bytes": numel * data.element_size(),
                                "seconds": {m: median(v) for m, v in times.items()},
                                "traffic": traffic, "rates": rates, "identical": identical})
        ddp = None if args.no_ddp else _ddp_step(args.codec, device, via.get("client"))
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"results": results, "ddp": ddp, "daemon": "in-process" if args.in_process else client.connected}, f)
    except BaseException:
        # mp.spawn shows the first rank to fail and stops the others: a rank that only learned another's failure
        # (tzip.distributed raises "rank(s) [...] failed" there) waits, so that the failing rank's own error is printed
        why = traceback.format_exc()
        told = re.search(r"rank\(s\) \[([0-9, ]+)\] failed", why)
        if told and str(rank) not in told.group(1).replace(" ", "").split(","):
            time.sleep(5)
        print(f"rank {rank} failed:\n{why}", file=sys.stderr, flush=True)
        raise
    finally:
        dist.destroy_process_group()


def project(r: dict, n: int, link_gbps: float, rates: tuple[float, float], pieces: int = 1) -> tuple[float, float]:
    """(plain, tzip) seconds per rank at a link of ``link_gbps`` GB/s (see the module docstring's formula). With
    ``pieces`` > 1, tzip's codec work (C, the codec terms of the formula) and link time (L, its last term) overlap as
    in a pipeline of that many equal pieces: ``max(C, L) + (C + L) / pieces`` (the slower resource paced by the
    pieces, plus one piece's way through both to fill and drain it)."""
    s, b = r["bytes"], link_gbps * 1e9
    rc, rd = rates[0] * 1e9, rates[1] * 1e9
    ratio = r["traffic"][r["codec"]][1] / r["traffic"][r["codec"]][0]
    plain = 2 * (n - 1) / n * s / b
    codec = (n - 1) / n * s / rc + s / n / rc + 2 * (n - 1) / n * s / rd
    link = 2 * (n - 1) / n * ratio * s / b
    if pieces > 1:
        return plain, max(codec, link) + (codec + link) / pieces
    return plain, codec + link


def run(args) -> dict:
    """The benchmark ``args`` (:func:`parse_args`) describe, ``args.ranks`` processes spawned here: {"machine",
    "data", "command", "ranks", "backend", "device", "codec", "results": one dict per (dtype, bucket size) with
    "seconds" per method, "traffic" {method: (bytes_raw, bytes_sent)} of rank 0, "rates" (rank 0's codec alone) and
    "identical" (every rank's results compared bit for bit), "ddp": the DDP step's figures (None with --no-ddp),
    "daemon": whether the ranks' client reached the daemon}. Starts a private daemon unless ``args.socket`` names
    one (RuntimeError when it cannot start); a rank's failure raises torch.multiprocessing's ProcessRaisedException."""
    with tempfile.TemporaryDirectory(prefix="tzip-bench-coll-") as d, _daemon_socket(args.socket) as socket:
        out = os.path.join(d, "out.json")
        mp.spawn(_rank_main, args=(args.ranks, args, os.path.join(d, "store"), socket, out), nprocs=args.ranks)
        with open(out) as f:
            got = json.load(f)
    for r in got["results"]:
        r["codec"] = args.codec
    if args.data:
        source = (f"scripts/gpu-data.sh's samples of all-MiniLM-L6-v2's gradients in {args.data} "
                  f"({', '.join(_SAMPLES.values())}: 6 blocks of 32768 values each, from one backward pass), rolled by "
                  "4099 values per rank and tiled to the bucket")
    else:
        source = ("real gradients of all-MiniLM-L6-v2 (22.6 M values), each rank's from one backward pass on its own "
                  "4 sentence pairs of the model card (tzip.demo_data's objective), in DDP's bucket order (last layer "
                  "first); a bucket is their first values, tiled past 22.6 M (fp32 100 MB)")
    return {"machine": _machine(), "data": source, "command": " ".join([sys.executable, "-m", __spec__.name if __spec__ else __name__, *sys.argv[1:]]),
            "ranks": args.ranks, "backend": f"{args.backend} (127.0.0.1)", "device": args.device, "codec": args.codec,
            **got}


def report(res: dict, args) -> str:
    n, c = res["ranks"], res["codec"]
    lines = [f"machine: {res['machine']}", f"data: {res['data']}", f"command: {res['command']}",
             f"{n} ranks, {res['backend']}, tensors on {res['device']}, one torch thread per rank; daemon: "
             f"{'in-process codec (--in-process)' if res['daemon'] == 'in-process' else 'connected' if res['daemon'] else 'AWAY (raw frames)'}",
             "", f"one all-reduce (SUM) of a bucket, rank 0's wall clock, median of {args.repeat} (seconds):"]
    pieces = ("all_reduce's default (PIECE_BYTES = " f"{PIECE_BYTES / MB:g} MB for CUDA tensors, one piece on the CPU)"
              if args.piece_mb is None else f"{args.piece_mb:g} MB")
    lines[-1] += f" tzip in pieces of {pieces}, and in one piece where that differs:"
    head = ["dtype", "MB", "plain dist.all_reduce", "tzip raw", f"tzip {c}", "raw 1 piece", f"{c} 1 piece",
            f"{c}/plain", "bytes sent/raw", "codec compress GB/s", "decompress GB/s", "bit-identical"]
    rows = []
    for r in res["results"]:
        s = r["seconds"]
        raw_b, sent_b = r["traffic"][c]
        rt = r["rates"]
        one = lambda m: f"{s[m]:.3f}" if m in s else "(same)"  # noqa: E731 - one piece is the default there
        rows.append([r["dtype"], f"{r['mb']:g}", f"{s['plain']:.3f}", f"{s['raw']:.3f}", f"{s[c]:.3f}",
                     one("raw/1"), one(c + "/1"), f"{s[c] / s['plain']:.2f}x", f"{sent_b / raw_b:.4f}", f"{rt['compress_gbps']:.3f}",
                     f"{rt['decompress_gbps']:.3f}", _identity(r["identical"], "codec_vs_raw", n)])
    lines += _table(head, rows)
    if res["ddp"]:
        dd = res["ddp"]
        lines += ["", f"DDP step of all-MiniLM-L6-v2 (fp32, {dd['params'] / 1e6:.1f} M parameters, {dd['buckets']} buckets), "
                  f"MB this rank sends per step: plain DDP {dd['bytes_plain'] / MB:.2f}, hook ({c}) "
                  f"{dd['bytes_hook'] / MB:.2f} (saved {100 * (1 - dd['bytes_hook'] / dd['bytes_plain']):.1f}%); "
                  f"forward+backward seconds (median of steps 2-4): plain {dd['step_s_plain']:.3f}, raw hook "
                  f"{dd['step_s_raw']:.3f}, hook {dd['step_s_hook']:.3f}; gradients bit-identical: "
                  f"{_identity(dd['identical'], 'hook_vs_raw', n)}"]
    given = args.codec_rates is not None
    label = "given with --codec-rates (not measured here)" if given else f"measured here ({args.device.upper() if args.device == 'cpu' else 'GPU'} tensors, {'in this process' if args.in_process else 'through the daemon'})"
    lines += ["", f"PROJECTION (a model, not a measurement): all-reduce milliseconds per rank at a link of B GB/s, codec rates "
              f"{label}, no overlap of codec and link:"]
    # the model is of CUDA buckets: their piece size (--piece-mb 0: one piece)
    piece_bytes = _checked_piece_bytes(None if args.piece_mb is None else int(args.piece_mb * MB), torch.device("cuda"))
    lines[-1] = lines[-1][:-1] + (f"; and in pieces of {piece_bytes / MB:g} MB overlapping codec and link, "
                                  "max(C, L) + (C + L) / pieces:")
    head = ["dtype", "MB", "codec GB/s (c/d)", *[f"plain @{b:g}" for b in args.links], *[f"tzip @{b:g}" for b in args.links],
            *[f"pieces @{b:g}" for b in args.links]]
    rows = []
    for r in res["results"]:
        rates = tuple(args.codec_rates) if given else (r["rates"]["compress_gbps"], r["rates"]["decompress_gbps"])
        pieces = math.ceil(r["bytes"] / piece_bytes) if piece_bytes else 1
        pts = [project(r, n, b, rates) for b in args.links]
        over = [project(r, n, b, rates, pieces)[1] for b in args.links]
        rows.append([r["dtype"], f"{r['mb']:g}", f"{rates[0]:.3g}/{rates[1]:.3g}", *[f"{p[0] * 1e3:.2f}" for p in pts],
                     *[f"{p[1] * 1e3:.2f}" for p in pts], *[f"{t * 1e3:.2f}" for t in over]])
    lines += _table(head, rows)
    return "\n".join(lines)


def _identity(flags: dict[str, bool], compressed_vs_raw: str, ranks: int) -> str:
    """"yes" when the compressed result equals the raw one and, on two ranks, plain PyTorch's too (the project's rule);
    else which comparison failed."""
    vs_plain = compressed_vs_raw.replace("_raw", "_plain")
    bad = [k for k in (compressed_vs_raw, *([vs_plain, "raw_vs_plain"] if ranks == 2 else []),
                       *(["pieces_vs_one"] if "pieces_vs_one" in flags else [])) if not flags[k]]
    return "yes" if not bad else "NO (" + ", ".join(bad) + ")"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "│ " + " │ ".join(x.rjust(w) for x, w in zip(cells, widths)) + " │"  # noqa: E731
    return [fmt(head), *(fmt(r) for r in rows)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's options (see the module docstring), checked and converted (sizes and links to lists of
    floats); ``argv`` None reads sys.argv. The namespace is what :func:`run` takes."""
    ap = argparse.ArgumentParser(prog="python -m tzip.bench.collectives", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the tensors live (default cpu)")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="process group backend (default "
                    "gloo; nccl needs --device cuda and a GPU per rank)")
    ap.add_argument("--sizes", default="25,100", help="bucket sizes in MB (10^6 bytes), comma-separated")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--codec", default=None, choices=["auto", "fast", "max"],
                    help="default: tzip.distributed's own for the device (fast for CUDA tensors, auto on the CPU); on an "
                         "H100 `auto` picked max for GPU gradients, whose GPU encoder runs at ~2.3 GB/s")
    ap.add_argument("--socket", help="use the daemon on this socket instead of starting one")
    ap.add_argument("--links", default="25,50,100", help="link speeds of the projection, GB/s")
    ap.add_argument("--codec-rates", default=None, help="COMPRESS,DECOMPRESS GB/s for the projection instead of the "
                    "rates measured here (e.g. a GPU's)")
    ap.add_argument("--piece-mb", type=float, default=None, help="tzip.distributed.all_reduce's piece_bytes in MB "
                    "(default: its own: PIECE_BYTES for CUDA tensors, one piece on the CPU); a row in pieces also runs "
                    "in one piece (piece_bytes=0)")
    ap.add_argument("--data", default=None, help="a folder of scripts/gpu-data.sh (data/gpu): its gradient samples, "
                    "tiled, instead of a backward pass of the model (no model package needed; implies --no-ddp)")
    ap.add_argument("--no-ddp", action="store_true", help="skip the DDP step of the real model")
    ap.add_argument("--in-process", action="store_true", help="code in each rank's process (tzip.in_process."
                    "InProcessCodec, libtzip.so) instead of through the daemon")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.data:
        args.no_ddp = True  # the DDP step trains the model itself
    if args.backend == "nccl" and args.device != "cuda":
        ap.error("--backend nccl needs --device cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU visible to PyTorch")
    if args.backend == "nccl" and torch.cuda.device_count() < args.ranks:
        ap.error(f"--backend nccl: {args.ranks} ranks need as many GPUs, {torch.cuda.device_count()} visible")
    args.codec = codec_for(args.codec, args.device == "cuda")
    args.sizes = [float(x) for x in args.sizes.split(",")]
    args.links = [float(x) for x in args.links.split(",")]
    if args.codec_rates is not None:
        args.codec_rates = [float(x) for x in args.codec_rates.split(",")]
        if len(args.codec_rates) != 2:
            ap.error("--codec-rates takes COMPRESS,DECOMPRESS")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    print(json.dumps(res, indent=1) if args.json else report(res, args))
    n = res["ranks"]
    ok = all(_identity(r["identical"], "codec_vs_raw", n) == "yes" for r in res["results"])
    ok = ok and (res["ddp"] is None or _identity(res["ddp"]["identical"], "hook_vs_raw", n) == "yes")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
