"""The per-call SM budget of the Python client (``Client.compress(..., sm_budget=N)``, protocol version 3): checked,
sent to a version-3 daemon with compress and decompress requests (also from the async calls' worker threads), never
sent to an older one, and on a GPU every budget gives the same frames and tensors, byte for byte."""

from __future__ import annotations

import pytest
import torch

import tzip
import tzip._session
import tzip.client as client_module

from tzip import _ring

from test_client_support import daemon, sock_dir, wait_for  # noqa: F401
from test_ring import weights_bf16 as all_weights_bf16

CUDA = torch.cuda.is_available()


def weights_bf16() -> list[torch.Tensor]:
    """A few of all-MiniLM-L6-v2's trained weight tensors, rounded to bf16 (test_ring's: the bundled model, or the
    layers $TZIP_TEST_WEIGHTS names on GPU hosts without the model's package)."""
    return all_weights_bf16()[:12]


def record_requests(c) -> list[dict]:
    """Every message the client sends from now on (the real transport still sends them)."""
    sent: list[dict] = []
    request = c._session.transport.request

    def spy(msg, *args, **kwargs):
        sent.append(dict(msg))
        return request(msg, *args, **kwargs)

    c._session.transport.request = spy
    return sent


@pytest.mark.parametrize("bad", [-1, 1025, 2.5, "8", True])
def test_a_bad_budget_is_a_value_error_before_anything_is_sent(daemon, bad):  # noqa: F811
    c = tzip.connect(daemon.socket, spawn=False, strict=True)
    try:
        x = torch.arange(64, dtype=torch.float32)
        with pytest.raises(ValueError, match="sm_budget"):
            c.compress(x, sm_budget=bad)
        with pytest.raises(ValueError, match="sm_budget"):
            c.decompress(c.compress(x), sm_budget=bad)
        with pytest.raises(ValueError, match="sm_budget"):
            c.compress_async(x, sm_budget=bad)
    finally:
        c.close()


def test_the_budget_goes_with_each_request_of_the_call_only(daemon):  # noqa: F811
    # The ZeroMQ requests' field (ring_entries=0: CPU requests would go through the submission ring, whose SQEs carry
    # the budget of GPU batches only; test_ring.py).
    c = tzip.connect(daemon.socket, spawn=False, strict=True, ring_entries=0)
    try:
        ts = weights_bf16()
        c.compress(ts[0])  # hello done before recording
        sent = record_requests(c)
        cts = c.compress(ts, codec="fast", sm_budget=16)
        back = c.decompress(cts, sm_budget=0)
        plain = c.compress(ts[0], codec="fast")
        later = c.compress_async(ts, codec="fast", sm_budget=3).result()
        back_async = c.decompress_async(later, sm_budget=7).result()
        ops = [(m["op"], m.get("sm_budget")) for m in sent if m["op"] in ("compress", "decompress")]
        assert ops == [("compress", 16), ("decompress", 0), ("compress", None), ("compress", 3), ("decompress", 7)]
        for t, a, b in zip(ts, back, back_async):
            assert torch.equal(a.view(torch.int16), t.view(torch.int16)) and torch.equal(b.view(torch.int16), t.view(torch.int16))
        assert plain.payload.numpy().tobytes() == cts[0].payload.numpy().tobytes()
    finally:
        c.close()


def test_a_call_the_ring_cannot_take_keeps_its_budget_and_stream_tag(daemon):  # noqa: F811
    """A call that goes on through ZeroMQ because the ring cannot serve it (here: the daemon marked the ring broken)
    is the same request (tzip._request.Request): its SM budget and stream tag go with every ZeroMQ message, and the
    tensors come back bit for bit."""
    c = tzip.connect(daemon.socket, spawn=False, strict=True)
    try:
        ts = weights_bf16()
        assert c.decompress(c.compress(ts[0])) is not None  # opens the CPU ring
        r = c._rings[None]
        r._sq_head.value = (r._head + r.entries + 5) & 0xFFFFFFFF  # a torn index: the daemon breaks the ring
        r.ring_doorbell()
        assert wait_for(lambda: r.words()["state"] == _ring.STATE_BROKEN, 10), r.words()
        sent = record_requests(c)
        with client_module.tagged("checkpoint"):
            cts = c.compress(ts, codec="fast", sm_budget=5)
            back = c.decompress(cts, sm_budget=6)
        later = c.decompress_async(cts, sm_budget=7).result(timeout=60)
        ops = [(m["op"], m.get("sm_budget"), m.get("stream")) for m in sent if m["op"] in ("compress", "decompress")]
        assert ops == [("compress", 5, "checkpoint"), ("decompress", 6, "checkpoint"), ("decompress", 7, None)]
        for t, a, b in zip(ts, back, later):
            assert torch.equal(a.view(torch.int16), t.view(torch.int16)) and torch.equal(b.view(torch.int16), t.view(torch.int16))
    finally:
        c.close()


