/**
 * Measurement of one codec on a set of tensors: size ratio and compress/decompress throughput
 * (original bytes per second, median of timed runs after a warm-up), with the round trip checked
 * byte for byte. Used by `tzip bench`.
 */
import { compress, decompress, type Codec } from '../native.js';
import type { Baseline } from './baselines.js';
import { timeMedian } from './timing.js';

/** One tensor's bytes and how to code them. */
export interface Sample {
  name: string;
  /** dtype passed to the codec. */
  dtype: string;
  shape: number[];
  bytes: Buffer;
}

/** How many times to run each measured operation. */
export interface RunPlan {
  /** Timed runs; the median is reported. */
  runs: number;
  /** Untimed runs before them. */
  warmup: number;
}

/** Throughput of one configuration, in GB/s (10^9 original bytes per second, median run). */
export interface Throughput {
  threads: number;
  compressGBps: number;
  decompressGBps: number;
}

/** Result of measuring one codec on a set of samples. Sizes in bytes. */
export interface Measurement {
  /** 'fast' | 'max' | 'bytes' for tzip, or a baseline's name ('zstd-1', 'zstd-3', 'lz4'). */
  codec: string;
  engine: 'tzip' | 'baseline';
  originalBytes: number;
  compressedBytes: number;
  /** compressedBytes / originalBytes (lower is better); null when there are no bytes. */
  ratio: number | null;
  /** Figures with the requested thread count (tzip only). */
  parallel: Throughput | undefined;
  /** Figures with one thread: per core. */
  perCore: Throughput;
  /** True when every sample decoded to exactly its original bytes. */
  roundTripIdentical: boolean;
}

function totalBytes(buffers: readonly Uint8Array[]): number {
  return buffers.reduce((s, b) => s + b.byteLength, 0);
}

function gbps(bytes: number, seconds: number): number {
  return seconds > 0 ? bytes / seconds / 1e9 : Number.POSITIVE_INFINITY;
}

function identical(samples: readonly Sample[], decoded: readonly Buffer[]): boolean {
  return samples.length === decoded.length && samples.every((s, i) => s.bytes.equals(decoded[i] as Buffer));
}

async function tzipThroughput(samples: readonly Sample[], codec: Codec, threads: number, plan: RunPlan):
  Promise<{ frames: Buffer[]; decoded: Buffer[]; throughput: Throughput }> {
  const original = totalBytes(samples.map((s) => s.bytes));
  let frames: Buffer[] = [];
  const c = await timeMedian(async () => {
    const out: Buffer[] = [];
    for (const s of samples) out.push(await compress(s.bytes, { dtype: s.dtype, shape: s.shape, codec, threads }));
    frames = out;
  }, plan.runs, plan.warmup);
  // Decode into buffers allocated once, as the product decodes into existing tensors: first-touch page faults of
  // fresh allocations would otherwise be timed (about a third of the decode time for bf16 on this machine).
  const decoded: Buffer[] = samples.map((s) => Buffer.allocUnsafe(s.bytes.length));
  const d = await timeMedian(async () => {
    for (let i = 0; i < frames.length; i++) await decompress(frames[i] as Buffer, { threads, out: decoded[i] });
  }, plan.runs, plan.warmup);
  return { frames, decoded, throughput: { threads, compressGBps: gbps(original, c.medianSeconds), decompressGBps: gbps(original, d.medianSeconds) } };
}

/**
 * Measures a tzip codec with `threads` worker threads and with one thread (skipped when `threads`
 * is 1), checking that every frame decodes to its sample's bytes.
 * @throws TzipError from the addon (e.g. TZIP_INVALID_ARGUMENT for a codec the dtype does not support).
 */
export async function measureTzip(samples: readonly Sample[], codec: Codec, threads: number, plan: RunPlan): Promise<Measurement> {
  const originalBytes = totalBytes(samples.map((s) => s.bytes));
  const perCore = await tzipThroughput(samples, codec, 1, plan);
  const parallel = threads === 1 ? undefined : await tzipThroughput(samples, codec, threads, plan);
  const compressedBytes = totalBytes(perCore.frames);
  return {
    codec,
    engine: 'tzip',
    originalBytes,
    compressedBytes,
    ratio: originalBytes === 0 ? null : compressedBytes / originalBytes,
    parallel: parallel?.throughput,
    perCore: perCore.throughput,
    roundTripIdentical: identical(samples, perCore.decoded) && (parallel === undefined || identical(samples, parallel.decoded)),
  };
}

/** Measures a baseline compressor (single-threaded), each sample compressed on its own. */
export async function measureBaseline(samples: readonly Sample[], baseline: Baseline, plan: RunPlan): Promise<Measurement> {
  const originalBytes = totalBytes(samples.map((s) => s.bytes));
  let frames: Buffer[] = [];
  const c = await timeMedian(() => { frames = samples.map((s) => baseline.compress(s.bytes)); }, plan.runs, plan.warmup);
  let decoded: Buffer[] = [];
  const d = await timeMedian(() => { decoded = frames.map((f) => baseline.decompress(f)); }, plan.runs, plan.warmup);
  const compressedBytes = totalBytes(frames);
  return {
    codec: baseline.name,
    engine: 'baseline',
    originalBytes,
    compressedBytes,
    ratio: originalBytes === 0 ? null : compressedBytes / originalBytes,
    parallel: undefined,
    perCore: { threads: 1, compressGBps: gbps(originalBytes, c.medianSeconds), decompressGBps: gbps(originalBytes, d.medianSeconds) },
    roundTripIdentical: identical(samples, decoded),
  };
}
