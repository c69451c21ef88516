/**
 * From the CUDA IPC handles and tensor descriptions of a GPU request to device pointers, with
 * every check a handle needs before the daemon opens it: PyTorch's handle kind (expandable
 * segments are refused with a way out), whose memory it is (PyTorch's ref-counter file is named
 * after the sharing process, which must be the session's), which GPU (by UUID; one GPU per
 * request), and whether the tensor fits the storage the handle describes. Layout and overlap
 * rules are the CPU path's (regions.ts).
 *
 * The daemon cannot see how large a client's allocation really is (CUDA IPC does not say): a
 * handle whose offset and size lie is trusted as far as the client's own process goes
 * (docs/protocol.md, "Trust").
 */
import type { FrameLayout } from './dtype-map.js';
import { DL_DEVICE } from './dtype-map.js';
import { ordinalOf } from './gpu.js';
import type { GpuSession } from './gpu-map.js';
import { MIXED_REQUEST, tensorLayout, type Extent } from './regions.js';
import { ReplyError } from './reply-error.js';
import { SHAREABLE_CUDA_EXPANDABLE_SEGMENT, type CudaIpcHandle, type MemoryHandle, type Tensor } from './schema.js';

/** The refusal of a PyTorch expandable-segment handle, with the ways to share such tensors. */
export const EXPANDABLE_SEGMENTS_REFUSED =
  'the tensor lies in a PyTorch expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), whose CUDA ' +
  'IPC handle (kind "e") this daemon does not open. Share memory from the regular caching allocator instead: start ' +
  'the training process without expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF, or allocate the tensors to ' +
  "compress while torch.cuda.memory._set_allocator_settings('expandable_segments:False') is in effect, or compress " +
  'a CPU copy (tensor.cpu())';

/** Whether a tensor description names GPU memory. */
export function tensorOnGpu(t: Tensor): boolean {
  return t.data.kind === 'cuda_ipc' || t.device.type === DL_DEVICE.CUDA || t.device.type === DL_DEVICE.CUDAManaged;
}

/**
 * Refuses what cannot be part of a GPU request (checked for the whole batch before any GPU is
 * looked up, so that a malformed request gets the same answer on every daemon).
 * @throws ReplyError TZIP_INVALID_ARGUMENT for CPU memory in a GPU request; TZIP_UNSUPPORTED for managed memory.
 */
export function expectGpu(item: Tensor | MemoryHandle, what: string, index: number): void {
  if ('kind' in item) {
    if (item.kind !== 'cuda_ipc') throw new ReplyError('TZIP_INVALID_ARGUMENT', `${what}: ${MIXED_REQUEST}`, { index });
    return;
  }
  if (item.device.type === DL_DEVICE.CUDAManaged) {
    throw new ReplyError('TZIP_UNSUPPORTED', `${what}: CUDA managed memory (DLPack device type 13) cannot be shared through CUDA IPC; copy it to device memory`, { index });
  }
  if (item.device.type !== DL_DEVICE.CUDA || item.data.kind !== 'cuda_ipc') {
    throw new ReplyError('TZIP_INVALID_ARGUMENT', `${what}: ${MIXED_REQUEST}`, { index });
  }
}

/** A region of a client's GPU allocation. */
export interface GpuRegion {
  /** The allocation's key (gpu-map.ts). */
  key: string;
  /** Device pointer of the region's first byte. */
  ptr: bigint;
  /** Bytes of the region. */
  size: number;
  extent: Extent;
}

/** A tensor in a client's GPU allocation. */
export interface GpuTensor {
  layout: FrameLayout;
  /** Device pointer of the tensor's first byte. */
  ptr: bigint;
  extent: Extent;
}

/** An opened allocation of a request: its key and base pointer, and how messages name it. */
interface Resolved {
  key: string;
  base: bigint;
  place: string;
}

/** Whether two byte strings (or two nulls) are equal. */
function sameBytes(a: Uint8Array | null, b: Uint8Array | null): boolean {
  if (a === null || b === null) return a === b;
  return Buffer.from(a.buffer, a.byteOffset, a.byteLength).equals(b);
}

/** What a GPU request's checks need of its session (session.ts's Session is one). */
export interface GpuOwner {
  /** The client's pid: CUDA memory it names must be shared by its own process. */
  readonly pid: number;
  /** Whether a PyTorch CUDA IPC ref-counter file name ("/torch_<pid>_...") is the session's process's. */
  ownsRefCounter(name: string): boolean;
  /** The session's CUDA IPC allocations and events (made on first use). */
  gpu(): GpuSession;
}

/** The handles of one GPU request, resolved against one session's GPU state. */
export class GpuRequest {
  /** The daemon's ordinal of the request's GPU (set by the first handle). */
  device: number | undefined;
  /** Keys of every allocation the request names. */
  readonly keys = new Set<string>();
  readonly state: GpuSession;
  /** The last handle resolved (see {@link resolve}). */
  private previous: { uuid: string; handle: Uint8Array; refCounter: Uint8Array | null; resolved: Resolved } | undefined;

