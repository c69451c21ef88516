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
}

/** Options of {@link decompress}. */
export interface DecompressOptions {
  /** Worker threads; default the addon's {@link defaultThreads}. */
  threads?: number | undefined;
  /** Check the decoded bytes against the frame's XXH32 digests (default true). */
  verify?: boolean | undefined;
  /** Destination, exactly the frame's nbytes long; returned filled. */
  out?: Uint8Array | undefined;
}

/** A frame's self-description, as decoded by {@link readHeader} (all sizes in bytes). */
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
  /** Frame checksum: XXH32 (seed 0) of the little-endian array of the chunks' XXH32 digests of original bytes. */
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

/** The addon's exports, as documented in docs/addon.md. */
interface Addon {
  compress(input: Uint8Array, opts: CompressOptions): Promise<Buffer>;
  decompress(frame: Uint8Array, opts?: DecompressOptions): Promise<Buffer>;
  readHeader(frame: Uint8Array): FrameHeader;
  maxCompressedSize(nbytes: number, ndim: number, chunkSize?: number): number;
  entropy(input: Uint8Array, dtype: string): EntropyBound;
  gpu(): GpuInfo;
  formatVersion: number;
  defaultChunkSize: number;
  defaultThreads: number;
}

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
 * @returns the frame.
 * @throws TzipError TZIP_INVALID_ARGUMENT when the options are bad or the byte length does not match dtype/shape.
 */
export async function compress(input: Uint8Array, opts: CompressOptions): Promise<Buffer> {
  const native = load();
  try {
    return await native.compress(input, opts);
  } catch (err) {
    throw toTzipError(err);
  }
}

/**
 * Decodes one frame back into the original bytes, checking its XXH32 digests unless `verify` is false.
 * @returns the original bytes (`opts.out` when given).
 * @throws TzipError TZIP_CORRUPT, TZIP_TRUNCATED, TZIP_CHECKSUM or TZIP_UNSUPPORTED for bad frames.
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
