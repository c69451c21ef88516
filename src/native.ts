/**
 * Typed access to the native codec addon (build/Release/tzip.node, API in docs/addon.md).
 *
 * The addon is loaded on first use, not at import time, so that code which never touches it
 * (`tzip --help`, header parsing) works before it is built. Every function maps the addon's
 * errors into {@link TzipError} (same `.code`); callers add the file and tensor names.
 */
import { existsSync } from 'node:fs';
import { createRequire } from 'node:module';
import { join } from 'node:path';
import { TzipError, toTzipError } from './errors.js';
import { packageRoot } from './package-root.js';

/** Codec choice for {@link compress}: 'auto' lets the addon pick per dtype; 'raw' stores bytes uncompressed. */
export type Codec = 'auto' | 'fast' | 'max' | 'bytes' | 'raw';

/** Codec recorded in a frame (what 'auto' resolved to). */
export type FrameCodec = 'raw' | 'fast' | 'max' | 'bytes';

/** All values accepted for {@link Codec}, in the order the CLI lists them. */
export const CODECS: readonly Codec[] = ['auto', 'fast', 'max', 'bytes', 'raw'];

/** Options of {@link compress}. */
export interface CompressOptions {
  /** safetensors dtype name (see src/dtype.ts); unknown dtypes must be passed as 'U8' with shape [nbytes]. */
  dtype: string;
  /** Tensor shape; prod(shape) * element size must equal the input's byte length. */
  shape: readonly number[];
  /** Codec; default 'auto'. */
  codec?: Codec | undefined;
  /** Worker threads; default the addon's {@link defaultThreads} (all cores). */
  threads?: number | undefined;
  /**
   * Bytes of input per independently coded chunk: a multiple of 256 from 4096 to 65536;
   * default {@link defaultChunkSize}.
   */
  chunkSize?: number | undefined;
  /**
   * Destination of at least {@link maxCompressedSize} bytes, not overlapping the input: the frame is
   * written at its start and `out.subarray(0, frame bytes)` returned (no frame-sized allocation or
   * copy). Bytes of `out` past the frame are left as they are.
   */
  out?: Uint8Array | undefined;
  /**
   * Run on the calling thread (the event loop) instead of libuv's thread pool; the promise is settled
   * on return. For small inputs, whose work costs less than the pool's hop (15-45 µs measured:
   * docs/benchmarks.md); the daemon uses it for requests of at most 16 KiB.
   */
  inline?: boolean | undefined;
}

/**
 * Entries of at most this many bytes are coded with `inline` by the file writer and reader (src/writer.ts,
 * src/reader.ts), as the daemon does for its small requests (src/daemon/limits.ts inlineMaxBytes): a safetensors
 * file's norms and biases are a few hundred bytes each, and the thread pool's hop cost more than their coding.
 * The bytes coded do not depend on it (nor on the thread count).
 */
export const INLINE_MAX_BYTES = 16 << 10;

/** Options of {@link decompress}. */
export interface DecompressOptions {
  /** Worker threads; default the addon's {@link defaultThreads}. */
  threads?: number | undefined;
  /** Check the decoded bytes against the frame's chunk digests (docs/format.md, section 9; default true). */
  verify?: boolean | undefined;
  /** Destination, exactly the frame's nbytes long; returned filled. */
  out?: Uint8Array | undefined;
  /** As {@link CompressOptions.inline}. */
  inline?: boolean | undefined;
}

/** A frame's self-description, as decoded by {@link readHeader} and returned per frame by {@link gpuDecompress} (all sizes in bytes). */
export interface FrameHeader {
  formatVersion: number;
  dtype: string;
  codec: FrameCodec;
  shape: number[];
  /** Size of the original tensor bytes. */
  nbytes: number;
  /** Bytes of original data per chunk. */
  chunkSize: number;
  nChunks: number;
  /** Fixed header + chunk table. */
  headerBytes: number;
  /** Compressed chunk bytes after the header. */
  payloadBytes: number;
  /** headerBytes + payloadBytes: the whole frame. */
  frameBytes: number;
  /** Frame checksum: XXH32 (seed 0) of the little-endian array of the chunk digests of the original bytes (docs/format.md, section 9). */
  checksum: number;
}

/** One field ("plane") of the dtype and its order-0 entropy. */
export interface EntropyPlane {
  name: string;
  /** Width of the field in bits. */
  bits: number;
  /** Order-0 (byte-histogram) entropy of the field over all elements, in bits per element. */
  entropyBits: number;
}

/** Result of {@link entropy}: the order-0 entropy bound of the bytes split into the dtype's fields. */
export interface EntropyBound {
  /** Bound in bytes: no order-0 coder of these fields can produce fewer bytes. */
  boundBytes: number;
  planes: EntropyPlane[];
}

