"""tzip.attach(optimizer=...) with the wrapped optimizers jobs really hold (issue 36, "Meet users where they already
train"): Accelerate's AcceleratedOptimizer (what Hugging Face Trainer's ``trainer.optimizer`` is, made here by the
real ``accelerate.Accelerator(cpu=True).prepare``), an LR scheduler holding the wrapper, and
torch.distributed.optim.ZeroRedundancyOptimizer (one gloo rank in this process). Each attached run's losses (their
float bits), parameters and state dicts (their bytes) must equal the same run without tzip, and the state must
really be offloaded (OffloadedTensor placeholders in the optimizer that holds it) while attached. A wrapper tzip
cannot reach is refused before anything changes.

One real daemon for the module (`tzip serve` on a private socket); the clients never start one of their own.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

import tzip
import tzip.attaching
import tzip.optim
from tzip.optim import OffloadedTensor

from dist_support import bits
from test_client_support import shared_daemon as daemon  # noqa: F401  (one daemon for the module)

accelerate = pytest.importorskip("accelerate")  # the test extra pins it (python-bridge/pyproject.toml)

#: Micro-batches per run; with gradient_accumulation_steps=2 the optimizer steps on every second one.
MICRO = 8


@pytest.fixture
def own_registry(monkeypatch):
    """Attaching in the pytest process: an attach state of its own (detach() leaves the process's checkpoint
    helpers on raw frames, which later test modules must not inherit)."""
    monkeypatch.setattr(tzip.attaching, "_reg", tzip.attaching._Registry())


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def batches(n: int = MICRO) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)) for _ in range(n)]


def loss_bits(loss: torch.Tensor) -> int:
    return int(bits(loss.detach().float().reshape(1))[0])


def state_dict_digest(sd: dict) -> str:
    """sha256 over the state dict's tensors (dtype, shape, device and bytes) and its other values; an
    OffloadedTensor in it fails the test (a state dict must hold plain tensors)."""
    h = hashlib.sha256()
    for i in sorted(sd["state"]):
        for k in sorted(sd["state"][i]):
            v = sd["state"][i][k]
            assert not isinstance(v, OffloadedTensor), (i, k)
            if isinstance(v, torch.Tensor):
                h.update(f"{i}.{k}:{v.dtype}:{tuple(v.shape)}:{v.device}".encode())
                h.update(bits(v).numpy().tobytes())
            else:
                h.update(f"{i}.{k}={v!r}".encode())
    h.update(repr([{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]).encode())
    return h.hexdigest()


def offloaded(opt: torch.optim.Optimizer) -> int:
    return sum(isinstance(v, OffloadedTensor) for st in opt.state.values() for v in st.values())


def trainer_run(attach_at: int | None = None, detach_at: int | None = None, client=None) -> dict:
    """What Hugging Face Trainer does with Accelerate, on the CPU: AdamW prepared by the real Accelerator (an
    AcceleratedOptimizer, which steps and zeroes only on every second micro-batch under gradient accumulation), a
    LambdaLR built on that wrapper and prepared too (AcceleratedScheduler), ``accelerator.backward``; the wrapper's
    state dict is taken (and loaded back) mid-run. ``attach_at`` / ``detach_at``: the micro-batch before which
    ``tzip.attach(optimizer=<the AcceleratedOptimizer>)`` / ``tzip.detach()`` run."""
    from accelerate.optimizer import AcceleratedOptimizer

    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = make_model()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    sched = acc.prepare(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)))
    assert type(opt) is AcceleratedOptimizer and isinstance(opt, torch.optim.Optimizer)
    inner = opt.optimizer
    out: dict = {"losses": [], "state_dicts": [], "offloaded": [], "attachment": None}
    for i, (x, y) in enumerate(batches()):
        if i == attach_at:
            out["attachment"] = tzip.attach(optimizer=opt, client=client)
        if i == detach_at:
            tzip.detach()
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        out["losses"].append(loss_bits(loss))
        out["offloaded"].append(offloaded(inner))
        sd = opt.state_dict()
        out["state_dicts"].append(state_dict_digest(sd))
        if i == 5:
            opt.load_state_dict(sd)  # a resume through the wrapper (the Trainer's _load_optimizer_and_scheduler)
    out["params"] = [bits(p).numpy().tobytes() for p in model.parameters()]
    out["lrs"] = [g["lr"] for g in inner.param_groups]
    return out


def test_trainer_accelerated_optimizer_attaches_and_is_bit_identical(daemon, own_registry):
    """attach(optimizer=AcceleratedOptimizer) used to raise AttributeError ('_optimizer_step_pre_hooks') inside
    torch after the state was already offloaded. Now the hooks go on the AdamW it wraps: between steps that AdamW's
    state holds OffloadedTensors, every step the wrapper takes (and skips, under gradient accumulation) gives the
    same losses, parameters, state dicts and learning rates, bit for bit, as the run without tzip."""
    want = trainer_run()
    with tzip.connect(daemon.socket, spawn=False) as c:
        got = trainer_run(attach_at=2, detach_at=7, client=c)
    a = got["attachment"]
    assert len(a.optimizers) == 1 and type(a.optimizers[0].optimizer) is torch.optim.AdamW
    assert all(n > 0 for n in got["offloaded"][2:7]), got["offloaded"]  # really offloaded while attached
    assert got["offloaded"][7] == 0 and got["offloaded"][:2] == [0, 0]
    assert got["losses"] == want["losses"]
    assert got["state_dicts"] == want["state_dicts"]
    assert got["params"] == want["params"]
    assert got["lrs"] == want["lrs"]


class _OpaqueWrapper(torch.optim.Optimizer):
    """A wrapper that passes isinstance(torch.optim.Optimizer), runs no Optimizer.__init__ (so its step runs no
    hooks) and keeps the optimizer it wraps where tzip cannot know it holds the state."""

    def __init__(self, inner: torch.optim.Optimizer):
        self._wrapped = inner

    @property
    def state(self):
        return self._wrapped.state

    @property
    def param_groups(self):
        return self._wrapped.param_groups

    def step(self, closure=None):
        return self._wrapped.step(closure)


def test_attach_refuses_a_wrapper_it_cannot_reach_before_anything_changes(daemon, own_registry):
    """An optimizer wrapper whose state tzip cannot find is refused with a TypeError naming it, with the state
    left as it was (plain tensors, steps going on) and the process not attached; an LR scheduler passed as the
    optimizer is named with the way to its optimizer."""
    model = make_model()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(batches(1)[0][0]).square().mean().backward()
    adamw.step()
    before = {id(v): bits(v).numpy().tobytes() for st in adamw.state.values() for v in st.values()}
    wrapper = _OpaqueWrapper(adamw)
    with tzip.connect(daemon.socket, spawn=False) as c:
        with pytest.raises(TypeError, match="_OpaqueWrapper"):
            tzip.attach(optimizer=wrapper, client=c)
        sched = torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: 1.0)
        with pytest.raises(TypeError, match=r"got LambdaLR \(it holds a AdamW: pass its \.optimizer\)"):
            tzip.attach(optimizer=sched, client=c)
    assert not tzip.attaching.attached()
    assert offloaded(adamw) == 0
    assert {id(v): bits(v).numpy().tobytes() for st in adamw.state.values() for v in st.values()} == before
    wrapper.step()  # still steps: nothing was left half-done
    assert offloaded(adamw) == 0


def zero_run(attach_at: int | None = None, client=None) -> dict:
    """ZeroRedundancyOptimizer(AdamW) on one gloo rank: ZeRO's step steps its local optimizer (``.optim``) and
    broadcasts the parameters; consolidate_state_dict gathers the local state dict, load_state_dict (a resume
    after step 3) puts it back."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    with pytest.raises(TypeError, match="ZeroRedundancyOptimizer"):  # it would offload ZeRO's stale own state
        tzip.optim.CompressedOffload(zero, client=client)
    out: dict = {"losses": [], "offloaded": [], "stats": None}
    for i, (x, y) in enumerate(batches(6)):
        if i == attach_at:
            out["stats"] = tzip.attach(optimizer=zero, client=client).optimizers
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        zero.step()
        zero.zero_grad()
        out["losses"].append(loss_bits(loss))
        out["offloaded"].append(offloaded(zero.optim))
        if i == 3:
            # a resume: ZeRO's load_state_dict writes the local optimizer's state directly, around its hooks
            zero.consolidate_state_dict(to=0)
            zero.load_state_dict(zero.state_dict())
    zero.consolidate_state_dict(to=0)
    out["state_dict"] = state_dict_digest(zero.state_dict())
    out["params"] = [bits(p).numpy().tobytes() for p in model.parameters()]
    return out


def test_zero_redundancy_optimizer_attaches_its_local_optimizer(daemon, own_registry, tmp_path):
    """attach(optimizer=ZeroRedundancyOptimizer) offloads the state of the AdamW that steps this rank's shard (ZeRO's
    own ``state`` is not the live one: hooks on it offloaded nothing), and the run stays bit-identical to ZeRO
    without tzip, through a resume (load_state_dict) and the consolidated state dict."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        want = zero_run()
        with tzip.connect(daemon.socket, spawn=False) as c:
            got = zero_run(attach_at=2, client=c)
            tzip.detach()
    finally:
        dist.destroy_process_group()
    assert type(got["stats"][0].optimizer) is torch.optim.AdamW
    assert all(n > 0 for n in got["offloaded"][2:]), got["offloaded"]
    assert got["losses"] == want["losses"]
    assert got["params"] == want["params"]
    assert got["state_dict"] == want["state_dict"]
