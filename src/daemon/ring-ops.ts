/**
 * The submission ring's control plane (protocol version 4, docs/ring.md "Control-plane operations"): `ring_open`,
 * `ring_register`, `ring_release` and `ring_close`, and the rings a session owns.
 *
 * The data plane is the addon's ring thread (src/native.ts `ringOpen`): it reads SQEs from the ring file, checks them
 * against the regions registered here and writes CQEs; no JavaScript runs per request. What the daemon does is what
 * the thread cannot: decide which memory is the session's (the same checks as for ZeroMQ requests), map it or open it
 * (shm-map.ts, gpu-map.ts), hold it while a region names it, count the thread's completions in the session's job
 * (handed over in batches, {@link RingEvents.onStats}), hand the thread the job's settings whenever they change
 * ({@link SessionRings.applySettings}; docs/ring.md "Who applies the job's settings") and the session's word of tensor
 * bytes in flight, which its batches reserve in as the session's ZeroMQ requests do (docs/ring.md "Limits").
 *
 * Memory held by rings:
 * - Shared-memory files (ring files and `shm` regions) are mapped through a {@link ShmMappings} of the session's rings
 *   alone ({@link SessionRings.mappings}), every mapping pinned (an epoch of its own) from registration to release: the
 *   ZeroMQ path's cache may drop its idle mappings at any time, a ring's may not be dropped while the thread may read
 *   it. The ownership rules are the ZeroMQ path's (the session's names only, regular files of the daemon's user, no
 *   symlinks, a file another session has mapped refused), and the files count against the session's
 *   `maxRegionsPerSession` together with its ZeroMQ mappings (session.ts).
 * - CUDA regions are allocations opened through the session's {@link GpuSession}: kept marked in
 *   use from registration to release, so neither the least-recently-used trimming of the ZeroMQ path nor a `release`
 *   op closes them under the thread; they count against `maxIpcHandlesPerSession`.
 * Releasing waits for the thread (`remove()`, which resolves once no batch uses the regions), then lets go.
 */
import { lstatSync } from 'node:fs';
import * as native from '../native.js';
import type { NativeRing, RingCompletionStats, RingOpenOptions, RingRegion as NativeRingRegion, RingSettings } from '../native.js';
import { STREAM_TAGS as GENERATED_STREAM_TAGS } from '../generated/constants.js';
import { gpuInventory, noteGpuUsed } from './gpu.js';
import type { GpuSession } from './gpu-map.js';
import { EXPANDABLE_SEGMENTS_REFUSED } from './gpu-regions.js';
import { limitError, type DaemonLimits } from './limits.js';
import { REPLY_ERROR_CODES, ReplyError, type ReplyErrorCode } from './reply-error.js';
import {
  SHAREABLE_CUDA_EXPANDABLE_SEGMENT, STREAMS, type RingCloseRequest, type RingOpenRequest, type RingRegion,
  type RingRegisterRequest, type RingReleaseRequest, type StreamName,
} from './schema.js';
import { shmPath, ShmMappings, type FileOwners } from './shm-map.js';

/** Rings one session may have open at once. */
export const MAX_RINGS_PER_SESSION = 8;
/** The ring file's first 8 bytes. */
export const RING_MAGIC = 'TZRING01';
/**
 * How long the ring thread spins on an empty ring before it sleeps on the doorbell, µs: long enough to catch the next
 * request of a training loop's burst (a bucket's tensors, the next layer) without a futex wake-up, which costs a
 * Python client 30-100 µs on the development VM (docs/benchmarks.md, "Daemon fast lane"); short enough that an idle
 * ring costs nothing.
 */
export const RING_SPIN_US = 250;
/**
 * The same for a ring that serves a GPU (ring_open with `device`): a GPU request's client spends longer between two
 * requests (its own GPU work, the copies of results) than 250 µs, so a thread that slept by then paid a futex wake-up
 * on every request, about 200 µs on the lent H200 VMs: a 25 MB bucket's ring round trip took 1.46x the direct addon
 * call with 250 µs and 1.05x with 2000 (docs/benchmarks.md, "Daemon fast lane, third round"). What it costs: a core
 * spinning for up to 2 ms after each GPU batch of the ring, on a GPU host.
 */
