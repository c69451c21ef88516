/**
 * The CUDA IPC memory and events the daemon opened for its clients.
 *
 * - Allocations (cudaIpcOpenMemHandle) are opened once per daemon and GPU, keyed by the 64 bytes
 *   of their cudaIpcMemHandle_t, and shared by the sessions that named them (two sessions of one
 *   process may name the same caching-allocator segment; CUDA maps a handle once per process).
 *   Each session keeps the set it holds, least recently used first (capped); an allocation is
 *   closed when no session holds it any more and no request is using it: a close asked for
 *   while a request runs on it (release, a lapsed lease, a disconnect) waits for that request.
 * - Events: the clients' interprocess events (cudaIpcOpenEventHandle, the requests'
 *   `wait_event`) are opened once per session and kept; each session has one interprocess event
 *   of the daemon's per GPU, recorded after each of its requests (its handle goes back in every
 *   GPU reply). They are destroyed when the session ends, after its last request.
 */
import { gpuApi, type GpuApi } from './gpu.js';
import { limitError } from './limits.js';
import { CUDA_IPC_HANDLE_BYTES } from './schema.js';
import { ReplyError } from './reply-error.js';

/** An allocation opened for one or more sessions. */
interface OpenAllocation {
  device: number;
  base: bigint;
  /** Ids of the sessions holding it. */
  holders: Set<string>;
  /** Requests running on it. */
  inUse: number;
}

function api(): GpuApi {
  const a = gpuApi();
  if (a === null) throw new ReplyError('TZIP_NO_DEVICE', 'this build of the tzip daemon has no GPU support in its native addon');
  return a;
}

/** Hex of a CUDA IPC memory handle's cudaIpcMemHandle_t (PyTorch's [version][kind] header dropped). */
export function handleHex(handle: Uint8Array): string {
  const payload = handle.byteLength === 2 + CUDA_IPC_HANDLE_BYTES ? handle.subarray(2) : handle;
  return Buffer.from(payload.buffer, payload.byteOffset, payload.byteLength).toString('hex');
}

/** The key of an allocation: device ordinal and handle. */
export function allocationKey(handle: Uint8Array, device: number): string {
  return `${device}:${handleHex(handle)}`;
}

/** Every allocation the daemon has open, by key. */
export class IpcAllocations {
  private readonly open = new Map<string, OpenAllocation>();
  /** Close failures, for the log (the daemon goes on). */
  closeErrors = 0;

  /** Allocations open. */
  get count(): number {
    return this.open.size;
  }

  /**
   * The base pointer of the allocation of `handle` (66 bytes, kind "c") on `device`, opened if
   * needed; `holder` holds it from now on.
   * @throws ReplyError TZIP_HANDLE when CUDA cannot open the handle.
   */
  acquire(holder: string, handle: Uint8Array, device: number): { key: string; base: bigint } {
    const key = allocationKey(handle, device);
    const seen = this.open.get(key);
    if (seen !== undefined) {
      seen.holders.add(holder);
      return { key, base: seen.base };
    }
    let base: bigint;
    try {
      base = api().cudaIpcOpenMemHandle(handle.subarray(2, 2 + CUDA_IPC_HANDLE_BYTES), device);
    } catch (err) {
      if (err instanceof ReplyError) throw err;
      throw new ReplyError('TZIP_HANDLE', `cannot open the CUDA IPC memory handle: ${err instanceof Error ? err.message : String(err)}`);
    }
    this.open.set(key, { device, base, holders: new Set([holder]), inUse: 0 });
    return { key, base };
  }

  /** Marks the allocations of `keys` used by a request (they stay open until {@link end}). */
  begin(keys: Iterable<string>): void {
    for (const key of keys) {
      const a = this.open.get(key);
      if (a !== undefined) a.inUse++;
    }
  }

  /** The request using `keys` is done: allocations no session holds any more are closed. */
  end(keys: Iterable<string>): void {
    for (const key of keys) {
      const a = this.open.get(key);
      if (a === undefined) continue;
      a.inUse--;
      this.closeIfUnused(key, a);
    }
  }

