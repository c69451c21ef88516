/**
 * The daemon's limits and timings, with their defaults (all overridable by `tzip serve` options), and
 * the error a session gets when it reaches one of its per-session limits (docs/security.md, "Limits").
 */
import { ReplyError } from './reply-error.js';

/** Limits and timings of one daemon. */
export interface DaemonLimits {
  /** Largest request message accepted, bytes (at least {@link MIN_MAX_MESSAGE_BYTES}); larger ones get a TZIP_TOO_LARGE reply. */
  maxMessageBytes: number;
  /**
   * Largest message the transport takes at all (ZMQ_MAXMSGSIZE), bytes: a peer that sends more
   * is disconnected by ZeroMQ without a reply. Protects the daemon's memory.
   */
  transportMaxMessageBytes: number;
  /** Most tensors/frames in one compress/decompress request. */
  maxBatch: number;
  /** Most dimensions of a tensor description. */
  maxNdim: number;
  /**
   * Most ZeroMQ compress/decompress requests of one session in flight at once (TZIP_BUSY beyond). Ring SQEs are not
   * counted: a ring's thread runs one batch at a time and a session has at most 8 rings, so at most 8 of its batches
   * are in flight; SQEs queued behind them wait in the client's ring file, not in the daemon (docs/ring.md, "Limits").
   */
  maxInflightPerSession: number;
  /** Most live sessions. */
  maxSessions: number;
  /** Lease length: a session with no request for this long is dropped, ms. */
  leaseMs: number;
  /** Heartbeat period the daemon asks clients for, ms (a third of the lease by default). */
  heartbeatMs: number;
  /** Mapped shared-memory bytes cached per session before the least recently used mappings are dropped. */
  maxMappedBytesPerSession: number;
  /** Idle mappings kept per session after its requests, least recently used dropped first (the kernel caps mappings per process). */
  maxMappingsPerSession: number;
  /**
   * Shared-memory files a session may have mapped at once (its registered regions), those its
   * requests in flight use included: at the limit, idle ones are dropped least recently used first
   * to make room, and a request that needs one more while all are in use gets TZIP_LIMIT.
   * `tzip serve --max-regions`. (The kernel's vm.max_map_count, 65530 by default, caps the
   * daemon's mappings of all sessions together: a mapping beyond it is a TZIP_HANDLE "cannot map".)
   */
  maxRegionsPerSession: number;
  /**
   * CUDA IPC allocations a session holds open at most (cudaIpcOpenMemHandle; each maps the
   * client's allocation into the daemon's address space): idle ones are closed least recently used
   * first to make room, and a request that needs one more while all are in use by the session's
   * requests in flight gets TZIP_LIMIT. `tzip serve --max-ipc-handles`.
   */
  maxIpcHandlesPerSession: number;
  /**
   * Tensor bytes of a session's requests in flight at most (compress: the tensors' bytes;
   * decompress: the destinations' bytes), its ZeroMQ requests and its ring batches together; a
   * request that would go beyond gets TZIP_LIMIT, a ring batch an error CQE TZIP_LIMIT for each of its
   * SQEs (one request or batch larger than the limit can never be served: split it).
   * `tzip serve --max-inflight-bytes`.
   */
  maxInflightBytesPerSession: number;
  /** Codec worker threads per tensor (the addon's default: all cores). */
  threads: number | undefined;
  /** Exit after this many ms with no session (0: never). */
  idleExitMs: number;
  /**
   * Requests whose tensors (compress) or decoded bytes (decompress) total at most this many bytes
   * run their codec calls on the event loop (the addon's `inline`), skipping libuv's thread pool
   * (15-45 µs per call measured on a 2-vCPU VM; 16 KiB codes in well under that), when they hold at
   * most {@link inlineMaxItems} tensors (each call has a fixed cost too: a request of thousands of
   * one-element tensors would hold the event loop for a long time).
   */
  inlineMaxBytes: number;
  /** See {@link inlineMaxBytes}. */
  inlineMaxItems: number;
}

