/**
 * Where the daemon's socket lives, the private folder around it, and the endpoint spellings users write.
 *
 * The socket is `$TZIP_SOCKET` when set (or the `--socket` option, which wins over it), else
 * `$XDG_RUNTIME_DIR/tzip/tzip.sock`, else `/tmp/tzip-$UID/tzip.sock`. Its folder must be a real
 * folder (not a symlink) owned by this user with mode 0700: created so when missing, refused
 * when someone else owns it or others can enter it. Nobody but this user can then connect
 * (ipc:// sockets obey the folder's permissions), so the daemon trusts every connecting client
 * as much as it trusts itself. The daemon changes the mode only of a folder it creates: an existing
 * folder open to others (/tmp, a shared current folder) is refused, never closed.
 *
 * `--socket` and `$TZIP_SOCKET` take the daemon's endpoint in any of the spellings of
 * {@link parseEndpoint}: a plain path, ZeroMQ's `ipc:///abs/path`, or (for client commands such as
 * `tzip jobs`) the daemon's CURVE-only TCP socket `tcp://127.0.0.1:PORT`. The Python client accepts
 * the same spellings by the same rules (python-bridge/tzip/_spawn.py, normalize_endpoint).
 */
import { chmodSync, lstatSync, mkdirSync, type Stats } from 'node:fs';
import { basename, dirname, isAbsolute, join, normalize, resolve } from 'node:path';
import { TzipError } from '../errors.js';

/** Linux's sockaddr_un.sun_path holds 108 bytes including the terminating NUL. */
export const MAX_SOCKET_PATH_BYTES = 107;

/** Name of the socket file in the default folders. */
export const SOCKET_NAME = 'tzip.sock';

/** What {@link parseEndpoint} accepts, for messages. */
export const ENDPOINT_SPELLINGS = 'a socket path, ipc:///abs/path or tcp://127.0.0.1:PORT';

/** A daemon endpoint: its ipc socket (by path) or its TCP socket on the loopback interface. */
export type Endpoint =
  | { kind: 'ipc'; /** Absolute, normalized socket path. */ path: string; /** `ipc://` + path. */ endpoint: string }
  | { kind: 'tcp'; /** 1..65535. */ port: number; /** `tcp://127.0.0.1:PORT`. */ endpoint: string };

const SCHEME = /^([A-Za-z][A-Za-z0-9+.-]*):\/\/(.*)$/s;
const TCP = /^127\.0\.0\.1:([0-9]{1,5})$/;

function checkLength(path: string, spelling: string): string {
  const bytes = Buffer.byteLength(path);
  if (bytes > MAX_SOCKET_PATH_BYTES) {
    throw new TzipError('TZIP_USAGE', `socket path is ${bytes} bytes long; Unix sockets allow at most ${MAX_SOCKET_PATH_BYTES} (${JSON.stringify(spelling)})`, { file: path });
  }
  return path;
}

/**
 * The endpoint a user's spelling names:
 * - a plain path (no `scheme://`): made absolute against the current folder;
 * - `ipc:///abs/path` (ZeroMQ's spelling: `ipc://` then an absolute path): that path, normalized
 *   (`..` and doubled slashes resolved, symlinks not followed);
 * - `tcp://127.0.0.1:PORT`, PORT 1..65535: the daemon's TCP socket (`tzip serve --tcp PORT`), which
 *   listens on loopback only and speaks only CURVE (src/daemon/curve.ts).
 * @throws TzipError TZIP_USAGE, naming the spelling and the accepted ones, for an empty string,
 *   another scheme (`inproc://`, `udp://`...), a relative ipc path (`ipc://tmp/x.sock`: ZeroMQ would
 *   take it relative to the current folder, almost always a missing slash), a TCP host other than
 *   127.0.0.1, a port outside 1..65535, or a socket path over {@link MAX_SOCKET_PATH_BYTES} bytes.
 */
export function parseEndpoint(spelling: string): Endpoint {
  if (spelling === '') throw new TzipError('TZIP_USAGE', `empty tzip endpoint: give ${ENDPOINT_SPELLINGS}`);
  const m = SCHEME.exec(spelling);
  if (m === null) {
    const path = checkLength(resolve(spelling), spelling);
    return { kind: 'ipc', path, endpoint: `ipc://${path}` };
  }
  const scheme = (m[1] as string).toLowerCase();
  const rest = m[2] as string;
  if (scheme === 'tcp') {
    const t = TCP.exec(rest);
    const port = t === null ? Number.NaN : Number(t[1]);
    if (!(port >= 1 && port <= 65535)) {
      throw new TzipError('TZIP_USAGE', `${JSON.stringify(spelling)}: the daemon's TCP endpoint is tcp://127.0.0.1:PORT with PORT 1..65535 (it listens on loopback only)`);
    }
    return { kind: 'tcp', port, endpoint: `tcp://127.0.0.1:${port}` };
  }
  if (scheme !== 'ipc') {
    throw new TzipError('TZIP_USAGE', `${JSON.stringify(spelling)}: unsupported endpoint scheme ${m[1]}://; give ${ENDPOINT_SPELLINGS}`);
  }
  if (!rest.startsWith('/')) {
    throw new TzipError('TZIP_USAGE', `${JSON.stringify(spelling)}: an ipc endpoint needs an absolute path, with three slashes: ipc:///abs/path`);
  }
  // normalize keeps a leading '//' (POSIX leaves its meaning to the system); Linux reads it as '/'.
  const path = checkLength(normalize(rest).replace(/^\/+/, '/'), spelling);
  return { kind: 'ipc', path, endpoint: `ipc://${path}` };
}

