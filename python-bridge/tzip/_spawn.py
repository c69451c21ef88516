"""Finding the daemon's endpoint and its CLI, telling whether a daemon lives there, and starting one.

Endpoints (:func:`normalize_endpoint`) are accepted as users write them: a plain path (made absolute against
the current folder), ``ipc:///abs/path`` (ZeroMQ's spelling of the same socket file) or the daemon's TCP
endpoint ``tcp://127.0.0.1:PORT`` (``tzip serve --tcp PORT``). The socket path is resolved as the daemon
resolves it (src/daemon/paths.ts): ``TZIP_SOCKET``, else ``$XDG_RUNTIME_DIR/tzip/tzip.sock``, else
``/tmp/tzip-$UID/tzip.sock``. The daemon writes a pid file next to the socket (``<socket>.lock``, JSON with
pid and process start time); a daemon is considered running when that process lives (not a zombie, same
start time) and the socket exists.

The tzip CLI that runs the daemon is found (:func:`find_cli`) in this order: ``$TZIP_CLI`` (the CLI script,
or an executable), else ``tzip`` on ``PATH`` (an ``npm install`` of the tzip package), else the repository
checkout this package lives in (``<repo>/dist/src/cli/main.js``, for an editable install). A JavaScript CLI
is run by ``$TZIP_NODE``, else ``node`` on ``PATH``. A daemon is started as ``<cli> serve --socket PATH
--idle-exit 600``, detached from the client (its own session, reparented to init), logging to
``<socket>.log``; which CLI was used is logged (logger ``tzip``, INFO), written to that log and kept in
:data:`last_spawn_cli`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

from ._errors import DaemonSpawnError

__all__ = ["normalize_endpoint", "default_socket_path", "default_ipc_path", "daemon_pid", "daemon_running",
           "spawn_daemon", "find_cli", "cli_command", "CliChoice", "pid_alive"]

_log = logging.getLogger("tzip")

#: Seconds a spawned daemon waits with no client before it exits.
SPAWN_IDLE_EXIT_S = 600

#: Linux's sockaddr_un.sun_path holds 108 bytes including the terminating NUL (as MAX_SOCKET_PATH_BYTES in
#: src/daemon/paths.ts): a longer ipc path cannot be bound or connected to.
MAX_SOCKET_PATH_BYTES = 107

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)
_TCP = re.compile(r"^127\.0\.0\.1:([0-9]{1,5})$")


def normalize_endpoint(s: str) -> str:
    """The daemon endpoint ``s`` names, in the one form the client uses: an absolute socket path or
    ``tcp://127.0.0.1:PORT``.

    - ``ipc:///abs/path`` (ZeroMQ's spelling: scheme ``ipc://`` then an absolute path) -> ``/abs/path``
      (normalized: ``..`` and doubled slashes resolved, no symlinks followed);
    - ``tcp://127.0.0.1:PORT`` with PORT 1..65535 -> itself (the daemon's TCP socket listens on loopback only,
      docs/protocol.md);
    - a plain path (no ``scheme://``) -> made absolute against the current folder, as the daemon's
      ``--socket`` does.

    Raises ValueError, naming ``s`` and the accepted spellings, for an empty string, another scheme
    (``inproc://``, ``udp://``, ...), a relative or abstract (``@name``) ipc path, a TCP host other than
    127.0.0.1, a port outside 1..65535, or a socket path longer than 107 bytes (Linux's sun_path).
    """
    if not isinstance(s, str):
        raise ValueError(f"a tzip endpoint is a str, not {type(s).__name__}: {s!r}")
    accepted = "a socket path, ipc:///abs/path or tcp://127.0.0.1:PORT"
    if not s:
        raise ValueError(f"empty tzip endpoint: give {accepted}")
    m = _SCHEME.match(s)
    if m is None:
        path = os.path.abspath(s)
    else:
        scheme, rest = m.group(1).lower(), m.group(2)
        if scheme == "tcp":
            t = _TCP.match(rest)
            if t is None or not 1 <= int(t.group(1)) <= 65535:
                raise ValueError(f"{s!r}: the daemon's TCP endpoint is tcp://127.0.0.1:PORT with PORT 1..65535 "
                                 "(it listens on loopback only)")
            return f"tcp://127.0.0.1:{int(t.group(1))}"
        if scheme != "ipc":
            raise ValueError(f"{s!r}: unsupported endpoint scheme {m.group(1)}://; give {accepted}")
        if not rest.startswith("/"):
            # ZeroMQ would take ipc://tmp/x.sock relative to the current folder: almost always a missing slash.
            raise ValueError(f"{s!r}: an ipc endpoint needs an absolute path, with three slashes: ipc:///abs/path")
        path = os.path.normpath(rest)
        if path.startswith("//"):
            path = "/" + path.lstrip("/")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(f"{s!r}: the socket path is {len(os.fsencode(path))} bytes long; Unix sockets allow at most "
                         f"{MAX_SOCKET_PATH_BYTES}")
    return path


def default_ipc_path() -> str:
    """The daemon's default socket path when ``TZIP_SOCKET`` is not set: ``$XDG_RUNTIME_DIR/tzip/tzip.sock``
    (an absolute XDG_RUNTIME_DIR only), else ``/tmp/tzip-$UID/tzip.sock``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        return os.path.join(runtime, "tzip", "tzip.sock")
    return os.path.join("/tmp", f"tzip-{os.getuid()}", "tzip.sock")


def default_socket_path() -> str:
    """The daemon endpoint from the environment: ``normalize_endpoint($TZIP_SOCKET)`` when set (an absolute
    path or ``tcp://127.0.0.1:PORT``), else :func:`default_ipc_path`.

    Raises ValueError (from :func:`normalize_endpoint`) when TZIP_SOCKET is set to something that is no endpoint.
    """
    env = os.environ.get("TZIP_SOCKET")
    if env:
        try:
            return normalize_endpoint(env)
        except ValueError as e:
            raise ValueError(f"TZIP_SOCKET: {e}") from None
    return default_ipc_path()


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


def _file_identity(path: str) -> tuple[int, int, int] | None:
    """(device, inode, ctime in ns) of ``path``, None when it does not exist. The inode alone does not tell a new
    socket file from a dead daemon's: ext4 often gives the new socket the inode number just freed, and a client then
    waited its whole timeout for a daemon that was already serving."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def daemon_running(socket_path: str) -> bool:
    """Whether a live daemon holds ``socket_path`` (its lock's process runs and the socket exists)."""
    return daemon_pid(socket_path) is not None and os.path.exists(socket_path)


def _repo_root() -> Path:
    # python-bridge/tzip/_spawn.py -> the repository root (meaningful only when this file lives in a checkout)
    return Path(__file__).resolve().parents[2]


class CliChoice(NamedTuple):
    """The tzip CLI :func:`find_cli` chose."""

    #: argv prefix that runs the CLI: ``[node, script]`` for a JavaScript CLI, ``[executable]`` otherwise.
    command: list[str]
    #: where it was found: ``"TZIP_CLI"``, ``"PATH"`` or ``"checkout"``.
    source: str
    #: the file found: $TZIP_CLI, the ``tzip`` on PATH (as PATH names it), or the checkout's main.js.
    path: str

    def describe(self) -> str:
        """``$TZIP_CLI (/x/main.js)``, ```tzip` on PATH (/p/bin/tzip)`` or ``the repository checkout (/r/...)``."""
        where = {"TZIP_CLI": "$TZIP_CLI", "PATH": "`tzip` on PATH", "checkout": "the repository checkout"}[self.source]
        return f"{where} ({self.path})"


def _node() -> str:
    node = os.environ.get("TZIP_NODE") or shutil.which("node")
    if not node:
        raise DaemonSpawnError("cannot start the tzip daemon: no `node` on PATH (set TZIP_NODE to the node executable; "
                               "tzip needs Node.js 20 or newer)")
    return node


def _runner(path: str) -> list[str]:
    """argv prefix that runs the CLI at ``path``: through node when it is (a link to) a JavaScript file, as npm's
    bin link to dist/src/cli/main.js is, so that TZIP_NODE is honoured; directly when it is another executable."""
    real = os.path.realpath(path)
    if real.endswith((".js", ".mjs", ".cjs")) or not os.access(real, os.X_OK):
        return [_node(), path]
    return [path]


def find_cli() -> CliChoice:
    """The tzip CLI that starts daemons: ``$TZIP_CLI``, else ``tzip`` on ``PATH``, else this repository checkout's
    ``dist/src/cli/main.js``.

    Raises DaemonSpawnError when TZIP_CLI is set but names no file (no fallback: an explicit choice that is wrong
    must not be replaced silently), when none of the three exists (the message lists what was looked for), or when
    a JavaScript CLI is found but no ``node`` (TZIP_NODE, PATH).
    """
    env = os.environ.get("TZIP_CLI")
    if env:
        if not os.path.exists(env):
            raise DaemonSpawnError(f"cannot start the tzip daemon: TZIP_CLI={env} does not exist")
        return CliChoice(_runner(env), "TZIP_CLI", env)
    on_path = shutil.which("tzip")
    if on_path:
        return CliChoice(_runner(on_path), "PATH", on_path)
    checkout = _repo_root() / "dist" / "src" / "cli" / "main.js"
    if checkout.is_file() and (_repo_root() / "package.json").is_file():
        return CliChoice([_node(), str(checkout)], "checkout", str(checkout))
    raise DaemonSpawnError(
        "cannot start the tzip daemon: no tzip CLI found. Looked for $TZIP_CLI (not set), `tzip` on PATH (none), "
        f"and a repository checkout ({checkout}: missing). Install the npm package (docs/install.md: "
        "`npm install -g tzip-0.1.0.tgz`), build the checkout (`npm run build:ts`), or set TZIP_CLI to the CLI.")


def cli_command() -> list[str]:
    """argv prefix that runs the tzip CLI (:func:`find_cli`'s command)."""
    return find_cli().command


#: The CLI the last :func:`spawn_daemon` of this process launched (None before any launch).
last_spawn_cli: CliChoice | None = None


def open_folder_problem(sock_dir: str, socket_path: str) -> str | None:
    """Why the daemon would refuse an existing socket folder open to group or others, and how to fix it (the words of
    src/daemon/paths.ts openFolderMessage: a socket in a folder of its own, or ``chmod 700 DIR`` for a folder that
    others cannot write in); None when the folder is private, missing or not ours to judge (another user's, not a
    folder: the daemon says why). Checked before a daemon is started, so the fix reaches the user's warning even
    where no CLI can be found or the daemon's log cannot be read."""
    try:
        st = os.lstat(sock_dir)
    except OSError:
        return None
    import stat

    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or not (st.st_mode & 0o077):
        return None
    example = os.path.join(sock_dir, f"tzip-{os.getuid()}", os.path.basename(socket_path))
    instead = (f"name a socket in a folder of its own, e.g. {example} (TZIP_SOCKET or tzip.connect(socket)), which "
               "tzip creates with mode 0700" if len(os.fsencode(example)) <= MAX_SOCKET_PATH_BYTES else
               "name a socket in a folder of its own (TZIP_SOCKET or tzip.connect(socket)), which tzip creates with mode 0700")
    # A folder others may write in (/tmp, a shared project folder) is theirs too: never suggest closing it.
    shared = bool(st.st_mode & 0o022) or bool(st.st_mode & 0o1000)
    close = "" if shared else f"; or, if {sock_dir} is tzip's alone, `chmod 700 {sock_dir}`"
    return (f"the socket folder {sock_dir} has mode {stat.S_IMODE(st.st_mode):o}, open to other users: tzip keeps its "
            f"socket in a private folder and changes the mode only of a folder it creates; {instead}{close}")


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
    stale = _file_identity(socket_path)
    sock_dir = os.path.dirname(socket_path)
    try:
        os.makedirs(os.path.dirname(sock_dir), exist_ok=True)
        try:
            os.mkdir(sock_dir, 0o700)
            # Ours, just made: 0700 whatever the umask (the daemon never changes the mode of a folder it finds).
            os.chmod(sock_dir, 0o700)
        except FileExistsError:
            pass
    except OSError as e:  # a failed start like the others: the client falls back to raw frames (strict: raises)
        raise DaemonSpawnError(f"cannot start the tzip daemon: cannot create the socket folder {sock_dir}: {e}") from e
    problem = open_folder_problem(sock_dir, socket_path)
    if problem is not None:  # the daemon would refuse it: say so, with the fix, first (not after a log tail)
        raise DaemonSpawnError(f"cannot start the tzip daemon: {problem}")
    log_path = socket_path + ".log"
    cli = find_cli()
    global last_spawn_cli
    last_spawn_cli = cli
    cmd = [*cli.command, "serve", "--socket", socket_path, "--idle-exit", str(SPAWN_IDLE_EXIT_S), *(extra_args or [])]
    _log.info("tzip: starting a daemon on %s with %s", socket_path, cli.describe())
    try:
        with open(log_path, "a") as f:
            f.write(f"tzip: pid {os.getpid()} starts a daemon with {cli.describe()}: {' '.join(cmd)}\n")
    except OSError:
        pass
    # sh backgrounds the daemon and exits at once: the daemon is reparented (no zombie left in this process).
    launcher = ['/bin/sh', '-c', 'log="$1"; shift; "$@" </dev/null >>"$log" 2>&1 & echo $!', "sh", log_path, *cmd]
    out = subprocess.run(launcher, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                         close_fds=True, check=False)
    try:
        child = int(out.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise DaemonSpawnError(f"cannot start the tzip daemon with {cli.describe()} ({' '.join(cmd)})") from None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = daemon_pid(socket_path)
        ident = _file_identity(socket_path)
        # Another client's daemon (pid != child) may have bound before we looked: its socket is not stale.
        if pid is not None and ident is not None and (ident != stale or pid != child):
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
    raise DaemonSpawnError(f"the tzip daemon did not start on {socket_path} with {cli.describe()} ({' '.join(cmd)}); "
                           f"log {log_path}:\n{tail}")
