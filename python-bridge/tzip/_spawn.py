"""Finding the daemon's socket, telling whether a daemon lives there, and starting one.

The socket path is resolved as the daemon resolves it (src/daemon/paths.ts): ``TZIP_SOCKET``, else
``$XDG_RUNTIME_DIR/tzip/tzip.sock``, else ``/tmp/tzip-$UID/tzip.sock``. The daemon writes a pid
file next to the socket (``<socket>.lock``, JSON with pid and process start time); a daemon is
considered running when that process lives (not a zombie, same start time) and the socket exists.

A daemon is started as ``node <repo>/dist/src/cli/main.js serve --socket PATH --idle-exit 600``
(``TZIP_NODE`` overrides the node executable, ``TZIP_CLI`` the CLI script), detached from the
client (its own session, reparented to init), logging to ``<socket>.log``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from ._errors import DaemonSpawnError

__all__ = ["default_socket_path", "daemon_pid", "daemon_running", "spawn_daemon", "cli_command", "pid_alive"]

#: Seconds a spawned daemon waits with no client before it exits.
SPAWN_IDLE_EXIT_S = 600


def default_socket_path() -> str:
    """The socket path the daemon uses by default (environment only)."""
    env = os.environ.get("TZIP_SOCKET")
    if env:
        return os.path.abspath(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        return os.path.join(runtime, "tzip", "tzip.sock")
    return os.path.join("/tmp", f"tzip-{os.getuid()}", "tzip.sock")


def _start_time(pid: int) -> tuple[int | None, str | None]:
    """(start time in clock ticks, state letter) of process ``pid`` from /proc; (None, None) when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None, None
    rest = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(rest[19]), rest[0]
    except (IndexError, ValueError):
        return None, rest[0] if rest else None


def pid_alive(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` runs (exists, is not a zombie, and started at ``start`` when given)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now, state = _start_time(pid)
    if state in ("Z", "X"):
        return False
    return start is None or now is None or now == start


def daemon_pid(socket_path: str) -> int | None:
    """The pid of the live daemon holding ``socket_path``'s lock, or None."""
    try:
        with open(socket_path + ".lock") as f:
            info = json.load(f)
        pid = int(info["pid"])
        start = info.get("start")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not pid_alive(pid, start if isinstance(start, int) else None):
        return None
    return pid


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def daemon_running(socket_path: str) -> bool:
    """Whether a live daemon holds ``socket_path`` (its lock's process runs and the socket exists)."""
    return daemon_pid(socket_path) is not None and os.path.exists(socket_path)


def _repo_root() -> Path:
    # python-bridge/tzip/_spawn.py -> the repository root
    return Path(__file__).resolve().parents[2]


def cli_command() -> list[str]:
    """``[node, cli]`` that runs the tzip CLI."""
    node = os.environ.get("TZIP_NODE") or shutil.which("node")
    if not node:
        raise DaemonSpawnError("cannot start the tzip daemon: no `node` on PATH (set TZIP_NODE to the node executable)")
    cli = os.environ.get("TZIP_CLI") or str(_repo_root() / "dist" / "src" / "cli" / "main.js")
    if not os.path.exists(cli):
        raise DaemonSpawnError(
            f"cannot start the tzip daemon: {cli} does not exist (build it with `npm run build:ts`, or set TZIP_CLI)"
        )
    return [node, cli]


def spawn_daemon(socket_path: str, timeout: float = 15.0, extra_args: list[str] | None = None) -> int:
    """Starts a daemon on ``socket_path`` unless one runs; waits until it serves. Returns its pid.

    Two clients racing to start one are fine: the second daemon finds the lock taken and exits,
    and both clients then use the first.
    """
    pid = daemon_pid(socket_path)
    if pid is not None and os.path.exists(socket_path):
        return pid
    # A socket file left by a dead daemon: wait for the new daemon to bind its own, or a client could say hello to
    # the stale path just before the new daemon replaces it.
    stale = _inode(socket_path)
    sock_dir = os.path.dirname(socket_path)
    os.makedirs(os.path.dirname(sock_dir), exist_ok=True)
    try:
        os.mkdir(sock_dir, 0o700)
    except FileExistsError:
        pass
    log_path = socket_path + ".log"
    cmd = [*cli_command(), "serve", "--socket", socket_path, "--idle-exit", str(SPAWN_IDLE_EXIT_S), *(extra_args or [])]
    # sh backgrounds the daemon and exits at once: the daemon is reparented (no zombie left in this process).
    launcher = ['/bin/sh', '-c', 'log="$1"; shift; "$@" </dev/null >>"$log" 2>&1 & echo $!', "sh", log_path, *cmd]
    out = subprocess.run(launcher, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                         close_fds=True, check=False)
    try:
        child = int(out.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise DaemonSpawnError(f"cannot start the tzip daemon ({' '.join(cmd)})") from None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = daemon_pid(socket_path)
        ino = _inode(socket_path)
        # Another client's daemon (pid != child) may have bound before we looked: its socket is not stale.
        if pid is not None and ino is not None and (ino != stale or pid != child):
            return pid
        if not pid_alive(child) and daemon_pid(socket_path) is None:
            break
        time.sleep(0.02)
    tail = ""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - 2000))
            tail = f.read().decode(errors="replace").strip()
    except OSError:
        pass
    raise DaemonSpawnError(f"the tzip daemon did not start on {socket_path} ({' '.join(cmd)}); log {log_path}:\n{tail}")
