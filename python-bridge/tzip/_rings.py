"""The session's submission rings (protocol version 4, docs/ring.md): one for CPU tensors and one per GPU, opened on
first use and put aside with their session, and the regions registered on each (``ring_register``; their
``ring_release`` queued here and sent by the heartbeat). :class:`Rings` is the client's registry of them; the routes
that submit requests through a ring (:mod:`tzip._ring_path`, :mod:`tzip._ring_gpu`, :mod:`tzip._ring_one`) ask it
for the ring and the regions a request needs."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any, Callable

from . import _generated_constants as _generated
from . import _ring
from ._errors import DaemonUnavailableError, TzipDaemonError
from ._session import Session
from ._wire import shm_region

_log = logging.getLogger("tzip")


class Rings:
    """This session's rings by what they serve (``None``: CPU tensors, else the CUDA index), read like a dict
    (``rings[None]``, ``get``, ``values``, ``items``, ``len``), with what could not be opened (:attr:`refused`) and
    the region releases waiting to be sent (:attr:`releases`).

    Args:
        session: the client's session (its id, liveness and control requests).
        shm_prefix: the session's shared-memory file prefix; ring files are named ``{prefix}ring-N``.
        entries: entries per ring (rounded down to a power of two, at least 8, at most hello's ``entries_max``);
            0 turns the rings off.
        spin_s: seconds a waiter polls for a completion before it sleeps (tzip._ring.Ring).
        region_lock: guards every ring's region cache and :attr:`releases`; the client's release lock, which the
            finalizers of its shared-memory files take too.
        open_gpu: ``open_gpu(ring, index)`` readies a new ring file for the tensors of cuda:``index`` (its GPU
            ordering words) and returns the ``device`` of its ``ring_open``; raises to refuse (the reason is kept).
    """

    def __init__(self, session: Session, shm_prefix: str, entries: int, spin_s: float, region_lock: threading.RLock,
                 open_gpu: Callable[[_ring.Ring, int], str]) -> None:
        self.session = session
        self.shm_prefix = shm_prefix
        self.entries = int(entries)
        self.spin_s = float(spin_s)
        self.region_lock = region_lock
        self._open_gpu = open_gpu
        #: hello's ``ring`` capability of the current session (None: no ring offered, requests go through ZeroMQ)
        self.caps: dict[str, Any] | None = None
        self.lock = threading.RLock()  # guards the registry (_by_key, refused, retired)
        self._by_key: dict[int | None, _ring.Ring] = {}
        #: why a ring could not be opened, by what it would serve (for the rest of the session)
        self.refused: dict[int | None, str] = {}
        #: (ring, region id) whose ``ring_release`` is queued (under region_lock)
        self.releases: list[tuple[_ring.Ring, int]] = []
        self._retired: list[_ring.Ring] = []
        self._counter = 0

    # --- the registry, read like a dict --------------------------------------------------------------------------
    def __getitem__(self, key: int | None) -> _ring.Ring:
        return self._by_key[key]

    def get(self, key: int | None) -> _ring.Ring | None:
        return self._by_key.get(key)

    def values(self) -> list[_ring.Ring]:
        return list(self._by_key.values())

    def items(self) -> list[tuple[int | None, _ring.Ring]]:
        return list(self._by_key.items())

    def __len__(self) -> int:
        return len(self._by_key)

    @property
    def usable(self) -> bool:
        """Whether the current session offers rings (requests may go through one)."""
        return bool(self.caps) and self.session.sid is not None

    # --- opening and closing ---------------------------------------------------------------------------------------
    def ring(self, key: int | None) -> _ring.Ring | None:
        """This session's ring for CPU tensors (``key`` None) or for the tensors of cuda:``key``, opened on first use;
        None when the daemon offers no ring, this machine cannot use one, or opening it failed (the requests then go
        through ZeroMQ; why is in :attr:`refused`). Raises DaemonUnavailableError when the daemon went away while
        the ring was being opened."""
        ring = self._by_key.get(key)
        if ring is not None and ring.usable and ring.sid == self.session.sid:
            return ring
        self.close_retired()
        if self.caps is None or self.session.sid is None or key in self.refused or self.entries <= 0:
            return None
        with self.lock:
            ring = self._by_key.get(key)
            if ring is not None:
                if ring.usable and ring.sid == self.session.sid:
                    return ring
                # It stopped serving (closed, broken, or the daemon went away): ZeroMQ for the rest of this session.
                del self._by_key[key]
                self.refused[key] = f"ring {ring.name} stopped serving ({ring.state})"
                self._retired.append(ring)
                return None
            why = _ring.supported()
            if why is not None:
                self.refused[key] = why
                return None
            return self._open(key)

    def _open(self, key: int | None) -> _ring.Ring | None:
        """(lock held) ``ring_open`` of a new ring file; None (and the reason noted) when it cannot be opened."""
        caps = self.caps or {}
        entries = min(self.entries, int(caps.get("entries_max", _generated.RING_MAX_ENTRIES)))
        entries = max(_generated.RING_MIN_ENTRIES, 1 << max(0, entries.bit_length() - 1))  # a power of two, at least 8
        self._counter += 1
        name = f"{self.shm_prefix}ring-{self._counter}"
        sid = self.session.sid
        try:
            ring = _ring.Ring(name, entries, self.session.alive, spin_s=self.spin_s,
                              max_batch=int(caps.get("max_batch", _generated.RING_MAX_BATCH)))
        except OSError as e:
            self.refused[key] = f"cannot make the ring file: {e}"
            return None
        body: dict[str, Any] = {"name": name, "entries": entries}
        try:
            if key is not None:
                body["device"] = self._open_gpu(ring, key)
            reply = self.session.call("ring_open", body, timeout=self.session.connect_timeout)
        except Exception as e:  # noqa: BLE001 - any refusal: ZeroMQ instead
            ring.close()
            if isinstance(e, DaemonUnavailableError):
                raise
            self.refused[key] = f"ring_open: {e}"
            _log.info("tzip: no submission ring for %s (%s); requests go through ZeroMQ",
                      "CPU tensors" if key is None else f"cuda:{key}", e)
            return None
        ring.id = int(reply["ring"])
        ring.sid = self.session.sid if self.session.sid is not None else sid
        ring.device = key
        self._by_key[key] = ring
        return ring

    def new_session(self, caps: dict[str, Any] | None) -> None:
        """A new session with ring capability ``caps``: the rings of the last one are put aside (closed later, outside
        any lock: closing one fails its pending requests, whose fallback may itself call the daemon)."""
        with self.lock:
            self._retired.extend(self._by_key.values())
            self._by_key.clear()
            self.refused.clear()
            self.caps = caps
        with self.region_lock:
            self.releases.clear()

    def close_retired(self) -> None:
        """Closes the rings put aside: a ring of the current session that stopped serving (broken) is closed in the
        daemon too (``ring_close``: it holds the ring's regions until then), then here (the file goes)."""
        if not self._retired:
            return
        with self.lock:
            rings, self._retired = self._retired, []
        for r in rings:
            if r.id is not None and r.sid is not None and r.sid == self.session.sid and not self.session.closing:
                try:
                    self.session.call("ring_close", {"ring": r.id}, timeout=2.0)
                except (DaemonUnavailableError, TzipDaemonError):
                    pass
            r.close()

    def wait_in_flight(self, timeout: float | None) -> None:
        """Waits until the requests in flight on the rings are done (at most ``timeout`` s; None: until they end or
        the daemon does): the client's close finishes them first."""
        in_flight = [(r, r.pending_handles()) for r in self.values()]
        if any(hs for _, hs in in_flight):
            for r, hs in in_flight:
                if hs:
                    r.watch()  # the background reaper completes them while this thread waits
            concurrent.futures.wait([h for _, hs in in_flight for h in hs], timeout=timeout)

    def close_in_daemon(self) -> list[_ring.Ring]:
        """Removes every open ring from the registry, has the daemon close those of the current session that still
        serve (``ring_close``), and returns them: the caller closes them here (their files go) once the session has
        ended, so that no request of the daemon finds a file gone."""
        with self.lock:
            rings = list(self._by_key.values())
            self._by_key.clear()
        if self.session.sid is not None:
            for ring in rings:
                if ring.sid == self.session.sid and ring.state != "dead":
                    try:
                        self.session.call("ring_close", {"ring": ring.id}, timeout=2.0)
                    except (DaemonUnavailableError, TzipDaemonError):
                        pass
        return rings

    def info(self) -> dict[str, Any]:
        """Client.ring_info's value: ``offered``, ``rings`` and ``refused``."""
        with self.lock:
            rings = {("cpu" if k is None else f"cuda:{k}"): {"id": r.id, "state": r.state, "entries": r.entries,
                                                              "regions": len(r.regions), "file": r.name}
                     for k, r in self._by_key.items()}
            refused = {("cpu" if k is None else f"cuda:{k}"): why for k, why in self.refused.items()}
        return {"offered": None if self.caps is None else dict(self.caps), "rings": rings, "refused": refused}

    # --- regions -------------------------------------------------------------------------------------------------
    def regions(self, ring: _ring.Ring, wanted: list[tuple[Any, dict[str, Any]]]) -> list[_ring.Region]:
        """The regions of ``wanted`` ((cache key, ``ring_register`` region) pairs) on ``ring``: cached ones as they
        are, the others registered in one ``ring_register``. Raises TzipDaemonError / DaemonUnavailableError."""
        with self.region_lock:
            got = [ring.regions.get(k) for k, _ in wanted]
        missing: dict[Any, dict[str, Any]] = {}
        for (k, spec), r in zip(wanted, got):
            if r is None and k not in missing:
                missing[k] = spec
        if missing:
            reply = self.session.call("ring_register", {"ring": ring.id, "regions": list(missing.values())})
            regs = reply.get("regions") or []
            if len(regs) != len(missing):
                raise TzipDaemonError("TZIP_PROTOCOL", f"ring_register answered {len(regs)} regions for {len(missing)}")
            with self.region_lock:
                for k, r in zip(missing, regs):
                    region = _ring.Region(r["id"], r["generation"], r["bytes"])
                    if k in ring.regions:  # another thread registered it meanwhile: ours goes again
                        self.releases.append((ring, region.id))
                    else:
                        ring.regions[k] = region
                got = [ring.regions[k] for k, _ in wanted]
        return got  # type: ignore[return-value]

    def shm(self, ring: _ring.Ring, names: list[str]) -> dict[str, _ring.Region]:
        """The regions of the session's shared-memory files ``names`` (whole files) on ``ring`` (the cached ones looked
        up here; the others registered by :meth:`regions`)."""
        cached = ring.regions
        with self.region_lock:
            got = {n: cached.get(("shm", n)) for n in names}
        missing = [n for n, r in got.items() if r is None]
        if missing:
            got.update(zip(missing, self.regions(ring, [(("shm", n), shm_region(n)) for n in missing])))
        return got

    def release_keys(self, ring: _ring.Ring, keys: list) -> None:
        """Queues the ``ring_release`` of the regions cached under ``keys`` on ``ring`` (sent by the heartbeat, or by
        :meth:`flush_releases`)."""
        with self.region_lock:
            for k in keys:
                r = ring.regions.pop(k, None)
                if r is not None:
                    self.releases.append((ring, r.id))

    def forget_shm(self, name: str) -> None:
        """(region_lock held) The shared-memory file ``name`` is gone: every ring's region of it is released (a file a
        ring maps stays mapped, its pages pinned, until ``ring_release``)."""
        for ring in list(self._by_key.values()):
            r = ring.regions.pop(("shm", name), None)
            if r is not None:
                self.releases.append((ring, r.id))

    def drop_gpu_buffers(self, ring: _ring.Ring) -> None:
        """Queues the release of regions of staging buffers the GPU arena dropped (their memory went back to PyTorch)."""
        with self.region_lock:
            for k in [k for k in ring.regions if k[0] == "gpubuf" and k[1].u8 is None]:
                self.releases.append((ring, ring.regions.pop(k).id))

    def flush_releases(self, timeout: float = 10.0) -> None:
        """Sends the queued ``ring_release``s (regions of dropped segments and staging buffers), one per ring."""
        with self.region_lock:
            todo, self.releases = self.releases, []
        by_ring: dict[int, tuple[_ring.Ring, list[int]]] = {}
        for ring, rid in todo:
            by_ring.setdefault(id(ring), (ring, []))[1].append(rid)
        for ring, ids in by_ring.values():
            if ring.sid != self.session.sid or not ring.usable or self.session.sid is None:
                continue  # that session's rings are gone with it
            try:
                self.session.call("ring_release", {"ring": ring.id, "regions": ids}, timeout=timeout)
            except (DaemonUnavailableError, TzipDaemonError):
                pass