  /** `holder` lets go of `key` (closed now if nothing else holds or uses it). */
  letGo(holder: string, key: string): void {
    const a = this.open.get(key);
    if (a === undefined) return;
    a.holders.delete(holder);
    this.closeIfUnused(key, a);
  }

  private closeIfUnused(key: string, a: OpenAllocation): void {
    if (a.holders.size > 0 || a.inUse > 0) return;
    this.open.delete(key);
    try {
      gpuApi()?.cudaIpcCloseMemHandle(a.base, a.device);
    } catch {
      this.closeErrors++;
    }
  }
}

/**
 * The allocations opened in this process, for every daemon in it: one table per process, not per Daemon, as CUDA
 * maps a handle once per process (two daemons in one process naming one allocation share its mapping). Its holders
 * are session ids (128 random bits), so the sessions of two daemons never hold for each other.
 */
export const ipcAllocations = new IpcAllocations();

/** Caps of one session's GPU state. */
export interface GpuCaps {
  /**
   * Allocations a session holds open at most (DaemonLimits.maxIpcHandlesPerSession): idle ones are
   * let go, least recently used first, to make room; beyond, TZIP_LIMIT.
   */
  maxAllocations: number;
  /** Client events a session keeps open before the least recently used are destroyed. */
  maxEvents: number;
}

export const DEFAULT_GPU_CAPS: GpuCaps = { maxAllocations: 4096, maxEvents: 256 };

interface OpenedEvent {
  event: bigint;
  device: number;
}

/** One session's CUDA IPC state. */
export class GpuSession {
  /** Keys of the allocations held, least recently used first. */
  private readonly held = new Set<string>();
  private readonly clientEvents = new Map<string, OpenedEvent>();
  private readonly ownEvents = new Map<number, { event: bigint; handle: Buffer }>();
  /** The allocation keys of each request being resolved or run (GpuRequest.keys): not let go to make room. */
  private readonly requests = new Set<Set<string>>();
  private inflight = 0;
  private closing = false;

  constructor(
    /** The session id (the holder name in {@link ipcAllocations}). */
    readonly holder: string,
    private readonly caps: GpuCaps = DEFAULT_GPU_CAPS,
    private readonly table: IpcAllocations = ipcAllocations,
  ) {}

  /** Allocations held. */
  get allocations(): number {
    return this.held.size;
  }

  /** Client events open. */
  get events(): number {
    return this.clientEvents.size;
  }

  /** Whether the session ended (no new requests are served on this state). */
  get closed(): boolean {
    return this.closing;
  }

  /**
   * A request starts: `keys` (its allocations, filled as it resolves its handles) are in use until
   * {@link untrack}.
   */
  track(keys: Set<string>): void {
    this.requests.add(keys);
  }

  /** The request of `keys` is over (resolved and run, or refused). */
  untrack(keys: Set<string>): void {
    if (this.requests.delete(keys) && this.inflight === 0) this.trimAllocations();
  }

  /**
   * The base pointer of `handle`'s allocation on `device` (see {@link IpcAllocations.acquire}).
   * @throws ReplyError TZIP_LIMIT when the session holds `maxAllocations` allocations, all in use
   *   by its requests (checked before CUDA opens the handle); TZIP_HANDLE as IpcAllocations.acquire.
   */
  allocation(handle: Uint8Array, device: number): { key: string; base: bigint } {
    const key = allocationKey(handle, device);
    if (!this.held.has(key) && this.held.size >= this.caps.maxAllocations) {
      const used = this.inUse();
      for (const k of this.held) {
        if (this.held.size < this.caps.maxAllocations) break;
        if (used.has(k)) continue;
        this.held.delete(k);
        this.table.letGo(this.holder, k);
      }
      if (this.held.size >= this.caps.maxAllocations) {
        throw limitError('maxIpcHandlesPerSession', this.caps.maxAllocations,
          `this session holds ${this.held.size} CUDA IPC allocations open, in use by its requests in flight`);
      }
    }
    const got = this.table.acquire(this.holder, handle, device);
    this.held.delete(got.key);
    this.held.add(got.key);
    return got;
  }

