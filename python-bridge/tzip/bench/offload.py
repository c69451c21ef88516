"""Benchmark of optimizer-state offload on the real model: tzip.optim.CompressedOffload against plain AdamW, against
the same offload without compression (codec="raw"), and, on a GPU, against torchao's CPUOffloadOptimizer.

    python -m tzip.bench.offload [--device cpu|cuda] [--rounds 1] [--steps 8] [--warmup 2] [--pairs 8]
                                 [--max-length 128] [--codec CODEC] [--chunk-mib 64] [--gpu-arena-keep-mib N]
                                 [--cases plain,offload,raw,torchao] [--socket PATH]
                                 [--json]

Each case trains all-MiniLM-L6-v2 (tzip.demo_data: the bundled trained weights, fp32, dropout off) with AdamW (lr
2e-5, weight decay 0.01) on the model card's sentence pairs and its contrastive objective, ``--pairs`` pairs (2 x
that many sentences of ``--max-length`` tokens) per step, from the same weights with the same batches; the cases run
in turn, ``--rounds`` times. Per case it reports, over the steps after ``--warmup`` of every round (medians, wall
clock, the GPU synchronised at each boundary):

* ``opt step ms``: ``optimizer.step()`` alone; ``train step ms``: zero_grad + forward + backward + step;
* on a GPU, ``torch.cuda.memory_allocated`` between steps (after a step), and the peaks of
  ``torch.cuda.max_memory_allocated`` during forward+backward and during the optimizer step, in MB (10**6 bytes);
* host memory holding the offloaded state, MB: for CompressedOffload its frames (on a GPU: the pinned slabs it
  holds, ``offload_stats()["pinned_bytes"]``); for torchao the growth of PyTorch's pinned allocator
  (``torch.cuda.host_memory_stats()["allocated_bytes.current"]``: its CPU copies of parameters, gradients and
  state, in blocks rounded up to powers of two); for plain AdamW on the CPU its state;
* ``state MB`` (uncompressed optimizer state) and ``ratio`` (compressed / uncompressed) for the offload cases;
* ``identical``: whether every step's loss and the parameters after the last step equal plain AdamW's bit for bit
  (float32 bits of the losses, bytes of the parameters; torchao runs AdamW on the CPU, a different kernel: not
  expected to).

torchao is optional (GPU only): ``pip install torchao==0.18.0`` (checked with torch 2.11.0); without it that case is
skipped with a message. Unless ``--socket`` is given, a private daemon is started for the run and stopped afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from .. import demo_data as dd
from .daemon import _daemon_socket
from .._codec_choice import codec_for
from ..client import CODECS, Client

ROOT = Path(__file__).resolve().parents[2]
ALL_CASES = ("plain", "offload", "raw", "torchao")
TORCHAO_PIN = "torchao==0.18.0"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _make_optimizer(case: str, params, args, client: Client):
    from ..optim import CompressedOffload

    kw = {"lr": 2e-5, "weight_decay": 0.01}
    chunk = None if args.chunk_mib <= 0 else int(args.chunk_mib * (1 << 20))
    if case == "plain":
        return torch.optim.AdamW(params, **kw)
    if case in ("offload", "raw"):
        return CompressedOffload(torch.optim.AdamW(params, **kw), codec=args.codec if case == "offload" else "raw",
                                 client=client, chunk_bytes=chunk, sm_budget=args.sm_budget)
    if case == "torchao":
        from torchao.optim import CPUOffloadOptimizer

        return CPUOffloadOptimizer(params, torch.optim.AdamW, **kw)
    raise ValueError(case)


def run_case(case: str, args, data: list, socket: str) -> dict:
    """One training run of ``case``; figures as the module docstring describes (bytes and seconds here). The
    offload cases get a client of their own (closed afterwards, with its staging buffers)."""
    client = None
    if case in ("offload", "raw"):
        keep = {} if args.gpu_arena_keep_mib is None else {"gpu_arena_keep_bytes": int(args.gpu_arena_keep_mib * (1 << 20))}
        client = Client(socket, spawn=False, strict=True, **keep)
    try:
        return _run_case(case, args, data, client)
    finally:
        if client is not None:
            client.close()


def _run_case(case: str, args, data: list, client: Client | None) -> dict:

    dev = args.device
    model = dd.load_model().to(dev)
    model.eval()  # dropout off: every case sees the same computation; autograd stays on
    if dev == "cuda":
        torch.cuda.empty_cache()
        host0 = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) if torch.cuda.is_initialized() else 0
    opt = _make_optimizer(case, model.parameters(), args, client)
    step_s, train_s, losses, loss_bits = [], [], [], []
    peak_fb = peak_opt = alloc_after = 0
    for i, batch in enumerate(data):
        _sync(dev)
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = dd.pair_loss(model, batch, dev)
        loss.backward()
        _sync(dev)
        t1 = time.perf_counter()
        if dev == "cuda":
            peak_fb = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        opt.step()
        _sync(dev)
        t2 = time.perf_counter()
        if dev == "cuda":
            peak_opt = torch.cuda.max_memory_allocated()
            alloc_after = torch.cuda.memory_allocated()
        losses.append(loss.item())
        loss_bits.append(loss.detach().reshape(1).view(torch.int32).item())
        if i >= args.warmup:
            step_s.append(t2 - t1)
            train_s.append(t2 - t0)
    r: dict = {"case": case, "step_times": step_s, "train_times": train_s, "losses": losses, "loss_bits": loss_bits,
               "params": [p.detach().cpu().clone() for p in model.parameters()]}
    stats = opt.offload_stats() if hasattr(opt, "offload_stats") else None
    if stats is not None:
        r.update(state_bytes=stats["state_bytes"], compressed_bytes=stats["compressed_bytes"], ratio=stats["ratio"],
                 host_bytes=stats["pinned_bytes"] if dev == "cuda" else stats["host_bytes"],
                 restore_s=stats["restore_s"], offload_s=stats["offload_s"])
    elif case == "plain":
        r["state_bytes"] = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                               if isinstance(v, torch.Tensor))
        r["host_bytes"] = r["state_bytes"] if dev == "cpu" else 0
    if dev == "cuda":
        r.update(alloc_between_steps=alloc_after, peak_forward_backward=peak_fb, peak_opt_step=peak_opt)
        if case == "torchao":
            r["host_bytes"] = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - host0
    del opt, model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return r


def run(args) -> dict:
    """Every case of ``args`` (a :func:`parse_args` namespace) in turn, ``args.rounds`` times: {"results": one dict
    per case with the figures of the module docstring (seconds, bytes; ``identical`` against plain AdamW, None
    without a plain case), "notes": cases left out and why, and the run's settings}. Raises SystemExit when
    ``--device cuda`` cannot run (no GPU, or the daemon serves none)."""
    if args.device == "cuda":
        # deterministic cuBLAS (set before CUDA starts), so that the runs can agree bit for bit
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA GPU visible to PyTorch")
    torch.use_deterministic_algorithms(True, warn_only=True)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(ALL_CASES))
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {', '.join(ALL_CASES)}")
    notes = []
    if "torchao" in cases:
        if args.device != "cuda":
            cases.remove("torchao")
            notes.append("torchao's CPUOffloadOptimizer needs a GPU: skipped")
        else:
            try:
                import torchao  # noqa: F401
                from torchao.optim import CPUOffloadOptimizer  # noqa: F401
            except ImportError as e:
                cases.remove("torchao")
                notes.append(f"torchao not importable ({e}): skipped; pip install {TORCHAO_PIN}")
    data = dd.pair_batches(args.steps, args.pairs, args.max_length)
    with _daemon_socket(args.socket) as sock:
        with Client(sock, spawn=False, strict=True) as probe:
            if args.device == "cuda" and not probe.daemon_info.get("gpu"):
                raise SystemExit(f"--device cuda: the daemon serves no GPU ({probe.daemon_info.get('gpu_reason')})")
        rounds = []
        for k in range(args.rounds):
            rounds.append([run_case(c, args, data, sock) for c in cases])
            if k + 1 < args.rounds:
                for x in rounds[-1]:
                    del x["params"]  # only the last round's are compared
    # The cases ran in turn, round after round, so that a change of machine load hits them alike: the timed steps
    # of every round are pooled (medians), the other figures are the last round's.
    results = rounds[-1]
    for i, r in enumerate(results):
        for key in ("step_times", "train_times"):
            r[key] = [t for rnd in rounds for t in rnd[i][key]]
        r["opt_step_s"], r["train_step_s"] = statistics.median(r["step_times"]), statistics.median(r["train_times"])
        del r["step_times"], r["train_times"]
    plain = next((r for r in results if r["case"] == "plain"), None)
    for r in results:
        # every step's loss (its float32 bits) and the parameters after the last step (their bytes)
        r["identical"] = None if plain is None else r["loss_bits"] == plain["loss_bits"] and all(
            torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(plain["params"], r["params"]))
    for r in results:
        del r["params"]
    machine = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"machine": machine, "device": args.device, "torch": torch.__version__, "commit": commit,
            "threads": torch.get_num_threads(), "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "pairs": args.pairs,
            "max_length": args.max_length, "codec": args.codec, "chunk_mib": args.chunk_mib, "notes": notes,
            "gpu_arena_keep_mib": args.gpu_arena_keep_mib, "sm_budget": args.sm_budget,
            "command": "python -m tzip.bench.offload " + " ".join(sys.argv[1:]), "results": results}


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}"


def report(r: dict) -> str:
    gpu = r["device"] == "cuda"
    lines = [f"optimizer-state offload, all-MiniLM-L6-v2 (fp32, AdamW), {r['rounds']} x {r['steps']} steps ({r['warmup']} untimed), "
             f"{2 * r['pairs']} sentences x {r['max_length']} tokens per step; {r['machine']}, torch {r['torch']}, "
             f"{r['threads']} threads, tzip {r['commit']}, codec {r['codec']!r}, chunks of {r['chunk_mib']} MiB"
             + ("" if r["gpu_arena_keep_mib"] is None or r["device"] != "cuda" else
                f", client gpu_arena_keep_bytes {r['gpu_arena_keep_mib']} MiB")
             + ("" if r.get("sm_budget") is None or r["device"] != "cuda" else
                f", sm_budget {r['sm_budget']} ({'every SM' if r['sm_budget'] == 0 else 'SMs'})"),
             f"command: {r['command']}"]
    head = ["case", "opt step ms", "train step ms"]
    if gpu:
        head += ["GPU alloc between steps MB", "peak fwd+bwd MB", "peak opt step MB"]
    head += ["host memory for state MB", "state MB", "ratio", "identical"]
    rows = []
    names = {"plain": "AdamW", "offload": "CompressedOffload", "raw": "CompressedOffload raw", "torchao": "torchao CPUOffloadOptimizer"}
    for x in r["results"]:
        row = [names[x["case"]], f"{x['opt_step_s'] * 1e3:.1f}", f"{x['train_step_s'] * 1e3:.1f}"]
        if gpu:
            row += [_mb(x["alloc_between_steps"]), _mb(x["peak_forward_backward"]), _mb(x["peak_opt_step"])]
        ratio = x.get("ratio")
        row += [_mb(x.get("host_bytes")), _mb(x.get("state_bytes")), "-" if ratio is None else f"{ratio:.4f}",
                {True: "yes", False: "no", None: "-"}[x["identical"]]]
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    lines.append("| " + " | ".join("-" * w for w in widths) + " |")
    for row in rows:
        lines.append("| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) + " |")
    plain = next((x for x in r["results"] if x["case"] == "plain"), None)
    for x in r["results"]:
        if plain is None or x is plain:
            continue
        parts = [f"{names[x['case']]}: opt step {x['opt_step_s'] / plain['opt_step_s']:.2f}x, "
                 f"train step {100 * (x['train_step_s'] / plain['train_step_s'] - 1):+.1f}% vs AdamW"]
        if gpu:
            def peak(y):
                return max(y["peak_forward_backward"], y["peak_opt_step"])

            parts.append(f"GPU memory between steps {_mb(plain['alloc_between_steps'] - x['alloc_between_steps'])} MB "
                         f"lower ({100 * (x['alloc_between_steps'] / plain['alloc_between_steps'] - 1):+.1f}%), peak of "
                         f"the training step {100 * (peak(x) / peak(plain) - 1):+.1f}%")
        if "restore_s" in x:
            parts.append(f"last restore {x['restore_s'] * 1e3:.1f} ms, offload {x['offload_s'] * 1e3:.1f} ms")
        lines.append("; ".join(parts))
    lines += r["notes"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's options (see the module docstring), checked; ``argv`` None reads sys.argv. The namespace
    is what :func:`run` takes."""
    ap = argparse.ArgumentParser(prog="python -m tzip.bench.offload", description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=8, help="training steps per case (default 8)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every case, in turn; timings pooled (default 1)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the timings (default 2)")
    ap.add_argument("--pairs", type=int, default=8, help="sentence pairs per step (default 8)")
    ap.add_argument("--max-length", type=int, default=128, help="tokens per sentence (default 128)")
    ap.add_argument("--codec", default=None, choices=[c for c in CODECS if c != "raw"],
                    help="default: tzip's own for the device (fast for CUDA tensors, auto on the CPU); on an H100 auto picked "
                         "max for GPU state and gradients, whose GPU encoder runs at ~2.3 GB/s")
    ap.add_argument("--chunk-mib", type=float, default=64, help="CompressedOffload chunk_bytes in MiB (0: one request)")
    ap.add_argument("--gpu-arena-keep-mib", type=float, default=None,
                    help="the offload client's gpu_arena_keep_bytes in MiB (default: the client's, 128)")
    ap.add_argument("--sm-budget", type=int, default=None,
                    help="CompressedOffload's sm_budget: SMs of the GPU codec during the optimizer step (0: every SM; "
                         "default: the daemon's, 10)")
    ap.add_argument("--cases", default=",".join(ALL_CASES), help=f"comma-separated, of {', '.join(ALL_CASES)}")
    ap.add_argument("--socket", help="use the daemon on this socket instead of starting one")
    ap.add_argument("--json", action="store_true", help="print the raw results as JSON")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    args.codec = codec_for(args.codec, args.device == "cuda")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    r = run(args)
    print(json.dumps(r, indent=2) if args.json else report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
