"""The client's heartbeat thread and the releases it sends: every ``Session.heartbeat_s`` (or at once when woken) it
trims the idle result segments, closes retired rings, queues the release of ring regions whose memory is gone, and
sends the daemon either the names of the shared-memory files this process removed (``release``) or a ``heartbeat``,
which keeps the session's lease alive."""

from __future__ import annotations

import os
import threading
from typing import Callable

from . import _ring, _shm
from ._errors import DaemonUnavailableError, TzipDaemonError
from ._rings import Rings
from ._session import Session

#: Removed files queued before the heartbeat is woken to send them at once (a burst of dropped segments).
WAKE_AFTER_FILES = 64


class Heartbeat:
    """The thread (started by :meth:`start` at the first session; ended by :meth:`stop`) and the queue of removed
    shared-memory files it sends.

    Args:
        session: the client's session. rings: its rings. arena: its staging arena and results: its result pool
            (both closed to make room on a full /dev/shm; the pool's idle segments trimmed on each beat).
        release_lock: the client's release lock (guards the queue; the arena's finalizers call :meth:`queue_release`).
        sweep: ``sweep(ring)`` queues the release of the caller's GPU allocations registered on ``ring`` that are
            gone (tzip._ring_gpu.RingGpu._sweep_segments).
    """

    def __init__(self, session: Session, rings: Rings, arena: _shm.Arena, results: _shm.ResultPool,
                 release_lock: threading.RLock, sweep: Callable[[_ring.Ring], None]) -> None:
        self.session, self.rings, self.arena, self.results = session, rings, arena, results
        self.release_lock, self.sweep = release_lock, sweep
        self.wake = threading.Event()
        self.stopped = False
        self._pending: list[str] = []
        self._pid = os.getpid()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts the thread (once; later calls do nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tzip-heartbeat", daemon=True)
            self._thread.start()

    def new_session(self) -> None:
        """(release_lock held) A new session has mapped nothing yet: the queued names are dropped."""
        self._pending.clear()

    def queue_release(self, name: str) -> None:
        """The shared-memory file ``name`` was removed here: its ``release`` is queued (sent now when many are)."""
        with self.release_lock:
            if self.stopped:
                return
            self._pending.append(name)
            self.rings.forget_shm(name)
            many = len(self._pending) >= WAKE_AFTER_FILES
        if many:
            self.wake.set()

    def take_pending(self) -> list[str]:
        with self.release_lock:
            names, self._pending = self._pending, []
        return names

    def make_room(self) -> None:
        """/dev/shm is full: closes the idle segments (staging arena, result pool) and has the daemon unmap the removed
        files now (``release`` with ``reclaim``), so that their pages are freed."""
        self.arena.close()
        self.results.drop_idle()
        names = self.take_pending()
        if self.session.sid is None:
            return
        self.rings.flush_releases(timeout=5.0)  # the rings' mappings of removed files hold their pages too
        try:
            self.session.call("release", {"names": names, "reclaim": True}, timeout=5.0)
        except (DaemonUnavailableError, TzipDaemonError):
            pass

    def stop(self) -> None:
        """Waits for the thread to end (the session is closing, and its transport interrupted: a request it waits on
        gives up within one poll); files removed from now on are not queued."""
        self.wake.set()
        if self._thread is not None:
            self._thread.join()
        self.stopped = True
        self.wake.set()

    def _loop(self) -> None:
        while not self.stopped:
            self.wake.wait(self.session.heartbeat_s)
            self.wake.clear()
            if self.stopped or self.session.closing or os.getpid() != self._pid:
                return
            self.results.trim()  # idle result segments go after 30 s, connected or not
            self.rings.close_retired()
            if self.session.sid is None:
                continue
            for ring in self.rings.values():
                if ring.device is not None:
                    self.rings.drop_gpu_buffers(ring)
                    if len(ring.segments):
                        self.sweep(ring)
            self.rings.flush_releases()
            names = self.take_pending()
            try:
                if names:
                    self.session.call("release", {"names": names}, timeout=10.0)
                else:
                    self.session.call("heartbeat", {}, timeout=10.0)
            except (DaemonUnavailableError, TzipDaemonError):
                pass
            except Exception:  # pragma: no cover - never let the heartbeat thread die
                pass
