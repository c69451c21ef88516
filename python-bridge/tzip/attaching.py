"""``tzip.attach()`` / ``tzip.detach()``: switch tzip on and off in a job that is already running.

(The module is ``tzip.attaching``, as ``tzip.saving`` holds ``tzip.save``: a submodule named ``attach`` would
replace the function ``tzip.attach`` on the package once imported.)

    import tzip
    ...                                   # a job that started without tzip: DDP, an optimizer, its checkpoints
    if step == 1000:
        tzip.attach(model=ddp_model, optimizer=opt)     # on every rank, at the same step
    ...
    if step == 2000:
        tzip.detach()

What :func:`attach` switches on, for the rest of the run (until :func:`detach`):

* ``model`` (a ``DistributedDataParallel``): its gradient buckets are all-reduced by tzip's lossless comm hook
  (:mod:`tzip.ddp`), registered the first time (DDP takes one hook per model, for good) and switched through
  ``LosslessState.enabled`` afterwards. Call attach/detach on every rank at the same iteration (between
  ``optimizer.step()`` and the next forward): all ranks must take the same path for a bucket.
* ``optimizer`` (a ``torch.optim.Optimizer``): its state is offloaded compressed between steps
  (:class:`tzip.optim.AttachedOffload`: hooks on the optimizer; the job keeps calling its own ``step()``). A
  wrapper (Hugging Face Trainer's ``AcceleratedOptimizer``, ``ZeroRedundancyOptimizer``) gets the hooks on the
  optimizer it steps, and the job keeps calling the wrapper.
  :func:`detach` brings the state back uncompressed.
* the checkpoint helpers (``tzip.save``, ``tzip.checkpoint.Writer``) called without a ``codec`` compress (the
  Client's default: "fast" for CUDA tensors, "auto" for CPU tensors);
  after :func:`detach` they write raw frames (still ``.tzip`` files that ``tzip.load`` reads).
* the daemon hears the job (:func:`tzip.client.job_info`: name, user, rank, world size, devices, MPS) with
  ``attached`` true (``tzip jobs`` lists it) and counts its requests by stream: gradients, optimizer, checkpoint.

Results are bit-identical either way: the codecs are lossless, the comm hook averages and sums as DDP does (two
ranks: equal to plain DDP; any world size: equal to the hook with ``codec="raw"``), and the optimizer's own step does
the arithmetic. A job whose codec the daemon sets to "off" (``tzip set JOB codec=off``) sends plain data from the
next request on. The daemon away: the gradients and new checkpoints travel as raw frames, with one warning
(``strict=True``: DaemonUnavailableError); a job survives a daemon restart (the client says hello again, with the
job, at its next request). Offloaded optimizer state is compressed and needs a daemon to come back: the default
client starts one again when none runs (``spawn``); where none can be started, ``step()`` raises
DaemonUnavailableError before anything changed, until a daemon serves the socket.

``TZIP_ATTACH=1`` in the environment of a job attaches it from the start, with no change to its code: the
``tzip-attach.pth`` file (:data:`PTH_LINE`, installed next to the package; :func:`install_pth`) makes Python run
:func:`_install_auto_attach` at start-up when the variable is 1 (otherwise it costs one environment lookup). That
imports neither torch nor tzip's client: it waits for the job to import ``torch.nn.parallel.distributed`` (then every
``DistributedDataParallel`` attaches when constructed) and ``torch.optim.optimizer`` (then every optimizer attaches
after its first step, once its state exists). ``TZIP_JOB`` names the job (without it, the ranks of one torchrun
launch still share one: :func:`tzip._job.job_info`).
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

__all__ = ["attach", "detach", "attached", "Attachment", "checkpoint_codec", "PTH_LINE", "install_pth"]

#: The one line of ``tzip-attach.pth``: Python's site module runs it at start-up (lines starting with ``import``).
PTH_LINE = ('import os; os.environ.get("TZIP_ATTACH") == "1" and '
            '__import__("tzip.attaching").attaching._install_auto_attach()\n')
#: The .pth file's name in site-packages.
PTH_NAME = "tzip-attach.pth"


@dataclass
class Attachment:
    """What :func:`attach` switched on: the job's name, the client, the comm-hook states of the DDP models
    (:class:`tzip.ddp.LosslessState`: ``bytes_raw``, ``bytes_sent``, ``buckets``) and the optimizers' offloads
    (:class:`tzip.optim.AttachedOffload`: ``offload_stats()``), and the job's settings from the daemon."""

    job: str
    client: Any
    models: list = field(default_factory=list)
    optimizers: list = field(default_factory=list)
    settings: dict = field(default_factory=dict)


