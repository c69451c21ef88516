"""Where tzip pays in a training job: optimizer-state offload, compressed collectives and the DDP hook, checkpoints,
each against what a job would use without tzip, on whatever this machine has, in ONE table.

    python -m tzip.bench.training [--device cpu|cuda] [--cases offload,collectives,nccl,checkpoint] [--quick]
                                  [--json PATH] [--socket PATH] [--codec auto|fast|max]
                                  [--steps N] [--warmup N] [--rounds N] [--pairs N] [--max-length N]
                                  [--sizes MB,MB] [--ranks N] [--repeat N] [--inputs minilm-f32,minilm-bf16]
                                  [--in-process]

Every case is one of the project's benchmark modules, run in this process (or its ranks) with the options shown
in the report, its figures turned into rows here:

* ``offload`` (:mod:`tzip.bench.offload`): all-MiniLM-L6-v2, fp32, AdamW, trained ``--steps`` steps of ``--pairs``
  sentence pairs of ``--max-length`` tokens on the model card's text, ``--rounds`` times in turn; the median
  training step (zero_grad + forward + backward + optimizer step) of ``tzip.optim.CompressedOffload`` (``--codec``)
  against plain AdamW on the device, against the same offload uncompressed (``codec="raw"``) and, on a GPU with
  torchao installed, against torchao's ``CPUOffloadOptimizer``. Bytes saved: the optimizer state's host memory
  (CPU), the GPU memory held between steps (against AdamW on a GPU), the pinned host memory (against torchao).
* ``collectives`` (:mod:`tzip.bench.collectives`): ``--ranks`` processes, gloo on 127.0.0.1, each rank's own real
  MiniLM gradients, bf16 and fp32 buckets of ``--sizes`` MB: ``tzip.distributed.all_reduce`` against plain
  ``dist.all_reduce`` (median of ``--repeat``, rank 0's wall clock), and the DDP forward+backward step of the model
  with ``tzip.ddp.lossless_allreduce_hook`` against plain DDP; ``--in-process``: tzip codes in each rank's own
  process (:mod:`tzip.in_process`) instead of through the daemon. With ``--device cuda`` the tensors are CUDA tensors
  (the frames cross the host: gloo), ranks sharing the GPUs there are. Bytes saved: what rank 0 sends (per
  all-reduce, per DDP step).
* ``nccl``: the same with ``--backend nccl``: needs ``--device cuda`` and one GPU per rank.
* ``checkpoint`` (:mod:`tzip.bench.checkpoint`): the trained weights (``--inputs``), written with fsync and read
  back (then every 4 KiB page touched, so that safetensors' mmap pays its page faults), warm page cache, median of
  ``--repeat``: ``tzip.save`` / ``tzip.load`` against ``torch.save`` / ``torch.load`` and safetensors, and DCP with
  ``tzip.checkpoint.Writer`` / ``Reader`` against DCP's ``FileSystemWriter`` (and its ZStandard extension when
  installed). With ``--device cuda`` the state dicts are CUDA tensors and every load targets the GPU
  (``map_location="cuda"``). Bytes saved: on disk.

The table's columns: case; baseline (what, and its median time); tzip (what, and its median time); tzip/baseline
(time ratio: below 1 tzip is faster); bytes saved (baseline bytes - tzip bytes, MB = 10**6 bytes; negative: tzip
holds more); bit-identical: ``yes`` when the tzip run equals its reference bit for bit (integer views, never float
equality): offload, every step's loss and the final parameters equal plain AdamW's (and so the raw offload's);
all-reduce and DDP, the result equals ``codec="raw"``'s and, on two ranks (where the reduction order cannot
matter), plain PyTorch's, on every rank; checkpoint, every loaded tensor equals the saved one. A case that cannot
run here (no GPU, one GPU for an NCCL case, torchao or zstandard not installed, no daemon) gets a row saying why.

The machine (CPU, cores, memory; GPUs: name, SM count, memory), the command and every case's settings are printed
before the table. ``--json PATH`` writes the rows and every case's full figures. Exit status 1 when a row that ran
is not bit-identical or a case failed, else 0. Unless ``--socket`` is given, one private daemon serves the whole
run and is stopped afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import traceback
from typing import Any, Callable

import torch

from .._codec_choice import codec_for  # (no dependencies: safe to import here)

# The benchmark modules (and the client under them, which needs pyzmq) are imported when the cases run, so that a
# machine without them gets rows saying why instead of an ImportError.

ALL_CASES = ("offload", "collectives", "nccl", "checkpoint")
HEAD = ("case", "baseline", "tzip", "tzip/baseline", "bytes saved", "bit-identical")

# Per-case settings: CPU-friendly defaults, --quick (the CI smoke test: seconds per case on 2 cores) and the GPU's
# longer offload run (a GPU step is ~50 ms: more steps cost little and steady the median).
DEFAULTS = {
    "cpu": {"steps": 6, "warmup": 2, "rounds": 3, "pairs": 8, "max_length": 128, "sizes": "25,100", "repeat": 5,
            "inputs": "minilm-f32,minilm-bf16"},
    "cuda": {"steps": 12, "warmup": 3, "rounds": 2, "pairs": 8, "max_length": 128, "sizes": "25,100", "repeat": 5,
             "inputs": "minilm-f32,minilm-bf16"},
    "quick": {"steps": 3, "warmup": 1, "rounds": 1, "pairs": 2, "max_length": 32, "sizes": "1", "repeat": 1,
              "inputs": "minilm-bf16"},
}


def machine() -> dict[str, Any]:
    """What this machine has: {"text": one line, "cpu": model name, "cores", "memory_bytes", "gpus": [{"name",
    "sms", "memory_bytes"}], "torch"}."""
    cpu, mem = "", 0
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
        with open("/proc/meminfo") as f:
            mem = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal:")), 0)
    except (OSError, ValueError):
        pass
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "sms": p.multi_processor_count, "memory_bytes": p.total_memory})
    gpu_text = "; ".join(f"GPU {i}: {g['name']}, {g['sms']} SMs, {g['memory_bytes'] / 2**30:.0f} GiB"
                         for i, g in enumerate(gpus)) or "no GPU"
    text = (f"{cpu or platform.processor() or platform.machine()}, {os.cpu_count()} cores, {mem / 2**30:.0f} GiB RAM; "
            f"{gpu_text}; {platform.system()} {platform.release()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}")
    return {"text": text, "cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "gpus": gpus,
            "torch": torch.__version__}


# --- rows -------------------------------------------------------------------------------------------------------

def _row(case: str, baseline: str = "", base_s: float | None = None, tzip: str = "", tzip_s: float | None = None,
         saved: int | None = None, where: str = "", compressed: float | None = None, identical: bool | None = None,
         skipped: str | None = None, error: str | None = None) -> dict[str, Any]:
    """One table row; times in seconds, ``saved`` in bytes (``where``: of what; ``compressed``: tzip's bytes /
    uncompressed bytes there). A skipped or failed row carries only its case and why."""
    ratio = tzip_s / base_s if base_s and tzip_s is not None else None
    return {"case": case, "baseline": baseline, "baseline_s": base_s, "tzip": tzip, "tzip_s": tzip_s, "ratio": ratio,
            "bytes_saved": saved, "saved_where": where, "compressed": compressed, "identical": identical,
            "skipped": skipped, "error": error}


def _offload_rows(r: dict, device: str) -> list[dict]:
    by = {x["case"]: x for x in r["results"]}
    tz, codec = by["offload"], r["codec"]
    ok = bool(tz["identical"])
    gpu = device == "cuda"
    size = f"{2 * r['pairs']}x{r['max_length']} tokens"
    tzip, c = f"CompressedOffload {codec}", tz["ratio"]
    rows = []
    if "plain" in by:
        p = by["plain"]
        if gpu:  # the state leaves the GPU: what the device keeps between steps is the saving
            saved, where = p["alloc_between_steps"] - tz["alloc_between_steps"], "GPU memory between steps"
        else:
            saved, where = p["host_bytes"] - tz["host_bytes"], "RAM of optimizer state"
        rows.append(_row(f"offload, train step {size}: vs AdamW", "AdamW", p["train_step_s"], tzip,
                         tz["train_step_s"], saved, where, c, ok))
    if "raw" in by:
        raw = by["raw"]
        rows.append(_row(f"offload, train step {size}: vs same, uncompressed", "CompressedOffload raw",
                         raw["train_step_s"], tzip, tz["train_step_s"], raw["host_bytes"] - tz["host_bytes"],
                         "pinned host memory" if gpu else "RAM of optimizer state", c, ok and bool(raw["identical"])))
    if "torchao" in by:
        ao = by["torchao"]
        rows.append(_row(f"offload, train step {size}: vs torchao", "torchao CPUOffloadOptimizer",
                         ao["train_step_s"], tzip, tz["train_step_s"], ao["host_bytes"] - tz["host_bytes"],
                         "pinned host memory", c, ok))
    else:
        why = next((n for n in r["notes"] if "torchao" in n), "not in --cases")
        rows.append(_row("offload: vs torchao CPUOffloadOptimizer", skipped=why))
    return rows


def _collective_rows(r: dict, label: str) -> list[dict]:
    from . import collectives

    n, codec = r["ranks"], r["codec"]
    where = ", in-process" if r.get("daemon") == "in-process" else ""  # (tzip.bench.collectives --in-process)

    def identical(flags: dict, compressed_vs_raw: str) -> bool:
        # the project's rule: equal to the raw run; on two ranks also to plain PyTorch
        return collectives._identity(flags, compressed_vs_raw, n) == "yes"

    rows = []
    for x in r["results"]:
        bytes_raw, bytes_sent = x["traffic"][codec]
        dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(x["dtype"], x["dtype"])
        rows.append(_row(f"all-reduce {dtype} {x['mb']:g} MB, {n} {label} ranks", "dist.all_reduce",
                         x["seconds"]["plain"], f"tzip.distributed {codec}{where}", x["seconds"][codec],
                         bytes_raw - bytes_sent, "sent by rank 0", bytes_sent / bytes_raw,
                         identical(x["identical"], "codec_vs_raw")))
    d = r.get("ddp")
    if d:
        rows.append(_row(f"DDP fwd+bwd step, MiniLM fp32, {n} {label} ranks", "plain DDP", d["step_s_plain"],
                         f"lossless hook {codec}{where}", d["step_s_hook"], d["bytes_plain"] - d["bytes_hook"],
                         "sent by rank 0 per step", d["bytes_hook"] / d["bytes_plain"],
                         identical(d["identical"], "hook_vs_raw")))
    return rows


# (baseline method of tzip.bench.checkpoint, the tzip method compared with it, the names of the two loads)
_CHECKPOINT_PAIRS = (
    ("torch.save", "tzip.save ({codec})", "torch.load", "tzip.load"),
    ("safetensors", "tzip.save ({codec})", "safetensors load_file", "tzip.load"),
    ("DCP FileSystemWriter", "DCP tzip.checkpoint ({codec})", "DCP FileSystemReader", "DCP tzip Reader"),
    ("DCP FileSystemWriter+ZStandard", "DCP tzip.checkpoint ({codec})", "DCP Reader+ZStandard", "DCP tzip Reader"),
)


def _checkpoint_rows(r: dict, codec: str) -> list[dict]:
    rows = []
    inputs = list(dict.fromkeys(x["input"] for x in r["rows"]))
    for inp in inputs:
        by = {x["method"]: x for x in r["rows"] if x["input"] == inp}
        for base, tz, base_load, tz_load in _CHECKPOINT_PAIRS:
            tz = tz.format(codec=codec)
            if base not in by:
                why = next((n for n in r["notes"] if base in n), f"{base} did not run")
                rows.append(_row(f"checkpoint {inp}: vs {base}", skipped=why))
                continue
            b, t = by[base], by[tz]
            saved = b["bytes"] - t["bytes"]
            name = tz.replace(" (", " ").rstrip(")")  # "tzip.save (auto)": "tzip.save auto"
            rows.append(_row(f"checkpoint {inp} save+fsync: vs {base}", base, b["save_fsync_s"], name,
                             t["save_fsync_s"], saved, "on disk", t["ratio"], t["bit_exact"]))
            rows.append(_row(f"checkpoint {inp} load: vs {base_load}", base_load, b["load_touch_s"], tz_load,
                             t["load_touch_s"], saved, "on disk", t["ratio"], t["bit_exact"]))
    return rows


# --- the cases ----------------------------------------------------------------------------------------------------

class _Case:
    """One case of the table: the sub-benchmark's argv, how to run it and how its result becomes rows."""

    def __init__(self, name: str, module: str, argv: list[str], run: Callable[[list[str]], dict],
                 rows: Callable[[dict], list[dict]], needs_gpu_daemon: bool):
        self.name, self.module, self.argv, self.run, self.rows = name, module, argv, run, rows
        self.needs_gpu_daemon = needs_gpu_daemon

    @property
    def command(self) -> str:
        """The sub-benchmark's command line, less the run's private ``--socket`` (without it, it starts its own)."""
        i = self.argv.index("--socket")
        return f"python -m {self.module} " + " ".join(self.argv[:i] + self.argv[i + 2:])


