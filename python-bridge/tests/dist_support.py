"""Shared helpers of the torch.distributed tests (test_distributed.py, test_ddp.py): a pool of real worker
processes joined in one gloo process group (a FileStore in a private temporary folder, sockets on 127.0.0.1),
which runs test functions by name on every rank and hands their return values back.

Every wait is bounded: the process group has a timeout of ``pg_timeout_s`` (a collective that cannot complete
raises in the workers instead of hanging), and :meth:`WorkerPool.run` kills the pool when a task is not done within
its ``timeout`` and fails with the tail of each worker's stderr. A task that raised on any rank leaves the pool
marked dirty (its ranks may be out of step): the next task starts a fresh pool. Functions that expect an error
catch it themselves and return what they saw, so the group stays usable.

Workers are started with ``sys.executable`` and the test folder on their path; they import the module that defines
the function (e.g. ``test_distributed``) and call ``fn(rank, world_size, **kwargs)`` with the default process group
initialised. Return values travel pickled (plain data: bytes, ints, strings; tensors are pickled by value).

Run as a script (``python dist_support.py --worker ...``) it is that worker.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import socket
from multiprocessing.connection import Connection
from pathlib import Path

HERE = Path(__file__).resolve().parent


class WorkerError(AssertionError):
    """A task raised on one or more ranks; the message holds each failing rank's traceback."""