/**
 * Protocol versions this daemon speaks, newest last (2: compress/decompress may carry a handle table; 3: jobs, streams,
 * settings: docs/protocol.md; 4: the submission ring, docs/ring.md).
 */
export const PROTOCOL_VERSIONS: readonly number[] = [1, 2, 3, 4];

/**
 * The least `maxMessageBytes` (`--max-message-bytes`): 64 KiB. Every client's first message is a hello, and the
 * largest hello the schema admits (a name, a job name and user of 200 characters, 64 device names of 80, all of
 * 3-byte UTF-8 characters) is 17,560 bytes of MessagePack, the largest `job` message 16,819 (test/config.test.ts
 * builds both); a request of one tensor of any shape (64 dimensions, CUDA IPC handles) is smaller still. Below the
 * bound a hello could be refused, and a TZIP_TOO_LARGE reply to a message too large to decode carries no request id
 * (parse-request.ts), so the client would see no answer at all: the daemon would serve no one.
 */
export const MIN_MAX_MESSAGE_BYTES = 64 << 10;

/** Default limits. */
export function defaultLimits(): DaemonLimits {
  const leaseMs = 10_000;
  return {
    maxMessageBytes: 1 << 20,
    transportMaxMessageBytes: 16 << 20,
    maxBatch: 4096,
    maxNdim: 64,
    maxInflightPerSession: 64,
    maxSessions: 1024,
    leaseMs,
    heartbeatMs: Math.floor(leaseMs / 3),
    maxMappedBytesPerSession: 64 * 2 ** 30,
    maxMappingsPerSession: 1024,
    // A request holds at most ~2600 tensors (1 MiB messages), each possibly in its own file (PyTorch's shared tensors).
    maxRegionsPerSession: 8192,
    // As many as a request can name (the Python client's GPU requests hold ~1300 tensors); the old least-recently-used cap.
    maxIpcHandlesPerSession: 4096,
    maxInflightBytesPerSession: 256 * 2 ** 30,
    threads: undefined,
    idleExitMs: 0,
    inlineMaxBytes: 16 << 10,
    inlineMaxItems: 64,
  };
}

/**
 * Whether a request of `items` tensors/frames and `bytes` (tensor bytes of a compress, decoded
 * bytes of a decompress) runs its codec calls on the event loop: {@link DaemonLimits.inlineMaxBytes}.
 */
export function runsInline(limits: DaemonLimits, items: number, bytes: number): boolean {
  return items <= limits.inlineMaxItems && bytes <= limits.inlineMaxBytes;
}

/**
 * The per-session limits: the `tzip serve` flag that sets each (`option`: its commander attribute),
 * and what it counts (for messages, `--help` and docs/security.md).
 */
export const SESSION_LIMITS = {
  maxRegionsPerSession: { flag: '--max-regions', option: 'maxRegions', what: 'shared-memory files mapped per session' },
  maxIpcHandlesPerSession: { flag: '--max-ipc-handles', option: 'maxIpcHandles', what: 'CUDA IPC allocations open per session' },
  maxInflightBytesPerSession: { flag: '--max-inflight-bytes', option: 'maxInflightBytes', what: 'tensor bytes of requests and ring batches in flight per session' },
} as const;

/** A per-session limit's name. */
export type SessionLimit = keyof typeof SESSION_LIMITS;

/**
 * The TZIP_LIMIT reply of a session at its limit `name` of `value`: what happened (`detail`), the
 * limit and its value, and the flag that raises it. The daemon goes on serving; other sessions have
 * limits of their own.
 */
export function limitError(name: SessionLimit, value: number, detail: string): ReplyError {
  const l = SESSION_LIMITS[name];
  return new ReplyError('TZIP_LIMIT', `${detail}: above the limit ${name} = ${value} (${l.what}); raise it with \`tzip serve ${l.flag} N\``);
}

