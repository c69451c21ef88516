"""Hugging Face ``Trainer`` with tzip: one callback.

    from tzip.integrations.transformers import TzipCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[TzipCallback(codec="auto")])
    trainer.train()            # launched as usual: torchrun --nproc-per-node N train.py, accelerate launch, ...

When training starts (``on_train_begin``, after the Trainer has wrapped the model and prepared the optimizer) the
callback calls :func:`tzip.attach` on what the Trainer built:

* ``trainer.model_wrapped``, when it is a ``DistributedDataParallel`` (Accelerate wraps the model so whenever the job
  has more than one process and no FSDP/DeepSpeed): its gradient buckets are all-reduced by tzip's lossless comm hook
  (:mod:`tzip.ddp`). Training stays bit-identical to the run without the callback (two ranks: equal to plain DDP;
  any world size: equal to the hook with ``codec="raw"``), with gradient accumulation (DDP's ``no_sync``) and
  ``ddp_find_unused_parameters`` either way.
* with ``offload_optimizer=True``, the Trainer's optimizer (an Accelerate ``AcceleratedOptimizer``; tzip hooks the
  optimizer it wraps): its state lives compressed between steps (:class:`tzip.optim.AttachedOffload`); the steps,
  ``optimizer.state_dict()`` and so the Trainer's checkpoints are bit-identical to those without.

When training ends (``on_train_end``) it calls :func:`tzip.detach` (the optimizer state comes back uncompressed, the
DDP model goes back to its own all-reduce) unless ``detach_at_end=False``; the next ``trainer.train()`` attaches
again. ``detach`` is process-wide: whatever else the process attached is switched off too.

Every ``on_log`` adds this rank's figures, counted since training started, to the Trainer's ``logs`` (and to the
entry ``trainer.state.log_history`` got for them); each key is present only when its figure exists:

* ``tzip/bytes_raw`` (int, bytes): what plain DDP's ring all-reduce would have sent for the same buckets;
* ``tzip/bytes_sent`` (int, bytes): what this rank sent (frames and headers);
* ``tzip/bytes_saved`` (int, bytes): ``bytes_raw - bytes_sent`` (negative when compression did not pay);
* ``tzip/ratio`` (float): ``bytes_sent / bytes_raw``, after the first bucket;
* ``tzip/optimizer_state_bytes``, ``tzip/optimizer_compressed_bytes`` (int, bytes) and ``tzip/optimizer_ratio``
  (float): the optimizer state offloaded now, with ``offload_optimizer=True``.

The figures are this rank's (rank 0's in the logs Trainer reports): gathering them would be a collective inside
``on_log``, which a job calling ``trainer.log`` on one rank only would hang. Callbacks run in list order and the
Trainer puts the ``report_to`` integrations (TensorBoard, W&B, ...) before the user's callbacks, so those see the tzip
keys only when ``TzipCallback`` comes first: ``trainer.callback_handler.callbacks.insert(0, ...)``; the progress bar
or printer and ``log_history`` always see them.

Without DDP (a single process, or FSDP / DeepSpeed, which do not use DDP's comm hooks) there are no DDP gradient
buckets to compress: the callback logs one line saying so (logger ``tzip.integrations.transformers``, WARNING) and
leaves the gradients alone; ``offload_optimizer=True`` still offloads the optimizer state.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from transformers import TrainerCallback

__all__ = ["TzipCallback"]

logger = logging.getLogger(__name__)


def _calling_trainer():
    """The ``transformers.Trainer`` whose training loop called this callback (the frame of ``_inner_training_loop``
    above the callback handler's), or None. The callback events are not given the trainer and their ``model`` is
    the unwrapped one (``CallbackHandler.model`` is ``trainer.model``); the DDP wrapper is ``trainer.model_wrapped``
    only."""
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        f = frame.f_back if frame is not None else None
        while f is not None:
            owner = f.f_locals.get("self")
            if isinstance(owner, Trainer):
                return owner
            f = f.f_back
        return None
    finally:
        del frame  # a frame held in a local is a reference cycle


def _ddp_inside(model):
    """The ``DistributedDataParallel`` that is ``model`` or that ``model`` wraps through ``torch.compile``
    (``OptimizedModule._orig_mod``), or None."""
    from torch.nn.parallel import DistributedDataParallel

    for _ in range(4):
        if isinstance(model, DistributedDataParallel):
            return model
        model = getattr(model, "_orig_mod", None)
        if model is None:
            return None
    return None


class TzipCallback(TrainerCallback):
    """Switches tzip on for a Hugging Face ``Trainer``'s training (see the module docstring).

    Args:
        codec: codec of the gradients and the offloaded optimizer state: "auto" (default), "fast", "max", "bytes",
            or "raw" (uncompressed frames: the reference the others are bit-identical to); None: tzip's default by
            device ("fast" for CUDA tensors, "auto" for CPU tensors).
        offload_optimizer: also keep the optimizer state compressed between steps (default False).
        job: the job's name in ``tzip jobs`` (default: $TZIP_JOB, torchrun's $TORCHELASTIC_RUN_ID, else
            ``<script>-<pid>``).
        client: a :class:`tzip.Client` (default: the process-wide one, which finds or starts a daemon).
        strict: raise DaemonUnavailableError instead of sending raw frames while no daemon serves.
        detach_at_end: call :func:`tzip.detach` when training ends (default True).

    Raises ValueError (unknown codec) at construction; from ``on_train_begin`` what :func:`tzip.attach` raises:
    RuntimeError when the DDP model already has another comm hook (Accelerate's ``DistributedDataParallelKwargs
    (comm_hook=...)``: DDP takes one hook per model), DaemonUnavailableError with ``strict=True``.

    Attributes (after ``on_train_begin``): ``attachment`` (the :class:`tzip.attaching.Attachment`, None when nothing
    was attached), ``ddp_state`` (the model's :class:`tzip.ddp.LosslessState`, None without DDP), ``offload`` (the
    optimizer's :class:`tzip.optim.AttachedOffload`, None unless ``offload_optimizer``).
    """

    def __init__(self, codec: str | None = "auto", offload_optimizer: bool = False, job: str | None = None,
                 client: Any = None, strict: bool = False, detach_at_end: bool = True):
        from .._codec_choice import check_codec

        check_codec(codec)  # a typo fails where the Trainer is built, not after the model is wrapped
        self.codec = codec
        self.offload_optimizer = bool(offload_optimizer)
        self.job = job
        self.client = client
        self.strict = bool(strict)
        self.detach_at_end = bool(detach_at_end)
        self.attachment = None
        self.ddp_state = None
        self.offload = None
        self._base = (0, 0)  # the hook's (bytes_raw, bytes_sent) when this training began

    # --- events -----------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        import tzip
        import tzip.attaching

        trainer = _calling_trainer()
        wrapped = trainer.model_wrapped if trainer is not None else model
        ddp = _ddp_inside(wrapped)
        self.attachment = self.ddp_state = self.offload = None
        if ddp is None:
            logger.warning("tzip: the Trainer's model is %s, not DistributedDataParallel (%s): no DDP gradients to "
                           "compress, the comm hook is not installed%s", type(wrapped).__name__,
                           "a single process" if args.world_size <= 1 else "FSDP/DeepSpeed do not take DDP comm hooks",
                           "; the optimizer state is offloaded" if self.offload_optimizer else "")
        opt = optimizer if self.offload_optimizer else None
        if self.offload_optimizer and opt is None:
            logger.warning("tzip: offload_optimizer=True but the Trainer has no optimizer yet: not offloaded")
        if ddp is None and opt is None:
            return  # attach() with neither would switch on again whatever the process attached before
        self.attachment = tzip.attach(model=ddp, optimizer=opt, job=self.job, codec=self.codec, client=self.client,
                                      strict=self.strict)
        if ddp is not None:
            self.ddp_state = tzip.attaching._reg.ddp.get(ddp)
            self._base = (self.ddp_state.bytes_raw, self.ddp_state.bytes_sent)
        if opt is not None:
            from ..attaching import _state_optimizer

            self.offload = getattr(_state_optimizer(opt), "_tzip_offload", None)
        logger.info("tzip: attached (job %s, codec %s): %s", self.attachment.job, self.codec,
                    ", ".join(x for x in ("DDP gradients" if ddp is not None else "",
                                          "optimizer state" if opt is not None else "") if x))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        figures = self.figures()
        logs.update(figures)
        # Trainer.log appended {**logs, "step": ...} to log_history just before this event: that copy gets them too
        if state.log_history:
            last = state.log_history[-1]
            if last.get("step") == state.global_step and all(k in last for k in logs if k not in figures):
                last.update(figures)

    def on_train_end(self, args, state, control, **kwargs):
        if self.detach_at_end and self.attachment is not None:
            import tzip

            tzip.detach()

    # --- figures ----------------------------------------------------------------------------------------------
    def figures(self) -> dict[str, int | float]:
        """The ``tzip/...`` figures ``on_log`` adds (module docstring): this rank's, since training began; empty
        before ``on_train_begin`` attached anything."""
        out: dict[str, int | float] = {}
        st = self.ddp_state
        if st is not None:
            raw, sent = st.bytes_raw - self._base[0], st.bytes_sent - self._base[1]
            out.update({"tzip/bytes_raw": raw, "tzip/bytes_sent": sent, "tzip/bytes_saved": raw - sent})
            if raw:
                out["tzip/ratio"] = sent / raw
        if self.offload is not None and not self.offload.removed:
            s = self.offload.offload_stats()
            out.update({"tzip/optimizer_state_bytes": s["state_bytes"],
                        "tzip/optimizer_compressed_bytes": s["compressed_bytes"]})
            if s["state_bytes"]:
                out["tzip/optimizer_ratio"] = s["compressed_bytes"] / s["state_bytes"]
        return out