def _cases(a: argparse.Namespace, socket: str) -> list[_Case | dict]:
    """The cases of ``a.cases`` in table order: a _Case to run, or a skipped row where this machine cannot run it."""
    from . import checkpoint, collectives, offload

    dev, out = a.device, []
    for name in a.cases:
        if name == "offload":
            cases = "plain,offload,raw" + (",torchao" if dev == "cuda" else "")
            argv = ["--device", dev, "--steps", str(a.steps), "--warmup", str(a.warmup), "--rounds", str(a.rounds),
                    "--pairs", str(a.pairs), "--max-length", str(a.max_length), "--codec", a.codec, "--cases", cases,
                    "--socket", socket]

            def run_offload(argv):
                r = offload.run(offload.parse_args(argv))
                if dev != "cuda":
                    r["notes"].append("torchao's CPUOffloadOptimizer offloads a GPU's parameters: needs --device cuda")
                return r

            out.append(_Case(name, "tzip.bench.offload", argv, run_offload, lambda r: _offload_rows(r, dev),
                             dev == "cuda"))
        elif name in ("collectives", "nccl"):
            backend = "gloo" if name == "collectives" else "nccl"
            if backend == "nccl" and (dev != "cuda" or torch.cuda.device_count() < a.ranks):
                why = ("needs --device cuda and a GPU per rank" if dev != "cuda" else
                       f"needs {a.ranks} GPUs (one per rank), {torch.cuda.device_count()} visible")
                out.append(_row(f"all-reduce and DDP, {a.ranks} NCCL ranks", skipped=why))
                continue
            argv = ["--ranks", str(a.ranks), "--device", dev, "--backend", backend, "--sizes", a.sizes,
                    "--repeat", str(a.repeat), "--codec", a.codec, "--socket", socket] + (["--in-process"] if a.in_process else [])
            out.append(_Case(name, "tzip.bench.collectives", argv,
                             lambda argv: collectives.run(collectives.parse_args(argv)),
                             lambda r, label=backend if backend == "gloo" else "NCCL": _collective_rows(r, label),
                             dev == "cuda"))
        elif name == "checkpoint":
            argv = ["--device", dev, "--inputs", a.inputs, "--repeat", str(a.repeat), "--codec", a.codec,
                    "--socket", socket]
            out.append(_Case(name, "tzip.bench.checkpoint", argv,
                             lambda argv: checkpoint.measure(checkpoint.parse_args(argv)),
                             lambda r: _checkpoint_rows(r, a.codec), dev == "cuda"))
    return out


