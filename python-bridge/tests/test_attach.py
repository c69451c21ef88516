"""tzip.attach / tzip.detach in a running job: a 2-rank gloo DDP job on the bundled real model (all-MiniLM-L6-v2,
real text, dropout on, AdamW) that starts without tzip, attaches (the comm hook and the optimizer-state offload),
detaches, survives a daemon restart and a daemon away, follows the daemon's codec setting, or attaches from its
start with TZIP_ATTACH=1. Each run's losses (their float bits), final parameters and final optimizer state (their
bytes) must equal those of the same job that never attached, bit for bit (two ranks: the order of a sum of two
cannot matter, so tzip's all-reduce equals DDP's). While attached, the daemon's `jobs` op lists the job with bytes
on its streams.

One real daemon for the module (`tzip serve` on a private socket), killed and restarted by the tests that need it;
the workers' clients can never start a daemon of their own ($TZIP_CLI names no file).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import tzip
import tzip._session
import tzip.attaching
import tzip.client
from tzip.optim import OffloadedTensor

from dist_support import Pools, bits
from test_client_support import DaemonProcess, daemon_jobs, daemon_set, wait_for
from test_client_support import shared_daemon as daemon  # noqa: F401  (one daemon for the module)

HERE = Path(__file__).resolve().parent
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
#: Optimizer steps of every run (the reference run has as many).
STEPS = 4
JOB = f"attach-test-{os.getpid()}"



@pytest.fixture(scope="module")
def pools(daemon):
    with tempfile.TemporaryDirectory(prefix="tzip-nocli-") as d:
        # cuBLAS is deterministic (torch.use_deterministic_algorithms) only with a fixed workspace: the GPU variant
        p = Pools({"TZIP_SOCKET": daemon.socket, "TZIP_CLI": os.path.join(d, "no-cli.js"), "TZIP_JOB": JOB,
                   "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
        yield p
        p.close()


@pytest.fixture
def own_registry(monkeypatch):
    """A test that attaches in this (the pytest) process gets an attach state of its own: detach() leaves the
    checkpoint helpers of the whole process on raw frames, which later test modules must not inherit."""
    monkeypatch.setattr(tzip.attaching, "_reg", tzip.attaching._Registry())


@pytest.fixture(scope="module")
def reference(pools):
    """The job that never attached: per rank (losses, parameters' sha256, optimizer state's sha256)."""
    pool = pools(2)
    pool.run(w_start)
    st = pool.run(w_steps, n=STEPS)
    assert not any(s["attached"] or s["hooked"] for s in st)
    return pool.run(w_end)


# --- worker side ------------------------------------------------------------------------------------------------------

_J: dict = {}


def text_batches(rank: int, world: int, steps: int, device: str, pairs_per_rank: int = 3, max_length: int = 32):
    """Per step a ``loss_of(model)``: all-MiniLM-L6-v2 on its model card's sentence pairs (each rank its own), with
    tzip.demo_data's objective (symmetric in-batch cross-entropy of scaled cosine similarities), on ``device``; as
    dist_support.minilm_batches, with the batch moved to the device."""
    from tzip import demo_data

    pairs = demo_data.sentence_pairs(demo_data.readme_sentences())
    tok = demo_data.load_tokenizer(max_length)
    for step in range(steps):
        start = ((step * world + rank) * pairs_per_rank) % max(1, len(pairs) - pairs_per_rank)
        chosen = pairs[start : start + pairs_per_rank]
        batch = {k: v.to(device) for k, v in demo_data.tokenize([p[0] for p in chosen] + [p[1] for p in chosen], tok).items()}

        def loss_of(model, batch=batch, k=len(chosen)):
            emb = demo_data.mean_pool_normalize(model(**batch).last_hidden_state, batch["attention_mask"])
            return demo_data.contrastive_loss(emb[:k], emb[k:])

        yield loss_of


def mlp_batches(rank: int, steps: int, device: str):
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x = torch.randn(16, 256, generator=g).to(device)
        y = torch.randn(16, 8, generator=g).to(device)
        yield lambda model, x=x, y=y: torch.nn.functional.mse_loss(model(x), y)


def w_start(rank, world, steps=STEPS, device="cpu", model="minilm"):
    """A fresh job: the real model (or, ``model="mlp"``, a 1.2 M parameter MLP) under DDP (several buckets), AdamW,
    each rank its own data."""
    from tzip import demo_data

    _J.clear()
    gc.collect()  # the previous job's model and optimizer: gone, also from tzip.attaching's weak registry
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(7 + rank)  # dropout masks: the same in every run
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.cuda.manual_seed(7 + rank)
    if model == "mlp":
        torch.manual_seed(0)
        layers = [torch.nn.Linear(256, 512), torch.nn.GELU()]
        for _ in range(4):
            layers += [torch.nn.Linear(512, 512), torch.nn.GELU()]
        net = torch.nn.Sequential(*layers, torch.nn.Linear(512, 8)).to(device)
        data, cap = mlp_batches(rank, steps, device), 1
    else:
        net = demo_data.load_model().to(device)
        net.train()
        net.pooler = None  # not part of the objective: every parameter gets a gradient
        data, cap = text_batches(rank, world, steps, device), 10
    ddp = DDP(net, bucket_cap_mb=cap, device_ids=None if device == "cpu" else [0])
    opt = torch.optim.AdamW(ddp.parameters(), lr=2e-5)
    _J.update(ddp=ddp, opt=opt, data=iter(data), losses=[])
    return _status()


def _hook_state():
    from tzip.ddp import LosslessState

    for _hook, state in getattr(_J["ddp"], "_comm_hooks", []):
        if isinstance(state, LosslessState):
            return state
    return None


def _status(warned=()) -> dict:
    state = _hook_state()
    offloaded = sum(isinstance(v, OffloadedTensor) for st in _J["opt"].state.values() for v in st.values())
    from tzip import _default

    clients = [c for (pid, _), c in _default._clients.items() if pid == os.getpid() and not c._closed]  # noqa: SLF001
    return {"attached": tzip.attaching.attached(), "hooked": state is not None,
            "enabled": bool(state is not None and state.enabled), "buckets": state.buckets if state else 0,
            "codec": state.codec if state else None, "strict": state.strict if state else None,
            "offloaded": offloaded, "settings": clients[0].settings if clients else None,
            "connected": bool(clients and clients[0].connected), "warned": list(warned)}


def w_steps(rank, world, n):
    ddp, opt = _J["ddp"], _J["opt"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(n):
            loss = next(_J["data"])(ddp)
            loss.backward()
            opt.step()
            opt.zero_grad()
            _J["losses"].append(int(bits(loss.float().reshape(1))[0]))
    return _status([str(w.message) for w in caught if "tzip" in str(w.message)])


def w_attach(rank, world, model=True, optimizer=True, **kw):
    a = tzip.attach(model=_J["ddp"] if model else None, optimizer=_J["opt"] if optimizer else None, **kw)
    return {"job": a.job, **_status()}


def w_detach(rank, world):
    tzip.detach()
    return _status()


def w_settings(rank, world):
    return _status()["settings"]


def w_end(rank, world):
    """(losses, parameters' sha256, optimizer state's sha256); the state dict must hold plain tensors."""
    params = hashlib.sha256(b"".join(bits(p).numpy().tobytes() for p in _J["ddp"].module.parameters())).hexdigest()
    sd = _J["opt"].state_dict()
    h = hashlib.sha256()
    for i in sorted(sd["state"]):
        for k in sorted(sd["state"][i]):
            v = sd["state"][i][k]
            assert not isinstance(v, OffloadedTensor), (i, k)
            if isinstance(v, torch.Tensor):
                h.update(f"{i}.{k}:{v.dtype}:{tuple(v.shape)}:{v.device}".encode())
                h.update(bits(v).numpy().tobytes())
    return list(_J["losses"]), params, h.hexdigest()


# --- helpers of the test side -----------------------------------------------------------------------------------------


def the_job(socket: str, name: str = JOB) -> dict | None:
    reply = daemon_jobs(socket)
    assert reply.get("ok"), reply
    found = [j for j in reply["jobs"] if j["name"] == name]
    return found[0] if found else None


def stream_bytes(job: dict | None, stream: str) -> int:
    if job is None:
        return 0
    s = job["streams"][stream]
    return int(s["compress"]["bytes_in"]) + int(s["decompress"]["bytes_in"])


def assert_matches(results, reference):
    for rank, (got, want) in enumerate(zip(results, reference)):
        assert got[0] == want[0], (rank, "losses")
        assert got[1] == want[1], (rank, "parameters")
        assert got[2] == want[2], (rank, "optimizer state")
    assert len({r[1] for r in results}) == 1  # every rank holds the same parameters


# --- tests ------------------------------------------------------------------------------------------------------------


def test_attach_then_detach_is_bit_identical_and_listed(pools, reference, daemon):
    pool = pools(2)
    pool.run(w_start)
    st = pool.run(w_steps, n=1)
    assert not any(s["attached"] or s["hooked"] for s in st)
    att = pool.run(w_attach)
    assert [a["job"] for a in att] == [JOB, JOB] and all(a["attached"] and a["enabled"] for a in att)
    st = pool.run(w_steps, n=2)
    for s in st:
        assert s["attached"] and s["buckets"] >= 2 and s["offloaded"] > 0, s
    job = the_job(daemon.socket)
    assert job is not None and job["attached"] is True, job
    assert job["sessions"] >= 2 and len(job["pids"]) == 2, job
    assert stream_bytes(job, "gradients") > 0 and stream_bytes(job, "optimizer") > 0, job["streams"]
    g = job["streams"]["gradients"]["compress"]
    assert g["bytes_out"] < g["bytes_in"], g  # real gradients compress
    buckets = [s["buckets"] for s in st]

    st = pool.run(w_detach)
    assert all(not s["attached"] and not s["enabled"] and s["offloaded"] == 0 for s in st), st
    assert wait_for(lambda: the_job(daemon.socket)["attached"] is False, 5), the_job(daemon.socket)
    before = stream_bytes(the_job(daemon.socket), "gradients")
    st = pool.run(w_steps, n=1)
    assert [s["buckets"] for s in st] == buckets  # DDP's own all-reduce: the hook's tzip path no longer runs
    assert stream_bytes(the_job(daemon.socket), "gradients") == before
    # attached again, the model's hook takes the new call's settings (it kept the first attach's codec and strict)
    att = pool.run(w_attach, codec="max", strict=True)
    assert all(a["enabled"] and a["codec"] == "max" and a["strict"] is True for a in att), att
    pool.run(w_detach)
    att = pool.run(w_attach, optimizer=False, codec="raw")
    assert all(a["enabled"] and a["codec"] == "raw" and a["strict"] is False for a in att), att
    pool.run(w_detach)
    att = pool.run(w_attach, model=False, optimizer=False, codec="bytes")  # attach(): what was attached before
    assert all(a["enabled"] and a["codec"] == "bytes" for a in att), att
    pool.run(w_detach)
    assert_matches(pool.run(w_end), reference)


def test_codec_off_sends_plain_until_cleared(pools, reference, daemon):
    pool = pools(2)
    pool.run(w_start)
    pool.run(w_attach)
    pool.run(w_steps, n=1)
    reply = daemon_set(daemon.socket, job=JOB, codec="off")
    assert reply.get("ok") and reply["settings"]["codec"] == "off", reply
    # Each rank hears it with its next reply: a ZeroMQ request's, or its heartbeat's (requests through the submission
    # ring have no reply, docs/ring.md).
    assert wait_for(lambda: all(s["codec"] == "off" for s in pool.run(w_settings)), 15, 0.5)
    st = pool.run(w_steps, n=1)
    assert all(s["settings"]["codec"] == "off" for s in st), st
    time.sleep(0.1)  # the ring thread hands its completion counts to the daemon in batches (at most every 10 ms)
    plain_from = stream_bytes(the_job(daemon.socket), "gradients")
    st = pool.run(w_steps, n=1)
    assert stream_bytes(the_job(daemon.socket), "gradients") == plain_from  # plain: no daemon request
    assert all(s["buckets"] > 0 for s in st)
    reply = daemon_set(daemon.socket, job=JOB, codec=None)
    assert reply.get("ok") and reply["settings"]["codec"] is None, reply
    # the ranks hear it with their next reply: the heartbeat (no gradient request is sent while plain)
    assert wait_for(lambda: all(s["codec"] is None for s in pool.run(w_settings)), 15, 0.5)
    pool.run(w_steps, n=1)
    assert wait_for(lambda: stream_bytes(the_job(daemon.socket), "gradients") > plain_from, 5)  # compressed again
    pool.run(w_detach)
    assert_matches(pool.run(w_end), reference)


def test_job_survives_daemon_restart_and_daemon_away(pools, reference, daemon):
    pool = pools(2)
    pool.run(w_start)
    pool.run(w_attach)
    pool.run(w_steps, n=1)
    # killed between two steps, with the optimizer state compressed in the job: back before the next step
    daemon.kill()
    daemon.start()
    st = pool.run(w_steps, n=1)
    assert all(s["connected"] and s["attached"] and s["offloaded"] > 0 for s in st), st
    job = the_job(daemon.socket)  # the new daemon heard the job again (hello after the restart)
    assert job is not None and job["attached"] is True, job
    assert stream_bytes(job, "gradients") > 0 and stream_bytes(job, "optimizer") > 0, job["streams"]

    # the daemon away for a whole step: the gradients travel as raw frames (one warning per rank)
    pool.run(w_detach)
    pool.run(w_attach, optimizer=False)
    daemon.kill()
    st = pool.run(w_steps, n=1)
    for s in st:
        assert not s["connected"] and s["attached"] and len(s["warned"]) == 1, s
    daemon.start()
    st = pool.run(w_steps, n=1)
    assert all(s["connected"] for s in st), st
    assert stream_bytes(the_job(daemon.socket), "gradients") > 0
    assert_matches(pool.run(w_end), reference)


def w_mixed_codecs(rank, world):
    """One all_reduce with rank 0 plain (its job's codec "off") and rank 1 compressing; and the reverse."""
    import tzip.distributed as tzd

    g = torch.Generator().manual_seed(5 + rank)
    out = []
    for plain_rank in (0, 1):
        x = torch.randn(300_001, generator=g).to(torch.bfloat16)
        want = x.clone()
        tzd.all_reduce(want, codec="raw")
        got = x.clone()
        tzd.all_reduce(got, codec="raw" if rank == plain_rank else "auto")
        out.append(torch.equal(bits(got), bits(want)))
    return out


def test_all_reduce_with_some_ranks_plain_is_lossless(pools):
    """A job's codec set "off" reaches its ranks at different requests: a call where some send plain bytes and
    others frames must give the same bits."""
    assert pools(2).run(w_mixed_codecs) == [[True, True], [True, True]]


@contextlib.contextmanager
def attach_env_pools(socket: str, job: str):
    """Pools of workers started with TZIP_ATTACH=1 and TZIP_JOB=``job``: the .pth line runs at interpreter start-up
    (here through a sitecustomize that adds a site folder holding tzip-attach.pth, as an installed wheel's
    site-packages would)."""
    with tempfile.TemporaryDirectory(prefix="tzip-site-") as d:
        site_dir = os.path.join(d, "site")
        os.mkdir(site_dir)
        tzip.attaching.install_pth(site_dir)
        Path(d, "sitecustomize.py").write_text(f"import site\nsite.addsitedir({site_dir!r})\n")
        pools = Pools({"TZIP_SOCKET": socket, "TZIP_CLI": os.path.join(d, "no-cli.js"), "TZIP_JOB": job,
                       "TZIP_ATTACH": "1", "PYTHONPATH": os.pathsep.join([d, str(HERE)])})
        try:
            yield pools
        finally:
            pools.close()


def test_tzip_attach_env_attaches_from_the_start(daemon, reference):
    """TZIP_ATTACH=1 attaches the job's DDP model and optimizer from its start."""
    job = JOB + "-env"
    with attach_env_pools(daemon.socket, job) as pools:
        pool = pools(2)
        st = pool.run(w_start)
        assert all(s["attached"] and s["hooked"] and s["enabled"] for s in st), st
        st = pool.run(w_steps, n=STEPS)
        assert all(s["offloaded"] > 0 and s["buckets"] > 0 for s in st), st  # the optimizer after its first step
        got = the_job(daemon.socket, job)
        assert got is not None and got["attached"] is True, got
        assert stream_bytes(got, "gradients") > 0 and stream_bytes(got, "optimizer") > 0
        assert_matches(pool.run(w_end), reference)


def w_fsdp_steps(rank, world, n):
    """n steps of an FSDP2 model; the tzip warnings they gave, and whether its optimizer state lies offloaded."""
    from torch.distributed.fsdp import fully_shard
    from tzip.optim import OffloadedTensor

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    fully_shard(m[0])
    fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(n):
            m(torch.randn(4, 32)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    offloaded = any(isinstance(v, OffloadedTensor) for st in opt.state.values() for v in st.values())
    return [str(w.message) for w in caught if "tzip" in str(w.message)], offloaded


def w_subclass_steps(rank, world, n):
    """n steps of an optimizer whose parameter is a tensor subclass other than DTensor (torch's TwoTensor), which
    the offload cannot take; the tzip warnings they gave."""
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    p = torch.nn.Parameter(TwoTensor(torch.randn(64, 32), torch.randn(64, 32)))
    opt = torch.optim.AdamW([p], lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(n):
            (p * 2).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return [str(w.message) for w in caught if "tzip" in str(w.message)]


def test_tzip_attach_env_attaches_an_fsdp2_jobs_optimizer(daemon):
    # DTensor state is offloaded shard by shard (an FSDP2 job's optimizer used to be refused, with a warning)
    with attach_env_pools(daemon.socket, JOB + "-fsdp") as pools:
        for warned, offloaded in pools(2).run(w_fsdp_steps, n=3):
            assert warned == [] and offloaded, (warned, offloaded)


def test_tzip_attach_env_warns_once_for_an_optimizer_it_cannot_attach(daemon):
    # the attach was tried again, and warned, after every step
    with attach_env_pools(daemon.socket, JOB + "-subclass") as pools:
        for warned in pools(2).run(w_subclass_steps, n=5):
            assert len(warned) == 1 and "tensor subclass" in warned[0], warned


def test_pth_line_costs_nothing_unless_tzip_attach_is_1():
    with tempfile.TemporaryDirectory(prefix="tzip-site-") as d:
        tzip.attaching.install_pth(d)
        probe = (f"import site, sys; site.addsitedir({d!r}); "
                 "print(sorted(m for m in ('tzip', 'tzip.attaching', 'torch') if m in sys.modules)); "
                 "print(any(type(f).__name__ == '_AfterImport' for f in sys.meta_path))")
        env = {k: v for k, v in os.environ.items() if k != "TZIP_ATTACH"}
        off = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        assert off.stdout.split("\n")[:2] == ["[]", "False"], off
        on = subprocess.run([sys.executable, "-c", probe], env={**env, "TZIP_ATTACH": "1"}, capture_output=True,
                            text=True, timeout=60)
        # installed, and still no torch: it is imported by the job, and the patches wait for it
        assert on.stdout.split("\n")[:2] == ["['tzip', 'tzip.attaching']", "True"], on


# --- the client's side of protocol version 3 --------------------------------------------------------------------------


def test_client_tags_streams_and_announces_its_job(daemon, monkeypatch):
    monkeypatch.delenv("TZIP_JOB", raising=False)
    name = f"client-job-{os.getpid()}"
    with tzip.connect(daemon.socket, spawn=False, job=name) as c:
        assert c.protocol_version >= 3
        x = torch.randn(4096)
        with tzip.client.tagged("checkpoint"):
            ct = c.compress(x)
            back = c.decompress_async(ct).result()  # the tag goes with the async call
        assert torch.equal(bits(back), bits(x))
        # (ring completions reach the job registry in batches, at most every 10 ms)
        job = wait_for(lambda: (j := the_job(daemon.socket, name)) is not None and
                       j["streams"].get("checkpoint", {}).get("decompress", {}).get("requests") and j, 5)
        assert job is not None and job["attached"] is True  # a named job is attached from its hello
        assert job["streams"]["checkpoint"]["compress"]["bytes_in"] == x.numel() * 4
        assert job["streams"]["checkpoint"]["decompress"]["requests"] == 1
        assert job["devices"] == ["cpu"] and job["user"]
        assert c.set_job(False)["codec"] is None
        assert the_job(daemon.socket, name)["attached"] is False
    with pytest.raises(ValueError, match="unknown stream"):
        with tzip.client.tagged("weights"):
            pass


def test_job_codec_setting_applies_at_the_next_request(daemon, monkeypatch):
    """``set JOB codec=...`` (what `tzip set` sends): the job's next compress once the client heard it (with a reply,
    or its heartbeat: requests through the submission ring have no reply) uses that codec whatever the call asked;
    "off" gives raw frames and tells the client (the integrations then send plain); null gives the call its own."""
    monkeypatch.delenv("TZIP_JOB", raising=False)
    name = f"codec-job-{os.getpid()}"
    x = torch.randn(64, 1024).to(torch.bfloat16)
    with tzip.connect(daemon.socket, spawn=False, job=name) as c:
        assert c.compress(x, codec="fast").codec == "fast"
        for setting, want in (("max", "max"), ("off", "raw"), (None, "fast")):
            reply = daemon_set(daemon.socket, job=name, codec=setting)
            assert reply.get("ok") and reply["settings"]["codec"] == setting, reply
            assert wait_for(lambda: c.settings["codec"] == setting, 10)
            ct = c.compress(x, codec="fast")
            assert ct.codec == want, (setting, ct.codec)
            assert c.settings["codec"] == setting
            assert c.job_codec("auto") == ("raw" if setting == "off" else "auto")
            assert torch.equal(bits(c.decompress(ct)), bits(x))
        refused = daemon_set(daemon.socket, job=f"no-such-job-{os.getpid()}", codec="fast")
        assert not refused.get("ok") and refused["error"]["code"] == "TZIP_USAGE", refused


def test_client_without_v3_sends_no_job_or_tags(daemon, monkeypatch):
    """An older daemon: a session of version 2 is sent no job and no stream tag, and a hello whose job the daemon
    refuses (an older daemon's schema has no such field) is said again without it."""
    monkeypatch.setattr(tzip._session, "PROTOCOL_VERSIONS", [1, 2])
    name = f"v2-job-{os.getpid()}"
    with tzip.connect(daemon.socket, spawn=False) as c:
        assert c.protocol_version == 2
        assert c.set_job(True, name=name) == {"codec": None, "sm_budget": None}
        with tzip.client.tagged("gradients"):
            x = torch.randn(2048)
            assert torch.equal(bits(c.decompress(c.compress(x))), bits(x))
        assert the_job(daemon.socket, name) is None  # never told
    monkeypatch.setattr(tzip._session, "PROTOCOL_VERSIONS", [1, 2, 3])
    real = tzip._session.job_info
    monkeypatch.setattr(tzip._session, "job_info", lambda *a, **k: {**real(*a, **k), "unknown_field": 1})
    with tzip.connect(daemon.socket, spawn=False, job=name) as c:
        assert c.connected and c._session.job_refused_by == c._session.daemon_pid  # noqa: SLF001
        x = torch.randn(100)
        assert torch.equal(bits(c.decompress(c.compress(x))), bits(x))


def test_checkpoint_helpers_follow_attach_and_detach(daemon, own_registry, tmp_path, monkeypatch):
    """tzip.save without a codec: compressed while attached (counted as the job's checkpoint stream), raw frames
    after detach (still a .tzip that loads bit for bit); an explicit codec is kept either way."""
    from tzip import demo_data

    monkeypatch.delenv("TZIP_JOB", raising=False)
    name = f"ckpt-job-{os.getpid()}"
    state = {k: v.to(torch.bfloat16) for k, v in list(demo_data.load_model().state_dict().items())[:12]}
    with tzip.connect(daemon.socket, spawn=False) as c:
        a = tzip.attach(job=name, client=c)
        assert a.job == name and tzip.attaching.attached()
        on = tzip.save(state, tmp_path / "on.tzip", client=c)
        job = the_job(daemon.socket, name)
        assert job is not None and job["attached"] and stream_bytes(job, "checkpoint") > 0, job
        tzip.detach()
        assert the_job(daemon.socket, name)["attached"] is False
        off = tzip.save(state, tmp_path / "off.tzip", client=c)
        kept = tzip.save(state, tmp_path / "kept.tzip", codec="max", client=c)
        raw_bytes = sum(t.numel() * t.element_size() for t in state.values())
        assert on < 0.9 * raw_bytes < off and kept < 0.9 * raw_bytes, (on, off, kept, raw_bytes)
        for f in ("on", "off", "kept"):
            back = tzip.load(tmp_path / f"{f}.tzip", client=c)
            assert all(torch.equal(bits(back[k]), bits(v)) for k, v in state.items()), f


def test_attach_refuses_what_it_cannot_switch(own_registry):
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        tzip.attach(model=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown codec"):
        tzip.attach(codec="zstd")
    assert not tzip.attaching.attached()
    tzip.detach()  # not attached: nothing to do


# --- GPU (run by the lead on the H200) --------------------------------------------------------------------------------


@needs_cuda
def test_cuda_two_ranks_one_gpu_attach_detach_is_bit_identical(pools, daemon):
    """The CUDA variant: both ranks on GPU 0 (gloo on CUDA tensors, as test_ddp's GPU test); the gradients and the
    optimizer state are compressed on the GPU through CUDA IPC. An MLP, as the GPU variants of test_ddp and
    test_fsdp: two runs must agree bit for bit, and not every CUDA kernel of the BERT model is guaranteed
    deterministic."""
    pool = pools(2)
    pool.run(w_start, device="cuda", model="mlp")
    pool.run(w_steps, n=STEPS)
    reference = pool.run(w_end)
    pool.run(w_start, device="cuda", model="mlp")
    pool.run(w_steps, n=1)
    pool.run(w_attach)
    st = pool.run(w_steps, n=2)
    assert all(s["attached"] and s["buckets"] > 0 and s["offloaded"] > 0 for s in st), st
    job = the_job(daemon.socket)
    assert job is not None and job["attached"] and any(d.startswith("GPU-") for d in job["devices"]), job
    assert stream_bytes(job, "gradients") > 0 and stream_bytes(job, "optimizer") > 0, job["streams"]
    st = pool.run(w_detach)
    assert all(s["offloaded"] == 0 for s in st), st
    pool.run(w_steps, n=1)
    assert_matches(pool.run(w_end), reference)


@needs_cuda
def test_cuda_attached_optimizer_frees_gpu_memory_and_detach_brings_it_back(daemon, own_registry):
    """One process, one GPU, no DDP: attach(optimizer=) offloads the AdamW state (torch.cuda.memory_allocated drops
    by its bytes), the steps stay bit-identical to the optimizer never attached, and detach brings the state back
    onto the GPU with its dtype, shape and strides."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(64, 1024, generator=g).cuda() for _ in range(6)]

    def train(model, opt, between=lambda i: None):
        out = []
        for i, x in enumerate(xs):
            between(i)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(int(bits(loss.reshape(1))[0]))
        return out

    ref_model = make()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    want = train(ref_model, ref_opt)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state_bytes = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    seen = {}
    # no idle staging buffers kept between requests: memory_allocated shows the state alone
    with tzip.connect(daemon.socket, spawn=False, gpu_arena_keep_bytes=0, result_pool_keep_bytes=0) as c:
        def between(i):
            if i == 2:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                tzip.attach(optimizer=opt, client=c)
                torch.cuda.synchronize()
                seen["freed"] = before - torch.cuda.memory_allocated()
            elif i == 4:
                tzip.detach()
                torch.cuda.synchronize()
                seen["layouts"] = [(v.device.type, v.dtype, tuple(v.shape), v.stride()) for st in opt.state.values()
                                   for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]

        got = train(model, opt, between)
    assert got == want
    assert seen["freed"] >= 0.95 * state_bytes, (seen["freed"], state_bytes)
    assert all(dev == "cuda" for dev, *_ in seen["layouts"]) and len(seen["layouts"]) == 2 * len(list(model.parameters()))
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(bits(p), bits(q))
    for (a, b) in zip(opt.state.values(), ref_opt.state.values()):
        for k in b:
            assert a[k].stride() == b[k].stride() and torch.equal(bits(a[k]), bits(b[k])), k


def test_a_job_name_with_control_characters_is_sent_printable(daemon):
    """The daemon refuses control characters in job names and users (they would reach the terminals of tzip jobs and
    tzip top); the client sends them as U+FFFD, so such a job still connects and is listed."""
    c = tzip.connect(daemon.socket, spawn=False, strict=True, job="night\nrun\x1b[2J")
    try:
        x = torch.arange(1024, dtype=torch.int32).view(torch.float32)
        assert torch.equal(c.decompress(c.compress(x)).view(torch.int32), x.view(torch.int32))
        names = [j["name"] for j in daemon_jobs(daemon.socket)["jobs"]]
        assert "night\ufffdrun\ufffd[2J" in names, names
    finally:
        c.close()


def run_attached(pool, start=None, **attach_kw):
    """The job (``w_start(**start)``): one plain step, attach (with ``attach_kw``), two steps, detach, one step;
    (losses, parameters, optimizer state) per rank."""
    pool.run(w_start, **(start or {}))
    pool.run(w_steps, n=1)
    pool.run(w_attach, **attach_kw)
    pool.run(w_steps, n=2)
    pool.run(w_detach)
    pool.run(w_steps, n=1)
    return pool.run(w_end)


def test_attached_compressed_equals_attached_with_codec_raw(pools, reference, daemon):
    """Lossless means: the job attached with compression equals the same job attached with codec="raw" (the same
    hook, offload and checkpoint path, frames stored uncompressed) bit for bit, and both equal the run that never
    attached (two ranks: the order of a sum cannot matter)."""
    pool = pools(2)
    compressed = run_attached(pool, codec="auto")
    raw = run_attached(pool, codec="raw")
    for rank, (c, r) in enumerate(zip(compressed, raw)):
        assert c == r, rank  # losses' float bits, parameters' and optimizer state's sha256
    assert_matches(compressed, reference)
    assert_matches(raw, reference)


def test_three_ranks_attached_compressed_equals_attached_with_codec_raw(pools, daemon):
    """Any world size: the attached job equals the same job attached with codec="raw" (three ranks, where the hook's
    sum in rank order may differ from DDP's own)."""
    def gradients() -> tuple[int, int]:  # the job's gradient bytes compressed so far: (in, out)
        job = the_job(daemon.socket)
        g = (job or {}).get("streams", {}).get("gradients", {}).get("compress", {})
        return g.get("bytes_in", 0), g.get("bytes_out", 0)

    pool = pools(3)
    before = gradients()
    compressed = run_attached(pool, start={"model": "mlp"}, codec="auto")
    after = gradients()
    raw = run_attached(pool, start={"model": "mlp"}, codec="raw")
    assert compressed == raw  # per rank: losses' float bits, parameters' and optimizer state's sha256
    assert len({(c[1], c[2]) for c in compressed}) == 1  # the replicas agree
    bytes_in, bytes_out = after[0] - before[0], after[1] - before[1]
    assert 0 < bytes_out < bytes_in, (before, after)  # this run's gradients went through the daemon, compressed
