"""The session with one daemon: the ZeroMQ transport, hello (protocol version, limits, the daemon's identity), the
session id, reconnection with back-off (spawning a daemon when allowed), the job this process belongs to and the job's
settings as replies carry them. :class:`tzip.client.Client` holds one and its request routes call through it; what a
new session means for the client's own state (rings, shared GPU memory) it learns through ``on_session``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from typing import Any, Callable, Iterable

import torch

from ._errors import DaemonUnavailableError, TzipDaemonError
from ._job import job_info
from ._request import Request
from ._spawn import daemon_pid, daemon_running, pid_alive, spawn_daemon
from ._transport import Transport

_log = logging.getLogger("tzip")

#: Protocol versions this client speaks (3: job info, stream tags, the job's settings in replies; 4: the submission
#: ring, docs/ring.md).
PROTOCOL_VERSIONS = [1, 2, 3, 4]

#: Seconds between reconnection attempts while the daemon is away.
RETRY_INTERVAL_S = 1.0


class Session:
    """The connection to the daemon at ``socket_path`` and what hello said.

    Attributes read by the request routes: ``sid`` (the session id, None while the daemon is away), ``version`` (the
    protocol version of the current or last session, 1-4), ``daemon`` (what the daemon said about itself), ``limits``
    (its size limits), ``heartbeat_s`` (seconds between heartbeats it asked for), ``settings`` (the job's settings
    from the last reply), ``closing`` (set by the client's close(): no new session, no retry).
    """

    def __init__(self, socket_path: str, transport: Transport, *, tcp: bool, spawn: bool, name: str, pid: int,
                 shm_prefix: str, connect_timeout: float, request_timeout: float | None, job: str | None,
                 on_session: Callable[[dict[str, Any], int], None]):
        """``on_session(reply, version)``: called under the session lock after each successful hello, before the
        new session id is published (the client resets what the last session had mapped and reads the ring
        capability)."""
        self.socket_path = socket_path
        self.transport = transport
        self.tcp = tcp
        self.spawn = spawn
        self.name = name
        self.pid = pid
        self.shm_prefix = shm_prefix
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.on_session = on_session
        self.lock = threading.RLock()
        self.sid: str | None = None
        self.daemon: dict[str, Any] = {}
        self.daemon_pid: int | None = None
        self.socket_ino: int | None = None
        self.limits: dict[str, Any] = {}
        self.version = 1
        # Protocol version 3. The job's name (None: job_info's default) and whether its integrations are on: True
        # after tzip.attach(), False after tzip.detach(), None before either (then hello carries a job only when one
        # was named: job=, $TZIP_JOB). Sent again with every new session (a restarted daemon knows nothing).
        self.job_name = job
        self.attached: bool | None = None
        self.job_devices: dict[torch.device, None] = {}
        self.job_refused_by: int | None = None  # the daemon pid whose hello refused the job field (older daemon)
        self.settings: dict[str, Any] = {"codec": None, "sm_budget": None}
        self.heartbeat_s = 3.0
        self.next_attempt = 0.0
        self.last_error: Exception | None = None
        self.warned = False
        self.closing = False

    # --- liveness -----------------------------------------------------------------------------
    def alive(self) -> bool:
        """Whether the daemon of this session still runs (its pid, and the socket file it listened on)."""
        if self.tcp:
            return True  # no pid file or socket file to look at: requests time out instead
        pid = self.daemon_pid
        if pid is not None and not pid_alive(pid):
            return False
        try:
            return os.stat(self.socket_path).st_ino == self.socket_ino
        except OSError:
            return False

    def unavailable(self) -> DaemonUnavailableError:
        """The error for a call made while no daemon serves (the last connection error when there is one)."""
        if isinstance(self.last_error, DaemonUnavailableError):
            return self.last_error
        return DaemonUnavailableError(f"no tzip daemon serves {self.socket_path}" +
                                      (f" ({self.last_error})" if self.last_error else ""))

    def warn_fallback(self) -> None:
        """Warns once per outage that calls store tensors uncompressed."""
        if self.warned:
            return
        self.warned = True
        warnings.warn(f"tzip: the daemon is not available ({self.unavailable()}); compress() stores tensors "
                      "uncompressed (codec 'raw') until it is back", RuntimeWarning, stacklevel=3)

    # --- the session --------------------------------------------------------------------------
    def ensure(self, force: bool = False) -> bool:
        """Opens a session when there is none (starting a daemon when ``spawn``); False when the daemon is away (then
        no new attempt for RETRY_INTERVAL_S unless ``force``)."""
        if self.sid is not None:
            return True
        if self.closing:
            return False  # no new session once close() began (the heartbeat thread may be in a call)
        with self.lock:
            if self.sid is not None:
                return True
            now = time.monotonic()
            if not force and now < self.next_attempt:
                return False
            try:
                if self.spawn:
                    spawn_daemon(self.socket_path)
                elif not self.tcp and not daemon_running(self.socket_path):
                    raise DaemonUnavailableError(f"no tzip daemon serves {self.socket_path} (start one with `tzip serve`, or connect with spawn=True)")
                self._hello()
            except DaemonUnavailableError as e:
                self.last_error = e
                self.next_attempt = time.monotonic() + RETRY_INTERVAL_S
                return False
            if self.warned:
                _log.info("tzip: reconnected to the daemon at %s", self.socket_path)
            self.warned = False
            self.last_error = None
            return True

    def _hello(self) -> None:
        pid = ino = None
        if not self.tcp:
            pid = daemon_pid(self.socket_path)
            try:
                ino = os.stat(self.socket_path).st_ino
            except OSError:
                raise DaemonUnavailableError(f"no tzip daemon serves {self.socket_path}") from None
        self.daemon_pid, self.socket_ino = pid, ino
        self.transport.reset()
        msg = {"op": "hello", "versions": PROTOCOL_VERSIONS, "pid": self.pid, "shm_prefix": self.shm_prefix, "name": self.name}
        job = self._hello_job()
        if job is not None:
            msg["job"] = job
        reply = self.transport.request(msg, self.alive, timeout=self.connect_timeout)
        if not reply.get("ok") and job is not None and (reply.get("error") or {}).get("code") == "TZIP_PROTOCOL":
            # A daemon older than protocol version 3 refuses the field (its schema knows no "job"): hello again
            # without it; the job is then never sent to this daemon.
            self.job_refused_by = pid
            del msg["job"]
            job = None
            reply = self.transport.request(msg, self.alive, timeout=self.connect_timeout)
        if not reply.get("ok"):
            err = reply.get("error") or {}
            if err.get("code") == "TZIP_BUSY":  # shutting down, or full: as good as away
                raise DaemonUnavailableError(f"the tzip daemon at {self.socket_path} does not take clients now: {err.get('message')}")
            raise TzipDaemonError(str(err.get("code")), str(err.get("message")))
        self.daemon = dict(reply.get("daemon") or {})
        self.version = int(reply.get("version", 1))
        self.limits = dict(reply.get("limits") or {})
        self.heartbeat_s = max(0.05, int(reply.get("heartbeat_ms", 3000)) / 1000)
        # Liveness is judged by the lock file's pid (as seen from this pid namespace), when it was alive at hello.
        self.daemon_pid = pid
        self.settings = {"codec": None, "sm_budget": None}  # a new session: the daemon's say from its replies
        self.note_settings(reply)
        self.on_session(reply, self.version)
        self.sid = str(reply["sid"])
        if self.version >= 3 and self.attached is not None and job is None:
            # attached (or detached) before this session, e.g. the daemon restarted: it hears it again
            try:
                self.send_job()
            except (DaemonUnavailableError, TzipDaemonError) as e:
                _log.warning("tzip: the daemon at %s did not take this job's info: %s", self.socket_path, e)

    def note_settings(self, reply: dict[str, Any]) -> None:
        """Keeps the job's settings a protocol version 3 reply carries."""
        got = reply.get("settings")
        if isinstance(got, dict):
            self.settings = {"codec": got.get("codec"), "sm_budget": got.get("sm_budget")}

    def mark_down(self, sid: str | None, err: Exception) -> None:
        """Session ``sid`` is gone (``err`` says why): the next call says hello again."""
        with self.lock:
            if self.sid == sid:
                self.sid = None
                self.last_error = err
                self.next_attempt = 0.0  # try again on the next call
                self.transport.reset()

    def call(self, op: str, body: dict[str, Any], timeout: float | None = None, req: Request | None = None) -> dict[str, Any]:
        """One request of the current session (re-saying hello once if the daemon forgot the session). ``req``: the
        compress or decompress call it serves, whose stream tag and SM budget go with it (protocol version 3).

        Raises DaemonUnavailableError (no daemon, or it went away during the request), TzipDaemonError (the daemon
        refused the request: its code and message)."""
        for attempt in range(2):
            if not self.ensure():
                raise self.unavailable()
            sid = self.sid
            msg = {"op": op, "sid": sid, **body}
            if req is not None and self.version >= 3:
                msg.update(req.wire_fields())
            try:
                reply = self.transport.request(msg, self.alive, timeout if timeout is not None else self.request_timeout)
            except DaemonUnavailableError as e:
                self.mark_down(sid, e)
                raise
            if reply.get("ok"):
                self.note_settings(reply)
                return reply
            err = reply.get("error") or {}
            code = str(err.get("code"))
            if code == "TZIP_SESSION" and attempt == 0 and not self.closing:
                with self.lock:
                    if self.sid == sid:
                        self.sid = None
                continue
            raise TzipDaemonError(code, str(err.get("message")), err.get("index"), err.get("need"))
        raise AssertionError("unreachable")

    # --- the job ------------------------------------------------------------------------------
    def job(self) -> dict[str, Any]:
        """The job info this process sends the daemon (:func:`tzip._job.job_info`) and ``attached``."""
        return {**job_info(self.job_name, self.job_devices), "attached": bool(self.attached)}

    def set_job(self, attached: bool, name: str | None, devices: Iterable[torch.device]) -> None:
        """Records the job (see Client.set_job) and sends it now when a session of protocol version 3 or later is
        open (else with the next hello). Raises TzipDaemonError when the daemon refuses it."""
        with self.lock:
            if name:
                self.job_name = str(name)[:200]
            for d in devices:
                self.job_devices[torch.device(d)] = None
            self.attached = bool(attached)
            if self.sid is None or self.version < 3:
                return
        try:
            self.send_job()
        except DaemonUnavailableError:
            pass  # sent with the next session

    def send_job(self) -> None:
        info = job_info(self.job_name, self.job_devices)
        self.call("job", {"job": info, "attached": bool(self.attached)}, timeout=self.connect_timeout)

    def _hello_job(self) -> dict[str, Any] | None:
        """The ``job`` of the hello: when attached or named (see ``attached``), and not refused by this daemon."""
        if self.attached is False or (self.attached is None and not (self.job_name or os.environ.get("TZIP_JOB"))):
            return None
        if self.job_refused_by is not None and self.job_refused_by == self.daemon_pid:
            return None
        return job_info(self.job_name, self.job_devices)
