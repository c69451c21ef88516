"""Records the daemon protocol messages the real Python client sends, as seeds of the js_protocol fuzz target.

Starts a private ``tzip serve`` (python-bridge/tests/test_client_support.py's DaemonProcess), connects the real
client, and compresses and decompresses real MiniLM tensors (tzip.demo_data's weights, F32 and BF16, several
codecs, one and several tensors per request), asks for stats and releases; every MessagePack message the client's
transport sends is written to OUT_DIR/NN-<op>.msgpack. No GPU here: the recorded compress and decompress
requests are also written in their CUDA form (gpu-<op>.msgpack), with the fields tzip/_cuda.py writes (a protocol
version 2 handle table of one ``cuda_ipc`` handle, ``ref`` regions, ``wait_event``). Run once by hand (the seeds are committed, a few KB):

    .venv/bin/python fuzz/python/record_protocol_seeds.py fuzz/seeds/protocol
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import msgpack
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python-bridge" / "tests"))
from test_client_support import DaemonProcess  # noqa: E402

import tzip  # noqa: E402
from tzip import _transport  # noqa: E402


def _cuda_form(message: dict) -> dict:
    """``message`` as the client sends it for CUDA tensors (tzip/_cuda.py: Share.wire, _Buffer.region/body)."""
    pid = os.getpid()
    size = max(h["offset"] + h["size"] for h in _shm_handles(message))
    share = {"kind": "cuda_ipc", "device_uuid": "GPU-6f1c2a4e-93b0-4d7e-8a52-0c1d2e3f4a5b", "device_index": 0,
             "handle": bytes([2, 0x63]) + bytes(range(64)), "offset": 0, "size": size,
             "ref_counter_handle": f"/torch_{pid}_1234567890_0".encode(), "ref_counter_offset": 3}
    for h in _shm_handles(message):
        offset, length = h["offset"], h["size"]
        h.clear()
        h.update({"kind": "ref", "index": 0, "offset": offset, "size": length})
    for key in ("tensors", "frames"):
        for item in message.get(key, []):
            for t in (item.get("tensor"), item.get("out")):
                if isinstance(t, dict) and "device" in t:
                    t["device"] = {"type": 2, "id": 0}
    message["handles"] = [share]
    message["wait_event"] = bytes(range(64, 128))
    return message


def _shm_handles(message: dict) -> list[dict]:
    found = []
    for key in ("tensors", "frames"):
        for item in message.get(key, []):
            for v in item.values():
                h = v.get("data", v) if isinstance(v, dict) else None
                if isinstance(h, dict) and h.get("kind") == "shm":
                    found.append(h)
    return found


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    recorded: list[bytes] = []
    real_packb = _transport.msgpack.packb

    def packb(message, **kw):
        data = real_packb(message, **kw)
        recorded.append(data)
        return data

    _transport.msgpack.packb = packb
    weights = load_file("data/demo/minilm-weights-f32.safetensors")
    bf16 = load_file("data/demo/minilm-weights-bf16.safetensors")
    with tempfile.TemporaryDirectory(prefix="tzip-seeds-") as d:
        os.chmod(d, 0o700)
        daemon = DaemonProcess(os.path.join(d, "s", "tzip.sock")).start()
        try:
            client = tzip.connect(daemon.socket, spawn=False, strict=True)
            q = weights["encoder.layer.0.attention.self.query.weight"][:8]
            cts = client.compress(q, codec="max")
            client.decompress(cts)
            batch = [bf16["embeddings.LayerNorm.weight"], bf16["encoder.layer.1.output.dense.bias"][:100],
                     weights["embeddings.position_ids"] if "embeddings.position_ids" in weights else q]
            cts = client.compress(batch, codec="auto")
            client.decompress(cts, verify=False)
            client.compress([q], codec="fast")
            client.compress([q], codec="raw")
            client.stats()
            client.close()
        finally:
            daemon.stop()
    _transport.msgpack.packb = real_packb
    gpu = 0
    for i, data in enumerate(recorded):
        message = msgpack.unpackb(data, raw=False)
        op = message.get("op", "x")
        (out / f"{i:02d}-{op}.msgpack").write_bytes(data)
        if op in ("compress", "decompress") and gpu < 2:
            (out / f"gpu-{op}.msgpack").write_bytes(msgpack.packb(_cuda_form(message), use_bin_type=True))
            gpu += 1
    print(f"{len(recorded)} messages in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