/** Result of {@link gpu}. */
export interface GpuInfo {
  available: boolean;
  /** Why no GPU is used, when `available` is false. */
  reason: string;
  devices: {
    name: string;
    uuid: string;
    /** Streaming multiprocessors. */
    sms: number;
    /** e.g. "9.0". */
    computeCapability: string;
    /** Device memory in bytes. */
    totalMemory: number;
  }[];
}

/** One GPU, as listed by {@link gpuDevices}. */
export interface GpuDevice {
  /** CUDA device ordinal (as CUDA_VISIBLE_DEVICES maps it): what every GPU function's `device` argument takes. */
  ordinal: number;
  /** 'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx', exactly as `nvidia-smi -L` prints it; stable across processes. */
  uuid: string;
  /** e.g. 'NVIDIA H200'. */
  name: string;
  /** Streaming multiprocessors. */
  smCount: number;
  /** Device memory in bytes. */
  totalMemory: number;
  /** PCI address as cudaDeviceGetPCIBusId writes it, e.g. '0000:18:00.0' ('' if CUDA cannot tell). */
  pciBusId: string;
  /** Compute capability, e.g. '9.0'. */
  computeCapability: string;
}

/**
 * A device pointer: a CUDA device address (CUdeviceptr / void*) as an unsigned 64-bit bigint, e.g. from
 * {@link gpuAlloc}, {@link cudaIpcOpenMemHandle} plus an offset, or torch's `tensor.data_ptr()`.
 */
export type DevicePtr = bigint;

/** A byte count: a number (up to 2^53 - 1) or a bigint (up to 2^64 - 1). */
export type ByteCount = number | bigint;

/** One tensor of a {@link gpuCompress} batch. */
export interface GpuEncodeItem {
  /** Device pointer to the tensor's bytes (any alignment; 16-byte aligned is fastest). May be 0n when nbytes is 0. */
  data: DevicePtr;
  /** Bytes at `data`: must equal prod(shape) * element size. */
  nbytes: ByteCount;
  /** safetensors dtype name ('BF16', 'F32', ...; see {@link CompressOptions.dtype}). */
  dtype: string;
  /** Codec; 'auto' when left out. Same choice and same bytes as {@link compress}. */
  codec?: Codec | undefined;
  /** Tensor shape, at most 32 dimensions. */
  shape: readonly ByteCount[];
  /** Device pointer where the frame is written (any alignment). */
  frame: DevicePtr;
  /**
   * Bytes available at `frame`: at least {@link maxCompressedSize}(nbytes, shape.length, chunkSize). The frame is
   * written inside [frame, frame + frameCapacity); its size is in the result of {@link gpuCompress}.
   */
  frameCapacity: ByteCount;
}

/** One frame of a {@link gpuDecompress} batch. */
export interface GpuDecodeItem {
  /** Device pointer to a frame (any alignment). */
  frame: DevicePtr;
  /** The frame's exact size in bytes (as for {@link decompress}: a longer range is TZIP_CORRUPT, a shorter TZIP_TRUNCATED). */
  frameBytes: ByteCount;
  /** Device pointer where the tensor's bytes are written (any alignment). May be 0n when outBytes is 0. */
  out: DevicePtr;
  /** Bytes at `out`: exactly the frame's nbytes, else this item fails with TZIP_INVALID_ARGUMENT. */
  outBytes: ByteCount;
}

/** What {@link gpuCompress} reports for one item: the frame it wrote. */
export interface GpuCompressed {
  /** Size in bytes of the frame written at the item's `frame` (at most its `frameCapacity`). */
  frameBytes: bigint;
  /**
   * The codec the frame records (its header byte 7): what the item's codec resolves to, 'auto' included ('fast' or
   * 'max' for a non-empty BF16/F16/F32 tensor, chosen on the device from the data; 'bytes' for other dtypes).
   */
  codec: FrameCodec;
}

/** Options of {@link gpuCompress} and {@link gpuDecompress}. */
export interface GpuRunOptions {
  /** Ordinal of the GPU that owns every pointer of the call (checked: TZIP_INVALID_ARGUMENT otherwise). */
  device: number;
  /**
   * SMs the call's kernels may occupy at a time (each kernel is a persistent grid of that many SMs' worth of blocks);
   * default 10; 0 or less: all SMs of the device.
   */
  smBudget?: number | undefined;
  /** gpuCompress only: bytes of input per chunk, a multiple of 256 from 4096 to 65536; default 65536. */
  chunkSize?: number | undefined;
  /** gpuDecompress only: check each chunk's digest (default true; the header digest and checksum always are). */
  verify?: boolean | undefined;
  /** A cudaEvent_t (as a bigint) the addon's stream waits for before the call's work (cudaStreamWaitEvent). */
  waitEvent?: bigint | undefined;
  /** A cudaEvent_t (as a bigint) recorded on the addon's stream after the call's work (cudaEventRecord). */
  recordEvent?: bigint | undefined;
}

