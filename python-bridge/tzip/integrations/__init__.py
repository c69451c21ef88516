"""tzip in the training frameworks users already run.

* :mod:`tzip.integrations.transformers`: ``TzipCallback`` for Hugging Face ``Trainer``
  (``Trainer(..., callbacks=[TzipCallback(codec="auto")])``).

Accelerate without Trainer needs no integration of its own: the model ``accelerator.prepare`` returns is a
``DistributedDataParallel`` and takes ``tzip.attach(model=...)`` (examples/accelerate_ddp.py).

Each submodule imports its framework when it is imported, not before: ``import tzip.integrations`` costs nothing.
"""
