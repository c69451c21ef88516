/**
 * Removes the shared-memory files of a client that died without cleaning up (killed, crashed).
 *
 * When a session ends by disconnect or lapsed lease and its process is gone, the files under
 * /dev/shm named with its `shm_prefix` (its arena and the tensors it allocated in shared memory)
 * would otherwise stay allocated until reboot. The daemon removes them, but only when it can tell
 * the process is dead: it saw the process at hello (same pid namespace) and the pid now is gone,
 * a zombie, or a different process (another start time). A process that is still exiting is
 * checked again a few times. PyTorch's own `torch_*` files are left to PyTorch's manager.
 */
import { lstatSync, readdirSync, unlinkSync } from 'node:fs';
import { processAlive, processStartTime } from './lock.js';
import type { Session } from './session.js';

/** Whether process `pid` that started at `start` is gone (dead, zombie, or the pid was reused). */
export function processGone(pid: number, start: number): boolean {
  if (!processAlive(pid)) return true;
  const now = processStartTime(pid);
  return now === null || now !== start;
}

/** Removes /dev/shm files starting with `prefix` owned by this user; returns the names removed. */
export function removeShmFiles(prefix: string): string[] {
  const removed: string[] = [];
  let names: string[];
  try {
    names = readdirSync('/dev/shm');
  } catch {
    return removed;
  }
  const uid = typeof process.getuid === 'function' ? process.getuid() : -1;
  for (const name of names) {
    if (!name.startsWith(prefix)) continue;
    const path = `/dev/shm/${name}`;
    try {
      const st = lstatSync(path);
      if (!st.isFile() || (uid !== -1 && st.uid !== uid)) continue;
      unlinkSync(path);
      removed.push(name);
    } catch {
      // gone already
    }
  }
  return removed;
}

/** Delays between checks of whether an ended session's process is gone, ms. */
const CHECK_DELAYS_MS = [0, 50, 250, 1000, 5000];

/**
 * After `session` ended by disconnect or lapsed lease: removes its files once its process is
 * known to be gone (checked now and a few times over the next seconds). `log` hears what was removed.
 */
export function scheduleOrphanCleanup(session: Session, log: (line: string) => void): void {
  const start = session.pidStart;
  if (start === null || !session.shmPrefix.startsWith('tzip-')) return;
  let attempt = 0;
  const check = (): void => {
    if (processGone(session.pid, start)) {
      const removed = removeShmFiles(session.shmPrefix);
      if (removed.length > 0) log(`removed ${removed.length} shared-memory file(s) of dead client pid ${session.pid} (${session.shmPrefix}*)`);
      return;
    }
    attempt++;
    const delay = CHECK_DELAYS_MS[attempt];
    if (delay !== undefined) setTimeout(check, delay).unref();
  };
  check();
}