/** Free and total device memory in bytes ({@link cudaMemGetInfo}). */
export interface GpuMemInfo {
  free: number;
  total: number;
}

/** An interprocess CUDA event and its handle ({@link cudaEventCreateInterprocess}). */
export interface InterprocessEvent {
  /** The cudaEvent_t, for {@link GpuRunOptions.waitEvent} / {@link GpuRunOptions.recordEvent} and {@link cudaEventDestroy}. */
  event: bigint;
  /** The 64-byte cudaIpcEventHandle_t another process opens with cudaIpcOpenEventHandle. */
  handle: Buffer;
}

/** A region of a {@link NativeRing}: what SQEs name it by (docs/ring.md, "Regions"). */
export interface RingRegion {
  /** Small integer, reused after a region is removed (never 0). */
  id: number;
  /** Incremented each time `id` is reused (starts at 1): an SQE naming an earlier generation fails TZIP_HANDLE. */
  generation: number;
  /** The region's size in bytes. */
  bytes: number;
}

/**
 * Completions of one kind (op, stream tag, CPU or GPU) that a ring thread handed to JavaScript in one batch (at most
 * every 10 ms, or every 256 CQEs). nop SQEs are not counted.
 */
export interface RingCompletionStats {
  op: 'compress' | 'decompress';
  /** The SQEs' stream tag: 0 other, 1 gradients, 2 optimizer, 3 checkpoint, 4 sendrecv. */
  stream: number;
  /** CQEs written, errors included. */
  items: number;
  /** Bytes the SQEs named as input (`src` bytes: tensors for compress, frames for decompress). */
  inBytes: number;
  /** Bytes written by the completions that succeeded (frame bytes for compress, tensor bytes for decompress). */
  outBytes: number;
  /** Wall time in seconds of the batches these completions came from. */
  seconds: number;
  /** CQEs with a non-zero status. */
  errors: number;
  /** Whether the batches ran on the ring's GPU stream. */
  gpu: boolean;
}

/** A submission ring served by a native thread of the addon ({@link ringOpen}; docs/ring.md, "Native API"). */
export interface NativeRing {
  /**
   * Adds a region of host memory: a {@link mapShared} Buffer, whole (its SIGBUS guard then covers the region: a
   * file that shrinks under it makes the SQEs using it fail TZIP_HANDLE). The ring keeps the Buffer alive until the
   * region is removed. A read-only mapping can be a `src`, never a `dst` (TZIP_INVALID_ARGUMENT in the CQE).
   * @throws TzipError TZIP_INVALID_ARGUMENT when the ring is closed or broken, or holds 65535 regions.
   */
  addHost(buffer: Buffer): RingRegion;
  /**
   * Adds [ptr, ptr + bytes) of device memory on `device` (one allocation: checked with cuMemGetAddressRange).
   * SQEs using it run on the ring's stream when `device` is the ring's device, else fail TZIP_INVALID_ARGUMENT.
   * @throws TzipError TZIP_UNSUPPORTED (no GPU), TZIP_INVALID_ARGUMENT (not device memory of `device`, ring closed).
   */
  addDevice(ptr: DevicePtr, bytes: number, device: number): RingRegion;
  /**
   * Resolves when no batch uses the regions any more; SQEs naming them fail TZIP_HANDLE from this call on. The ring
   * then drops its reference to their Buffers, and their ids may be reused (with the next generation).
   * @throws TzipError (as a rejection) TZIP_INVALID_ARGUMENT when an id is not registered or already being removed.
   */
  remove(ids: number[]): Promise<void>;
  /**
   * Stops the thread after the batch in flight (a GPU batch whose stream waits on `produced` gets the awaited value
   * written by the ring, so that it drains); resolves when the thread has stopped and every region is released.
   * The header's state becomes 1 (closed) unless the ring was broken.
   */
  close(): Promise<void>;
  /**
   * Replaces what the thread applies to the SQEs (the daemon's job settings, docs/ring.md "Who applies the job's
   * settings"): every batch whose checks start after this call returns runs with `settings`; a batch already running
   * keeps those it started with. Never waits for a batch to run (one mutex, which the thread holds only while it
   * checks a batch or marks one finished).
   * @throws TzipError TZIP_INVALID_ARGUMENT (an unknown codec, a negative smBudgetOverride, smBudget missing).
   */
  setSettings(settings: RingSettings): void;
  /** 'serving', 'closed' (close() was called or the object was dropped) or 'broken' (see docs/ring.md). */
  readonly state: 'serving' | 'closed' | 'broken';
}