def test_an_older_daemon_is_sent_no_budget(daemon, monkeypatch):  # noqa: F811
    """A version-2 session would be refused (TZIP_PROTOCOL) for a field it does not have: the client leaves it out."""
    monkeypatch.setattr(tzip._session, "PROTOCOL_VERSIONS", [1, 2])
    c = tzip.connect(daemon.socket, spawn=False, strict=True)
    try:
        t = weights_bf16()[0]
        ct = c.compress(t, sm_budget=4)
        assert c.protocol_version == 2
        assert torch.equal(c.decompress(ct, sm_budget=4).view(torch.int16), t.view(torch.int16))
    finally:
        c.close()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("codec", ["fast", "max"])
def test_cuda_every_budget_gives_the_same_frames_and_tensors(daemon, codec):  # noqa: F811
    c = tzip.connect(daemon.socket, spawn=False, strict=True)
    try:
        ts = [t.cuda() for t in weights_bf16()]
        ref = c.compress(ts, codec=codec)
        ref_bytes = [ct.payload.cpu().numpy().tobytes() for ct in ref]
        for budget in (0, 1, 4, 132, 1024):
            cts = c.compress(ts, codec=codec, sm_budget=budget)
            assert [ct.payload.cpu().numpy().tobytes() for ct in cts] == ref_bytes, budget
            for t, b in zip(ts, c.decompress(cts, sm_budget=budget)):
                assert torch.equal(b.view(torch.int16), t.view(torch.int16)), budget
    finally:
        c.close()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_cuda_calls_for_all_sms_go_through_the_ring(daemon):  # noqa: F811
    """``sm_budget=0`` (and budgets above the SQE byte's 255) on a GPU of at most 255 SMs are said as 255 in the SQE:
    no compress or decompress goes through ZeroMQ (2 ms a call there against 0.45 ms through the ring on an H100,
    docs/benchmarks.md), and the frames and tensors equal the default budget's."""
    if torch.cuda.get_device_properties(0).multi_processor_count > 255:
        pytest.skip("a GPU of more than 255 SMs: such calls go through ZeroMQ")
    c = tzip.connect(daemon.socket, spawn=False, strict=True)
    try:
        ts = [t.cuda() for t in weights_bf16()]
        ref = c.compress(ts, codec="fast")
        sent = record_requests(c)
        for budget in (0, 300):
            one = c.compress(ts[0], codec="fast", sm_budget=budget)
            cts = c.compress(ts, codec="fast", sm_budget=budget)
            assert [ct.payload.cpu().numpy().tobytes() for ct in cts] == [ct.payload.cpu().numpy().tobytes() for ct in ref]
            assert one.payload.cpu().numpy().tobytes() == ref[0].payload.cpu().numpy().tobytes()
            for t, b in zip(ts + ts[:1], c.decompress(cts, sm_budget=budget) + [c.decompress(one, sm_budget=budget)]):
                assert torch.equal(b.view(torch.int16), t.view(torch.int16)), budget
            later = c.decompress_async(c.compress_async(ts, codec="fast", sm_budget=budget).result(), sm_budget=budget)
            for t, b in zip(ts, later.result()):
                assert torch.equal(b.view(torch.int16), t.view(torch.int16)), budget
        assert [m["op"] for m in sent if m["op"] in ("compress", "decompress")] == []
    finally:
        c.close()
