/**
 * Sessions: one per connected client (Python `Client`), made by `hello`, named by a random id.
 *
 * A session holds the client's lease, the shared-memory mappings cached for it, and the ZeroMQ
 * routing ids of the sockets it speaks through (a client may use one socket per thread). It ends
 * on `release` with `end`, when its lease lapses (no request for `leaseMs`, requests in flight
 * excepted) or when the last of its sockets disconnects; its mappings are dropped then (CUDA IPC
 * allocations and events once its requests in flight are done: gpu-map.ts), and the
 * shared-memory files it made are removed if its process is gone (shm-cleanup.ts). Its submission rings (protocol
 * version 4, ring-ops.ts) are closed then too, their threads stopped and their regions let go.
 *
 * A session may name only its own memory: files whose name starts with its `shm_prefix`
 * (`tzip-<pid>-<hex>-`, unique among live sessions) or PyTorch's shared-memory files of its own
 * process (`torch_<pid>_...`, the file_system sharing strategy).
 */
import { randomBytes } from 'node:crypto';
import { DEFAULT_GPU_CAPS, GpuSession } from './gpu-map.js';
import { processStartTime } from './lock.js';
import { limitError, type DaemonLimits } from './limits.js';
import type { GpuOwner } from './gpu-regions.js';
import type { ShmOwner } from './regions.js';
import { ReplyError } from './reply-error.js';
import { RingCounters, SessionRings, type RingOwner } from './ring-ops.js';
import type { JobInfo } from './schema.js';
import { FileOwners, ShmMappings } from './shm-map.js';

/** Why a session ended. */
export type EndReason = 'goodbye' | 'lease' | 'disconnect' | 'replaced' | 'shutdown';

/** One client's session: the memory checks of CPU and GPU requests and its rings take it as what they need of it. */
export class Session implements ShmOwner, GpuOwner, RingOwner {
  readonly sid = randomBytes(16).toString('hex');
  readonly createdAt = Date.now();
  lastSeen = Date.now();
  /** ZeroMQ compress/decompress requests in flight (ring batches are bounded by the rings: docs/ring.md "Limits"). */
  inflight = 0;
  /**
   * Tensor bytes in flight of the session's ZeroMQ requests and ring batches together (see
   * {@link DaemonLimits.maxInflightBytesPerSession}): one BigInt64 word of a SharedArrayBuffer, which {@link reserveBytes}
   * changes with Atomics here and the rings' native threads with atomics of their own.
   */
  private readonly inflightWord = new BigInt64Array(new SharedArrayBuffer(8));
  /** The same word as bytes, for the ring threads (src/native.ts, RingOpenOptions.inflightBytes). */
  readonly inflightShared = new Uint8Array(this.inflightWord.buffer);
  requests = 0;
  /** Protocol version 3: the job the client said it belongs to (hello's `job`, the `job` op), or null. */
  job: JobInfo | null = null;
  /** Whether the job's integrations are on (hello with a `job`, `job` with `attached: true`). */
  attached = false;
  /** When the session became attached (ms since the epoch), or null while it is not. */
  attachedAt: number | null = null;
  /** Whether the daemon has warned that this session's client does not share its MPS server (once per session). */
  mpsWarned = false;
  readonly routingIds = new Set<string>();
  /** The shared-memory files mapped for its ZeroMQ requests (a cache: idle ones are dropped to make room). */
  readonly mappings: ShmMappings;
  /** Its submission rings and the memory registered to them (protocol version 4). */
  readonly rings: SessionRings;
  /** The CUDA IPC allocations and events opened for this session (made on its first GPU request). */
  private gpuState: GpuSession | undefined;
  /** Start time of the client's process when the daemon can see it (same pid namespace), else null. */
  readonly pidStart: number | null;
  private readonly torchPrefix: string;
  /** The last request epoch handed out ({@link nextEpoch}). */
  private epoch = 0;

  constructor(
    readonly pid: number,
    readonly shmPrefix: string,
    readonly name: string,
    readonly version: number,
    private readonly limits: Pick<DaemonLimits, 'maxMappedBytesPerSession' | 'maxMappingsPerSession' | 'maxRegionsPerSession' | 'maxIpcHandlesPerSession' | 'maxInflightBytesPerSession' | 'threads'>,
    ringCounters: RingCounters = new RingCounters(),
    /** The daemon's owners of mapped files (its SessionTable's; a session made alone has a table of its own). */
    readonly fileOwners: FileOwners = new FileOwners(),
  ) {
    this.torchPrefix = `torch_${pid}_`;
    // PyTorch's files of the process are every one of its sessions' (a process may have several clients).
    const torchOwner = `pid:${pid}`;
    const ownerOf = (name: string) => (name.startsWith(this.torchPrefix) ? torchOwner : this.sid);
    const rings = (): SessionRings => this.rings;
    // The files its rings hold count against maxRegionsPerSession too: the requests' mappings get what they leave
    // (at least one, as a request always could map its newest file).
    this.mappings = new ShmMappings({
      maxBytes: limits.maxMappedBytesPerSession,
      maxCached: limits.maxMappingsPerSession,
      get maxRegions() {
        return Math.max(1, limits.maxRegionsPerSession - rings().mappedFiles);
      },
    }, ownerOf, fileOwners);
    this.rings = new SessionRings(this, ringCounters, limits, ownerOf);
    this.pidStart = processStartTime(pid);
  }