/** What a ring applies to every SQE it runs ({@link NativeRing.setSettings}, {@link RingOpenOptions}). */
export interface RingSettings {
  /** SM budget of SQEs whose sm_budget is 0 (GPU batches), when {@link smBudgetOverride} is null. */
  smBudget: number;
  /**
   * The codec of every compress SQE (the frame's codec byte follows it: `raw` writes raw frames), or null: each SQE's
   * own. Never needs more room than the SQE's `dst`: the SQE's checks hold `dst` bytes to the frame bound, the size of
   * a raw frame and the most any codec writes; an SQE below it fails TZIP_INVALID_ARGUMENT whatever the codec.
   */
  codec: Codec | null;
  /**
   * The SM budget of every SQE, which wins over the SQE's own (0: all SMs; any count, as a job's budget may be more
   * than an SQE's byte holds), or null: the SQE's (0: {@link smBudget}).
   */
  smBudgetOverride: number | null;
}

/** Options of {@link ringOpen}. */
export interface RingOpenOptions {
  /** Entries of the ring (a power of two from 8 to 4096): must equal the file's `entries` word. */
  entries: number;
  /** The GPU ordinal of the ring's stream; without it the ring serves CPU batches only (and refuses WAIT/SIGNAL, which
   * order GPU work through the file's `produced`/`done` words: docs/ring.md "GPU ordering flags"). */
  device?: number | undefined;
  /** SM budget of SQEs whose sm_budget is 0 (GPU batches); default 10. */
  smBudget: number;
  /** The codec of every compress SQE ({@link RingSettings.codec}); absent or null: each SQE's own. */
  codec?: Codec | null | undefined;
  /** The SM budget of every SQE ({@link RingSettings.smBudgetOverride}); absent or null: each SQE's own. */
  smBudgetOverride?: number | null | undefined;
  /**
   * The session's tensor bytes in flight: an 8-byte, 8-aligned view of a SharedArrayBuffer whose BigInt64 word the
   * daemon's JavaScript reserves in with Atomics too. Each compress/decompress batch adds its bytes (compress: the
   * tensors', decompress: the destinations') while it runs, or, when that would pass {@link maxInflightBytes}, fails
   * every SQE TZIP_LIMIT without running. Absent: not counted. The ring keeps the buffer alive while its thread runs.
   */
  inflightBytes?: Uint8Array | undefined;
  /** The limit of {@link inflightBytes} (required with it). */
  maxInflightBytes?: number | undefined;
  /** Threads of a CPU batch (1..1024). */
  cpuThreads: number;
  /** Microseconds the thread polls sq_head (and a GPU batch's event) before it sleeps (0..1000000). */
  spinUs: number;
  /** Completions in batches (JavaScript thread). */
  onStats: (batch: RingCompletionStats[]) => void;
  /** Called once when the ring breaks (an index out of range, the ring file shrank), with why. */
  onBroken: (why: string) => void;
}

/** Sizes of the ring file (docs/ring.md, "The ring file"). */
export const RING_LAYOUT = Object.freeze({
  headerBytes: 4096,
  sqeBytes: 128,
  cqeBytes: 64,
  entriesMin: 8,
  entriesMax: 4096,
  maxBatch: 1024,
});

/** Bytes of a ring file of `entries` entries: 4096 + entries * 128 + entries * 64. */
export function ringBytes(entries: number): number {
  return RING_LAYOUT.headerBytes + entries * (RING_LAYOUT.sqeBytes + RING_LAYOUT.cqeBytes);
}

/** The addon's exports, as documented in docs/addon.md. */
interface Addon {
  compress(input: Uint8Array, opts: CompressOptions): Promise<Uint8Array>;
  decompress(frame: Uint8Array, opts?: DecompressOptions): Promise<Buffer>;
  readHeader(frame: Uint8Array): FrameHeader;
  maxCompressedSize(nbytes: number, ndim: number, chunkSize?: number): number;
  entropy(input: Uint8Array, dtype: string): EntropyBound;
  gpu(): GpuInfo;
  gpuDevices(): GpuDevice[];
  gpuCompress(items: readonly GpuEncodeItem[], opts: GpuRunOptions): Promise<GpuCompressed[]>;
  gpuDecompress(items: readonly GpuDecodeItem[], opts: GpuRunOptions): Promise<FrameHeader[]>;
  cudaIpcGetMemHandle(ptr: DevicePtr, device: number): Buffer;
  cudaIpcOpenMemHandle(handle: Uint8Array, device: number): bigint;
  cudaIpcCloseMemHandle(base: DevicePtr, device: number): void;
  cudaIpcOpenEventHandle(handle: Uint8Array, device: number): bigint;
  cudaEventCreateInterprocess(device: number): InterprocessEvent;
  cudaEventDestroy(event: bigint, device: number): void;
  cudaMemGetInfo(device: number): GpuMemInfo;
  gpuAlloc(device: number, nbytes: ByteCount): bigint;
  gpuFree(ptr: DevicePtr, device: number): void;
  gpuCopyToDevice(ptr: DevicePtr, src: Uint8Array, device: number): void;
  gpuCopyFromDevice(ptr: DevicePtr, nbytes: ByteCount, device: number): Buffer;
  mapShared(path: string, writable: boolean): Buffer;
  mapSharedFaulted(buffer: Buffer): boolean;
  ringOpen(file: Buffer, opts: RingOpenOptions): NativeRing;
  formatVersion: number;
  defaultChunkSize: number;
  defaultThreads: number;
}

