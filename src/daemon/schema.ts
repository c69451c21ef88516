/**
 * The request messages of the daemon protocol (docs/protocol.md), as zod schemas: every decoded
 * message is checked against them before anything else looks at it. Field names are snake_case
 * on the wire. Unknown fields are errors (the protocol version says which fields exist).
 *
 * Tensors are described in DLPack's terms (DLDevice, DLDataType, shape, strides, byte_offset);
 * where DLPack has a data pointer, the wire has a memory handle: a union on `kind`: `shm` (a file
 * under /dev/shm) or `cuda_ipc` (PyTorch's CUDA IPC handle of a storage on a GPU named by UUID).
 */
import { z } from 'zod';
import { CODECS, RING_LAYOUT } from '../native.js';
import { SM_BUDGET_MAX, STREAMS as GENERATED_STREAMS } from '../generated/constants.js';

/** A non-negative integer a double holds exactly. */
const uint = z.number().int().min(0).max(Number.MAX_SAFE_INTEGER);
/** A byte string (MessagePack bin). */
const bytes = z.instanceof(Uint8Array);

/** Request ids are chosen by the client and echoed in the reply. */
export const RequestId = uint;

/** Session ids are 32 lowercase hex digits, given out by `hello`. */
export const SessionId = z.string().regex(/^[0-9a-f]{32}$/, 'a session id is 32 lowercase hex digits (from hello)');