def _model_problem() -> str | None:
    """Why the bundled model (what every case trains or saves) cannot be loaded here, or None."""
    try:
        from ..demo_data import model_dir

        model_dir()
    except Exception as e:  # RuntimeError without the package, FileNotFoundError with a broken one
        return f"the bundled model is not installed ({type(e).__name__}: {e})"
    return None


def _daemon_problem(socket: str, device: str) -> tuple[str | None, str | None]:
    """(why no case can use the daemon, why no GPU case can), each None when there is no such problem."""
    try:
        from ..client import Client

        with Client(socket, spawn=False, strict=True) as c:
            info = c.daemon_info
    except Exception as e:  # ImportError (no pyzmq), an unreachable daemon: every case needs it
        return f"the tzip daemon is not reachable: {type(e).__name__}: {e}", None
    if device == "cuda" and not info.get("gpu"):
        return None, f"the tzip daemon serves no GPU ({info.get('gpu_reason') or 'no reason given'})"
    return None, None


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Every case of ``a`` (:func:`parse_args`) in turn: {"machine": :func:`machine`, "command", "device",
    "cases": {name: {"command", "result" (the sub-benchmark's figures) or "error"}}, "rows": the table's rows
    (dicts, see :func:`_row`)}. A case that fails becomes an error row (its traceback on stderr); the daemon not
    starting makes every case a skipped row with its message."""
    if a.device == "cuda":
        # deterministic cuBLAS for the runs that must agree bit for bit; set before any cuBLAS handle exists (the
        # ranks of the collectives inherit it)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    mach = machine()
    report: dict[str, Any] = {"machine": mach, "device": a.device, "codec": a.codec,
                              "command": "python -m tzip.bench.training " + " ".join(a.argv), "cases": {}, "rows": []}
    rows = report["rows"]
    try:
        from .daemon import _daemon_socket
    except ImportError as e:  # pyzmq (or another of the client's modules) missing
        why = f"the tzip Python client cannot load ({type(e).__name__}: {e})"
        rows += [_row(name, skipped=why) for name in a.cases]
        return report
    no_model = _model_problem()
    if no_model:
        rows += [_row(name, skipped=no_model) for name in a.cases]
        return report
    try:
        daemon = _daemon_socket(a.socket)
        socket = daemon.__enter__()
    except Exception as e:  # no node / CLI (DaemonSpawnError), or the daemon exited at once (RuntimeError)
        why = f"the tzip daemon cannot start: {type(e).__name__}: {e}"
        rows += [_row(f"{name}", skipped=why) for name in a.cases]
        return report
    try:
        no_daemon, no_gpu_daemon = _daemon_problem(socket, a.device)
        for case in _cases(a, socket):
            if isinstance(case, dict):  # skipped before running
                rows.append(case)
                continue
            why = no_daemon or (no_gpu_daemon if case.needs_gpu_daemon else None)
            if why:
                rows.append(_row(case.name, skipped=why))
                continue
            print(f"[bench_training] {case.name}: {case.command}", file=sys.stderr, flush=True)
            entry: dict[str, Any] = {"command": case.command}
            report["cases"][case.name] = entry
            try:
                entry["result"] = case.run(case.argv)
                rows += case.rows(entry["result"])
            except BaseException as e:  # SystemExit of a sub-benchmark's checks too: a row, not the end of the run
                if isinstance(e, KeyboardInterrupt):
                    raise
                traceback.print_exc()
                entry["error"] = f"{type(e).__name__}: {e}"
                rows.append(_row(case.name, error=entry["error"]))
    finally:
        daemon.__exit__(None, None, None)
    return report


# --- output -------------------------------------------------------------------------------------------------------

def _ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def cells(row: dict) -> list[str]:
    """The table cells of one row (:data:`HEAD` order)."""
    if row["skipped"] or row["error"]:
        return [row["case"], f"skipped: {row['skipped']}" if row["skipped"] else f"ERROR: {row['error']}",
                "-", "-", "-", "-"]
    saved = "-" if row["bytes_saved"] is None else f"{row['bytes_saved'] / 1e6:.1f} MB {row['saved_where']}"
    if row["compressed"] is not None:
        saved += f" (ratio {row['compressed']:.3f})"
    return [row["case"], f"{row['baseline']} {_ms(row['baseline_s'])}", f"{row['tzip']} {_ms(row['tzip_s'])}",
            "-" if row["ratio"] is None else f"{row['ratio']:.2f}", saved,
            {True: "yes", False: "NO", None: "-"}[row["identical"]]]


def table(rows: list[dict]) -> str:
    """The rows as one markdown table (:data:`HEAD` columns)."""
    body = [cells(r) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(HEAD)]
    line = lambda cs: "| " + " | ".join(c.ljust(w) for c, w in zip(cs, widths)) + " |"  # noqa: E731
    return "\n".join([line(HEAD), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(b) for b in body)])


def report_text(r: dict) -> str:
    """The printed report: machine, command, every case's command, then the table (last)."""
    lines = [f"where tzip pays -- {r['machine']['text']}", f"command: {r['command']}",
             f"tensors on {r['device']}, codec {r['codec']}; times are medians; tzip/baseline < 1: tzip faster; "
             f"bytes saved = baseline - tzip (MB = 10**6 bytes)"]
    for name, c in r["cases"].items():
        lines.append(f"  {name}: {c['command']}" + (f"  -> {c['error']}" if "error" in c else ""))
    for name, c in r["cases"].items():
        for note in (c.get("result") or {}).get("notes", []):
            lines.append(f"  note ({name}): {note}")
    return "\n".join(lines) + "\n\n" + table(r["rows"])


def ok(r: dict) -> bool:
    """True when no case failed and every row that ran is bit-identical."""
    return all(not row["error"] and (row["skipped"] or row["identical"]) for row in r["rows"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's options (see the module docstring), with the per-device (or --quick) defaults filled
    in; ``argv`` None reads sys.argv. Exits with a usage error for an unknown case or --device cuda without a GPU."""
    ap = argparse.ArgumentParser(prog="python -m tzip.bench.training", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the model, gradients and checkpoints live (default: cuda when a GPU is visible)")
    ap.add_argument("--cases", default=",".join(ALL_CASES), help=f"comma-separated, of {', '.join(ALL_CASES)}")
    ap.add_argument("--quick", action="store_true", help="tiny settings for a smoke test (seconds per case)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows and every case's figures to PATH")
    ap.add_argument("--socket", help="use the daemon on this socket instead of starting one")
    ap.add_argument("--codec", default=None, choices=["auto", "fast", "max"],
                    help="default: tzip's own for the device (fast for CUDA tensors, auto on the CPU); on an H100 auto picked "
                         "max for GPU state and gradients, whose GPU encoder runs at ~2.3 GB/s")
    ap.add_argument("--steps", type=int, help="offload: training steps per case and round")
    ap.add_argument("--warmup", type=int, help="offload: first steps of a round left out of the timings")
    ap.add_argument("--rounds", type=int, help="offload: runs of every case, in turn")
    ap.add_argument("--pairs", type=int, help="offload: sentence pairs per step")
    ap.add_argument("--max-length", type=int, help="offload: tokens per sentence")
    ap.add_argument("--ranks", type=int, default=2, help="collectives: processes (default 2)")
    ap.add_argument("--sizes", help="collectives: bucket sizes, MB, comma-separated")
    ap.add_argument("--repeat", type=int, help="collectives and checkpoint: timed runs per method")
    ap.add_argument("--inputs", help="checkpoint: comma-separated inputs of tzip.bench.checkpoint")
    ap.add_argument("--in-process", action="store_true", help="collectives and nccl: code in each rank's process "
                    "(tzip.in_process.InProcessCodec) instead of through the daemon")
    a = ap.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    a.cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    unknown = sorted(set(a.cases) - set(ALL_CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {', '.join(ALL_CASES)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU visible to PyTorch")
    for k, v in DEFAULTS["quick" if a.quick else a.device].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.steps <= a.warmup:
        ap.error("--steps must exceed --warmup")
    a.codec = codec_for(a.codec, a.device == "cuda")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    r = run(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1, default=str)
    print(report_text(r), flush=True)
    return 0 if ok(r) else 1


if __name__ == "__main__":
    sys.exit(main())