/**
 * The addon, loaded once per process: Node loads a native module once per process, so every caller (each daemon in
 * the process included) shares it.
 */
let addon: Addon | undefined;

/** Absolute path the addon is loaded from: `<package root>/build/Release/tzip.node`. */
export function addonPath(): string {
  return join(packageRoot(), 'build', 'Release', 'tzip.node');
}

/** Whether the addon file exists (it is built by `bash scripts/setup.sh`). */
export function addonAvailable(): boolean {
  return existsSync(addonPath());
}

function load(): Addon {
  if (addon !== undefined) return addon;
  const path = addonPath();
  if (!existsSync(path)) {
    throw new TzipError('TZIP_IO', 'native addon not built; run `bash scripts/setup.sh`', { file: path });
  }
  const require = createRequire(import.meta.url);
  addon = require(path) as Addon;
  return addon;
}

/**
 * Compresses one tensor's bytes into one self-describing frame (docs/format.md). Runs on the
 * addon's worker threads.
 * @returns the frame (a view of `opts.out` when given).
 * @throws TzipError TZIP_INVALID_ARGUMENT when the options are bad, the byte length does not match dtype/shape,
 *   or `opts.out` is smaller than maxCompressedSize or overlaps the input; TZIP_OUT_OF_MEMORY when the frame's or
 *   the codec's host memory cannot be allocated.
 */
export async function compress(input: Uint8Array, opts: CompressOptions): Promise<Buffer> {
  const native = load();
  try {
    const frame: Uint8Array = await native.compress(input, opts);
    return Buffer.isBuffer(frame) ? frame : Buffer.from(frame.buffer, frame.byteOffset, frame.byteLength);
  } catch (err) {
    throw toTzipError(err);
  }
}

/**
 * Decodes one frame back into the original bytes, checking its chunk digests unless `verify` is false.
 * @returns the original bytes (`opts.out` when given).
 * @throws TzipError TZIP_CORRUPT, TZIP_TRUNCATED, TZIP_CHECKSUM or TZIP_UNSUPPORTED for bad frames;
 *   TZIP_OUT_OF_MEMORY when the output or the codec's host memory cannot be allocated.
 */
export async function decompress(frame: Uint8Array, opts: DecompressOptions = {}): Promise<Buffer> {
  const native = load();
  try {
    return await native.decompress(frame, opts);
  } catch (err) {
    throw toTzipError(err);
  }
}

/**
 * Decodes a frame's header and chunk table (synchronous). `frame` may be a prefix of the frame;
 * it must hold at least `headerBytes` bytes.
 * @throws TzipError TZIP_TRUNCATED with `needBytes` (how many bytes of the frame are needed) when the prefix is too short;
 *   TZIP_CORRUPT / TZIP_UNSUPPORTED for bad headers.
 */
export function readHeader(frame: Uint8Array): FrameHeader {
  const native = load();
  try {
    return native.readHeader(frame);
  } catch (err) {
    throw toTzipError(err);
  }
}

/** Exact upper bound, in bytes, of the frame {@link compress} makes from `nbytes` bytes of an `ndim`-dimensional tensor. */
export function maxCompressedSize(nbytes: number, ndim: number, chunkSize?: number): number {
  const native = load();
  try {
    return chunkSize === undefined ? native.maxCompressedSize(nbytes, ndim) : native.maxCompressedSize(nbytes, ndim, chunkSize);
  } catch (err) {
    throw toTzipError(err);
  }
}

/**
 * Order-0 entropy bound, in bytes, of `input` split into the fields of `dtype` (floats: exponent and
 * residual planes; other dtypes: byte planes). Computed by the addon from byte histograms.
 * @throws TzipError TZIP_INVALID_ARGUMENT for an unknown dtype or a length that is not a whole number of elements.
 */