export const RING_GPU_SPIN_US = 2000;

/** The stream names of the SQE's `stream` tag (docs/ring.md: 0 other, 1 gradients, 2 optimizer, 3 checkpoint, 4 sendrecv). */
const STREAM_TAGS: readonly StreamName[] = GENERATED_STREAM_TAGS;

/** The stream an SQE's `stream` tag counts under (an unknown tag: `other`). */
export function streamOfTag(tag: number): StreamName {
  const name = STREAM_TAGS[tag];
  return name !== undefined && (STREAMS as readonly string[]).includes(name) ? name : 'other';
}

// --- the addon's ring (docs/ring.md, "Native API"; src/native.ts) -----------------------------------------------

/** The addon's ringOpen. */
export type RingOpen = (file: Buffer, opts: RingOpenOptions) => NativeRing;

/**
 * The addon's ringOpen, or null when the addon has no ring (the daemon then offers no `ring` in hello). An addon is
 * asked through native.ts's `ringAvailable()` where it has one; else an addon built from this tree is taken to have it.
 */
export function ringOpener(): RingOpen | null {
  const available = (native as { ringAvailable?: () => boolean }).ringAvailable;
  try {
    if (typeof available === 'function' ? !available() : !native.addonAvailable()) return null;
  } catch {
    return null;
  }
  return native.ringOpen;
}

/** hello's `ring` capability (docs/ring.md), or undefined when the addon has no ring. */
export function ringCapability(limits: Pick<DaemonLimits, 'maxRegionsPerSession'>): object | undefined {
  if (ringOpener() === null) return undefined;
  const l = native.RING_LAYOUT;
  return { entries_max: l.entriesMax, sqe_bytes: l.sqeBytes, cqe_bytes: l.cqeBytes, max_batch: l.maxBatch, max_regions: limits.maxRegionsPerSession };
}

// --- a session's rings ----------------------------------------------------------------------------------------------

/** What a session's rings need of the session (session.ts's Session is one). */
export interface RingOwner {
  /** The client's pid (PyTorch's files of its process are `torch_<pid>_...`). */
  readonly pid: number;
  /** The start of the names of the session's own files: its ring files must have it. */
  readonly shmPrefix: string;
  /** Whether /dev/shm/`name` is the session's to hand over. */
  owns(name: string): boolean;
  /** The daemon's owners of mapped files (a file another session has mapped is refused). */
  readonly fileOwners: FileOwners;
  /** The mappings of the session's ZeroMQ requests: those in use count against maxRegionsPerSession with the rings'. */
  readonly mappings: Pick<ShmMappings, 'inUseCount'>;
  /**
   * The session's tensor bytes in flight, as the 8 bytes of a SharedArrayBuffer's BigInt64 word: its ZeroMQ requests
   * reserve in it from JavaScript, its rings' threads from theirs (maxInflightBytesPerSession, docs/ring.md "Limits").
   */
  readonly inflightShared: Uint8Array;
  /** A number no earlier request or registration of the session got (the epoch that pins a mapping). */
  nextEpoch(): number;
  /** The session's CUDA IPC allocations (made on first use), and the same if it ever made them. */
  gpu(): GpuSession;
  readonly gpuIfAny: GpuSession | undefined;
}

/** What the daemon does with what one session's rings report (server.ts). */
export interface RingEvents {
  /** A batch of the thread's completion counts of one of the session's rings. */
  onStats(batch: readonly RingCompletionStats[]): void;
  /** The session's ring `ring` broke (its indices were out of range): `why`. */
  onBroken(ring: number, why: string): void;
}

/**
 * The settings a ring of the session applies to its SQEs, from `ringSmBudget`, the `sm_budget` its `ring_open` asked
 * (jobs.ts, JobRegistry.ringSettings).
 */
export type RingSettingsOf = (ringSmBudget: number | undefined) => RingSettings;

/** Daemon-wide counters of the rings (`stats`'s `ring`). */
export class RingCounters {
  /** Rings opened since the start. */
  opened = 0;
  /** Rings open now (closing ones included). */
  open = 0;
  /** Rings reported broken. */
  broken = 0;
  /** SQEs completed (successes and errors). */
  sqes = 0;
  /** SQEs completed with an error status. */
  sqeErrors = 0;
  /** Regions registered now, over all rings. */
  regions = 0;
}