  /** Whether /dev/shm/`name` is this session's to hand over. */
  owns(name: string): boolean {
    const bare = name.replace(/^\//, '');
    return bare.startsWith(this.shmPrefix) || bare.startsWith(this.torchPrefix);
  }

  /** Sets the session's job and whether it is attached (the time of attaching is kept while it stays attached). */
  setJob(job: JobInfo | null, attached: boolean, now: number = Date.now()): void {
    this.job = job;
    if (attached && !this.attached) this.attachedAt = now;
    if (!attached) this.attachedAt = null;
    this.attached = attached;
  }

  /**
   * A number no earlier request of this session got: the epoch of a compress/decompress request or of a ring's
   * registration, under which its mappings check each file against the file system once and stay pinned
   * (ShmMappings.map and endRequest; the session's mappings are its own, so the numbers need only be unique in it).
   */
  nextEpoch(): number {
    this.epoch = (this.epoch + 1) % Number.MAX_SAFE_INTEGER;
    return this.epoch;
  }

  /** Renews the lease. */
  touch(): void {
    this.lastSeen = Date.now();
  }

  /** The session's GPU state (made on first use). */
  gpu(): GpuSession {
    if (this.gpuState === undefined) this.gpuState = new GpuSession(this.sid, { maxAllocations: this.limits.maxIpcHandlesPerSession, maxEvents: DEFAULT_GPU_CAPS.maxEvents });
    return this.gpuState;
  }

  /** Tensor bytes the session's ZeroMQ requests and ring batches hold in flight now. */
  get inflightBytes(): number {
    return Number(Atomics.load(this.inflightWord, 0));
  }

  /**
   * Counts `bytes` (a request's tensor bytes) in flight until the returned function is called.
   * @throws ReplyError TZIP_LIMIT when the session's requests and ring batches in flight would hold more than
   *   {@link DaemonLimits.maxInflightBytesPerSession}.
   */
  reserveBytes(bytes: number): () => void {
    const limit = BigInt(this.limits.maxInflightBytesPerSession);
    const n = BigInt(bytes);
    // A ring thread may reserve between the load and the exchange: the exchange then fails and the loop looks again.
    for (;;) {
      const held = Atomics.load(this.inflightWord, 0);
      if (held + n > limit) {
        throw limitError('maxInflightBytesPerSession', this.limits.maxInflightBytesPerSession,
          `this request's tensors are ${bytes} bytes and this session's requests and ring batches in flight hold ${held} bytes`);
      }
      if (Atomics.compareExchange(this.inflightWord, 0, held, held + n) === held) break;
    }
    let done = false;
    return () => {
      if (done) return;
      done = true;
      Atomics.sub(this.inflightWord, 0, n);
    };
  }

  /** The session's GPU state if it ever made one. */
  get gpuIfAny(): GpuSession | undefined {
    return this.gpuState;
  }

  /** Whether a `/dev/shm` name given as PyTorch's CUDA IPC ref-counter file ("/torch_<pid>_...") is this session's process's. */
  ownsRefCounter(name: string): boolean {
    return name.replace(/^\//, '').startsWith(this.torchPrefix);
  }
}

/** Called when a session ends (after its mappings are dropped). */
export type EndListener = (session: Session, reason: EndReason) => void;

/** All live sessions. */
export class SessionTable {
  private readonly bySid = new Map<string, Session>();
  private readonly byPrefix = new Map<string, Session>();
  private readonly byRouting = new Map<string, Session>();
  /** Routing ids ZeroMQ reported connected (ROUTER_NOTIFY) and not yet disconnected. */
  private readonly connected = new Set<string>();

  constructor(
    private readonly limits: DaemonLimits,
    private readonly onEnd: EndListener,
    /** The daemon's counters of rings (stats). */
    readonly ringCounters: RingCounters = new RingCounters(),
    /** Which session has each mapped file, for all of the daemon's sessions (shm-map.ts). */
    readonly fileOwners: FileOwners = new FileOwners(),
  ) {}

  /** Rings being closed for sessions that ended (see {@link closing}). */
  private readonly ringsClosing = new Set<Promise<void>>();

  /** Resolves when the rings of every ended session are closed (their threads stopped). */
  async closing(): Promise<void> {
    while (this.ringsClosing.size > 0) await Promise.allSettled([...this.ringsClosing]);
  }

  get size(): number {
    return this.bySid.size;
  }

  /** Live sessions. */
  all(): IterableIterator<Session> {
    return this.bySid.values();
  }

  /** Shared-memory files and bytes mapped for the live sessions (their requests' and their rings'), in all (`stats`, the metrics' gauges). */
  mapped(): { files: number; bytes: number } {
    let files = 0;
    let bytes = 0;
    for (const s of this.bySid.values()) {
      files += s.mappings.count + s.rings.mappedFiles;
      bytes += s.mappings.bytes + s.rings.mappedBytes;
    }
    return { files, bytes };
  }

  /**
   * Opens a session for a `hello` that came through `routingId`.
   * @throws ReplyError TZIP_BUSY at the session cap; TZIP_HANDLE when another live process holds the prefix.
   */
  open(pid: number, shmPrefix: string, name: string, version: number, routingId: string): Session {
    const holder = this.byPrefix.get(shmPrefix);
    if (holder !== undefined) {
      if (holder.pid !== pid) {
        throw new ReplyError('TZIP_HANDLE', `shm_prefix ${shmPrefix} belongs to another live session (pid ${holder.pid})`);
      }
      // The same process says hello again (it lost its session id): the old session is replaced.
      this.end(holder, 'replaced');
    }
    if (this.bySid.size >= this.limits.maxSessions) {
      throw new ReplyError('TZIP_BUSY', `the daemon serves its maximum of ${this.limits.maxSessions} sessions`);
    }
    const session = new Session(pid, shmPrefix, name, version, this.limits, this.ringCounters, this.fileOwners);
    this.bySid.set(session.sid, session);
    this.byPrefix.set(shmPrefix, session);
    this.attach(session, routingId);
    return session;
  }

  /** The live session `sid`, with `routingId` added to its sockets; renews its lease. */
  lookup(sid: string, routingId: string): Session {
    const session = this.bySid.get(sid);
    if (session === undefined) {
      throw new ReplyError('TZIP_SESSION', 'unknown or expired session; say hello again');
    }
    this.attach(session, routingId);
    session.touch();
    return session;
  }

  /** The live session `sid` or undefined (no side effects). */
  peek(sid: string): Session | undefined {
    return this.bySid.get(sid);
  }

  private attach(session: Session, routingId: string): void {
    const other = this.byRouting.get(routingId);
    if (other === session) return;
    if (other !== undefined) other.routingIds.delete(routingId);
    this.byRouting.set(routingId, session);
    session.routingIds.add(routingId);
  }

  /**
   * A ROUTER_NOTIFY message for `routingId` (connect and disconnect look alike: the first is a
   * connect, the next a disconnect). A disconnect ends the session once none of its sockets is left.
   */
  notify(routingId: string): 'connect' | 'disconnect' {
    if (!this.connected.has(routingId)) {
      this.connected.add(routingId);
      return 'connect';
    }
    this.connected.delete(routingId);
    const session = this.byRouting.get(routingId);
    this.byRouting.delete(routingId);
    if (session !== undefined) {
      session.routingIds.delete(routingId);
      if (session.routingIds.size === 0) this.end(session, 'disconnect');
    }
    return 'disconnect';
  }

  /**
   * Ends sessions whose lease lapsed at `now` (those with requests in flight are kept). `late` (ms) is how much later
   * than planned the caller's timer fired: a daemon starved of CPU reads its socket late too, so a heartbeat may be
   * waiting unread; every lease is first extended by that much (found by `python -m tzip.bench.load`: 32 clients on 2
   * cores ended live clients' sessions by lease).
   */
  sweep(now: number = Date.now(), late = 0): number {
    let ended = 0;
    if (late > 0) for (const session of this.bySid.values()) session.lastSeen += late;
    for (const session of [...this.bySid.values()]) {
      if (session.inflight === 0 && now - session.lastSeen > this.limits.leaseMs) {
        this.end(session, 'lease');
        ended++;
      }
    }
    return ended;
  }

  /**
   * Ends `session`: drops its mappings, starts closing its rings (their memory is let go once their threads have
   * stopped: {@link closing}) and forgets it. Idempotent.
   */
  end(session: Session, reason: EndReason): void {
    if (this.bySid.get(session.sid) !== session) return;
    this.bySid.delete(session.sid);
    if (this.byPrefix.get(session.shmPrefix) === session) this.byPrefix.delete(session.shmPrefix);
    for (const r of session.routingIds) if (this.byRouting.get(r) === session) this.byRouting.delete(r);
    session.routingIds.clear();
    session.mappings.drop();
    if (session.rings.count > 0) {
      const closing = session.rings.closeAll();
      this.ringsClosing.add(closing);
      void closing.finally(() => this.ringsClosing.delete(closing));
    } else {
      session.rings.closeAll();
    }
    // The allocations its rings hold stay open (marked in use) until the rings are closed.
    session.gpuIfAny?.close();
    this.onEnd(session, reason);
  }

  /** Ends every session. */
  endAll(reason: EndReason): void {
    for (const session of [...this.bySid.values()]) this.end(session, reason);
  }
}
