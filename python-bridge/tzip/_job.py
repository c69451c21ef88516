"""What a request tells the daemon about its job (protocol version 3, docs/protocol.md "Jobs"): the job info of
hello and the ``job`` op (:func:`job_info`), the stream tag of the requests made inside :func:`tagged`, and the SM
budget of the call being made. The Client reads the tag and the budget when it builds a request (ZeroMQ or ring)."""

from __future__ import annotations

import contextlib
import contextvars
import getpass
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Any, Iterable

import torch

from . import _generated_constants as _generated


#: What a request's bytes are, for the daemon's job registry (protocol version 3, docs/protocol.md): gradients (the
#: DDP comm hook, FSDP's reduce-scatter), optimizer (state offload), checkpoint (tzip.save/load, tzip.checkpoint),
#: sendrecv (the other tzip.distributed collectives), other (anything untagged).
STREAMS = _generated.STREAMS  # src/errors.json "streams" (generated)
#: The stream tag of the requests made in this context (see :func:`tagged`); None: untagged ("other").
_stream_tag: contextvars.ContextVar[str | None] = contextvars.ContextVar("tzip_stream_tag", default=None)
#: The largest SM budget a request may name (docs/protocol.md, "Jobs": sm_budget is 0..1024).
MAX_SM_BUDGET = _generated.MAX_SM_BUDGET


def _checked_sm_budget(sm_budget: int | None) -> int | None:
    if sm_budget is None:
        return None
    if isinstance(sm_budget, bool) or not isinstance(sm_budget, int) or not 0 <= sm_budget <= MAX_SM_BUDGET:
        raise ValueError(f"sm_budget is an int from 0 (all SMs) to {MAX_SM_BUDGET}, or None (the daemon's); got {sm_budget!r}")
    return sm_budget


@contextlib.contextmanager
def tagged(stream: str):
    """Tags every compress and decompress request made inside the ``with`` block, in this thread (and in the async
    calls submitted from it), with ``stream`` (one of :data:`STREAMS`), so the daemon counts their bytes under that
    stream of the job (``tzip jobs``). Protocol version 3; older daemons are sent no tag. Nesting: the innermost
    tag wins. Raises ValueError for an unknown stream."""
    if stream not in STREAMS:
        raise ValueError(f"unknown stream {stream!r}; one of {', '.join(STREAMS)}")
    token = _stream_tag.set(stream)
    try:
        yield
    finally:
        _stream_tag.reset(token)


def _printable(text: str) -> str:
    """``text`` with control characters (C0, DEL, C1) as U+FFFD: the daemon refuses them in job names and users
    (they would reach the terminals of ``tzip jobs``/``tzip top`` and split log lines; docs/protocol.md, "Jobs")."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", "\ufffd", text)


def _script_name() -> str:
    arg0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if arg0 in ("", "-c", "-m", "-"):
        return "python"
    return Path(arg0).name or "python"


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _mps_client() -> bool | None:
    """Whether this process is (or will be) a CUDA MPS client: an MPS control pipe exists where CUDA looks for it
    ($CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps). None when it cannot tell (no CUDA device in use)."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    if os.path.exists(os.path.join(pipe, "control")):
        return True
    if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or torch.cuda.is_initialized():
        return False
    return None


#: The key under which the ranks of a torchrun launch without a run id agree on their job's name, in the store
#: torchrun's agent hosts for them (see :func:`_launch_job_name`).
LAUNCH_STORE_KEY = "tzip/job-name"
#: How long a rank waits to reach that store before it names its job after the rendezvous endpoint instead.
LAUNCH_STORE_TIMEOUT_S = 5.0
#: The job name found for a launch: (the environment it was found from, the name). Found once per process: every
#: hello says it again, and the store is only asked the first time.
_launch_name: tuple[tuple[str | None, ...], str] | None = None


def _store_job_name(addr: str, port: int, candidate: str) -> str | None:
    """The job name in the store at ``addr:port`` (torchrun's agent store), set to ``candidate`` by the first rank
    to ask (compare-and-set: no rank waits for another); None when the store cannot be reached or read."""
    import datetime

    import torch.distributed as dist

    if not dist.is_available():
        return None
    try:
        store = dist.TCPStore(addr, port, None, False, datetime.timedelta(seconds=LAUNCH_STORE_TIMEOUT_S))
        value = store.compare_set(LAUNCH_STORE_KEY, "", candidate)
    except (RuntimeError, ValueError, OSError):  # DistNetworkError and DistStoreError are RuntimeErrors
        return None
    name = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return name or None