export function entropy(input: Uint8Array, dtype: string): EntropyBound {
  const native = load();
  try {
    return native.entropy(input, dtype);
  } catch (err) {
    throw toTzipError(err);
  }
}

/** Which GPUs the addon can use (none in CPU-only builds; `reason` says why). */
export function gpu(): GpuInfo {
  return load().gpu();
}

/** Version number of the frame format the addon writes (docs/format.md). */
export function formatVersion(): number {
  return load().formatVersion;
}

/** Default chunk size of {@link compress}, in bytes of original data. */
export function defaultChunkSize(): number {
  return load().defaultChunkSize;
}

/** Default worker thread count of the addon (all cores). */
export function defaultThreads(): number {
  return load().defaultThreads;
}

// ------------------------------------------------------------------------------------------------ GPU codec and CUDA IPC
//
// Pointers are device addresses as bigints; sizes are bytes (number or bigint, 64-bit). Every function takes the
// ordinal of the GPU it works on, makes that device current for the call and restores the previous one. Errors are
// TzipError: TZIP_UNSUPPORTED when no GPU or driver can be used (`detail` says why, as gpu().reason does),
// TZIP_INVALID_ARGUMENT for bad arguments (a pointer that is not device memory of `device`, a size mismatch, a
// capacity below the bound), TZIP_CUDA when a CUDA runtime call fails (the message has the CUDA error name and text).

/** Calls `f` on the loaded addon and maps its errors into {@link TzipError}. */
function call<T>(f: (native: Addon) => T): T {
  const native = load();
  try {
    return f(native);
  } catch (err) {
    throw toTzipError(err);
  }
}

/**
 * The GPUs this process can use, with their UUIDs (to match a client's GPU by UUID, not by ordinal).
 * @returns [] when there is no driver or no GPU (never throws for that; {@link gpu} says why).
 * @throws TzipError TZIP_IO when the addon is not built.
 */
export function gpuDevices(): GpuDevice[] {
  return call((n) => n.gpuDevices());
}

/**
 * Compresses a batch of tensors already in GPU memory into one frame each, byte for byte the frames {@link compress}
 * makes from the same bytes, dtype, shape, codec and chunk size. One launch sequence for the whole batch, on the
 * addon's own non-blocking stream of `opts.device` (after `opts.waitEvent`, before `opts.recordEvent`); the promise
 * resolves once that work has finished (a worker thread waits for it, never the event loop). The frame sizes and the
 * codecs the device chose come back to the host in one device-to-host copy for the whole batch.
 * @returns per item, in order, the size in bytes of the frame written at `item.frame` and the codec it records.
 * @throws TzipError (as a rejection) TZIP_INVALID_ARGUMENT (bad item or option, pointer not device memory of
 *   `opts.device`, frameCapacity below {@link maxCompressedSize}), TZIP_UNSUPPORTED (no GPU), TZIP_CUDA,
 *   TZIP_OUT_OF_MEMORY (the codec's device scratch or pinned staging memory, cudaErrorMemoryAllocation), TZIP_CORRUPT (a frame's memory was overwritten during the call, so that it no longer records the codec chosen).
 */
export async function gpuCompress(items: readonly GpuEncodeItem[], opts: GpuRunOptions): Promise<GpuCompressed[]> {
  const native = load();
  try {
    return await native.gpuCompress(items, opts);
  } catch (err) {
    throw toTzipError(err);
  }
}

/**
 * Decodes a batch of frames in GPU memory into GPU memory; same stream, events and completion as {@link gpuCompress}.
 * Every frame is parsed and checked on the device; a failing item never writes outside its `out` range (it may
 * leave that range partly written), and the other items still decode. After the decode, the first bytes of every
 * frame (fixed header and shape: at most 304) are gathered on the device and come back with the error codes in one
 * device-to-host copy; the addon parses them with the CPU's header checks, reading no byte past `frameBytes`.
 * @returns per item, in order, the frame's header ({@link readHeader}'s fields: dtype, shape, nbytes, codec,
 *   frameBytes, ...), as the frame's memory held it after the decode. The decoder checked the whole header on the
 *   device, header digest and chunk table included; these bytes are read again afterwards, so a caller that does not
 *   own the frames' memory (another process's) compares them with what it expects (frameBytes with the size it
 *   passed, nbytes, dtype and shape with the destination).
 * @throws TzipError (as a rejection) whose code is the first failing item's (TZIP_CORRUPT, TZIP_TRUNCATED,
 *   TZIP_CHECKSUM, TZIP_UNSUPPORTED, or TZIP_INVALID_ARGUMENT when outBytes is not the frame's nbytes: the same code
 *   {@link decompress} gives for the same bytes), whose message names the item index, and whose `itemErrors` holds
 *   per item its code or '' for an item that decoded; the same for a frame whose header bytes fail the checks when read
 *   back after the decode (its memory changed during the call); TZIP_INVALID_ARGUMENT (bad item or option, pointer not
 *   device memory of `opts.device`), TZIP_CUDA and TZIP_OUT_OF_MEMORY (as {@link gpuCompress}) without `itemErrors`;
 *   TZIP_UNSUPPORTED when there is no GPU.
 */