/** The default socket path of the folders alone, ignoring `$TZIP_SOCKET`. */
function folderSocketPath(env: NodeJS.ProcessEnv): string {
  const runtime = env.XDG_RUNTIME_DIR;
  if (runtime !== undefined && runtime !== '' && isAbsolute(runtime)) return join(runtime, 'tzip', SOCKET_NAME);
  const uid = typeof process.getuid === 'function' ? process.getuid() : 0;
  return join('/tmp', `tzip-${uid}`, SOCKET_NAME);
}

/**
 * The default endpoint (environment only; no `--socket` option): `$TZIP_SOCKET` in any spelling of
 * {@link parseEndpoint}, else the ipc socket in the default folder.
 * @throws TzipError TZIP_USAGE when `$TZIP_SOCKET` is not a valid spelling.
 */
export function defaultEndpoint(env: NodeJS.ProcessEnv = process.env): Endpoint {
  const fromEnv = env.TZIP_SOCKET;
  if (fromEnv !== undefined && fromEnv !== '') return parseEndpoint(fromEnv);
  const path = folderSocketPath(env);
  return { kind: 'ipc', path, endpoint: `ipc://${path}` };
}

/** The endpoint to use: `option` (from `--socket`) when given, else {@link defaultEndpoint}. */
export function resolveEndpoint(option?: string, env: NodeJS.ProcessEnv = process.env): Endpoint {
  const ep = option !== undefined && option !== '' ? parseEndpoint(option) : defaultEndpoint(env);
  // A parsed spelling is checked already; the default folder's path (a long XDG_RUNTIME_DIR) is checked here.
  if (ep.kind === 'ipc') checkLength(ep.path, ep.path);
  return ep;
}

/**
 * The default socket path (environment only; no `--socket` option): `$TZIP_SOCKET` (a path or
 * `ipc:///abs/path`), else the default folder's `tzip.sock`. A `tcp://` `$TZIP_SOCKET` names no socket
 * file: the default folder's socket is returned (where that daemon keeps its `curve/` keys too).
 */
export function defaultSocketPath(env: NodeJS.ProcessEnv = process.env): string {
  const fromEnv = env.TZIP_SOCKET;
  if (fromEnv !== undefined && fromEnv !== '') {
    const ep = parseEndpoint(fromEnv);
    if (ep.kind === 'ipc') return ep.path;
  }
  return folderSocketPath(env);
}

/**
 * The socket path a daemon listens on: `option` (from `--socket`) when given, else `$TZIP_SOCKET`,
 * else the default folder's (see {@link defaultSocketPath}); a path or `ipc:///abs/path` either way.
 * @throws TzipError TZIP_USAGE for a `tcp://` spelling (the daemon's TCP socket is an addition to its
 *   ipc socket, asked for with `tzip serve --tcp PORT`), a bad spelling, or a path too long.
 */
export function resolveSocketPath(option?: string, env: NodeJS.ProcessEnv = process.env): string {
  const fromOption = option !== undefined && option !== '';
  const ep = resolveEndpoint(option, env);
  if (ep.kind === 'tcp') {
    const where = fromOption ? '--socket' : 'TZIP_SOCKET';
    throw new TzipError('TZIP_USAGE', `${where} is ${ep.endpoint}: the daemon listens on an ipc socket (a path or ipc:///abs/path); add its TCP socket with \`tzip serve --tcp ${ep.port}\``);
  }
  return ep.path;
}

/** The ZeroMQ endpoint of a socket path. */
export function endpointOf(socketPath: string): string {
  return `ipc://${socketPath}`;
}

/**
 * The folder of the CURVE keys a client of a `tcp://` endpoint reads (src/daemon/curve.ts): `$TZIP_CURVE_DIR`,
 * else `curve/` next to the default socket (as the Python client, python-bridge/tzip/client.py, looks).
 */
export function curveDirFor(env: NodeJS.ProcessEnv = process.env): string {
  const dir = env.TZIP_CURVE_DIR;
  if (dir !== undefined && dir !== '') return resolve(dir);
  return join(dirname(defaultSocketPath(env)), 'curve');
}

