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

``tzip.attach()`` / ``tzip.detach()`` switch the training integrations on and off in a running job
(:mod:`tzip.attaching`; ``TZIP_ATTACH=1`` attaches a job from its start).

Also here: the demo inputs (:mod:`tzip.demo_data`) and a pure-Python reference decoder (:mod:`tzip.reference`).
"""

__version__ = "0.1.0"

__all__ = ["Client", "CompressedTensor", "DaemonUnavailableError", "DeviceUnavailableError", "OutOfMemoryError", "TzipDaemonError",
           "connect", "attach", "detach",
           "save", "load", "__version__"]

# Every name is loaded on first use, so `import tzip` stays light: torch is imported by the first name that needs it
# (TZIP_ATTACH=1 imports tzip.attaching at interpreter start-up, which must not import torch), torch.distributed and
# DCP only by what needs them. The integrations are submodules (tzip.distributed, tzip.ddp, tzip.fsdp, tzip.optim,
# tzip.checkpoint), imported as usual.
_LAZY = {
    "Client": "client", "connect": "client", "DaemonUnavailableError": "client", "DeviceUnavailableError": "client",
    "OutOfMemoryError": "client", "TzipDaemonError": "client",
    "CompressedTensor": "compressed",
    "save": "saving", "load": "saving",
    "attach": "attaching", "detach": "attaching",
}
_SUBMODULES = {"client", "compressed", "saving", "attaching", "checkpoint", "ddp", "distributed", "fsdp", "optim",
               "inference", "in_process", "demo_data", "reference", "gpu_data", "integrations"}


def __getattr__(name: str):
    import importlib

    mod = _LAZY.get(name)
    if mod is None:
        if name in _SUBMODULES:  # `import tzip; tzip.client` as when the package imported it eagerly
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module 'tzip' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