export async function gpuDecompress(items: readonly GpuDecodeItem[], opts: GpuRunOptions): Promise<FrameHeader[]> {
  const native = load();
  try {
    return await native.gpuDecompress(items, opts);
  } catch (err) {
    throw toTzipError(err);
  }
}

/**
 * The CUDA IPC handle of the allocation that holds `ptr` (cudaIpcGetMemHandle; for tests and tools). Another process
 * opens it with {@link cudaIpcOpenMemHandle} and gets the allocation's base, so pass an allocation's base here (as
 * {@link gpuAlloc} returns) or send the offset of `ptr` in it along.
 * @returns the 64-byte cudaIpcMemHandle_t.
 * @throws TzipError TZIP_INVALID_ARGUMENT (not device memory of `device`), TZIP_CUDA, TZIP_UNSUPPORTED.
 */
export function cudaIpcGetMemHandle(ptr: DevicePtr, device: number): Buffer {
  return call((n) => n.cudaIpcGetMemHandle(ptr, device));
}

/**
 * Maps another process's allocation into this one (cudaIpcOpenMemHandle with cudaIpcMemLazyEnablePeerAccess).
 * A handle cannot be opened in the process that made it. Close with {@link cudaIpcCloseMemHandle}.
 * @param handle the 64-byte cudaIpcMemHandle_t.
 * @returns the base address of the mapping (the allocation's first byte).
 * @throws TzipError TZIP_INVALID_ARGUMENT (handle not 64 bytes), TZIP_CUDA (e.g. an invalid or stale handle), TZIP_UNSUPPORTED.
 */
export function cudaIpcOpenMemHandle(handle: Uint8Array, device: number): bigint {
  return call((n) => n.cudaIpcOpenMemHandle(handle, device));
}

/**
 * Unmaps what {@link cudaIpcOpenMemHandle} mapped (cudaIpcCloseMemHandle).
 * @throws TzipError TZIP_CUDA, TZIP_INVALID_ARGUMENT, TZIP_UNSUPPORTED.
 */
export function cudaIpcCloseMemHandle(base: DevicePtr, device: number): void {
  call((n) => n.cudaIpcCloseMemHandle(base, device));
}

/**
 * Opens another process's interprocess event (cudaIpcOpenEventHandle), for {@link GpuRunOptions.waitEvent} /
 * {@link GpuRunOptions.recordEvent}. Release it with {@link cudaEventDestroy}.
 * @param handle the 64-byte cudaIpcEventHandle_t.
 * @returns the cudaEvent_t.
 * @throws TzipError TZIP_INVALID_ARGUMENT (handle not 64 bytes), TZIP_CUDA, TZIP_UNSUPPORTED.
 */
export function cudaIpcOpenEventHandle(handle: Uint8Array, device: number): bigint {
  return call((n) => n.cudaIpcOpenEventHandle(handle, device));
}

/**
 * Creates an event other processes can open (cudaEventInterprocess | cudaEventDisableTiming) and its handle.
 * Release it with {@link cudaEventDestroy}.
 * @throws TzipError TZIP_CUDA, TZIP_INVALID_ARGUMENT, TZIP_UNSUPPORTED.
 */
export function cudaEventCreateInterprocess(device: number): InterprocessEvent {
  return call((n) => n.cudaEventCreateInterprocess(device));
}

/**
 * Destroys an event made by {@link cudaEventCreateInterprocess} or opened by {@link cudaIpcOpenEventHandle}.
 * @throws TzipError TZIP_CUDA, TZIP_INVALID_ARGUMENT, TZIP_UNSUPPORTED.
 */
export function cudaEventDestroy(event: bigint, device: number): void {
  call((n) => n.cudaEventDestroy(event, device));
}

/**
 * Free and total memory of a GPU, in bytes (cudaMemGetInfo).
 * @throws TzipError TZIP_CUDA, TZIP_INVALID_ARGUMENT, TZIP_UNSUPPORTED.
 */
export function cudaMemGetInfo(device: number): GpuMemInfo {
  return call((n) => n.cudaMemGetInfo(device));
}

