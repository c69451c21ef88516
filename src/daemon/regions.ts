/**
 * From the memory handles and tensor descriptions of a CPU request to the bytes the codec reads
 * and writes, with every check a handle needs: whose memory it is, whether it exists and is large
 * enough, and whether an output overlaps anything else of the same request. (GPU requests:
 * gpu-regions.ts, which shares the layout and overlap checks.)
 */
import { DL_DEVICE, frameLayout, isCompactCOrder, type FrameLayout } from './dtype-map.js';
import { ReplyError } from './reply-error.js';
import type { MemoryHandle, Tensor } from './schema.js';
import type { ShmMappings } from './shm-map.js';

/**
 * What the checks of a CPU request's memory need of its session (session.ts's Session is one): whose files it may
 * name, and the mappings of its requests.
 */
export interface ShmOwner {
  /** The client's pid (PyTorch's files of its process are `torch_<pid>_...`). */
  readonly pid: number;
  /** The start of the names of the session's own files. */
  readonly shmPrefix: string;
  /** Whether /dev/shm/`name` is the session's to hand over. */
  owns(name: string): boolean;
  /** The shared-memory files mapped for the session's requests. */
  readonly mappings: Pick<ShmMappings, 'map' | 'idOf' | 'takeFault'>;
}

/** The message of a CPU request (shm handles) that names GPU memory too. */
export const MIXED_REQUEST =
  'a request is either all CPU memory (handle kind "shm", device type 1 or 3) or all on one GPU (handle kind "cuda_ipc", device type 2); split it';

/** Where a region lies, for overlap checks: `start` and `length` within the memory named `name`. */
export interface Extent {
  /** The memory: a file's identity (`dev:ino`, shm-map.ts: two names of one file are one file) or the GPU allocation (a key of its handle). */
  name: string;
  start: number;
  length: number;
  writable: boolean;
  what: string;
  index: number;
  /** How to name the memory in a message (default "/dev/shm/<name>"). */
  place?: string;
}

/** Bytes of a region and where they lie, for overlap checks. */
export interface ResolvedRegion {
  bytes: Buffer;
  /** The file (no leading '/'). */
  name: string;
  /** The file's identity (`dev:ino`; the name when unknown): what overlap checks compare, so that hard links to one file do not pass for two files. */
  id?: string | undefined;
  /** Offset of `bytes` in the file. */
  start: number;
  writable: boolean;
  /** What the region is, for messages: "tensor 3", "output of tensor 3". */
  what: string;
  index: number;
}

/**
 * The bytes of a handle's region. `epoch` (a number unique to the request) lets a request stat
 * each of its files once.
 * @throws ReplyError TZIP_INVALID_ARGUMENT for GPU handles (this is the CPU path); TZIP_HANDLE for
 *   files that are not the session's, missing, not writable when `writable`, or smaller than the region.
 */