class _Registry:
    """The process's attach state: None before any attach/detach, True attached, False detached; the DDP models
    and optimizers attach has seen (weakly: a model the job drops is forgotten)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.state: bool | None = None
        self.client: Any = None  # the client the job was announced with (detach announces the end there)
        self.ddp: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DDP model -> LosslessState
        # Optimizers seen; each keeps its AttachedOffload as ``_tzip_offload`` (a value of a WeakKeyDictionary
        # would hold its key alive: the offload refers to its optimizer).
        self.optimizers: weakref.WeakSet = weakref.WeakSet()
        # Optimizers TZIP_ATTACH=1 could not attach (it warned once): not tried again at every step.
        self.refused: weakref.WeakSet = weakref.WeakSet()


_reg = _Registry()


def _after_fork_in_child() -> None:
    # A child after fork has its own (new) default client and none of the parent's job: it starts detached-unknown.
    global _reg
    _reg = _Registry()


os.register_at_fork(after_in_child=_after_fork_in_child)


def attached() -> bool:
    """Whether :func:`attach` is in effect in this process (False before it and after :func:`detach`)."""
    return _reg.state is True


def checkpoint_codec(codec: str | None) -> str | None:
    """The codec of a checkpoint helper called with ``codec`` (None: not given): ``codec`` when given; else "raw"
    after :func:`detach`, and None otherwise (attached, or never attached: the Client's default by device, "fast"
    for CUDA tensors and "auto" for CPU tensors, tzip._codec_choice)."""
    if codec is not None:
        return codec
    return "raw" if _reg.state is False else None


def _find_ddp(model):
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model
    raise TypeError(f"tzip.attach(model=...) takes a DistributedDataParallel model, got {type(model).__name__} "
                    "(FSDP2: tzip.fsdp.use_lossless_collectives; a model without DDP has no gradients to send)")


def _attach_ddp(ddp, process_group, client, strict: bool, codec: str | None):
    """The model's LosslessState, switched on with this call's codec, client and strict; the hook is registered
    the first time."""
    from .ddp import LosslessState, lossless_allreduce_hook

    state = _reg.ddp.get(ddp)
    if state is None:
        hooks = list(getattr(ddp, "_comm_hooks", []))  # DDP keeps the (hook, state) it registered
        ours = [s for h, s in hooks if isinstance(s, LosslessState)]
        if ours:
            state = ours[0]  # the job registered tzip's hook itself: switch that one
        elif hooks:
            raise RuntimeError(f"this DistributedDataParallel model has another comm hook ({hooks[0][0]!r}); DDP takes "
                               "one hook per model, so tzip's cannot be added")
        else:
            group = process_group if process_group is not None else getattr(ddp, "process_group", None)
            state = LosslessState(group, codec, client, strict, enabled=True)
            ddp.register_comm_hook(state, lossless_allreduce_hook)
        _reg.ddp[ddp] = state
    # a model attached before keeps its hook but takes this call's settings, as an optimizer attached again does
    state.codec, state.client, state.strict = codec, client, strict
    state.enabled = True
    return state


def _state_optimizer(opt):
    """The optimizer attach hooks (tzip.optim.optimizer_holding_state): ``opt``, or the one a wrapper such as
    Accelerate's AcceleratedOptimizer or ZeroRedundancyOptimizer steps for it. TypeError, before anything changed,
    for what is not an optimizer (an LR scheduler: named, with the way to its optimizer) or a wrapper whose state
    cannot be reached."""
    import torch

    from .optim import optimizer_holding_state

    if not isinstance(opt, torch.optim.Optimizer):
        inner = getattr(opt, "optimizer", None)
        hint = (f" (it holds a {type(inner).__name__}: pass its .optimizer)"
                if isinstance(inner, torch.optim.Optimizer) else "")
        raise TypeError(f"tzip.attach(optimizer=...) takes a torch.optim.Optimizer, got {type(opt).__name__}{hint}")
    return optimizer_holding_state(opt)


def _attach_optimizer(opt, client, strict: bool, codec: str | None):
    from .optim import AttachedOffload, CompressedOffload

    opt = _state_optimizer(opt)
    if isinstance(opt, CompressedOffload):
        return None  # its state is offloaded compressed already
    off = getattr(opt, "_tzip_offload", None)
    if off is None or off.removed:
        off = AttachedOffload(opt, codec, client, strict)
        opt._tzip_offload = off
        _reg.optimizers.add(opt)
    return off


def _offloads() -> list:
    return [o for o in (getattr(opt, "_tzip_offload", None) for opt in list(_reg.optimizers)) if o is not None]


def attach(model=None, optimizer=None, process_group=None, job: str | None = None, *, codec: str | None = None,
           client=None, strict: bool = False) -> Attachment:
    """Switches tzip on for the rest of the run (see the module docstring); callable at any step, on every rank at
    the same one. ``attach()`` with neither ``model`` nor ``optimizer`` after :func:`detach` switches on again the
    models and optimizers attached before; with them, those are added (the others stay as they are). Whatever a
    call switches on, attached before or not, takes its ``codec``, ``client`` and ``strict``.

    The first attach of a model makes its hook's process group (:mod:`tzip.ddp`): a collective over the group's
    ranks, which waits for all of them up to the group's timeout (init_process_group's), so every rank must call
    it at the same iteration.

    Args:
        model: a ``DistributedDataParallel`` model (its gradients go through tzip's lossless comm hook).
        optimizer: a ``torch.optim.Optimizer`` (its state is offloaded compressed between steps), or a wrapper that
            passes for one: Accelerate's ``AcceleratedOptimizer`` (Hugging Face Trainer's ``trainer.optimizer``) and
            ``ZeroRedundancyOptimizer`` (``overlap_with_ddp=False``) attach the optimizer they step
            (:func:`tzip.optim.optimizer_holding_state`); the job keeps calling the wrapper.
        process_group: the group the hook all-reduces over (default: the model's).
        job: the job's name, shared by its ranks (default: $TZIP_JOB, torchrun's $TORCHELASTIC_RUN_ID, else the
            name the ranks of a torchrun launch agree on when its run id is "none", else ``<script>-<pid>``;
            :func:`tzip._job.job_info`).
        codec: codec of the gradients and the optimizer state: "auto", "fast", "max", "bytes" or "raw"; None
            (default): "fast" on a GPU, "auto" on the CPU (tzip._codec_choice).
        client: a :class:`tzip.Client` (default: the process-wide one, tzip._default).
        strict: raise DaemonUnavailableError instead of sending raw frames while the daemon is away.

    Returns an :class:`Attachment`. Raises TypeError (a model that is not DDP, an optimizer that is not a
    torch.optim.Optimizer, a wrapper whose optimizer cannot be reached: named, and nothing changed), RuntimeError (the model has another comm hook), ValueError (unknown codec) and, with
    ``strict``, DaemonUnavailableError.
    """
    from ._codec_choice import check_codec
    from ._default import resolve_client

    check_codec(codec)
    ddp = _find_ddp(model) if model is not None else None
    if optimizer is not None:
        # A wrapper (Trainer's AcceleratedOptimizer, ZeroRedundancyOptimizer) is resolved, or refused, here: before
        # the daemon hears of the job and before any state is offloaded.
        optimizer = _state_optimizer(optimizer)
    with _reg.lock:
        c = resolve_client(client, strict)
        devices = []
        if ddp is not None:
            devices = list(dict.fromkeys(p.device for p in ddp.parameters()))
        settings = c.set_job(True, name=job, devices=devices)
        _reg.client = c
        if ddp is not None:
            _attach_ddp(ddp, process_group, client, strict, codec)
        elif optimizer is None:
            for d in list(_reg.ddp):
                _attach_ddp(d, process_group, client, strict, codec)
        if optimizer is not None:
            _attach_optimizer(optimizer, c, strict, codec)
        if model is None and optimizer is None:  # attach() again: what was attached before
            for opt in list(_reg.optimizers):
                _attach_optimizer(opt, c, strict, codec)
        _reg.state = True
        return Attachment(c.job["name"], c, [s for s in _reg.ddp.values() if s.enabled],
                          [o for o in _offloads() if not o.removed], settings)


def detach() -> None:
    """Switches tzip off for the rest of the run, or until the next :func:`attach`: the DDP models' buckets go
    through DDP's own all-reduce, the optimizers' state comes back uncompressed (their hooks removed), the
    checkpoint helpers called without a codec write raw frames, and the daemon hears ``attached: false``. Call it
    on every rank at the same iteration. A no-op when not attached.

    Raises DaemonUnavailableError when compressed optimizer state cannot be decoded (no daemon); what could be
    switched off is, and the call may be repeated once a daemon serves the socket."""
    with _reg.lock:
        if _reg.state is not True:
            return
        for state in list(_reg.ddp.values()):
            state.enabled = False
        failed: BaseException | None = None
        for off in _offloads():
            try:
                off.remove()
            except BaseException as e:  # noqa: BLE001 - the others are still switched off; raised below
                failed = failed or e
        if failed is not None:
            raise failed
        _reg.state = False
        if _reg.client is not None and not _reg.client._closed:  # noqa: SLF001 (a client the job closed: no one to tell)
            _reg.client.set_job(False)


# --------------------------------------------------------------------------- TZIP_ATTACH=1


def install_pth(site_dir: str | None = None) -> str:
    """Writes ``tzip-attach.pth`` (:data:`PTH_LINE`) into ``site_dir`` (default: this interpreter's first
    site-packages folder), so that ``TZIP_ATTACH=1`` attaches every job this interpreter runs. Returns its path.
    Wheels of tzip carry the file; this is for checkouts installed in editable mode."""
    if site_dir is None:
        import site

        site_dir = site.getsitepackages()[0]
    path = os.path.join(site_dir, PTH_NAME)
    with open(path, "w") as f:
        f.write(PTH_LINE)
    return path


def _auto(**what) -> bool:
    """attach(**what) for TZIP_ATTACH=1; a failure warns and never stops the job. Returns whether it attached."""
    if _reg.state is False:
        return False  # the job detached: new models and optimizers stay as they are
    try:
        attach(**what)
    except Exception as e:  # noqa: BLE001 - the job goes on without tzip
        warnings.warn(f"tzip: TZIP_ATTACH=1 could not attach {', '.join(what)}: {type(e).__name__}: {e}",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


def _patch_ddp(module) -> None:
    cls = module.DistributedDataParallel
    if getattr(cls.__init__, "_tzip_auto", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _auto(model=self)

    __init__._tzip_auto = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def _patch_optimizer(module) -> None:
    if getattr(module, "_tzip_auto", False):
        return
    module._tzip_auto = True

    def after_step(opt, args, kwargs) -> None:
        # After the first step the optimizer's state exists (and its constructor has finished): attach it then.
        # Every later step finds it known and returns at once.
        if getattr(opt, "_tzip_offload", None) is not None or _reg.state is False or opt in _reg.refused:
            return
        from .optim import CompressedOffload

        if not isinstance(opt, CompressedOffload) and not _auto(optimizer=opt):
            _reg.refused.add(opt)  # warned once; an explicit tzip.attach(optimizer=opt) still tries

    module.register_optimizer_step_post_hook(after_step)


_PATCHES = {"torch.nn.parallel.distributed": _patch_ddp, "torch.optim.optimizer": _patch_optimizer}


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then the patch of the module."""

    def __init__(self, loader, patch):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._patch(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`_PATCHES` with the other finders and wraps their loaders."""

    def find_spec(self, fullname, path, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


_installed = False


def _install_auto_attach() -> None:
    """TZIP_ATTACH=1 (see the module docstring): patches the DDP and optimizer modules once the job imports them
    (now, for those already imported)."""
    global _installed
    if _installed:
        return
    _installed = True
    sys.meta_path.insert(0, _AfterImport())
    for name, patch in _PATCHES.items():
        mod = sys.modules.get(name)
        if mod is not None:
            patch(mod)


if __name__ == "__main__":
    if sys.argv[1:] == ["install-pth"]:
        print(install_pth())
    else:
        sys.exit("usage: python -m tzip.attaching install-pth   (writes tzip-attach.pth into site-packages)")
