"""Records the daemon protocol messages the real Python client sends, as seeds of the js_protocol fuzz target.

Starts a private ``tzip serve`` (python-bridge/tests/test_client_support.py's DaemonProcess), connects the real
client, and compresses and decompresses real MiniLM tensors (tzip.demo_data's weights, F32 and BF16, several
codecs, one and several tensors per request), asks for stats and releases; every MessagePack message the client's
transport sends is written to OUT_DIR/NN-<op>.msgpack. Run once by hand (the seeds are committed, a few KB):

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
    for i, data in enumerate(recorded):
        op = msgpack.unpackb(data, raw=False).get("op", "x")
        (out / f"{i:02d}-{op}.msgpack").write_bytes(data)
    print(f"{len(recorded)} messages in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