  constructor(private readonly session: GpuOwner) {
    this.state = session.gpu();
    this.state.track(this.keys);
  }

  /** The request is over (run or refused): its allocations may be let go to make room again. */
  finish(): void {
    this.state.untrack(this.keys);
  }

  /**
   * The region of a `cuda_ipc` handle, its allocation opened (cached per session).
   * @throws ReplyError TZIP_INVALID_ARGUMENT for shm handles and a second GPU; TZIP_UNSUPPORTED for
   *   expandable-segment handles; TZIP_NO_DEVICE for a GPU the daemon does not see; TZIP_HANDLE for
   *   another process's memory and handles CUDA cannot open.
   */
  handle(h: MemoryHandle, writable: boolean, what: string, index: number): GpuRegion {
    if (h.kind !== 'cuda_ipc') throw new ReplyError('TZIP_INVALID_ARGUMENT', `${what}: ${MIXED_REQUEST}`, { index });
    const c: CudaIpcHandle = h;
    if (!Number.isSafeInteger(c.offset + c.size)) {
      throw new ReplyError('TZIP_TOO_LARGE', `${what}: offset ${c.offset} + size ${c.size} is beyond 2^53`, { index });
    }
    const opened = this.resolve(c, what, index);
    return {
      key: opened.key,
      ptr: opened.base + BigInt(c.offset),
      size: c.size,
      extent: { name: opened.key, start: c.offset, length: c.size, writable, what, index, place: opened.place },
    };
  }

  /**
   * The allocation of a `cuda_ipc` handle after its checks (kind, whose memory, which GPU), opened.
   * A batch names the same few allocations again and again (every staged tensor is in the client's
   * one staging buffer): a handle equal to the previous one, byte for byte, with the same ref
   * counter and GPU, has passed the same checks and gets the same answer without them.
   */
  private resolve(c: CudaIpcHandle, what: string, index: number): Resolved {
    const prev = this.previous;
    if (prev !== undefined && prev.uuid === c.device_uuid && sameBytes(prev.handle, c.handle) &&
        sameBytes(prev.refCounter, c.ref_counter_handle ?? null)) {
      return prev.resolved;
    }
    if (c.handle[1] === SHAREABLE_CUDA_EXPANDABLE_SEGMENT) {
      throw new ReplyError('TZIP_UNSUPPORTED', `${what}: ${EXPANDABLE_SEGMENTS_REFUSED}`, { index });
    }
    if (c.ref_counter_handle !== undefined && c.ref_counter_handle !== null) {
      const name = Buffer.from(c.ref_counter_handle).toString('latin1');
      if (!this.session.ownsRefCounter(name)) {
        throw new ReplyError('TZIP_HANDLE',
          `${what}: CUDA memory shared by another process (PyTorch ref counter ${name}) is not this session's memory ` +
          `(the session's process is pid ${this.session.pid})`, { index });
      }
    }
    const device = ordinalOf(c.device_uuid, what, index);
    if (this.device === undefined) this.device = device;
    else if (device !== this.device) {
      throw new ReplyError('TZIP_INVALID_ARGUMENT', `${what}: a request names memory of one GPU only (this one names GPU ${c.device_uuid} too); split it`, { index });
    }
    let opened: { key: string; base: bigint };
    try {
      opened = this.state.allocation(c.handle, device);
    } catch (err) {
      if (err instanceof ReplyError) throw new ReplyError(err.code, `${what}: ${err.message}`, { ...err.extra, index });
      throw err;
    }
    this.keys.add(opened.key);
    const hex = opened.key.slice(opened.key.indexOf(':') + 1);
    const resolved = { ...opened, place: `the CUDA allocation ${hex.slice(0, 16)}... on GPU ${c.device_uuid}` };
    this.previous = { uuid: c.device_uuid, handle: c.handle, refCounter: c.ref_counter_handle ?? null, resolved };
    return resolved;
  }

  /**
   * A tensor in GPU memory (DLPack device type kDLCUDA and a `cuda_ipc` handle).
   * @throws ReplyError as {@link handle}, and as regions.ts's tensorLayout; TZIP_HANDLE when the
   *   tensor does not fit the storage the handle describes.
   */
  tensor(t: Tensor, writable: boolean, what: string, index: number): GpuTensor {
    expectGpu(t, what, index);
    if (t.data.kind !== 'cuda_ipc') throw new ReplyError('TZIP_INVALID_ARGUMENT', `${what}: ${MIXED_REQUEST}`, { index });
    const layout = tensorLayout(t, what, index);
    const region = this.handle(t.data, writable, what, index);
    if (t.byte_offset + layout.nbytes > region.size) {
      throw new ReplyError('TZIP_HANDLE', `${what}: ${layout.nbytes} bytes at byte_offset ${t.byte_offset} do not fit the ${region.size}-byte storage`, { index });
    }
    return {
      layout,
      ptr: region.ptr + BigInt(t.byte_offset),
      extent: { ...region.extent, start: region.extent.start + t.byte_offset, length: layout.nbytes },
    };
  }
}