def _launch_job_name() -> str | None:
    """The job name the ranks of one launch agree on when nothing names the job (no $TZIP_JOB, no run id: a
    ``torchrun`` without ``--standalone`` nor ``--rdzv-id`` gives its ranks $TORCHELASTIC_RUN_ID "none"), else None.

    Under torchrun whose ranks use its agent's store ($TORCHELASTIC_USE_AGENT_STORE "True": the store that the agent
    of node 0 hosts at $MASTER_ADDR:$MASTER_PORT for the whole launch, restarts included), the first rank to ask
    sets ``<script>-<12 hex digits>`` under :data:`LAUNCH_STORE_KEY` and every rank reads that: one name per launch,
    even for two launches one after the other on the same port, and the same before and after the job's
    ``init_process_group`` (the store is the agent's, not the group's). Otherwise (a launcher of another kind whose
    ranks share $MASTER_ADDR/$MASTER_PORT with $WORLD_SIZE above 1, or a store that cannot be reached within
    :data:`LAUNCH_STORE_TIMEOUT_S`): ``<script>-<MASTER_ADDR>:<MASTER_PORT>``. A single process (no $MASTER_PORT,
    or $WORLD_SIZE 1 outside torchrun) gets None: its job stays ``<script>-<pid>``."""
    global _launch_name
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if run_id not in (None, "none") or not addr or not port:
        return None
    world = _env_int("WORLD_SIZE")
    if run_id is None and (world is None or world < 2):
        return None
    key = (run_id, addr, port, str(agent_store))
    if _launch_name is not None and _launch_name[0] == key:
        return _launch_name[1]
    name = None
    if run_id is not None and agent_store and port.isdigit():
        name = _store_job_name(addr, int(port), f"{_script_name()}-{secrets.token_hex(6)}")
    if name is None:
        name = f"{_script_name()}-{addr}:{port}"
    _launch_name = (key, name)
    return name


def job_info(name: str | None = None, devices: Iterable[torch.device] = ()) -> dict[str, Any]:
    """What this process tells the daemon about its job (protocol version 3's ``job``: ``hello`` and the ``job``
    op): ``name`` (``name``, else $TZIP_JOB, else torchrun's $TORCHELASTIC_RUN_ID unless it is "none", else the
    name the ranks of the launch agree on (:func:`_launch_job_name`), else ``<script>-<pid>``; at most 200
    characters: the ranks of a job share it), ``user``, ``rank`` and ``world_size`` (torch.distributed's when it
    is initialised, else $RANK / $WORLD_SIZE), ``devices`` (the UUIDs of the GPUs of ``devices`` and of the current
    CUDA device when CUDA is initialised, else ``["cpu"]``) and ``mps`` (see :func:`_mps_client`). Reads no GPU
    that is not in use (never initialises CUDA). Under torchrun with no run id, the first call connects to torchrun's
    agent store (up to :data:`LAUNCH_STORE_TIMEOUT_S` when it does not answer); its errors are not raised."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not name:
        name = os.environ.get("TZIP_JOB") or (run_id if run_id and run_id != "none" else None)
    if not name:
        name = _launch_job_name()
    if not name:
        name = f"{_script_name()}-{os.getpid()}"
    info: dict[str, Any] = {"name": _printable(str(name))[:200]}
    try:
        info["user"] = _printable(getpass.getuser())[:200]
    except (KeyError, OSError):
        info["user"] = str(os.getuid())
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    dist_mod = sys.modules.get("torch.distributed")  # only when the job imported it: no import here
    if dist_mod is not None and dist_mod.is_available() and dist_mod.is_initialized():
        rank, world = dist_mod.get_rank(), dist_mod.get_world_size()
    if rank is not None and rank >= 0:
        info["rank"] = rank
    if world is not None and world >= 1:
        info["world_size"] = world
    gpus: dict[int, None] = {}
    for d in devices:
        if d.type == "cuda":
            gpus[d.index if d.index is not None else 0] = None
    if torch.cuda.is_initialized():
        gpus[torch.cuda.current_device()] = None
    uuids = []
    if gpus:
        from ._cuda import device_uuid

        uuids = [device_uuid(i) for i in gpus]
    info["devices"] = uuids[:64] or ["cpu"]
    info["mps"] = _mps_client()
    return info
