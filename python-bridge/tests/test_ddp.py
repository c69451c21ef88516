"""tzip.ddp: the lossless comm hook in real DistributedDataParallel training on gloo worker processes and a real
daemon (one per module).

The same training run (same initial weights, same per-rank data, same seeds) is done with plain DDP, with the hook
at codec="raw" and with the hook compressing; the losses (their float bits) and the final parameters (their bytes)
must agree bit for bit: hook == raw hook on 4 ranks, and == plain DDP on 2 ranks (where the order of a sum of two
cannot matter). Covers several buckets (small bucket_cap_mb), gradient_as_bucket_view both ways, no_sync()
accumulation over more than two iterations, the bucket rebuild after the first iteration, a bf16 model, the bundled
real model (all-MiniLM-L6-v2) on real text, and the daemon away (raw frames, one warning; strict raises).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import tzip.ddp
import tzip.distributed as tzd
from tzip.in_process import InProcessCodec

from dist_support import Pools, bits, minilm_batches, run_without_daemon
from test_client_support import shared_daemon  # noqa: F401


@pytest.fixture(scope="module")
def pools(shared_daemon):  # noqa: F811
    # cuBLAS is deterministic (torch.use_deterministic_algorithms) only with a fixed workspace: the GPU variant
    p = Pools({"TZIP_SOCKET": shared_daemon.socket, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    yield p
    p.close()


# --- worker side ------------------------------------------------------------------------------------------------------


def mlp(dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    """1.45 M parameters (5.8 MB in fp32), five 512x512 layers: with bucket_cap_mb=1, DDP all-reduces them in one
    bucket the first iteration and in six after its rebuild."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 512), torch.nn.GELU()]
    for _ in range(5):
        layers += [torch.nn.Linear(512, 512), torch.nn.GELU()]
    m = torch.nn.Sequential(*layers, torch.nn.Linear(512, 8))
    return m.to(device=device, dtype=dtype)