  /**
   * A client's interprocess event (64-byte cudaIpcEventHandle_t) opened on `device`.
   * @throws ReplyError TZIP_HANDLE when CUDA cannot open it.
   */
  clientEvent(handle: Uint8Array, device: number): bigint {
    const key = `${device}:${Buffer.from(handle.buffer, handle.byteOffset, handle.byteLength).toString('hex')}`;
    const seen = this.clientEvents.get(key);
    if (seen !== undefined) {
      this.clientEvents.delete(key);
      this.clientEvents.set(key, seen);
      return seen.event;
    }
    let event: bigint;
    try {
      event = api().cudaIpcOpenEventHandle(handle, device);
    } catch (err) {
      if (err instanceof ReplyError) throw err;
      throw new ReplyError('TZIP_HANDLE', `wait_event: cannot open the CUDA IPC event handle: ${err instanceof Error ? err.message : String(err)}`);
    }
    this.clientEvents.set(key, { event, device });
    this.trimEvents();
    return event;
  }

  /**
   * The daemon's interprocess event of this session on `device` (made on first use).
   * @throws ReplyError TZIP_CUDA when CUDA cannot make one.
   */
  ownEvent(device: number): { event: bigint; handle: Buffer } {
    const seen = this.ownEvents.get(device);
    if (seen !== undefined) return seen;
    let made: { event: bigint; handle: Buffer };
    try {
      made = api().cudaEventCreateInterprocess(device);
    } catch (err) {
      if (err instanceof ReplyError) throw err;
      throw new ReplyError('TZIP_CUDA', `cannot create an interprocess CUDA event: ${err instanceof Error ? err.message : String(err)}`);
    }
    const entry = { event: made.event, handle: Buffer.from(made.handle) };
    this.ownEvents.set(device, entry);
    return entry;
  }

  /** A request starts using `keys` (allocations) and this session's events. */
  begin(keys: readonly string[]): void {
    this.inflight++;
    this.table.begin(keys);
  }

  /** The request is done; a session that ended meanwhile is cleaned up after its last request. */
  end(keys: readonly string[]): void {
    this.table.end(keys);
    this.inflight--;
    if (this.inflight === 0) {
      this.trimAllocations();
      this.trimEvents();
      if (this.closing) this.destroyEvents();
    }
  }

  /**
   * Lets go of the allocations of `handles` (all when undefined); they are closed once no
   * session holds them and no request uses them. Returns how many were let go.
   */
  release(handles?: readonly Uint8Array[]): number {
    let keys: string[];
    if (handles === undefined) {
      keys = [...this.held];
    } else {
      const wanted = new Set(handles.map(handleHex));
      keys = [...this.held].filter((k) => wanted.has(k.slice(k.indexOf(':') + 1)));
    }
    for (const key of keys) {
      this.held.delete(key);
      this.table.letGo(this.holder, key);
    }
    return keys.length;
  }

  /** The session ended: everything is let go (events once its requests are done). Idempotent. */
  close(): void {
    this.closing = true;
    this.release();
    if (this.inflight === 0) this.destroyEvents();
  }

  /** Keys of the allocations the session's requests use. */
  private inUse(): Set<string> {
    const all = new Set<string>();
    for (const keys of this.requests) for (const k of keys) all.add(k);
    return all;
  }

  private trimAllocations(): void {
    if (this.held.size <= this.caps.maxAllocations) return;
    const used = this.inUse();
    for (const key of this.held) {
      if (this.held.size <= this.caps.maxAllocations) break;
      if (used.has(key)) continue;
      this.held.delete(key);
      this.table.letGo(this.holder, key);
    }
  }

  private trimEvents(): void {
    if (this.inflight > 0) return; // an event may be waited on by a request of this session
    for (const [key, e] of this.clientEvents) {
      if (this.clientEvents.size <= this.caps.maxEvents) break;
      this.clientEvents.delete(key);
      destroy(e.event, e.device);
    }
  }

  private destroyEvents(): void {
    for (const e of this.clientEvents.values()) destroy(e.event, e.device);
    this.clientEvents.clear();
    for (const [device, e] of this.ownEvents) destroy(e.event, device);
    this.ownEvents.clear();
  }
}

function destroy(event: bigint, device: number): void {
  try {
    gpuApi()?.cudaEventDestroy(event, device);
  } catch {
    // nothing to do: the event is gone either way
  }
}
