"""tzip: lossless GPU/CPU compression for PyTorch tensors.

tzip compresses the raw bytes of tensors -- bf16/fp16/fp32 model weights and gradients, and any other
safetensors dtype -- without losing a bit: a decompressed tensor is byte-identical to the original. Floating-point
data is coded field by field (docs/format.md). The codec lives in the tzip daemon (``tzip serve``); this package
talks to it over ZeroMQ and hands it shared-memory handles (CPU tensors) or CUDA IPC handles (GPU tensors, which
stay on their GPU), so tensor bytes never cross the socket (docs/protocol.md)::

    import tzip
    client = tzip.connect()            # starts a daemon if none runs
    ct = client.compress(tensor)       # CompressedTensor: payload, dtype, shape, codec, ratio
    back = client.decompress(ct)       # bit-identical to tensor

Also here: the demo inputs (:mod:`tzip.demo_data`) and a pure-Python reference decoder (:mod:`tzip.reference`).
"""

from .client import Client, DaemonUnavailableError, DeviceUnavailableError, OutOfMemoryError, TzipDaemonError, connect
from .compressed import CompressedTensor

__version__ = "0.1.0"

__all__ = ["Client", "CompressedTensor", "DaemonUnavailableError", "DeviceUnavailableError", "OutOfMemoryError", "TzipDaemonError",
           "connect",
           "save", "load", "__version__"]

# Names loaded on first use, so `import tzip` stays light (torch.distributed and DCP are imported only by what needs
# them): tzip.save / tzip.load come from tzip.saving; the integrations are submodules (tzip.distributed, tzip.ddp,
# tzip.fsdp, tzip.optim, tzip.checkpoint), imported as usual.
_LAZY = {"save": "saving", "load": "saving"}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'tzip' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value