def mlp_batches(rank: int, n: int, dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(n):
        x = torch.randn(16, 256, generator=g).to(device=device, dtype=dtype)
        y = torch.randn(16, 8, generator=g).to(device=device, dtype=dtype)
        yield lambda model, x=x, y=y: torch.nn.functional.mse_loss(model(x), y)


def run(rank, mode: str, model: torch.nn.Module, batches, steps: int, accum: int, bucket_view: bool,
        bucket_cap_mb: float, strict: bool = False, lr: float = 0.05, find_unused: bool = False):
    """Trains ``model`` with DDP: ``steps`` optimizer steps of ``accum`` micro-batches (all but the last under
    no_sync()). ``mode``: "plain" (no hook) or the hook's codec, coded by the daemon, or in this process
    (tzip.in_process) when it ends in "@in-process". Returns the loss bits, the parameters' sha256 and the hook state's
    counters."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(7 + rank)  # dropout masks: the same in every mode
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=bucket_view,
              device_ids=None if next(model.parameters()).device.type == "cpu" else [0],
              find_unused_parameters=find_unused)
    state = None
    if mode != "plain":
        codec, _, where = mode.partition("@")
        client = InProcessCodec() if where == "in-process" else None
        state = tzip.ddp.LosslessState(codec=codec, strict=strict, client=client)
        ddp.register_comm_hook(state, tzip.ddp.lossless_allreduce_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr)
    losses = []
    batches = iter(batches)
    for _ in range(steps):
        for micro in range(accum):
            loss_of = next(batches)
            if micro < accum - 1:
                with ddp.no_sync():
                    loss = loss_of(ddp)
                    loss.backward()
            else:
                loss = loss_of(ddp)
                loss.backward()
            losses.append(int(bits(loss.float().reshape(1))[0]))
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the gradients: they may be views of the buckets
    digest = hashlib.sha256(b"".join(bits(p).numpy().tobytes() for p in model.parameters())).hexdigest()
    counts = (state.bytes_raw, state.bytes_sent, state.buckets) if state else None
    return losses, digest, counts


def w_mlp(rank, world, modes, dtype="float32", bucket_view=True, steps=4, accum=2, device="cpu"):
    dt = getattr(torch, dtype)
    if device == "cuda":
        torch.cuda.set_device(0)
    return {mode: run(rank, mode, mlp(dt, device), mlp_batches(rank, steps * accum, dt, device), steps, accum,
                      bucket_view, bucket_cap_mb=1) for mode in modes}


class WithUnused(torch.nn.Module):
    """The MLP of :func:`mlp` beside a layer the forward pass never uses (DDP's find_unused_parameters case)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.body = mlp(dtype)
        self.unused = torch.nn.Linear(512, 512).to(dtype)

    def forward(self, x):
        return self.body(x)


def w_find_unused(rank, world, modes, steps=3, accum=2):
    return {mode: run(rank, mode, WithUnused(torch.float32), mlp_batches(rank, steps * accum, torch.float32), steps,
                      accum, True, bucket_cap_mb=0.25, find_unused=True) for mode in modes}


def w_real_model(rank, world, modes, steps=2, pairs_per_rank=3, max_length=32):
    """all-MiniLM-L6-v2 on its model card's sentence pairs (each rank its own pairs), the training objective of
    tzip.demo_data (symmetric in-batch cross-entropy of scaled cosine similarities), dropout on."""
    from tzip import demo_data

    out = {}
    for mode in modes:
        model = demo_data.load_model()
        model.train()
        # the pooler is not part of the objective: without it every parameter gets a gradient (no unused parameters)
        model.pooler = None
        data = minilm_batches(rank, world, steps, pairs_per_rank, max_length)  # the same batches for every mode
        out[mode] = run(rank, mode, model, data, steps, 1, bucket_view=True, bucket_cap_mb=25, lr=2e-5)
    return out


def w_daemon_away(rank, world):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = w_mlp(rank, world, ["raw", "auto"], steps=3, accum=2)
    ours = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "tzip" in str(w.message)]
    try:
        run(rank, "auto", mlp(torch.float32), mlp_batches(rank, 1, torch.float32), 1, 1, True, 1, strict=True)
        strict = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        strict = f"{type(e).__name__}: {e}"
    t = torch.ones(3)
    tzd.all_reduce(t, codec="raw")  # the group is still in step
    return got, ours, strict, t.tolist()


def w_hook_group_timeout(rank, world):
    """The timeout of the hook's own group, in seconds (the pool's process group has 30 s)."""
    group = tzip.ddp.LosslessState()._wire_group()
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


# --- tests ------------------------------------------------------------------------------------------------------------


def assert_identical(results, modes, world):
    for rank, res in enumerate(results):
        for mode in modes[1:]:
            assert res[mode][0] == res[modes[0]][0], (rank, mode, "losses")
            assert res[mode][1] == res[modes[0]][1], (rank, mode, "parameters")
    digests = {res[m][1] for res in results for m in modes}
    assert len(digests) == 1  # every rank holds the same parameters


@pytest.mark.parametrize("bucket_view", [True, False])
def test_two_ranks_hook_equals_plain_ddp(pools, bucket_view):
    modes = ["plain", "raw", "auto"]
    results = pools(2).run(w_mlp, timeout=600, modes=modes, bucket_view=bucket_view)
    assert_identical(results, modes, 2)
    steps = 4
    for res in results:
        raw_raw, raw_sent, buckets = res["raw"][2]
        auto_raw, auto_sent, auto_buckets = res["auto"][2]
        assert buckets == auto_buckets and buckets == 1 + 6 * (steps - 1)  # one bucket, then six after the rebuild
        assert raw_raw == auto_raw and raw_sent > raw_raw  # raw: every byte, plus the headers
        assert auto_sent < auto_raw  # the gradients compress


def test_two_ranks_hook_coding_in_process_equals_plain_ddp(pools):
    modes = ["plain", "raw", "auto@in-process", "fast@in-process"]
    results = pools(2).run(w_mlp, timeout=600, modes=modes, steps=3, accum=2)
    assert_identical(results, modes, 2)
    for res in results:
        assert res["fast@in-process"][2][1] < res["fast@in-process"][2][0]  # the gradients compress


def test_two_ranks_bf16_model_equals_plain_ddp(pools):
    modes = ["plain", "raw", "auto"]
    results = pools(2).run(w_mlp, timeout=600, modes=modes, dtype="bfloat16", steps=3, accum=3)
    assert_identical(results, modes, 2)


def test_find_unused_parameters_two_ranks_equals_plain_ddp(pools):
    # DDP all-reduces its map of used parameters on the model's group from the autograd thread while the hook's worker
    # thread all-reduces buckets: on one group the two reached the ranks in different orders and every run hung until
    # the group's timeout (an adversarial pass found it; the hook now has a group of its own).
    modes = ["plain", "raw", "auto"]
    results = pools(2).run(w_find_unused, timeout=300, modes=modes)
    assert_identical(results, modes, 2)
    for res in results:
        assert res["auto"][2][2] > 0  # buckets all-reduced by tzip


def test_four_ranks_hook_equals_raw(pools):
    modes = ["raw", "auto", "max"]
    results = pools(4).run(w_mlp, timeout=600, modes=modes, steps=3, accum=2)
    assert_identical(results, modes, 4)


def test_real_model_two_ranks_equals_plain_ddp(pools):
    modes = ["plain", "auto"]
    results = pools(2).run(w_real_model, timeout=900, modes=modes)
    assert_identical(results, modes, 2)
    for res in results:
        raw, sent, buckets = res["auto"][2]
        assert buckets >= 2 and sent < 0.8 * raw, res["auto"][2]  # real gradients: well under the raw bytes


def test_daemon_away_hook_sends_raw_once_warned_strict_raises():
    results = run_without_daemon(2, w_daemon_away, timeout=600)
    assert_identical([r[0] for r in results], ["raw", "auto"], 2)
    for got, warned, strict, after in results:
        assert len(warned) == 1, warned
        raw, sent, _ = got["auto"][2]
        assert sent > raw  # raw frames
        # DDP raises RuntimeError from backward; its message names the hook's own error (not "Unable to cast")
        assert strict is not None and ("DaemonUnavailableError: " in strict or "DaemonSpawnError: " in strict), strict
        assert after == [2.0] * 3


def test_hook_group_has_the_jobs_timeout(pools):
    # made with torch's default (30 minutes), a stalled peer held the other ranks for 30 minutes whatever timeout the
    # job gave init_process_group
    assert pools(2).run(w_hook_group_timeout, timeout=120) == [30.0, 30.0]


EXIT_SCRIPT = """
import datetime, sys, weakref
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import tzip.ddp
rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)),
            bucket_cap_mb=0.05)
state = tzip.ddp.LosslessState(codec="raw")
model.register_comm_hook(state, tzip.ddp.lossless_allreduce_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()
wire = weakref.ref(state._wire_group())
dist.destroy_process_group()
print("hook group freed:", wire() is None, flush=True)
"""  # the model and the state stay alive to the end, as in a training script's globals


def test_destroy_process_group_frees_the_hook_group_and_ranks_exit_cleanly(tmp_path):
    # When the state held its group strongly, destroy_process_group() could not free it: gloo's threads outlived it,
    # and one of them sometimes took the GIL during interpreter shutdown, killing the rank with SIGABRT ("terminate
    # called without an active exception").
    script = tmp_path / "train.py"
    script.write_text(EXIT_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", str(tmp_path / "store")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "hook group freed: True" in out, (p.returncode, out[-2000:])


def test_state_pickles_without_group_client_or_thread():
    s = tzip.ddp.LosslessState(codec="max", strict=True)
    s.bytes_raw, s.bytes_sent, s.buckets = 100, 40, 3
    back = pickle.loads(pickle.dumps(s))
    assert (back.codec, back.strict, back.bytes_raw, back.bytes_sent, back.buckets) == ("max", True, 100, 40, 3)
    assert back.process_group is None and back.client is None and back.ratio == 0.4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_two_ranks_one_gpu_hook_equals_plain_ddp(pools):
    modes = ["plain", "raw", "auto", "fast@in-process"]
    results = pools(2).run(w_mlp, timeout=600, modes=modes, device="cuda", steps=3, accum=2)
    assert_identical(results, modes, 2)
