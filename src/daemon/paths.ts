/**
 * Where the daemon's socket lives, and the private folder around it.
 *
 * The socket is `$TZIP_SOCKET` when set (or the `--socket` option, which wins over it), else
 * `$XDG_RUNTIME_DIR/tzip/tzip.sock`, else `/tmp/tzip-$UID/tzip.sock`. Its folder must be a real
 * folder (not a symlink) owned by this user with mode 0700: created so when missing, refused
 * when someone else owns it or others can enter it. Nobody but this user can then connect
 * (ipc:// sockets obey the folder's permissions), so the daemon trusts every connecting client
 * as much as it trusts itself. A folder of ours that others can enter is set back to 0700.
 */
import { chmodSync, lstatSync, mkdirSync } from 'node:fs';
import { dirname, isAbsolute, join, resolve } from 'node:path';
import { TzipError } from '../errors.js';

/** Linux's sockaddr_un.sun_path holds 108 bytes including the terminating NUL. */
export const MAX_SOCKET_PATH_BYTES = 107;

/** Name of the socket file in the default folders. */
export const SOCKET_NAME = 'tzip.sock';

/** The default socket path (environment only; no `--socket` option). */
export function defaultSocketPath(env: NodeJS.ProcessEnv = process.env): string {
  const fromEnv = env.TZIP_SOCKET;
  if (fromEnv !== undefined && fromEnv !== '') return resolve(fromEnv);
  const runtime = env.XDG_RUNTIME_DIR;
  if (runtime !== undefined && runtime !== '' && isAbsolute(runtime)) return join(runtime, 'tzip', SOCKET_NAME);
  const uid = typeof process.getuid === 'function' ? process.getuid() : 0;
  return join('/tmp', `tzip-${uid}`, SOCKET_NAME);
}

/** The socket path to use: `option` (from `--socket`) when given, else {@link defaultSocketPath}. */
export function resolveSocketPath(option?: string, env: NodeJS.ProcessEnv = process.env): string {
  const path = option !== undefined && option !== '' ? resolve(option) : defaultSocketPath(env);
  if (Buffer.byteLength(path) > MAX_SOCKET_PATH_BYTES) {
    throw new TzipError('TZIP_USAGE', `socket path is ${Buffer.byteLength(path)} bytes long; Unix sockets allow at most ${MAX_SOCKET_PATH_BYTES}`, { file: path });
  }
  return path;
}

/** The ZeroMQ endpoint of a socket path. */
export function endpointOf(socketPath: string): string {
  return `ipc://${socketPath}`;
}

/**
 * Makes sure the socket's folder exists, is a real folder owned by this user and has mode 0700
 * (no access for group or others). A missing folder is created with mode 0700 (its parents
 * with the default mode); an existing one of ours with a wider mode is chmod'ed to 0700.
 * @throws TzipError TZIP_IO when the folder cannot be created, is a symlink or not a folder,
 *   or belongs to another user.
 */
export function ensurePrivateDir(socketPath: string): string {
  const dir = dirname(socketPath);
  try {
    mkdirSync(dirname(dir), { recursive: true });
    mkdirSync(dir, { mode: 0o700 });
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
  if ((st.mode & 0o077) !== 0) {
    // Ours but open to others (made by hand, or by a umask): close it.
    try {
      chmodSync(dir, 0o700);
    } catch (err) {
      throw new TzipError('TZIP_IO', `the socket folder has mode ${(st.mode & 0o777).toString(8)} and cannot be set to 700: ${(err as Error).message}`, { file: dir, cause: err });
    }
  }
  return dir;
}
