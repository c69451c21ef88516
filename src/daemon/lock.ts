/**
 * The daemon lock: only one daemon may serve a socket path.
 *
 * Two parts:
 * - a kernel-held mutex: a Unix socket bound in Linux's abstract namespace under a name derived
 *   from the uid and the socket path. Binding is atomic (a second bind fails with EADDRINUSE) and
 *   the kernel releases the name the moment the holder exits, however it exits, so a crashed
 *   daemon never leaves a lock behind (the same guarantee as flock(2), which Node lacks).
 * - a pid file next to the socket (`<socket>.lock`, JSON: pid, process start time, socket,
 *   since) saying who holds it. It is what a refused daemon reports, what clients read to see
 *   whether the daemon still lives, and a second guard: a pid file whose process is alive and
 *   has the recorded start time (so not a reused pid) refuses the lock even when the mutex was
 *   free (two network namespaces sharing the folder). A pid file whose process is gone, or whose
 *   pid now belongs to another process, is stale: it is replaced (and reported).
 *
 * Where abstract sockets do not exist (not Linux), the pid file alone is the lock: created with
 * link(2) (atomic, fails when it exists), replaced when stale.
 */
import { createHash } from 'node:crypto';
import { linkSync, readFileSync, renameSync, unlinkSync, writeFileSync } from 'node:fs';
import { createServer, type Server } from 'node:net';
import { TzipError } from '../errors.js';

/** What the pid file holds. */
export interface LockInfo {
  pid: number;
  /** Process start time (clock ticks since boot, /proc/PID/stat field 22); null where unknown. */
  start: number | null;
  socket: string;
  /** ISO time the lock was taken. */
  since: string;
}

/** Path of the pid file of a socket. */
export function lockPathOf(socketPath: string): string {
  return `${socketPath}.lock`;
}

/** Start time of process `pid` in clock ticks since boot, or null when unknown (no /proc, no such process). */
export function processStartTime(pid: number): number | null {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    // Fields after the command name (which may hold spaces and parentheses): state is field 3.
    const rest = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    const start = Number(rest[22 - 3]);
    return Number.isFinite(start) ? start : null;
  } catch {
    return null;
  }
}

/** Whether process `pid` exists and runs: signal 0 reaches it (EPERM: exists, not ours) and it is no zombie. */
export function processAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'EPERM') return false;
  }
  // A killed process whose parent has not reaped it yet is a zombie: it answers signal 0 but is dead.
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    const state = stat.charAt(stat.lastIndexOf(')') + 2);
    return state !== 'Z' && state !== 'X';
  } catch {
    return true; // no /proc: trust the signal
  }
}

/** Reads a pid file; null when missing or unreadable. */
export function readLockInfo(lockPath: string): LockInfo | null {
  try {
    const value = JSON.parse(readFileSync(lockPath, 'utf8')) as Partial<LockInfo>;
    if (typeof value.pid !== 'number' || !Number.isInteger(value.pid) || value.pid <= 0) return null;
    return {
      pid: value.pid,
      start: typeof value.start === 'number' ? value.start : null,
      socket: typeof value.socket === 'string' ? value.socket : '',
      since: typeof value.since === 'string' ? value.since : '',
    };
  } catch {
    return null;
  }
}

/** Whether the holder recorded in `info` still runs (same pid and, where known, same start time). */
export function holderAlive(info: LockInfo): boolean {
  if (!processAlive(info.pid)) return false;
  if (info.start === null) return true;
  const start = processStartTime(info.pid);
  return start === null || start === info.start;
}

function mutexName(socketPath: string): string {
  const uid = typeof process.getuid === 'function' ? process.getuid() : 0;
  const hash = createHash('sha256').update(socketPath).digest('hex').slice(0, 32);
  return `\0tzip-daemon-${uid}-${hash}`;
}

function listenAbstract(name: string): Promise<Server | 'busy' | 'unsupported'> {
  if (process.platform !== 'linux') return Promise.resolve('unsupported');
  return new Promise((resolve) => {
    const server = createServer((conn) => conn.destroy());
    server.once('error', (err: NodeJS.ErrnoException) => {
      resolve(err.code === 'EADDRINUSE' ? 'busy' : 'unsupported');
    });
    server.listen(name, () => {
      server.unref();
      resolve(server);
    });
  });
}

function refused(socketPath: string, info: LockInfo | null): TzipError {
  const who = info !== null ? `another tzip daemon (pid ${info.pid}, since ${info.since || 'unknown'})` : 'another tzip daemon';
  return new TzipError('TZIP_USAGE', `${who} is serving this socket; stop it first (or use --socket for a different path)`, { file: socketPath });
}

/** A held daemon lock; {@link release} gives it back (also implicit when the process exits). */
export class DaemonLock {
  private released = false;

  private constructor(
    readonly socketPath: string,
    readonly lockPath: string,
    readonly info: LockInfo,
    /** The stale pid file that was replaced, if any. */
    readonly replacedStale: LockInfo | null,
    private readonly mutex: Server | null,
  ) {}

  /**
   * Takes the lock of `socketPath` for this process.
   * @throws TzipError TZIP_USAGE when another live daemon holds it; TZIP_IO when the pid file cannot be written.
   */
  static async acquire(socketPath: string): Promise<DaemonLock> {
    const lockPath = lockPathOf(socketPath);
    const mutex = await listenAbstract(mutexName(socketPath));
    if (mutex === 'busy') throw refused(socketPath, readLockInfo(lockPath));
    const previous = readLockInfo(lockPath);
    if (previous !== null && previous.pid !== process.pid && holderAlive(previous)) {
      if (mutex !== 'unsupported') mutex.close();
      throw refused(socketPath, previous);
    }
    const info: LockInfo = { pid: process.pid, start: processStartTime(process.pid), socket: socketPath, since: new Date().toISOString() };
    const tmp = `${lockPath}.${process.pid}.tmp`;
    try {
      writeFileSync(tmp, `${JSON.stringify(info)}\n`, { mode: 0o600 });
      if (mutex === 'unsupported') {
        // No kernel mutex: link(2) is the atomic step. A stale file is moved away first.
        if (previous !== null) {
          try {
            unlinkSync(lockPath);
          } catch {
            // gone already
          }
        }
        try {
          linkSync(tmp, lockPath);
        } catch (err) {
          if ((err as NodeJS.ErrnoException).code === 'EEXIST') throw refused(socketPath, readLockInfo(lockPath));
          throw err;
        } finally {
          unlinkSync(tmp);
        }
      } else {
        renameSync(tmp, lockPath);
      }
    } catch (err) {
      if (mutex !== 'unsupported') mutex.close();
      if (err instanceof TzipError) throw err;
      throw new TzipError('TZIP_IO', `cannot write the daemon lock file: ${(err as Error).message}`, { file: lockPath, cause: err });
    }
    return new DaemonLock(socketPath, lockPath, info, previous !== null && previous.pid !== process.pid ? previous : null,
      mutex === 'unsupported' ? null : mutex);
  }

  /** Removes the pid file (when it is still ours) and frees the mutex. Idempotent. */
  release(): void {
    if (this.released) return;
    this.released = true;
    const current = readLockInfo(this.lockPath);
    if (current !== null && current.pid === this.info.pid) {
      try {
        unlinkSync(this.lockPath);
      } catch {
        // already gone
      }
    }
    this.mutex?.close();
  }
}
