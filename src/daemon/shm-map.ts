/**
 * The shared-memory files a session has handed the daemon, mapped once and kept (per session)
 * until `release`, the end of the lease or the client's disconnect.
 *
 * Files are mapped whole with the addon's `mapShared` (MAP_SHARED; the mapping goes away when its
 * Buffer is garbage collected, which {@link requestGc} hurries along after drops). Before each
 * use a cached mapping is checked against the file (stat: same inode, same size): a file that
 * was replaced, grown or shrunk is mapped again, one that was removed is an error.
 *
 * Only regular files directly under /dev/shm that belong to the daemon's user are mapped.
 * A client that shrinks (ftruncate) a file while the daemon works on it does not bring the daemon
 * down: the addon's SIGBUS guard turns the cut pages into zero pages and marks the mapping
 * faulted (cuda/src/addon/shared_guard.h); {@link ShmMappings.takeFault} then drops it and the
 * request is answered TZIP_HANDLE (docs/protocol.md, "Trust").
 */
import { statSync } from 'node:fs';
import { createRequire } from 'node:module';
import { addonPath } from '../native.js';
import { requestGc } from './gc.js';
import { ReplyError } from './reply-error.js';

interface SharedMapper {
  mapShared(path: string, writable: boolean): Buffer;
  mapSharedFaulted(buffer: Buffer): boolean;
}

let mapper: SharedMapper | undefined;

/** The addon's mapShared and mapSharedFaulted (docs/addon.md). */
function addonMapper(): SharedMapper {
  if (mapper !== undefined) return mapper;
  const addon = createRequire(import.meta.url)(addonPath()) as Partial<SharedMapper>;
  if (typeof addon.mapShared !== 'function' || typeof addon.mapSharedFaulted !== 'function') {
    throw new ReplyError('TZIP_INTERNAL', 'the native addon has no mapShared()/mapSharedFaulted(); rebuild it (bash scripts/setup.sh)');
  }
  mapper = addon as SharedMapper;
  return mapper;
}


/** The path of a /dev/shm name (a leading '/' as in shm_open is dropped). */
export function shmPath(name: string): string {
  return `/dev/shm/${name.replace(/^\//, '')}`;
}

interface Mapping {
  buffer: Buffer;
  ino: number;
  dev: number;
  size: number;
  writable: boolean;
  /** The request (see {@link ShmMappings.map}'s `epoch`) that last checked it against the file. */
  checkedIn: number;
}

/** Caps of one cache. */
export interface MappingCaps {
  maxBytes: number;
  maxMappings: number;
}

/** One session's mapped files, least recently used first. */
export class ShmMappings {
  private readonly entries = new Map<string, Mapping>();
  private mappedBytes = 0;

  constructor(private readonly caps: MappingCaps) {}

  /** Number of mapped files. */
  get count(): number {
    return this.entries.size;
  }

  /** Bytes mapped. */
  get bytes(): number {
    return this.mappedBytes;
  }

  /**
   * The whole file /dev/shm/`name` mapped, writable when `writable` (a file that cannot be
   * opened for writing is mapped read-only and refused for output).
   * `epoch` names the request: a file already checked in the same request is not stat'ed again.
   * @throws ReplyError TZIP_HANDLE when the file is missing, not a regular file, not the daemon
   *   user's, or cannot be mapped (as asked).
   */
  map(name: string, writable: boolean, epoch = -1): Buffer {
    const key = name.replace(/^\//, '');
    const seen = this.entries.get(key);
    if (seen !== undefined && epoch >= 0 && seen.checkedIn === epoch && (seen.writable || !writable)) return seen.buffer;
    const path = shmPath(key);
    const st = statSync(path, { throwIfNoEntry: false, bigint: false });
    if (st === undefined) {
      this.forget(key);
      throw new ReplyError('TZIP_HANDLE', `shared-memory file ${path} does not exist`);
    }
    if (!st.isFile()) throw new ReplyError('TZIP_HANDLE', `${path} is not a regular file`);
    const uid = typeof process.getuid === 'function' ? process.getuid() : st.uid;
    if (st.uid !== uid) throw new ReplyError('TZIP_HANDLE', `${path} belongs to uid ${st.uid}, not to the daemon's user`);
    const cached = this.entries.get(key);
    // A mapping that faulted (its file shrank, maybe to grow back since) holds zero pages where the file was cut.
    if (cached !== undefined && cached.ino === st.ino && cached.dev === st.dev && cached.size === st.size && (cached.writable || !writable) &&
        !addonMapper().mapSharedFaulted(cached.buffer)) {
      this.entries.delete(key);
      this.entries.set(key, cached);
      cached.checkedIn = epoch;
      return cached.buffer;
    }
    this.forget(key);
    let buffer: Buffer;
    let mappedWritable = true;
    try {
      buffer = addonMapper().mapShared(path, true);
    } catch (err) {
      if (writable) throw new ReplyError('TZIP_HANDLE', `cannot map ${path} for writing: ${(err as Error).message}`);
      try {
        buffer = addonMapper().mapShared(path, false);
        mappedWritable = false;
      } catch (err2) {
        throw new ReplyError('TZIP_HANDLE', `cannot map ${path}: ${(err2 as Error).message}`);
      }
    }
    this.entries.set(key, { buffer, ino: st.ino, dev: st.dev, size: buffer.length, writable: mappedWritable, checkedIn: epoch });
    this.mappedBytes += buffer.length;
    this.evict();
    return buffer;
  }

  /**
   * Whether the mapping of `name` took a SIGBUS (its file shrank under it) since it was mapped; a
   * faulted mapping is dropped, as its cut pages now read zeros.
   */
  takeFault(name: string): boolean {
    const key = name.replace(/^\//, '');
    const m = this.entries.get(key);
    if (m === undefined || !addonMapper().mapSharedFaulted(m.buffer)) return false;
    this.forget(key);
    return true;
  }

  /** Drops the mappings of `names` (all when undefined); returns how many were dropped. */
  drop(names?: readonly string[]): number {
    let dropped = 0;
    let bytes = 0;
    const keys = names === undefined ? [...this.entries.keys()] : names.map((n) => n.replace(/^\//, ''));
    for (const key of keys) {
      const m = this.entries.get(key);
      if (m === undefined) continue;
      bytes += m.size;
      this.forget(key);
      dropped++;
    }
    if (bytes > 0) requestGc(bytes);
    return dropped;
  }

  private forget(key: string): void {
    const m = this.entries.get(key);
    if (m === undefined) return;
    this.entries.delete(key);
    this.mappedBytes -= m.size;
  }

  private evict(): void {
    let bytes = 0;
    for (const [key, m] of this.entries) {
      if (this.entries.size <= this.caps.maxMappings && this.mappedBytes <= this.caps.maxBytes) break;
      if (this.entries.size === 1) break; // the newest mapping stays, whatever its size
      bytes += m.size;
      this.forget(key);
    }
    if (bytes > 0) requestGc(bytes);
  }
}
