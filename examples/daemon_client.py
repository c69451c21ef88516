"""Compress a model's weights and gradients through the tzip daemon, and get them back bit for bit.

    npm run build:ts                       # the daemon is dist/src/cli/main.js serve
    .venv/bin/python examples/daemon_client.py

connect() starts a daemon when none runs (on $TZIP_SOCKET / $XDG_RUNTIME_DIR/tzip/tzip.sock /
/tmp/tzip-$UID/tzip.sock); it exits by itself after 10 minutes without clients.
"""

from __future__ import annotations

import io

import torch

import tzip.client as tz
from tzip.compressed import CompressedTensor


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).to(torch.bfloat16)
    model(torch.randn(64, 512, dtype=torch.bfloat16)).square().mean().backward()
    params = list(model.parameters())

    with tz.connect() as client:  # strict=False: falls back to uncompressed frames if the daemon is away
        print(client, client.daemon_info.get("version"))

        # one request for the whole batch; the tensors are copied once into shared memory
        weights = client.compress(params)
        grads = client.compress([p.grad for p in params])
        for name, cts in (("weights", weights), ("grads", grads)):
            orig = sum(c.nbytes for c in cts)
            comp = sum(c.compressed_nbytes for c in cts)
            print(f"{name}: {orig / 1e6:.2f} MB -> {comp / 1e6:.2f} MB (ratio {comp / orig:.3f}, codecs {sorted({c.codec for c in cts})})")

        # bit-exact round trip
        for p, back in zip(params, client.decompress(weights)):
            assert torch.equal(p.detach().view(torch.int16), back.view(torch.int16))

        # a tensor that lives in shared memory is handed to the daemon without any copy
        bucket = client.empty((4_000_000,), torch.bfloat16)
        torch.nn.init.normal_(bucket, std=0.02)
        fut = client.compress_async(bucket)  # concurrent.futures.Future
        ct = fut.result()
        print(ct)

        # CompressedTensors serialise as bytes or with torch.save (weights_only loads work)
        again = CompressedTensor.from_bytes(ct.to_bytes())
        buf = io.BytesIO()
        torch.save({"bucket": ct}, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)["bucket"]
        assert torch.equal(client.decompress(again).view(torch.int16), bucket.view(torch.int16))
        assert torch.equal(client.decompress(loaded).view(torch.int16), bucket.view(torch.int16))
        print("round trips bit-exact; daemon stats:", {k: client.stats()[k] for k in ("sessions", "compress", "decompress")})


if __name__ == "__main__":
    main()