/** Name of a file directly under /dev/shm (a leading '/' as in shm_open names is allowed). */
export const ShmName = z.string().regex(/^\/?[A-Za-z0-9._-]{1,240}$/, 'a /dev/shm file name: letters, digits, ".", "_", "-"')
  .refine((s) => s.replace(/^\//, '') !== '.' && s.replace(/^\//, '') !== '..', 'not a file name');

/** Prefix of the /dev/shm files a client creates: `tzip-<pid>-<8 to 32 hex digits>-`. */
export const ShmPrefix = z.string().regex(/^tzip-[0-9]{1,10}-[0-9a-f]{8,32}-$/, 'shm_prefix is "tzip-<pid>-<8 to 32 hex digits>-"');

/** A region of a POSIX shared-memory file: /dev/shm/<name>, bytes [offset, offset + size). */
export const ShmHandle = z.strictObject({
  kind: z.literal('shm'),
  name: ShmName,
  offset: uint,
  size: uint,
});
export type ShmHandle = z.infer<typeof ShmHandle>;

/** Bytes of a cudaIpcMemHandle_t / cudaIpcEventHandle_t. */
export const CUDA_IPC_HANDLE_BYTES = 64;
/** Kind byte of PyTorch's shareable handle for a cudaMalloc'd allocation. */
export const SHAREABLE_CUDA_MALLOC = 0x63; // 'c'
/** Kind byte of PyTorch's shareable handle for an expandable segment (refused: docs/protocol.md). */
export const SHAREABLE_CUDA_EXPANDABLE_SEGMENT = 0x65; // 'e'
/** Versions of PyTorch's shareable-handle header this daemon reads (torch 2.11 writes 2). */
export const SHAREABLE_HANDLE_VERSIONS: readonly number[] = [1, 2];

/**
 * PyTorch's shareable handle of a CUDA allocation, as `UntypedStorage._share_cuda_()` gives it:
 * `[version][kind]` + payload. Kind 'c' carries the 64-byte cudaIpcMemHandle_t of the allocation
 * base (66 bytes in all); kind 'e' (expandable segments) passes the schema and is refused with an
 * explanation when the handle is resolved.
 */
export const ShareableHandle = bytes.superRefine((b, ctx) => {
  if (b.byteLength < 2 || b.byteLength > 4096) {
    ctx.addIssue({ code: 'custom', message: 'a CUDA IPC handle is [version][kind] + payload (66 bytes for kind "c")' });
    return;
  }
  const kind = b[1] as number;
  if (kind === SHAREABLE_CUDA_MALLOC) {
    if (b.byteLength !== 2 + CUDA_IPC_HANDLE_BYTES) {
      ctx.addIssue({ code: 'custom', message: `a kind "c" CUDA IPC handle is 66 bytes ([version]["c"] + 64-byte cudaIpcMemHandle_t), not ${b.byteLength}` });
    } else if (!SHAREABLE_HANDLE_VERSIONS.includes(b[0] as number)) {
      ctx.addIssue({ code: 'custom', message: `CUDA IPC handle version ${b[0]} is not one this daemon reads (${SHAREABLE_HANDLE_VERSIONS.join(', ')})` });
    }
  } else if (kind !== SHAREABLE_CUDA_EXPANDABLE_SEGMENT) {
    ctx.addIssue({ code: 'custom', message: `unknown CUDA IPC handle kind byte 0x${kind.toString(16)} (PyTorch writes "c" or "e")` });
  }
});

/** A cudaIpcEventHandle_t (64 bytes). */
export const EventHandle = bytes.refine((b) => b.byteLength === CUDA_IPC_HANDLE_BYTES, 'a CUDA IPC event handle is 64 bytes (cudaIpcEventHandle_t)');

/** PyTorch's IPC ref-counter file of a share (`/torch_<pid>_...`), as `_share_cuda_()` gives it. */
export const RefCounterName = bytes.refine(isShmFileName, 'ref_counter_handle is a /dev/shm name ("/torch_<pid>_...")');

/** 1 to 255 bytes of [A-Za-z0-9._-], after an optional leading '/' (a loop over the bytes: one per tensor per request). */
function isShmFileName(b: Uint8Array): boolean {
  if (b.byteLength < 1 || b.byteLength > 255) return false;
  const start = b[0] === 0x2f ? 1 : 0;
  if (start === b.byteLength) return false;
  for (let i = start; i < b.byteLength; i++) {
    const c = b[i] as number;
    const ok = (c >= 0x30 && c <= 0x39) || (c >= 0x41 && c <= 0x5a) || (c >= 0x61 && c <= 0x7a) || c === 0x2e || c === 0x5f || c === 0x2d;
    if (!ok) return false;
  }
  return true;
}

/**
 * A CUDA allocation shared by PyTorch (`UntypedStorage._share_cuda_()`): the shareable handle of
 * the allocation holding the storage, where the storage starts in it and its size, and PyTorch's
 * ref-counter file and slot of the share (named after the sharing process, which must be the
 * session's). The GPU is named by UUID: device ordinals differ between processes.
 */
export const CudaIpcHandle = z.strictObject({
  kind: z.literal('cuda_ipc'),
  /** UUID of the GPU ("GPU-xxxxxxxx-..." as nvidia-smi -L prints it; the prefix is optional). */
  device_uuid: z.string().min(1).max(80),
  /** The client's CUDA device index (informational: indices differ between processes). */
  device_index: uint.optional(),
  /** PyTorch's shareable handle: [version]["c"] + cudaIpcMemHandle_t (66 bytes). */
  handle: ShareableHandle,
  /** Offset of the storage in the allocation, bytes. */
  offset: uint,
  /** Size of the storage, bytes. */
  size: uint,
  /** PyTorch's ref-counter file of the share ("/torch_<pid>_..."); its pid must be the session's. */
  ref_counter_handle: RefCounterName.nullable().optional(),
  /** Slot of the share in the ref-counter file (the client releases it, not the daemon). */
  ref_counter_offset: uint.optional(),
});
export type CudaIpcHandle = z.infer<typeof CudaIpcHandle>;

/** Where bytes live: the union every tensor and region uses. */
export const MemoryHandle = z.discriminatedUnion('kind', [ShmHandle, CudaIpcHandle]);
export type MemoryHandle = z.infer<typeof MemoryHandle>;

/** DLDevice: device type (kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, ...) and index. */
export const Device = z.strictObject({ type: z.number().int().min(0).max(255), id: z.number().int().min(0).max(65535) });

/** DLDataType: type code (kDLInt = 0, kDLUInt, kDLFloat, kDLOpaqueHandle, kDLBfloat, kDLComplex, kDLBool, float8 codes 7..17), bits, lanes. */
export const DataType = z.strictObject({
  code: z.number().int().min(0).max(255),
  bits: z.number().int().min(1).max(255),
  lanes: z.number().int().min(1).max(65535),
});
export type DataType = z.infer<typeof DataType>;

/** Entries of a request's `handles` table at most (protocol version 2). */
export const MAX_REQUEST_HANDLES = 4096;

/**
 * Protocol version 2: bytes [offset, offset + size) of the region of entry `index` of the
 * request's `handles` table. A batch whose tensors lie in a few allocations (a client's staging
 * buffer) sends each allocation's handle once; the daemon expands references right after
 * validation (handle-refs.ts), so everything after sees plain handles.
 */
export const HandleRef = z.strictObject({
  kind: z.literal('ref'),
  index: z.number().int().min(0).max(MAX_REQUEST_HANDLES - 1),
  offset: uint,
  size: uint,
});
export type HandleRef = z.infer<typeof HandleRef>;

/** A memory handle as a request may send it: in full, or a reference into the request's `handles`. */
const WireHandle = z.discriminatedUnion('kind', [ShmHandle, CudaIpcHandle, HandleRef]);

/** The fields of a tensor: DLTensor with a memory handle (`data`) in place of the data pointer. */
function tensorSchema<H extends z.ZodType>(data: H) {
  return z.strictObject({
    device: Device,
    dtype: DataType,
    shape: z.array(uint).max(64),
    /** In elements, as in DLPack; null/absent for compact C order (the only layout served). */
    strides: z.array(z.number().int()).max(64).nullable().optional(),
    /** Offset of the first element from the start of the handle's region, bytes. */
    byte_offset: uint,
    data,
  });
}

/** A tensor: DLTensor with a memory handle in place of the data pointer. */
export const Tensor = tensorSchema(MemoryHandle);
export type Tensor = z.infer<typeof Tensor>;
/** A tensor as a request may send it (`data` may be a {@link HandleRef}). */
const WireTensor = tensorSchema(WireHandle);

const CodecName = z.enum(CODECS as unknown as [string, ...string[]]);
const Threads = z.number().int().min(1).max(1024);

/**
 * Protocol version 3: what a request's bytes are for, as the job's registry counts them (jobs.ts); a request
 * without one counts as `other`.
 */
export const STREAMS = GENERATED_STREAMS; // src/errors.json "streams" (src/generated/constants.ts)
export type StreamName = (typeof STREAMS)[number];
const Stream = z.enum(STREAMS);

/** SMs the GPU kernels of a request may occupy at a time; 0: all SMs of the device (the addon's `smBudget`). */
export const MAX_SM_BUDGET = SM_BUDGET_MAX; // src/errors.json "sm_budget" (src/generated/constants.ts)
const SmBudget = z.number().int().min(0).max(MAX_SM_BUDGET);

/**
 * A name shown to people (a job's name, its user, a device): 1 to `max` characters, none of them a control character
 * (Unicode Cc: C0, DEL, C1). Job names are printed by `tzip jobs` and `tzip top` on a terminal, written in log lines and
 * in Prometheus label values: an escape sequence, a newline or a NUL there would be obeyed or break a line.
 */
export function printableName(max: number) {
  return z.string().min(1).max(max).regex(/^\P{Cc}*$/u, 'no control characters (newlines, tabs, escapes, NUL)');
}

/**
 * Protocol version 3: the job a session belongs to (a training run: one name shared by all of its ranks), as
 * `hello` or the `job` op carry it.
 */
export const JobInfo = z.strictObject({
  /** The job's name: sessions that give the same name are one job (`tzip jobs`, `tzip set JOB`). */
  name: printableName(200),
  /** Who runs it (free text; default: the daemon's user, the only one who can connect). */
  user: z.union([z.literal(''), printableName(200)]).optional(),
  /** This process's rank in the job (torch.distributed). */
  rank: z.number().int().min(0).max(2 ** 31 - 1).optional(),
  world_size: z.number().int().min(1).max(2 ** 31 - 1).optional(),
  /** The devices the process computes on: GPU UUIDs ("GPU-...", as `nvidia-smi -L` prints them) or "cpu". */
  devices: z.array(printableName(80)).max(64).optional(),
  /** The process is an MPS client (CUDA_MPS_PIPE_DIRECTORY set / MPS active); null: it cannot tell. */
  mps: z.boolean().nullable().optional(),
});
export type JobInfo = z.infer<typeof JobInfo>;

/** Codec settings of the `set` op: a codec for every tensor, or `off` (the daemon writes `raw` frames). */
export const SETTING_CODECS = ['fast', 'max', 'auto', 'off'] as const;
export type SettingCodec = (typeof SETTING_CODECS)[number];

export const HelloRequest = z.strictObject({
  id: RequestId,
  op: z.literal('hello'),
  /** Protocol versions the client speaks. */
  versions: z.array(z.number().int().min(1).max(65535)).min(1).max(32),
  /** The client's process id (as the daemon sees it when they share a pid namespace). */
  pid: z.number().int().min(1).max(2 ** 31 - 1),
  shm_prefix: ShmPrefix,
  /** Free text shown in stats. */
  name: z.string().max(200).optional(),
  /** Protocol version 3: the session's job (attached from the start); null or absent: none. */
  job: JobInfo.nullable().optional(),
});

export const HeartbeatRequest = z.strictObject({ id: RequestId, op: z.literal('heartbeat'), sid: SessionId });

function compressSchema<H extends z.ZodType, T extends z.ZodType>(handle: H, tensor: T) {
  return z.strictObject({
    id: RequestId,
    op: z.literal('compress'),
    sid: SessionId,
    /** Default codec of the batch (auto for CPU tensors, fast for GPU tensors: op-gpu.ts GPU_DEFAULT_CODEC). */
    codec: CodecName.optional(),
    /** Protocol version 3: what the tensors are, for the job's counters. */
    stream: Stream.optional(),
    /** Protocol version 3: SMs of the GPU kernels (0: all; default the daemon's setting, else the addon's 10). */
    sm_budget: SmBudget.optional(),
    threads: Threads.optional(),
    /** Bytes of input per chunk (default the codec's, 65536). */
    chunk_size: z.number().int().min(4096).max(65536).optional(),
    /** GPU requests: the client's interprocess event, recorded after its inputs were written; the daemon's stream waits on it. */
    wait_event: EventHandle.nullable().optional(),
    /** Protocol version 2: handles the request's {@link HandleRef}s name by index. */
    handles: z.array(MemoryHandle).max(MAX_REQUEST_HANDLES).optional(),
    tensors: z.array(z.strictObject({
      tensor,
      /** Where the frame goes; its size is the capacity (at least maxCompressedSize). */
      out: handle,
      codec: CodecName.optional(),
    })),
  });
}

function decompressSchema<H extends z.ZodType, T extends z.ZodType>(handle: H, tensor: T) {
  return z.strictObject({
    id: RequestId,
    op: z.literal('decompress'),
    sid: SessionId,
    /** Check every chunk's digest (default true). */
    verify: z.boolean().optional(),
    /** Protocol version 3: as in compress. */
    stream: Stream.optional(),
    /** Protocol version 3: as in compress. */
    sm_budget: SmBudget.optional(),
    threads: Threads.optional(),
    /** GPU requests: as in compress. */
    wait_event: EventHandle.nullable().optional(),
    /** Protocol version 2: as in compress. */
    handles: z.array(MemoryHandle).max(MAX_REQUEST_HANDLES).optional(),
    frames: z.array(z.strictObject({
      /** The frame: exactly its bytes. */
      frame: handle,
      /** Where the tensor goes: its dtype and shape must be those of the frame. */
      out: tensor,
    })),
  });
}

/** A compress request as the daemon handles it: every handle in full (references expanded). */
export const CompressRequest = compressSchema(MemoryHandle, Tensor);
/** A compress request as a client may send it (handles may be {@link HandleRef}s). */
export const WireCompressRequest = compressSchema(WireHandle, WireTensor);
export type WireCompressRequest = z.infer<typeof WireCompressRequest>;

/** A decompress request as the daemon handles it: every handle in full (references expanded). */
export const DecompressRequest = decompressSchema(MemoryHandle, Tensor);
/** A decompress request as a client may send it (handles may be {@link HandleRef}s). */
export const WireDecompressRequest = decompressSchema(WireHandle, WireTensor);
export type WireDecompressRequest = z.infer<typeof WireDecompressRequest>;

export const ReleaseRequest = z.strictObject({
  id: RequestId,
  op: z.literal('release'),
  sid: SessionId,
  /** Files whose mappings to drop; with neither `names` nor `handles`: everything of the session's. */
  names: z.array(ShmName).max(65536).optional(),
  /** CUDA IPC handles (as sent in requests) whose mappings to close. */
  handles: z.array(ShareableHandle).max(65536).optional(),
  /** Also end the session (a clean goodbye). */
  end: z.boolean().optional(),
  /** Unmap the dropped files now (a garbage collection shortly after the reply), for a client out of /dev/shm. */
  reclaim: z.boolean().optional(),
});

export const StatsRequest = z.strictObject({ id: RequestId, op: z.literal('stats'), sid: SessionId.optional() });

export const ShutdownRequest = z.strictObject({ id: RequestId, op: z.literal('shutdown'), sid: SessionId });

/**
 * Protocol version 3: sets (or, with `job: null`, clears) the session's job at any time; `attached` says whether
 * the job's integrations are switched on (`tzip.attach()`) or off (`tzip.detach()`).
 */
export const JobRequest = z.strictObject({
  id: RequestId,
  op: z.literal('job'),
  sid: SessionId,
  job: JobInfo.nullable(),
  attached: z.boolean(),
});

/** Protocol version 3: the job registry (no session needed). */
export const JobsRequest = z.strictObject({ id: RequestId, op: z.literal('jobs'), sid: SessionId.optional() });

/**
 * Protocol version 3: a job's settings (`job`) or the daemon's (no `job`), applied from the next request; a
 * field absent is left as it is, null clears it. No session needed.
 */
export const SetRequest = z.strictObject({
  id: RequestId,
  op: z.literal('set'),
  sid: SessionId.optional(),
  job: printableName(200).optional(),
  codec: z.enum(SETTING_CODECS).nullable().optional(),
  sm_budget: SmBudget.nullable().optional(),
});

/** Protocol version 4 (docs/ring.md): the submission ring's control plane. `entries` of a ring: a power of two in [8, 4096]. */
const RingEntries = z.number().int().min(RING_LAYOUT.entriesMin).max(RING_LAYOUT.entriesMax)
  .refine((n) => (n & (n - 1)) === 0, 'entries is a power of two');
/** A ring's id, as ring_open gave it. */
const RingId = z.number().int().min(0).max(2 ** 31 - 1);
/** A GPU as rings name it: DLPack's kDLCUDA and the daemon's device ordinal (hello's `daemon.gpus[].index`). */
export const RingDevice = z.strictObject({ type: z.literal(2), id: z.number().int().min(0).max(65535) });

/** Protocol version 4: opens a ring on the session's ring file /dev/shm/`name` (docs/ring.md, "The ring file"). */
export const RingOpenRequest = z.strictObject({
  id: RequestId,
  op: z.literal('ring_open'),
  sid: SessionId,
  /** The ring file: a name of the session's (its shm_prefix), `ring_bytes(entries)` long. */
  name: ShmName,
  entries: RingEntries,
  /** The GPU whose batches the ring serves (on a stream of its own); absent: CPU batches only. */
  device: RingDevice.optional(),
  /** SMs of the GPU kernels of SQEs that give 0 (0: all SMs). */
  sm_budget: SmBudget.optional(),
});

/** A region as ring_register names it: a shared-memory file of the session (whole), or bytes of a CUDA allocation. */
export const RingRegion = z.discriminatedUnion('kind', [
  z.strictObject({ kind: z.literal('shm'), name: ShmName }),
  z.strictObject({
    kind: z.literal('cuda'),
    device: RingDevice,
    /** PyTorch's shareable handle of the allocation, as in GPU requests. */
    handle: ShareableHandle,
    /** Where the region starts in the allocation, bytes. */
    offset: uint,
    bytes: z.number().int().min(1).max(Number.MAX_SAFE_INTEGER),
  }),
]);
export type RingRegion = z.infer<typeof RingRegion>;

/** Regions of one ring_register / ring_release at most. */
export const MAX_RING_REGIONS_PER_REQUEST = 4096;

export const RingRegisterRequest = z.strictObject({
  id: RequestId,
  op: z.literal('ring_register'),
  sid: SessionId,
  ring: RingId,
  regions: z.array(RingRegion).min(1).max(MAX_RING_REGIONS_PER_REQUEST),
});

export const RingReleaseRequest = z.strictObject({
  id: RequestId,
  op: z.literal('ring_release'),
  sid: SessionId,
  ring: RingId,
  regions: z.array(z.number().int().min(0).max(2 ** 32 - 1)).min(1).max(MAX_RING_REGIONS_PER_REQUEST),
});

export const RingCloseRequest = z.strictObject({ id: RequestId, op: z.literal('ring_close'), sid: SessionId, ring: RingId });

/** The request schemas by op. */
export const REQUESTS = {
  hello: HelloRequest,
  heartbeat: HeartbeatRequest,
  compress: WireCompressRequest,
  decompress: WireDecompressRequest,
  release: ReleaseRequest,
  stats: StatsRequest,
  shutdown: ShutdownRequest,
  job: JobRequest,
  jobs: JobsRequest,
  set: SetRequest,
  ring_open: RingOpenRequest,
  ring_register: RingRegisterRequest,
  ring_release: RingReleaseRequest,
  ring_close: RingCloseRequest,
} as const;

export type Op = keyof typeof REQUESTS;
export const OPS = Object.keys(REQUESTS) as Op[];

export type HelloRequest = z.infer<typeof HelloRequest>;
export type HeartbeatRequest = z.infer<typeof HeartbeatRequest>;
export type CompressRequest = z.infer<typeof CompressRequest>;
export type DecompressRequest = z.infer<typeof DecompressRequest>;
export type ReleaseRequest = z.infer<typeof ReleaseRequest>;
export type StatsRequest = z.infer<typeof StatsRequest>;
export type ShutdownRequest = z.infer<typeof ShutdownRequest>;
export type JobRequest = z.infer<typeof JobRequest>;
export type JobsRequest = z.infer<typeof JobsRequest>;
export type SetRequest = z.infer<typeof SetRequest>;
export type RingOpenRequest = z.infer<typeof RingOpenRequest>;
export type RingRegisterRequest = z.infer<typeof RingRegisterRequest>;
export type RingReleaseRequest = z.infer<typeof RingReleaseRequest>;
export type RingCloseRequest = z.infer<typeof RingCloseRequest>;
export type Request =
  | HelloRequest | HeartbeatRequest | CompressRequest | DecompressRequest | ReleaseRequest | StatsRequest | ShutdownRequest
  | JobRequest | JobsRequest | SetRequest | RingOpenRequest | RingRegisterRequest | RingReleaseRequest | RingCloseRequest;

/** The envelope read first, to echo the id and pick the schema even when the rest is bad. */
export const Envelope = z.looseObject({ id: z.unknown().optional(), op: z.unknown().optional() });