/**
 * Makes sure the socket's folder exists, is a real folder owned by this user and has no access for
 * group or others (mode 0700 or narrower). A missing folder is created with mode 0700 (its parents
 * with the default mode). The mode of a folder that already existed is never changed: a socket
 * named in a shared folder (`/tmp/tzip.sock`, the current folder, `$HOME`) would otherwise have
 * that folder closed to everyone else (and /tmp's sticky bit cleared); such a folder is refused,
 * with what to do instead.
 * @throws TzipError TZIP_IO when the folder cannot be created, is a symlink or not a folder,
 *   belongs to another user, or existed with a mode open to group or others.
 */
export function ensurePrivateDir(socketPath: string): string {
  const dir = dirname(socketPath);
  let created = false;
  try {
    mkdirSync(dirname(dir), { recursive: true });
    mkdirSync(dir, { mode: 0o700 });
    created = true;
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'EEXIST') {
      throw new TzipError('TZIP_IO', `cannot create the socket folder: ${(err as Error).message}`, { file: dir, cause: err });
    }
  }
  const st = lstatSync(dir);
  if (st.isSymbolicLink() || !st.isDirectory()) {
    throw new TzipError('TZIP_IO', 'the socket folder is not a folder (a symlink or a file): refusing to use it', { file: dir });
  }
  const uid = typeof process.getuid === 'function' ? process.getuid() : st.uid;
  if (st.uid !== uid) {
    throw new TzipError('TZIP_IO', `the socket folder belongs to uid ${st.uid}, not to this user (uid ${uid}): refusing to use it`, { file: dir });
  }
  if (created) {
    // Made here, in this call: 0700 whatever the umask took away (a umask of 0277 would leave it unwritable).
    if ((st.mode & 0o7777) !== 0o700) {
      try {
        chmodSync(dir, 0o700);
      } catch (err) {
        throw new TzipError('TZIP_IO', `cannot set the new socket folder to mode 700: ${(err as Error).message}`, { file: dir, cause: err });
      }
    }
  } else if ((st.mode & 0o077) !== 0) {
    throw new TzipError('TZIP_IO', openFolderMessage(dir, socketPath, st.mode, uid), { file: dir });
  }
  return dir;
}

/**
 * Why an existing socket folder open to others is refused and what to do: a socket of its own folder (which tzip
 * creates 0700), or, for a folder that others cannot write to (not /tmp), closing it by hand when it is tzip's alone.
 */
function openFolderMessage(dir: string, socketPath: string, mode: number, uid: number): string {
  const shown = (mode & 0o7777).toString(8);
  const example = join(dir, `tzip-${uid}`, basename(socketPath));
  const instead = Buffer.byteLength(example) <= MAX_SOCKET_PATH_BYTES
    ? `name a socket in a folder of its own, e.g. ${example} (--socket or TZIP_SOCKET), which tzip creates with mode 0700`
    : 'name a socket in a folder of its own (--socket or TZIP_SOCKET), which tzip creates with mode 0700';
  // A folder others may write in (/tmp, a shared project folder) is theirs too: never suggest closing it.
  const sharedByOthers = (mode & 0o022) !== 0 || (mode & 0o1000) !== 0;
  const orClose = sharedByOthers ? '' : `; or, if ${dir} is tzip's alone, \`chmod 700 ${dir}\``;
  return `the socket folder has mode ${shown}, open to other users: tzip keeps its socket in a private folder and changes the mode only of a folder it creates; ${instead}${orClose}`;
}

/** What a file that is not a socket is, for messages. */
function fileKind(st: Stats): string {
  if (st.isSymbolicLink()) return 'a symlink';
  if (st.isFile()) return 'a regular file';
  if (st.isDirectory()) return 'a folder';
  if (st.isFIFO()) return 'a FIFO';
  if (st.isCharacterDevice()) return 'a character device';
  if (st.isBlockDevice()) return 'a block device';
  return 'not a socket';
}

/**
 * Makes sure nothing but a Unix socket is at `socketPath` before the daemon binds there: libzmq's ipc bind unlinks
 * whatever the path names first, so `--socket notes.txt` would silently delete the user's file. Nothing there, or a
 * socket (a stale one of a dead daemon: the daemon lock says whether one still serves it), is fine.
 * @throws TzipError TZIP_IO naming the path and what is there (a regular file, a folder, a symlink, a FIFO, a
 *   device), or why it cannot be looked at.
 */
export function checkSocketPathFree(socketPath: string): void {
  let st: Stats;
  try {
    st = lstatSync(socketPath);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') return;
    throw new TzipError('TZIP_IO', `cannot look at the socket path ${socketPath}: ${(err as Error).message}`, { file: socketPath, cause: err });
  }
  if (st.isSocket()) return;
  throw new TzipError('TZIP_IO', `the socket path exists and is ${fileKind(st)}, not a Unix socket: binding there would delete it, `
    + 'so tzip refuses; name a socket path where nothing is (--socket or TZIP_SOCKET), or remove that file yourself', { file: socketPath });
}