/** A file mapped for the session's rings, and how many of their registrations hold it. */
interface HeldFile {
  key: string;
  buffer: Buffer;
  /** The epoch that pins its mapping in {@link SessionRings.mappings}. */
  epoch: number;
  ino: number;
  dev: number;
  /** The file's identity (`dev:ino`). */
  id: string;
  holds: number;
}

/** A region of a ring: the thread's id and generation, and what the daemon holds for it. */
interface Region {
  id: number;
  generation: number;
  bytes: number;
  /** The shared-memory file it is (kind shm). */
  file?: HeldFile;
  /** The CUDA allocation it lies in (kind cuda). */
  allocation?: string;
  releasing: boolean;
}

/** One open ring. */
interface Ring {
  id: number;
  device: number | undefined;
  /** ring_open's `sm_budget`: the default of its SQEs that give none, unless the job's settings say otherwise. */
  smBudget: number | undefined;
  native: NativeRing;
  file: HeldFile;
  regions: Map<number, Region>;
  /** Allocation keys the ring's regions hold, with how many holds each. */
  allocations: Map<string, number>;
  /** The keys above as a set tracked by the session's GpuSession (never trimmed while tracked). */
  tracked: Set<string>;
  /** Whether {@link tracked} is tracked by the session's GpuSession. */
  tracking: boolean;
  closing: Promise<void> | undefined;
  /** Why the thread reported it broken, or null. */
  broken: string | null;
}

/** A session's rings and the memory they hold. */
export class SessionRings {
  /** The session's files mapped for its rings (ring files and shm regions), each pinned while held. */
  readonly mappings: ShmMappings;
  private readonly rings = new Map<number, Ring>();
  private readonly files = new Map<string, HeldFile>();
  private nextId = 1;
  /** Broken rings not yet reported to the client (docs/ring.md: the next control request says so, once). */
  private unreported: { ring: number; why: string }[] = [];
  private ended = false;

  constructor(
    private readonly session: RingOwner,
    private readonly counters: RingCounters,
    private readonly limits: Pick<DaemonLimits, 'maxRegionsPerSession' | 'maxMappedBytesPerSession' | 'maxInflightBytesPerSession' | 'threads'>,
    ownerOf: (name: string) => string,
  ) {
    // Every mapping here is pinned while held; its caps only bound what ShmMappings would keep idle (nothing).
    this.mappings = new ShmMappings({ maxBytes: limits.maxMappedBytesPerSession, maxCached: 0, maxRegions: limits.maxRegionsPerSession }, ownerOf,
      session.fileOwners);
  }

  /** Rings open (closing ones included). */
  get count(): number {
    return this.rings.size;
  }

  /** Regions registered to the session's rings. */
  get regionCount(): number {
    let n = 0;
    for (const r of this.rings.values()) n += r.regions.size;
    return n;
  }

  /** Shared-memory files mapped for the rings. */
  get mappedFiles(): number {
    return this.mappings.count;
  }

  /** Bytes of those files. */
  get mappedBytes(): number {
    return this.mappings.bytes;
  }

  /**
   * The report of a broken ring the client has not had yet, taken (docs/ring.md: once), as the error to answer its
   * request with; undefined when there is none.
   */
  takeBrokenReport(): ReplyError | undefined {
    const first = this.unreported.shift();
    if (first === undefined) return undefined;
    return new ReplyError('TZIP_PROTOCOL', `ring broken: ring ${first.ring} of this session stopped serving (${first.why}); close it (ring_close) and open a new one`);
  }

