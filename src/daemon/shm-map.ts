/**
 * The shared-memory files a session has handed the daemon, mapped once and kept (per session)
 * until `release`, the end of the lease or the client's disconnect.
 *
 * Files are mapped whole with the addon's `mapShared` (MAP_SHARED; the mapping goes away when its
 * Buffer is garbage collected, which {@link requestGc} hurries along after drops). Before each
 * use a cached mapping is checked against the file (stat: same inode, same size): a file that
 * was replaced, grown or shrunk is mapped again, one that was removed is an error.
 *
 * Only regular files directly under /dev/shm that belong to the daemon's user are mapped; a name that
 * is a symlink is refused (lstat), and the file is checked again after mapping, so that a name swapped
 * for a link in between is refused too. Files are known by (device, inode), not by name: two hard
 * links to one file are one file for the overlap checks (regions.ts), and a file another live session
 * has mapped is refused to every other session whatever name it is given ({@link FileOwners}).
 *
 * A session holds at most `maxRegions` mappings (docs/security.md, "Limits"): idle ones are dropped
 * least recently used first to make room; when all of them are in use by the session's requests in
 * flight, a request naming one more file is refused with TZIP_LIMIT.
 * A client that shrinks (ftruncate) a file while the daemon works on it does not bring the daemon
 * down: the addon's SIGBUS guard turns the cut pages into zero pages and marks the mapping
 * faulted (cuda/src/addon/shared_guard.h); {@link ShmMappings.takeFault} then drops it and the
 * request is answered TZIP_HANDLE (docs/protocol.md, "Trust").
 */
import { lstatSync } from 'node:fs';
import { mapShared, mapSharedFaulted } from '../native.js';
import { requestGc } from './gc.js';
import { ReplyError } from './reply-error.js';
import { limitError } from './limits.js';

/** The path of a /dev/shm name (a leading '/' as in shm_open is dropped). */
export function shmPath(name: string): string {
  return `/dev/shm/${name.replace(/^\//, '')}`;
}

/** A file's identity: `dev:ino` (two names of one file, hard links, have one identity). */
export function fileIdOf(st: { dev: number; ino: number }): string {
  return `${st.dev}:${st.ino}`;
}

/**
 * Which session has each mapped file (by identity), one table per daemon (its SessionTable's, session.ts): a file is one
 * session's at a time. A session that names a file another live session has mapped (through a hard link, a rename,
 * or its own name) is refused, so a session cannot reach another's memory through a name it owns.
 */
export class FileOwners {
  private readonly owners = new Map<string, { owner: string; count: number }>();

  /**
   * Records that `owner` mapped file `id`.
   * @throws ReplyError TZIP_HANDLE when another owner has it mapped.
   */
  claim(id: string, owner: string, path: string): void {
    const got = this.owners.get(id);
    if (got === undefined) {
      this.owners.set(id, { owner, count: 1 });
      return;
    }
    if (got.owner !== owner) {
      throw new ReplyError('TZIP_HANDLE', `${path} is a file another session has mapped (a link to or a rename of its memory): not this session's memory`);
    }
    got.count++;
  }

  /** `owner` let go of one mapping of file `id`. */
  release(id: string, owner: string): void {
    const got = this.owners.get(id);
    if (got === undefined || got.owner !== owner) return;
    if (--got.count === 0) this.owners.delete(id);
  }

  /** Files mapped (for tests). */
  get size(): number {
    return this.owners.size;
  }
}

interface Mapping {
  buffer: Buffer;
  /** The file's identity ({@link fileIdOf}). */
  id: string;
  /** Whose it is in {@link FileOwners}. */
  owner: string;
  ino: number;
  dev: number;
  size: number;
  writable: boolean;
  /** The request (see {@link ShmMappings.map}'s `epoch`) that last checked it against the file. */
  checkedIn: number;
}

/** Caps of one session's mappings. */
export interface MappingCaps {
  /** Bytes mapped before idle mappings are dropped (the newest mapping stays, whatever its size). */
  maxBytes: number;
  /** Idle mappings kept after requests (least recently used dropped first). */
  maxCached: number;
  /** Mappings held at most, those in use included ({@link DaemonLimits.maxRegionsPerSession}); beyond, TZIP_LIMIT. */
  maxRegions: number;
}