class WorkerPool:
    """``world_size`` worker processes in one gloo process group (see the module docstring)."""

    def __init__(self, world_size: int, env: dict[str, str] | None = None, pg_timeout_s: float = 30.0,
                 start_timeout_s: float = 120.0):
        self.world_size = world_size
        self.env = dict(env or {})
        self.pg_timeout_s = pg_timeout_s
        self.start_timeout_s = start_timeout_s
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._procs: list[subprocess.Popen] = []
        self._conns: list = []
        self._logs: list[Path] = []
        self._listener: socket.socket | None = None
        self._dirty = True

    # --- lifetime ---------------------------------------------------------------------------------
    def _start(self) -> None:
        self.close()
        self._tmp = tempfile.TemporaryDirectory(prefix="tzip-dist-")
        d = Path(self._tmp.name)  # mode 0700: only this user reaches the control socket
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(d / "ctl.sock"))
        self._listener.listen(self.world_size)
        self._listener.settimeout(self.start_timeout_s)
        env = dict(os.environ)
        env.update({
            "PYTHONPATH": os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        })
        if os.path.exists("/sys/class/net/lo"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # 127.0.0.1: never a real interface
        env.update(self.env)
        store = d / "store"
        for rank in range(self.world_size):
            log = d / f"rank{rank}.log"
            self._logs.append(log)
            with open(log, "wb") as f:
                self._procs.append(subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--worker", str(d / "ctl.sock"), str(rank),
                     str(self.world_size), str(store), str(self.pg_timeout_s)],
                    stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=str(HERE)))
        conns: dict[int, Connection] = {}
        try:
            for _ in range(self.world_size):
                s, _addr = self._listener.accept()
                s.settimeout(None)
                c = Connection(s.detach())
                if not c.poll(self.start_timeout_s):
                    raise OSError("a worker connected but never said its rank")
                conns[int(c.recv())] = c
        except OSError as e:
            tails = self._tails()
            self.close()
            raise RuntimeError(f"workers did not start within {self.start_timeout_s} s ({e}):\n{tails}") from None
        self._conns = [conns[r] for r in range(self.world_size)]
        self._dirty = False

    def close(self) -> None:
        """Stops every worker (SIGKILL after a short grace) and removes the temporary folder."""
        for c in self._conns:
            try:
                c.send_bytes(b"")  # an empty task: exit
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                p.wait(10)
        for c in self._conns:
            c.close()
        self._conns, self._procs, self._logs = [], [], []
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        self._dirty = True

    def _tails(self, n: int = 4000) -> str:
        out = []
        for r, log in enumerate(self._logs):
            try:
                text = log.read_text(errors="replace")[-n:]
            except OSError:
                text = "(no log)"
            out.append(f"--- rank {r} ---\n{text}")
        return "\n".join(out)

    # --- tasks ------------------------------------------------------------------------------------
    def run(self, fn, timeout: float = 180.0, **kwargs) -> list:
        """Runs ``fn(rank, world_size, **kwargs)`` on every rank; returns the results in rank order.

        ``fn`` is a module-level function (or "module:name"). Raises WorkerError when it raised on any rank (the
        tracebacks in the message) and TimeoutError (after killing the pool) when a rank is not done within
        ``timeout`` seconds.
        """
        if self._dirty:
            self._start()
        spec = fn if isinstance(fn, str) else f"{fn.__module__}:{fn.__qualname__}"
        task = pickle.dumps((spec, kwargs))
        for c in self._conns:
            c.send_bytes(task)
        results: list = [None] * self.world_size
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        for r, c in enumerate(self._conns):
            left = deadline - time.monotonic()
            if left <= 0 or not c.poll(left):
                tails = self._tails()
                self.close()
                raise TimeoutError(f"{spec}: rank {r} not done within {timeout} s; workers killed:\n{tails}")
            try:
                status, value = pickle.loads(c.recv_bytes())
            except (EOFError, OSError):
                tails = self._tails()
                self.close()
                raise WorkerError(f"{spec}: rank {r} died:\n{tails}") from None
            if status == "ok":
                results[r] = value
            else:
                errors[r] = value
        if errors:
            self._dirty = True  # its ranks may be out of step: a fresh pool for the next task
            raise WorkerError(f"{spec} raised on rank(s) {sorted(errors)}:\n" +
                              "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        return results


class Pools:
    """Worker pools of a test module, one per world size, made on first use with ``env`` and closed together."""

    def __init__(self, env: dict[str, str] | None = None, **kwargs):
        self.env = dict(env or {})
        self.kwargs = kwargs
        self._pools: dict[int, WorkerPool] = {}

    def __call__(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is None:
            pool = self._pools[world_size] = WorkerPool(world_size, self.env, **self.kwargs)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def run_without_daemon(world_size: int, fn, timeout: float = 300.0, **kwargs) -> list:
    """``fn`` on a fresh pool whose $TZIP_SOCKET names no daemon and where none can be started ($TZIP_CLI names a
    missing file): the default clients fall back (or raise, when strict)."""
    with tempfile.TemporaryDirectory(prefix="tzip-away-") as d:
        pools = Pools({"TZIP_SOCKET": os.path.join(d, "none", "tzip.sock"), "TZIP_CLI": os.path.join(d, "no-cli.js")})
        try:
            return pools(world_size).run(fn, timeout=timeout, **kwargs)
        finally:
            pools.close()


def bits(t) -> "object":
    """``t``'s values as an integer tensor of the same width, on the CPU (for bit-exact comparisons)."""
    from tzip._dlpack import int_alias

    return int_alias(t.detach().cpu().contiguous()).clone()


def minilm_batches(rank: int, world: int, steps: int, pairs_per_rank: int = 3, max_length: int = 32):
    """The training data of the real-model tests: per step, a ``loss_of(model)`` for all-MiniLM-L6-v2 on its model
    card's sentence pairs (each rank its own ``pairs_per_rank`` pairs), with tzip.demo_data's objective (symmetric
    in-batch cross-entropy of scaled cosine similarities). Anchors and positives go through one forward (DDP expects
    one forward per backward)."""
    from tzip import demo_data

    pairs = demo_data.sentence_pairs(demo_data.readme_sentences())
    tok = demo_data.load_tokenizer(max_length)
    for step in range(steps):
        start = ((step * world + rank) * pairs_per_rank) % max(1, len(pairs) - pairs_per_rank)
        chosen = pairs[start : start + pairs_per_rank]
        batch = demo_data.tokenize([p[0] for p in chosen] + [p[1] for p in chosen], tok)

        def loss_of(model, batch=batch, k=len(chosen)):
            emb = demo_data.mean_pool_normalize(model(**batch).last_hidden_state, batch["attention_mask"])
            return demo_data.contrastive_loss(emb[:k], emb[k:])

        yield loss_of


def _worker(address: str, rank: int, world: int, store_path: str, pg_timeout_s: float) -> None:
    import datetime

    import torch.distributed as dist

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(address)
    conn = Connection(s.detach())
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    conn.send(rank)
    try:
        while True:
            try:
                task = conn.recv_bytes()
            except (EOFError, OSError):
                return
            if not task:
                return
            spec, kwargs = pickle.loads(task)
            try:
                mod, name = spec.split(":")
                fn = importlib.import_module(mod)
                for part in name.split("."):
                    fn = getattr(fn, part)
                reply = ("ok", fn(rank, world, **kwargs))
            except BaseException:  # noqa: BLE001 - everything goes back to the test
                reply = ("err", traceback.format_exc())
            try:
                conn.send_bytes(pickle.dumps(reply))
            except Exception:  # noqa: BLE001 - an unpicklable result
                conn.send_bytes(pickle.dumps(("err", traceback.format_exc())))
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip the interpreter's teardown (seconds with torch loaded); nothing is left to flush


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], float(sys.argv[6]))
    else:
        sys.exit("usage: dist_support.py --worker ADDRESS RANK WORLD STORE PG_TIMEOUT_S (started by WorkerPool)")