/**
 * Allocates device memory (cudaMalloc of max(nbytes, 1) bytes; for tests and tools). Free with {@link gpuFree}.
 * @returns the device pointer.
 * @throws TzipError TZIP_OUT_OF_MEMORY (cudaErrorMemoryAllocation), TZIP_CUDA, TZIP_INVALID_ARGUMENT, TZIP_UNSUPPORTED.
 */
export function gpuAlloc(device: number, nbytes: ByteCount): bigint {
  return call((n) => n.gpuAlloc(device, nbytes));
}

/**
 * Frees what {@link gpuAlloc} allocated (cudaFree).
 * @throws TzipError TZIP_CUDA, TZIP_INVALID_ARGUMENT, TZIP_UNSUPPORTED.
 */
export function gpuFree(ptr: DevicePtr, device: number): void {
  call((n) => n.gpuFree(ptr, device));
}

/**
 * Copies `src` to [ptr, ptr + src.byteLength) and waits until the bytes are in device memory (for tests and tools).
 * @throws TzipError TZIP_INVALID_ARGUMENT (range not device memory of `device`), TZIP_CUDA, TZIP_UNSUPPORTED.
 */
export function gpuCopyToDevice(ptr: DevicePtr, src: Uint8Array, device: number): void {
  call((n) => n.gpuCopyToDevice(ptr, src, device));
}

/**
 * Copies [ptr, ptr + nbytes) of device memory into a new Buffer (synchronous; for tests and tools).
 * @throws TzipError TZIP_INVALID_ARGUMENT (range not device memory of `device`), TZIP_UNSUPPORTED (no GPU, or more
 *   bytes than a Buffer can hold), TZIP_OUT_OF_MEMORY (the Buffer cannot be allocated), TZIP_CUDA.
 */
export function gpuCopyFromDevice(ptr: DevicePtr, nbytes: ByteCount, device: number): Buffer {
  return call((n) => n.gpuCopyFromDevice(ptr, nbytes, device));
}

// ------------------------------------------------------------------------------------------------ shared memory and the ring

/**
 * Maps the whole /dev/shm file at `path` (MAP_SHARED; writable or read-only), SIGBUS-guarded: a file that shrinks
 * under the mapping reads zeros there instead of killing the process ({@link mapSharedFaulted} then says so).
 * Unmapped when the Buffer is garbage collected.
 * @throws TzipError TZIP_INVALID_ARGUMENT (not a regular file under /dev/shm, cannot open or map it),
 *   TZIP_OUT_OF_MEMORY (no address space).
 */
export function mapShared(path: string, writable: boolean): Buffer {
  return call((n) => n.mapShared(path, writable));
}

/** Whether a mapping made by {@link mapShared} took a SIGBUS (its file shrank) since it was made. */
export function mapSharedFaulted(buffer: Buffer): boolean {
  return call((n) => n.mapSharedFaulted(buffer));
}

/** Calls `f` and maps a native error into {@link TzipError}. */
function mapped<T>(f: () => T): T {
  try {
    return f();
  } catch (err) {
    throw toTzipError(err);
  }
}

/**
 * Whether the addon has the submission ring ({@link ringOpen}): false when it is not built, or was built before the
 * ring (an older build/Release/tzip.node). The daemon offers the ring in hello only then.
 */
export function ringAvailable(): boolean {
  if (!addonAvailable()) return false;
  return typeof (load() as Partial<Addon>).ringOpen === 'function';
}

/**
 * Opens the submission ring of docs/ring.md on a ring file the client created (its {@link mapShared} mapping,
 * writable, exactly {@link ringBytes}(entries) bytes, starting with "TZRING01" and `entries`), and starts its native
 * thread. The thread serves SQEs until {@link NativeRing.close}; every SQE gets a CQE (status 0 or the numeric value
 * of an error code of src/errors.json); a ring whose indices leave their range is broken (state 2, `onBroken`).
 * @throws TzipError TZIP_INVALID_ARGUMENT (bad options or file), TZIP_UNSUPPORTED (`device` given without a usable
 *   GPU, or a driver without stream memory operations for `flag`), TZIP_CUDA.
 */
export function ringOpen(file: Buffer, opts: RingOpenOptions): NativeRing {
  const r = call((n) => n.ringOpen(file, opts));
  return {
    addHost: (buffer) => mapped(() => r.addHost(buffer)),
    addDevice: (ptr, bytes, device) => mapped(() => r.addDevice(ptr, bytes, device)),
    remove: async (ids) => {
      try {
        await r.remove(ids);
      } catch (err) {
        throw toTzipError(err);
      }
    },
    close: () => r.close(),
    setSettings: (settings) => mapped(() => r.setSettings(settings)),
    get state() {
      return r.state;
    },
  };
}