  /**
   * `ring_open`: maps and checks the ring file, starts the addon's thread on it with the session's job settings
   * (`settingsOf`; later changes come through {@link applySettings}).
   */
  open(req: RingOpenRequest, settingsOf: RingSettingsOf, events: RingEvents, opener: RingOpen): { ring: number } {
    this.checkLive();
    if (this.rings.size >= MAX_RINGS_PER_SESSION) {
      throw new ReplyError('TZIP_LIMIT', `this session has ${this.rings.size} rings open, the most a session may have (${MAX_RINGS_PER_SESSION}, docs/ring.md); close one first`);
    }
    const bare = req.name.replace(/^\//, '');
    if (!bare.startsWith(this.session.shmPrefix)) {
      throw new ReplyError('TZIP_HANDLE', `${shmPath(bare)} is not this session's ring file: its name must start with the session's shm_prefix ${this.session.shmPrefix}`);
    }
    const device = req.device !== undefined ? gpuOrdinal(req.device.id, 'ring_open device') : undefined;
    const want = native.ringBytes(req.entries);
    const file = this.hold(bare, (f) => {
      if (this.ringFileIds().has(f.id)) throw new ReplyError('TZIP_INVALID_ARGUMENT', `${shmPath(bare)} is already the file of another ring of this session`);
      if (this.heldIds().has(f.id)) throw new ReplyError('TZIP_INVALID_ARGUMENT', `${shmPath(bare)} is a region of a ring of this session, not a ring file`);
      if (f.buffer.length !== want) {
        throw new ReplyError('TZIP_INVALID_ARGUMENT', `${shmPath(bare)} is ${f.buffer.length} bytes; a ring of ${req.entries} entries is ring_bytes(${req.entries}) = ${want} bytes`);
      }
      const magic = f.buffer.toString('latin1', 0, 8);
      if (magic !== RING_MAGIC) {
        throw new ReplyError('TZIP_INVALID_ARGUMENT', `${shmPath(bare)} does not start with the magic "${RING_MAGIC}" (docs/ring.md, "The ring file")`);
      }
      const entries = f.buffer.readUInt32LE(8);
      if (entries !== req.entries) {
        throw new ReplyError('TZIP_INVALID_ARGUMENT', `${shmPath(bare)} says ${entries} entries in its header; ring_open says ${req.entries}`);
      }
    });
    let ring: Ring | undefined;
    try {
      const id = this.nextId++;
      const opts: RingOpenOptions = {
        entries: req.entries,
        ...settingsOf(req.sm_budget),
        cpuThreads: this.limits.threads ?? native.defaultThreads(),
        spinUs: device !== undefined ? RING_GPU_SPIN_US : RING_SPIN_US,
        inflightBytes: this.session.inflightShared,
        maxInflightBytes: this.limits.maxInflightBytesPerSession,
        // Counted even after the session ended: the work was done (jobs.ts counts it under the job's name).
        onStats: (batch) => events.onStats(batch),
        onBroken: (why) => this.onBroken(id, why, events),
      };
      if (device !== undefined) opts.device = device;
      let nativeRing: NativeRing;
      try {
        nativeRing = opener(file.buffer, opts);
      } catch (err) {
        throw nativeError(err, 'ring_open');
      }
      // The ring's stream holds a CUDA context of the daemon on its GPU: `jobs` may ask that GPU's memory now.
      if (device !== undefined) noteGpuUsed(device);
      ring = { id, device, smBudget: req.sm_budget, native: nativeRing, file, regions: new Map(), allocations: new Map(), tracked: new Set(), tracking: false, closing: undefined, broken: null };
      this.rings.set(id, ring);
      this.counters.opened++;
      this.counters.open++;
      return { ring: id };
    } finally {
      if (ring === undefined) this.unhold(file);
    }
  }

  /**
   * Hands the session's job settings to each of its open rings (the job's or the daemon's settings changed, or the
   * session moved to another job): every SQE a ring checks from then on runs with them (docs/ring.md, "Who applies
   * the job's settings").
   */
  applySettings(settingsOf: RingSettingsOf): void {
    for (const ring of this.rings.values()) {
      if (ring.closing === undefined) ring.native.setSettings(settingsOf(ring.smBudget));
    }
  }

  /** `ring_register`: maps or opens every region first, then adds them to the thread (all or none). */
  async register(req: RingRegisterRequest): Promise<{ regions: NativeRingRegion[] }> {
    this.checkLive();
    const ring = this.ring(req.ring);
    if (ring.broken !== null) throw new ReplyError('TZIP_PROTOCOL', `ring ${ring.id} is broken (${ring.broken}); close it`);
    const ringFiles = this.ringFileIds();
    const planned: { region: RingRegion; file?: HeldFile; allocation?: { key: string; ptr: bigint; device: number } }[] = [];
    const added: Region[] = [];
    let done = false;
    try {
      req.regions.forEach((region, i) => {
        const what = `region ${i}`;
        if (region.kind === 'shm') {
          const bare = region.name.replace(/^\//, '');
          if (!this.session.owns(bare)) {
            throw new ReplyError('TZIP_HANDLE', `${what}: ${shmPath(bare)} is not this session's memory (its names start with ${this.session.shmPrefix} or torch_${this.session.pid}_)`, { index: i });
          }
          const file = this.hold(bare, (f) => {
            if (ringFiles.has(f.id)) throw new ReplyError('TZIP_INVALID_ARGUMENT', `${what}: ${shmPath(bare)} is a ring file of this session, not memory for tensors`, { index: i });
          }, i);
          planned.push({ region, file });
        } else {
          const deviceOrdinal = gpuOrdinal(region.device.id, what, i);
          if (ring.device === undefined || deviceOrdinal !== ring.device) {
            throw new ReplyError('TZIP_INVALID_ARGUMENT', `${what}: GPU memory of device ${deviceOrdinal} on ring ${ring.id}, which serves ${ring.device === undefined ? 'CPU batches only (ring_open without "device")' : `device ${ring.device}`}`, { index: i });
          }
          const opened = this.openAllocation(region.handle, deviceOrdinal, what, i);
          // Held from here (released below if the registration fails).
          ring.allocations.set(opened.key, (ring.allocations.get(opened.key) ?? 0) + 1);
          ring.tracked.add(opened.key);
          this.track(ring);
          planned.push({ region, allocation: { key: opened.key, ptr: opened.base + BigInt(region.offset), device: deviceOrdinal } });
        }
      });
      for (const p of planned) {
        let got: NativeRingRegion;
        try {
          got = p.file !== undefined
            ? ring.native.addHost(p.file.buffer)
            : ring.native.addDevice(p.allocation?.ptr as bigint, (p.region as Extract<RingRegion, { kind: 'cuda' }>).bytes, p.allocation?.device as number);
        } catch (err) {
          throw nativeError(err, `region ${planned.indexOf(p)}`);
        }
        const r: Region = { id: got.id, generation: got.generation, bytes: got.bytes, releasing: false };
        if (p.file !== undefined) r.file = p.file;
        if (p.allocation !== undefined) r.allocation = p.allocation.key;
        added.push(r);
      }
      for (const r of added) ring.regions.set(r.id, r);
      this.counters.regions += added.length;
      done = true;
      return { regions: added.map((r) => ({ id: r.id, generation: r.generation, bytes: r.bytes })) };
    } finally {
      if (!done) {
        // Nothing of a failed registration stays: the regions the thread took are removed, the memory let go.
        if (added.length > 0) {
          try {
            await ring.native.remove(added.map((r) => r.id));
          } catch {
            // a thread that cannot remove them has stopped: nothing uses them
          }
        }
        for (const p of planned) {
          if (p.file !== undefined) this.unhold(p.file);
          if (p.allocation !== undefined) this.dropAllocation(ring, p.allocation.key);
        }
      }
    }
  }

  /** `ring_release`: the regions are removed from the thread (after their last batch), then let go. */
  async release(req: RingReleaseRequest): Promise<object> {
    const ring = this.ring(req.ring);
    const regions: Region[] = [];
    const seen = new Set<number>();
    req.regions.forEach((id, i) => {
      const r = ring.regions.get(id);
      if (r === undefined || r.releasing) {
        throw new ReplyError('TZIP_HANDLE', `region ${id} is not registered to ring ${ring.id}${r !== undefined ? ' (it is being released)' : ''}`, { index: i });
      }
      if (seen.has(id)) throw new ReplyError('TZIP_INVALID_ARGUMENT', `region ${id} is named twice`, { index: i });
      seen.add(id);
      regions.push(r);
    });
    for (const r of regions) r.releasing = true;
    try {
      await ring.native.remove(regions.map((r) => r.id));
    } finally {
      // Whether remove() resolved or failed (the thread stopped), no batch uses the regions any more.
      for (const r of regions) this.forgetRegion(ring, r);
    }
    return {};
  }

  /** `ring_close`: the thread stops after its batch in flight; the regions are let go, the file unmapped. */
  async close(req: RingCloseRequest): Promise<object> {
    const ring = this.ring(req.ring);
    // A client closing a broken ring has seen that it broke.
    this.unreported = this.unreported.filter((u) => u.ring !== ring.id);
    await this.closeRing(ring);
    return {};
  }

  /** The session ended: every ring is closed (resolves when all are). Idempotent. */
  closeAll(): Promise<void> {
    this.ended = true;
    this.unreported = [];
    return Promise.all([...this.rings.values()].map((r) => this.closeRing(r))).then(() => undefined);
  }

  private closeRing(ring: Ring): Promise<void> {
    if (ring.closing !== undefined) return ring.closing;
    ring.closing = (async () => {
      try {
        await ring.native.close();
      } catch {
        // the thread has stopped either way
      }
      // Every allocation hold of the ring is a region's: forgetting the regions lets go of them all.
      for (const r of [...ring.regions.values()]) this.forgetRegion(ring, r);
      if (ring.tracking) this.session.gpuIfAny?.untrack(ring.tracked);
      ring.tracked.clear();
      this.unhold(ring.file);
      this.rings.delete(ring.id);
      this.counters.open--;
    })();
    return ring.closing;
  }

  private onBroken(id: number, why: string, events: RingEvents): void {
    const ring = this.rings.get(id);
    if (ring === undefined || ring.broken !== null || ring.closing !== undefined) return;
    ring.broken = why;
    this.counters.broken++;
    if (!this.ended) {
      this.unreported.push({ ring: id, why });
      events.onBroken(id, why);
    }
  }

  private checkLive(): void {
    if (this.ended) throw new ReplyError('TZIP_SESSION', 'the session ended; say hello again');
  }

  /** The open ring `id`. */
  private ring(id: number): Ring {
    const ring = this.rings.get(id);
    if (ring === undefined) throw new ReplyError('TZIP_HANDLE', `ring ${id} is not open in this session`);
    if (ring.closing !== undefined) throw new ReplyError('TZIP_HANDLE', `ring ${id} is being closed`);
    return ring;
  }

  private ringFileIds(): Set<string> {
    const ids = new Set<string>();
    for (const r of this.rings.values()) ids.add(r.file.id);
    return ids;
  }

  /** Identities of the files held (ring files and regions). */
  private heldIds(): Set<string> {
    const ids = new Set<string>();
    for (const f of this.files.values()) ids.add(f.id);
    return ids;
  }

  /** The ring's allocation keys are kept from the GpuSession's trimming from its first allocation on. */
  private track(ring: Ring): void {
    if (ring.tracking) return;
    ring.tracking = true;
    this.session.gpu().track(ring.tracked);
  }

  /**
   * /dev/shm/`key` mapped (writable) and held once more; `check` sees it first (and may refuse it: nothing is held
   * then). A file held already is the same mapping, if it is still the same file.
   * @throws ReplyError TZIP_HANDLE (as ShmMappings.map; a held name whose file was replaced since), TZIP_LIMIT (the
   *   session's maxRegionsPerSession), and what `check` throws.
   */
  private hold(key: string, check: (f: HeldFile) => void, index?: number): HeldFile {
    const at = (err: unknown) => (err instanceof ReplyError && index !== undefined ? err.at(index) : err);
    const seen = this.files.get(key);
    if (seen !== undefined) {
      const st = lstatSync(shmPath(key), { throwIfNoEntry: false });
      if (st === undefined || !st.isFile() || st.ino !== seen.ino || st.dev !== seen.dev || st.size !== seen.buffer.length) {
        throw at(new ReplyError('TZIP_HANDLE', `${shmPath(key)} changed since a ring of this session registered it (replaced, grown or shrunk): release that region first`));
      }
      check(seen);
      seen.holds++;
      return seen;
    }
    const limit = this.limits.maxRegionsPerSession;
    const zmq = this.session.mappings.inUseCount;
    if (this.mappings.count + zmq >= limit) {
      throw at(limitError('maxRegionsPerSession', limit,
        `this session holds ${this.mappings.count} shared-memory files for its rings and ${zmq} for its requests in flight`));
    }
    const epoch = this.session.nextEpoch();
    let buffer: Buffer;
    try {
      buffer = this.mappings.map(key, true, epoch);
    } catch (err) {
      this.mappings.endRequest(epoch);
      throw at(err);
    }
    const st = lstatSync(shmPath(key), { throwIfNoEntry: false });
    const id = this.mappings.idOf(key) ?? '';
    const file: HeldFile = { key, buffer, epoch, ino: st?.ino ?? -1, dev: st?.dev ?? -1, id, holds: 0 };
    try {
      check(file);
    } catch (err) {
      this.mappings.endRequest(epoch);
      this.mappings.drop([key]);
      throw at(err);
    }
    file.holds = 1;
    this.files.set(key, file);
    return file;
  }

  /** One hold of `file` less; the last unpins and drops its mapping. */
  private unhold(file: HeldFile): void {
    if (--file.holds > 0) return;
    if (this.files.get(file.key) === file) this.files.delete(file.key);
    this.mappings.endRequest(file.epoch);
    this.mappings.drop([file.key]);
  }

  /**
   * The allocation of a CUDA IPC `handle` on `device`, opened through the session's GpuSession and marked in use
   * until {@link dropAllocation}.
   */
  private openAllocation(handle: Uint8Array, device: number, what: string, index?: number): { key: string; base: bigint } {
    if (handle[1] === SHAREABLE_CUDA_EXPANDABLE_SEGMENT) {
      throw new ReplyError('TZIP_UNSUPPORTED', `${what}: ${EXPANDABLE_SEGMENTS_REFUSED}`, index !== undefined ? { index } : {});
    }
    const gpu = this.session.gpu();
    let opened: { key: string; base: bigint };
    try {
      opened = gpu.allocation(handle, device);
    } catch (err) {
      if (err instanceof ReplyError) throw new ReplyError(err.code, `${what}: ${err.message}`, { ...err.extra, ...(index !== undefined ? { index } : {}) });
      throw err;
    }
    gpu.begin([opened.key]);
    return opened;
  }

  /** Ends one hold of allocation `key` of `ring`. */
  private dropAllocation(ring: Ring, key: string): void {
    const n = (ring.allocations.get(key) ?? 0) - 1;
    if (n > 0) ring.allocations.set(key, n);
    else {
      ring.allocations.delete(key);
      ring.tracked.delete(key);
    }
    this.session.gpuIfAny?.end([key]);
  }

  private forgetRegion(ring: Ring, r: Region): void {
    if (ring.regions.get(r.id) !== r) return;
    ring.regions.delete(r.id);
    this.counters.regions--;
    if (r.file !== undefined) this.unhold(r.file);
    if (r.allocation !== undefined) this.dropAllocation(ring, r.allocation);
  }
}

/**
 * The daemon's ordinal `id` of a GPU a ring names.
 * @throws ReplyError TZIP_NO_DEVICE when the daemon has no GPU or none of that ordinal.
 */
function gpuOrdinal(id: number, what: string, index?: number): number {
  const inv = gpuInventory();
  const extra = index !== undefined ? { index } : {};
  if (inv.devices.length === 0) {
    throw new ReplyError('TZIP_NO_DEVICE', `${what}: this tzip daemon has no usable GPU (${inv.reason}); GPU memory cannot be served`, extra);
  }
  const found = inv.devices.find((d) => d.ordinal === id);
  if (found === undefined) {
    throw new ReplyError('TZIP_NO_DEVICE', `${what}: the daemon has no GPU ${id} (hello's daemon.gpus lists indices ${inv.devices.map((d) => d.ordinal).join(', ')})`, extra);
  }
  return found.ordinal;
}

/** An error the addon's ring threw, as a reply (its code kept when it has one of the protocol's). */
function nativeError(err: unknown, what: string): ReplyError {
  if (err instanceof ReplyError) return err;
  const code = (err as { code?: unknown } | null)?.code;
  const message = err instanceof Error ? err.message : String(err);
  const known = typeof code === 'string' && (REPLY_ERROR_CODES as readonly string[]).includes(code);
  return new ReplyError(known ? (code as ReplyErrorCode) : 'TZIP_INTERNAL', `${what}: ${message}`);
}

