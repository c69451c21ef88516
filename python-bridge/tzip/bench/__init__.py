"""Benchmarks, each a command: ``python -m tzip.bench.NAME --help``.

``training`` (where tzip pays in a training job: offload, collectives, checkpoints in one table), ``offload``,
``collectives``, ``checkpoint``, ``daemon`` (request latency and rates through the daemon), ``load`` (many client
processes against one daemon), ``overlap``, ``memops`` (GPU stream memory operations), ``inference`` (weights kept
compressed in GPU memory). Their figures and the commands that produced them: docs/benchmarks.md.
"""
