"""tzip.integrations.transformers.TzipCallback in the real Hugging Face Trainer (issue 36, "Meet users where they
already train").

Every run is a real ``transformers.Trainer.train()`` (DDP through the real Accelerate, no mocks) on 2 gloo ranks on
the CPU: the bundled all-MiniLM-L6-v2's trained weights (its first 2 layers, to fit 2 cores) as a
BertForSequenceClassification on sentence pairs of its model card (examples/trainer_callback.py's ``train``, which
these tests import), dropout on, AdamW with its linear schedule. Each run with ``TzipCallback`` must give the same
logged losses (their float bits) and final parameters on every rank (their bytes, sha256) as the same run without
it, while its gradients really went through tzip's hook compressed (``tzip/bytes_sent`` below ``tzip/bytes_raw``
in the Trainer's logs), with gradient accumulation 2 and ``ddp_find_unused_parameters`` True and False, with the
optimizer state offloaded, and through a checkpoint resume. On one process the callback says it has nothing to
compress and changes nothing.

One real daemon for the module (`tzip serve` on a private socket); the workers' clients can never start one of their
own ($TZIP_CLI names no file). The worker pool (dist_support) is closed, its processes killed, at the module's end.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
from pathlib import Path

import pytest
import torch

import tzip
import tzip.attaching

from dist_support import Pools
from test_client_support import shared_daemon as daemon  # noqa: F401  (one daemon for the module)

pytest.importorskip("accelerate")  # the test extra pins it
pytest.importorskip("transformers")  # the demo extra pins it

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "trainer_callback.py"
#: Transformer layers kept of MiniLM's 6 (the embeddings, most of the gradient bytes, are always there).
LAYERS = 2
STEPS = 4


@pytest.fixture(scope="module")
def pools(daemon):
    with tempfile.TemporaryDirectory(prefix="tzip-nocli-") as d:
        p = Pools({"TZIP_SOCKET": daemon.socket, "TZIP_CLI": os.path.join(d, "no-cli.js"),
                   "TZIP_JOB": f"trainer-test-{os.getpid()}"})
        yield p
        p.close()


# --- worker side ------------------------------------------------------------------------------------------------------

def _example():
    """examples/trainer_callback.py as a module (its build_model, build_dataset, train, loss_bits, params_sha256)."""
    spec = importlib.util.spec_from_file_location("trainer_callback_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _torchrun_env(rank: int, world: int) -> None:
    # What torchrun would set: Accelerate (through TrainingArguments) reads the job's shape from these, and finds the
    # gloo process group dist_support's worker already made.
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"})


def optimizer_digest(sd: dict) -> str:
    """sha256 over an optimizer state dict's tensors (key, dtype, shape and bytes) and other values."""
    h = hashlib.sha256()
    for i in sorted(sd["state"]):
        for k in sorted(sd["state"][i]):
            v = sd["state"][i][k]
            assert isinstance(v, torch.Tensor) and type(v) is torch.Tensor, (i, k, type(v))  # no placeholders
            h.update(f"{i}.{k}:{v.dtype}:{tuple(v.shape)}".encode())
            h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    h.update(repr([{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]).encode())
    return h.hexdigest()


class _StopAt:
    """A TrainerCallback (made in the worker) that ends training after ``step`` optimizer steps: the interruption
    of the resume test (the Trainer saves the checkpoint of that step first)."""

    def __new__(cls, step: int):
        from transformers import TrainerCallback

        class StopAt(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step >= step:
                    control.should_training_stop = True

        return StopAt()


def w_train(rank, world, out: str, tzip_kwargs: dict | None = None, stop_at: int | None = None, **kw) -> dict:
    """One Trainer run on this rank (examples/trainer_callback.py's ``train``; ``kw`` its options), with
    ``TzipCallback(**tzip_kwargs)`` unless None. Returns the logged losses' bits, the parameters' and the optimizer
    state's sha256, the ``tzip/...`` figures of every log entry and what the callback attached."""
    from tzip.integrations.transformers import TzipCallback

    _torchrun_env(rank, world)
    ex = _example()
    cb = TzipCallback(**tzip_kwargs) if tzip_kwargs is not None else None
    extra = [_StopAt(stop_at)] if stop_at is not None else []
    trainer = ex.train(out, cb, layers=LAYERS, steps=STEPS, extra_callbacks=extra, **kw)
    return {
        "losses": ex.loss_bits(trainer), "steps": [e["step"] for e in trainer.state.log_history if "loss" in e],
        "params": ex.params_sha256(trainer.model), "optimizer": optimizer_digest(trainer.optimizer.state_dict()),
        "figures": [{k: v for k, v in e.items() if k.startswith("tzip/")} for e in trainer.state.log_history],
        "ddp": type(trainer.model_wrapped).__name__,
        "buckets": cb.ddp_state.buckets if cb is not None and cb.ddp_state is not None else None,
        "offload": repr(cb.offload) if cb is not None else None,
        "attached_after": tzip.attaching.attached(),
    }


# --- tests ------------------------------------------------------------------------------------------------------------

_plain: dict = {}


def plain_run(pools, tmp: Path, **kw) -> list[dict]:
    """The run without the callback (cached per option set: several tests compare with the same one)."""
    key = tuple(sorted(kw.items()))
    if key not in _plain:
        _plain[key] = pools(2).run(w_train, timeout=300, out=str(tmp / f"plain-{len(_plain)}"), **kw)
    return _plain[key]


def check_compressed(res: list[dict]) -> None:
    """The hook all-reduced buckets compressed on every rank, and the figures reached the Trainer's log history."""
    for r in res:
        assert r["ddp"] == "DistributedDataParallel"
        assert r["buckets"] and r["buckets"] > 0
        last = [f for f in r["figures"] if f][-1]
        assert 0 < last["tzip/bytes_sent"] < last["tzip/bytes_raw"], last  # raw frames would be larger
        assert last["tzip/bytes_saved"] == last["tzip/bytes_raw"] - last["tzip/bytes_sent"]
        assert 0 < last["tzip/ratio"] < 1
        assert not r["attached_after"]  # detached when training ended


@pytest.mark.parametrize("accumulation,find_unused", [(1, False), (1, True), (2, False), (2, True)])
def test_trainer_with_callback_is_bit_identical(pools, tmp_path_factory, accumulation, find_unused):
    """Trainer(callbacks=[TzipCallback(codec="auto")]) on 2 gloo ranks: every logged loss (float bits) and the
    final parameters and AdamW state of both ranks (bytes) equal the same Trainer run without the callback, with
    gradient_accumulation_steps 1 and 2 (DDP's no_sync on the micro-batches between steps) and
    ddp_find_unused_parameters True and False (DDP's own collectives beside the hook's), while every log entry
    carries tzip/bytes_raw, tzip/bytes_sent, tzip/bytes_saved and tzip/ratio < 1."""
    tmp = tmp_path_factory.mktemp("trainer")
    kw = dict(accumulation=accumulation, find_unused=find_unused)
    want = plain_run(pools, tmp, **kw)
    got = pools(2).run(w_train, timeout=300, out=str(tmp / "tzip"), tzip_kwargs={"codec": "auto"}, **kw)
    check_compressed(got)
    assert len(got[0]["losses"]) == STEPS
    for r in range(2):
        assert got[r]["losses"] == want[r]["losses"]
        assert got[r]["params"] == want[r]["params"]
        assert got[r]["optimizer"] == want[r]["optimizer"]
    assert got[0]["params"] == got[1]["params"]  # the replicas agree
    # every logged step carries the figures, growing step by step
    raws = [f["tzip/bytes_raw"] for f in got[0]["figures"] if "tzip/bytes_raw" in f]
    assert len(raws) >= STEPS and raws == sorted(raws) and raws[0] > 0


def test_trainer_offload_optimizer_is_bit_identical(pools, tmp_path_factory):
    """TzipCallback(offload_optimizer=True): the Trainer's AcceleratedOptimizer gets tzip's offload on the AdamW it
    wraps (the state compressed between steps, tzip/optimizer_ratio < 1 in the logs) and the run, with gradient
    accumulation 2, equals the one without the callback bit for bit (losses, parameters, optimizer state dict, which
    detach at the end of training brought back uncompressed)."""
    tmp = tmp_path_factory.mktemp("offload")
    kw = dict(accumulation=2, find_unused=False)
    want = plain_run(pools, tmp, **kw)
    got = pools(2).run(w_train, timeout=300, out=str(tmp / "tzip"),
                       tzip_kwargs={"codec": "auto", "offload_optimizer": True}, **kw)
    check_compressed(got)
    for r in range(2):
        assert "AdamW" in got[r]["offload"] and "removed" in got[r]["offload"]  # attached, then detached
        opt = [f for f in got[r]["figures"] if "tzip/optimizer_state_bytes" in f]
        assert len(opt) >= STEPS
        assert all(0 < f["tzip/optimizer_compressed_bytes"] < f["tzip/optimizer_state_bytes"] for f in opt), opt
        assert got[r]["losses"] == want[r]["losses"]
        assert got[r]["params"] == want[r]["params"]
        assert got[r]["optimizer"] == want[r]["optimizer"]


def test_trainer_resume_from_checkpoint_is_bit_identical(pools, tmp_path_factory):
    """A run with the callback (and the optimizer offloaded) interrupted after step 2, its checkpoint saved by the
    Trainer (model, AdamW state through the offload, RNG states), then resumed by a fresh Trainer with a fresh
    callback from that checkpoint, ends with the losses of steps 3-4 and the parameters and optimizer state of the
    uninterrupted run without tzip, bit for bit."""
    tmp = tmp_path_factory.mktemp("resume")
    kw = dict(accumulation=1, find_unused=False)
    want = plain_run(pools, tmp, **kw)
    out = str(tmp / "interrupted")
    tz = {"codec": "auto", "offload_optimizer": True}
    first = pools(2).run(w_train, timeout=300, out=out, tzip_kwargs=tz, stop_at=2, save_steps=2, **kw)
    assert first[0]["steps"] == [1, 2]
    assert first[0]["losses"] == want[0]["losses"][:2]
    assert (Path(out) / "checkpoint-2" / "optimizer.pt").is_file()
    got = pools(2).run(w_train, timeout=300, out=out, tzip_kwargs=tz, resume_from=str(Path(out) / "checkpoint-2"),
                       **kw)
    check_compressed(got)
    for r in range(2):
        # the log history of steps 1-2 comes back from the checkpoint (trainer_state.json), steps 3-4 are new
        assert got[r]["steps"] == [1, 2, 3, 4]
        assert got[r]["losses"] == want[r]["losses"]
        assert got[r]["params"] == want[r]["params"]
        assert got[r]["optimizer"] == want[r]["optimizer"]


@pytest.fixture
def restore_determinism():
    """The example's train() switches torch.use_deterministic_algorithms on for the process; a test that runs it in this
    process puts the setting back, or later tests of the session inherit it (torch.empty of float4 then fails in
    test_saving: "fill_empty_deterministic_" has no float4 kernel)."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_single_process_callback_says_so_and_changes_nothing(daemon, tmp_path, monkeypatch, caplog,
                                                             restore_determinism):
    """Without DDP (one process, this one) the callback installs no hook and logs one WARNING saying there are no
    DDP gradients to compress; with offload_optimizer=True it still offloads the optimizer state (figures in the
    logs), and the run equals the one without the callback bit for bit."""
    from tzip.integrations.transformers import TzipCallback

    monkeypatch.setattr(tzip.attaching, "_reg", tzip.attaching._Registry())  # detach() here must not leak
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    ex = _example()
    want = ex.train(str(tmp_path / "plain"), None, layers=1, steps=3)
    with tzip.connect(daemon.socket, spawn=False) as client:
        cb = TzipCallback(codec="auto", offload_optimizer=True, client=client)
        with caplog.at_level(logging.INFO, logger="tzip.integrations.transformers"):
            got = ex.train(str(tmp_path / "tzip"), cb, layers=1, steps=3)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "tzip.integrations.transformers"]
    assert len(warned) == 1 and "not DistributedDataParallel (a single process)" in warned[0].getMessage()
    assert cb.ddp_state is None and cb.offload is not None and cb.offload.removed
    figs = [e for e in got.state.log_history if "loss" in e]
    assert figs and all("tzip/bytes_raw" not in e for e in figs)
    assert all(0 < e["tzip/optimizer_compressed_bytes"] < e["tzip/optimizer_state_bytes"] for e in figs)
    assert ex.loss_bits(got) == ex.loss_bits(want)
    assert ex.params_sha256(got.model) == ex.params_sha256(want.model)
    assert optimizer_digest(got.optimizer.state_dict()) == optimizer_digest(want.optimizer.state_dict())


def test_unknown_codec_fails_where_the_callback_is_made():
    from tzip.integrations.transformers import TzipCallback

    with pytest.raises(ValueError, match="unknown codec 'zip'"):
        TzipCallback(codec="zip")
