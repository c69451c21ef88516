/**
 * Hurries the garbage collector after the daemon lets go of shared-memory mappings.
 *
 * A mapping is unmapped when V8 collects its Buffer, but V8 does not see the mapping's size
 * and may wait long: meanwhile the client's freed shared memory stays allocated. So after drops
 * of at least {@link GC_THRESHOLD_BYTES} (or any drop at the end of a session) a full collection
 * is scheduled shortly after (once, however many drops come in between).
 */
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';

/** Dropped mapping bytes that justify a collection on their own. */
export const GC_THRESHOLD_BYTES = 64 << 20;

// Per process, not per Daemon: there is one V8 heap per process, and one collection frees every daemon's dropped
// mappings at once, so the bytes waiting for it are counted together.
let gcFn: (() => void) | null | undefined;
let pendingBytes = 0;
let timer: NodeJS.Timeout | undefined;

function getGc(): (() => void) | null {
  if (gcFn !== undefined) return gcFn;
  const existing = (globalThis as { gc?: () => void }).gc;
  if (typeof existing === 'function') {
    gcFn = existing;
    return gcFn;
  }
  try {
    setFlagsFromString('--expose-gc');
    gcFn = runInNewContext('gc') as () => void;
  } catch {
    gcFn = null;
  }
  return gcFn;
}

/** Notes `bytes` of dropped mappings; `force` schedules a collection whatever the amount. */
export function requestGc(bytes: number, force = false): void {
  pendingBytes += bytes;
  if (timer !== undefined || (!force && pendingBytes < GC_THRESHOLD_BYTES) || pendingBytes === 0) return;
  timer = setTimeout(() => {
    timer = undefined;
    pendingBytes = 0;
    getGc()?.();
  }, 50);
  timer.unref();
}