export function resolveHandle(session: ShmOwner, handle: MemoryHandle, writable: boolean, what: string, index: number, epoch = -1): ResolvedRegion {
  if (handle.kind === 'cuda_ipc') throw new ReplyError('TZIP_INVALID_ARGUMENT', `${what}: ${MIXED_REQUEST}`, { index });
  const name = handle.name.replace(/^\//, '');
  if (!session.owns(name)) {
    throw new ReplyError('TZIP_HANDLE', `${what}: /dev/shm/${name} is not this session's memory (its files start with "${session.shmPrefix}" or "torch_${session.pid}_")`, { index });
  }
  let file: Buffer;
  try {
    file = session.mappings.map(name, writable, epoch);
  } catch (err) {
    if (err instanceof ReplyError) throw new ReplyError(err.code, `${what}: ${err.message}`, { ...err.extra, index });
    throw err;
  }
  // Both are at most 2^53 - 1 (the schema), so their sum is exact enough to compare: beyond 2^53 it is beyond any file.
  if (handle.offset + handle.size > file.length) {
    throw new ReplyError('TZIP_HANDLE', `${what}: region [${handle.offset}, ${handle.offset + handle.size}) is beyond the end of /dev/shm/${name} (${file.length} bytes)`, { index });
  }
  const id = session.mappings.idOf(name);
  return { bytes: file.subarray(handle.offset, handle.offset + handle.size), name, id, start: handle.offset, writable, what, index };
}

/** A tensor resolved: its frame layout and its bytes (exactly `layout.nbytes`). */
export interface ResolvedTensor {
  layout: FrameLayout;
  region: ResolvedRegion;
}

/**
 * The bytes of a tensor description.
 * @throws ReplyError TZIP_INVALID_ARGUMENT for GPU devices/handles (this is the CPU path) and
 *   strided layouts; TZIP_UNSUPPORTED for other devices and element types that are not whole
 *   bytes; TZIP_HANDLE as {@link resolveHandle} and when the tensor does not fit its region.
 */
export function resolveTensor(session: ShmOwner, tensor: Tensor, writable: boolean, what: string, index: number, epoch = -1): ResolvedTensor {
  if (tensor.data.kind === 'cuda_ipc' || tensor.device.type === DL_DEVICE.CUDA || tensor.device.type === DL_DEVICE.CUDAManaged) {
    throw new ReplyError('TZIP_INVALID_ARGUMENT', `${what}: ${MIXED_REQUEST}`, { index });
  }
  if (tensor.device.type !== DL_DEVICE.CPU && tensor.device.type !== DL_DEVICE.CUDAHost) {
    throw new ReplyError('TZIP_UNSUPPORTED', `${what}: DLPack device type ${tensor.device.type} is not served (CPU = 1, CUDA host = 3, CUDA = 2)`, { index });
  }
  const layout = tensorLayout(tensor, what, index);
  const region = resolveHandle(session, tensor.data, writable, what, index, epoch);
  if (tensor.byte_offset + layout.nbytes > region.bytes.length) {
    throw new ReplyError('TZIP_HANDLE', `${what}: ${layout.nbytes} bytes at byte_offset ${tensor.byte_offset} do not fit the ${region.bytes.length}-byte region`, { index });
  }
  const bytes = region.bytes.subarray(tensor.byte_offset, tensor.byte_offset + layout.nbytes);
  return { layout, region: { ...region, bytes, start: region.start + tensor.byte_offset } };
}

/**
 * The frame layout of a tensor description, after the layout checks every device shares.
 * @throws ReplyError TZIP_INVALID_ARGUMENT for strided layouts; TZIP_UNSUPPORTED for element
 *   types that are not whole bytes; TZIP_TOO_LARGE beyond 2^53 bytes.
 */
export function tensorLayout(tensor: Tensor, what: string, index: number): FrameLayout {
  if (!isCompactCOrder(tensor.shape, tensor.strides)) {
    throw new ReplyError('TZIP_INVALID_ARGUMENT', `${what}: strides [${(tensor.strides ?? []).join(', ')}] are not the compact C order of shape [${tensor.shape.join(', ')}]; send the contiguous values`, { index });
  }
  try {
    return frameLayout(tensor.dtype, tensor.shape);
  } catch (err) {
    if (err instanceof ReplyError) throw new ReplyError(err.code, `${what}: ${err.message}`, { ...err.extra, index });
    throw err;
  }
}

function extentOf(r: ResolvedRegion | Extent): Extent {
  return 'bytes' in r ? { name: r.id ?? r.name, start: r.start, length: r.bytes.length, writable: r.writable, what: r.what, index: r.index, place: `/dev/shm/${r.name}` } : r;
}

/**
 * After the codec ran on `regions`: refuses the request when one of their files shrank while the
 * daemon read or wrote it (the addon's SIGBUS guard saw a fault; the bytes involved are zeros, not
 * the client's), dropping those mappings.
 * @throws ReplyError TZIP_HANDLE naming the first such region.
 */
export function checkNotShrunk(session: ShmOwner, regions: readonly ResolvedRegion[]): void {
  let first: ResolvedRegion | undefined;
  const seen = new Set<string>();
  for (const r of regions) {
    if (seen.has(r.name)) continue;
    seen.add(r.name);
    if (session.mappings.takeFault(r.name) && first === undefined) first = r;
  }
  if (first !== undefined) {
    throw new ReplyError('TZIP_HANDLE', `${first.what}: /dev/shm/${first.name} shrank while the daemon used it; nothing of this request can be trusted`, { index: first.index });
  }
}

/**
 * Refuses a request where a region written overlaps another region of the same request (the
 * codec would read or write bytes that change under it).
 * @throws ReplyError TZIP_HANDLE naming both regions.
 */
export function checkOverlaps(regions: readonly (ResolvedRegion | Extent)[]): void {
  if (!regions.some((r) => r.writable)) return;
  const byFile = new Map<string, Extent[]>();
  for (const region of regions) {
    const r = extentOf(region);
    if (r.length === 0) continue;
    let list = byFile.get(r.name);
    if (list === undefined) byFile.set(r.name, (list = []));
    list.push(r);
  }
  for (const list of byFile.values()) {
    if (list.length < 2 || !list.some((r) => r.writable)) continue;
    list.sort((a, b) => a.start - b.start);
    // Sweep: keep the region reaching furthest so far; any later region starting before its end overlaps it.
    let reach = list[0] as Extent;
    for (let i = 1; i < list.length; i++) {
      const r = list[i] as Extent;
      if (r.start < reach.start + reach.length && (r.writable || reach.writable)) {
        throw new ReplyError('TZIP_HANDLE', `${r.what} overlaps ${reach.what} in ${r.place ?? `/dev/shm/${r.name}`}`, { index: r.index });
      }
      if (r.start + r.length > reach.start + reach.length) reach = r;
    }
  }
}