/** One session's mapped files, least recently used first. */
export class ShmMappings {
  private readonly entries = new Map<string, Mapping>();
  private mappedBytes = 0;
  /** Names each request in flight (by epoch) has mapped: those mappings are not dropped to make room. */
  private readonly inUse = new Map<number, Set<string>>();

  /**
   * `ownerOf(name)`: whose a file named `name` is in `owners` (the session's id; for PyTorch's `torch_<pid>_` files
   * the pid, as every session of that process may name them); `owners`: the daemon's table, shared by the mappings
   * of all its sessions.
   */
  constructor(private readonly caps: MappingCaps, private readonly ownerOf: (name: string) => string,
    private readonly owners: FileOwners) {}

  /** Number of mapped files. */
  get count(): number {
    return this.entries.size;
  }

  /** Bytes mapped. */
  get bytes(): number {
    return this.mappedBytes;
  }

  /** The identity ({@link fileIdOf}) of the mapping of `name`, if mapped. */
  idOf(name: string): string | undefined {
    return this.entries.get(name.replace(/^\//, ''))?.id;
  }

  /**
   * The whole file /dev/shm/`name` mapped, writable when `writable` (a file that cannot be
   * opened for writing is mapped read-only and refused for output).
   * `epoch` names the request: a file already checked in the same request is not stat'ed again,
   * and the mapping is kept until {@link endRequest}(epoch).
   * @throws ReplyError TZIP_HANDLE when the file is missing, not a regular file (a symlink
   *   included), not the daemon user's, another session's, or cannot be mapped (as asked);
   *   TZIP_LIMIT when the session holds `maxRegions` mappings, all in use by its requests in flight.
   */
  map(name: string, writable: boolean, epoch = -1): Buffer {
    const key = name.replace(/^\//, '');
    const seen = this.entries.get(key);
    if (seen !== undefined && epoch >= 0 && seen.checkedIn === epoch && (seen.writable || !writable)) return seen.buffer;
    const path = shmPath(key);
    const st = lstatSync(path, { throwIfNoEntry: false, bigint: false });
    if (st === undefined) {
      this.forget(key);
      throw new ReplyError('TZIP_HANDLE', `shared-memory file ${path} does not exist`);
    }
    if (!st.isFile()) throw new ReplyError('TZIP_HANDLE', `${path} is not a regular file${st.isSymbolicLink() ? ' (a symlink)' : ''}`);
    const uid = typeof process.getuid === 'function' ? process.getuid() : st.uid;
    if (st.uid !== uid) throw new ReplyError('TZIP_HANDLE', `${path} belongs to uid ${st.uid}, not to the daemon's user`);
    const cached = this.entries.get(key);
    // A mapping that faulted (its file shrank, maybe to grow back since) holds zero pages where the file was cut.
    if (cached !== undefined && cached.ino === st.ino && cached.dev === st.dev && cached.size === st.size && (cached.writable || !writable) &&
        !mapSharedFaulted(cached.buffer)) {
      this.entries.delete(key);
      this.entries.set(key, cached);
      cached.checkedIn = epoch;
      this.use(key, epoch);
      return cached.buffer;
    }
    this.forget(key);
    this.makeRoom(epoch);
    const id = fileIdOf(st);
    const owner = this.ownerOf(key);
    this.owners.claim(id, owner, path);
    let buffer: Buffer;
    let mappedWritable: boolean;
    try {
      ({ buffer, mappedWritable } = mapFile(path, writable));
      // The name may have been swapped (for a symlink, another file) between the lstat and the open.
      const after = lstatSync(path, { throwIfNoEntry: false, bigint: false });
      if (after === undefined || !after.isFile() || after.ino !== st.ino || after.dev !== st.dev) {
        throw new ReplyError('TZIP_HANDLE', `${path} was replaced while the daemon mapped it`);
      }
    } catch (err) {
      this.owners.release(id, owner);
      throw err;
    }
    this.entries.set(key, { buffer, id, owner, ino: st.ino, dev: st.dev, size: buffer.length, writable: mappedWritable, checkedIn: epoch });
    this.mappedBytes += buffer.length;
    this.use(key, epoch);
    this.evict();
    return buffer;
  }

  /** Request `epoch` is done with its mappings: they may be dropped to make room again. */
  endRequest(epoch: number): void {
    if (this.inUse.delete(epoch)) this.evict();
  }

  /** Mappings in use by requests in flight. */
  get inUseCount(): number {
    return this.pinned().size;
  }

  private use(key: string, epoch: number): void {
    if (epoch < 0) return;
    let set = this.inUse.get(epoch);
    if (set === undefined) this.inUse.set(epoch, (set = new Set()));
    set.add(key);
  }

  private pinned(): Set<string> {
    if (this.inUse.size === 1) return this.inUse.values().next().value as Set<string>;
    const all = new Set<string>();
    for (const set of this.inUse.values()) for (const k of set) all.add(k);
    return all;
  }

  /**
   * Before a new mapping: drops idle mappings (least recently used first) until there is room for one more.
   * @throws ReplyError TZIP_LIMIT when every mapping held is in use by a request in flight.
   */
  private makeRoom(epoch: number): void {
    if (this.entries.size < this.caps.maxRegions) return;
    const pinned = this.pinned();
    let bytes = 0;
    for (const [key, m] of this.entries) {
      if (this.entries.size < this.caps.maxRegions) break;
      if (pinned.has(key)) continue;
      bytes += m.size;
      this.forget(key);
    }
    if (bytes > 0) requestGc(bytes);
    if (this.entries.size >= this.caps.maxRegions) {
      const mine = epoch >= 0 ? this.inUse.get(epoch)?.size ?? 0 : 0;
      throw limitError('maxRegionsPerSession', this.caps.maxRegions,
        `this session holds ${this.entries.size} shared-memory files mapped, in use by its requests in flight (${mine} by this request)`);
    }
  }

  /**
   * Whether the mapping of `name` took a SIGBUS (its file shrank under it) since it was mapped; a
   * faulted mapping is dropped, as its cut pages now read zeros.
   */
  takeFault(name: string): boolean {
    const key = name.replace(/^\//, '');
    const m = this.entries.get(key);
    if (m === undefined || !mapSharedFaulted(m.buffer)) return false;
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
    this.owners.release(m.id, m.owner);
  }

  /** Drops idle mappings, least recently used first, while above the caps (the newest mapping stays, whatever its size). */
  private evict(): void {
    const keep = Math.min(this.caps.maxCached, this.caps.maxRegions);
    if (this.entries.size <= keep && this.mappedBytes <= this.caps.maxBytes) return;
    const pinned = this.pinned();
    let bytes = 0;
    for (const [key, m] of this.entries) {
      if (this.entries.size <= keep && this.mappedBytes <= this.caps.maxBytes) break;
      if (this.entries.size === 1) break;
      if (pinned.has(key)) continue;
      bytes += m.size;
      this.forget(key);
    }
    if (bytes > 0) requestGc(bytes);
  }
}

/**
 * The file at `path` mapped whole: read-write when it can be opened so, else read-only (refused when `writable`).
 * @throws ReplyError TZIP_OUT_OF_MEMORY when the daemon's address space has no room (the addon's code: mmap ENOMEM),
 *   TZIP_HANDLE for every other failure (the file's fault).
 */
function mapFile(path: string, writable: boolean): { buffer: Buffer; mappedWritable: boolean } {
  const refusal = (err: unknown, what: string): ReplyError => {
    const code = (err as { code?: unknown } | null)?.code;
    const text = `cannot map ${path}${what}: ${(err as Error).message}`;
    return new ReplyError(code === 'TZIP_OUT_OF_MEMORY' ? 'TZIP_OUT_OF_MEMORY' : 'TZIP_HANDLE', text);
  };
  try {
    return { buffer: mapShared(path, true), mappedWritable: true };
  } catch (err) {
    if (writable || (err as { code?: unknown } | null)?.code === 'TZIP_OUT_OF_MEMORY') throw refusal(err, writable ? ' for writing' : '');
    try {
      return { buffer: mapShared(path, false), mappedWritable: false };
    } catch (err2) {
      throw refusal(err2, '');
    }
  }
}
