/**
 * General-purpose compressors that tzip is compared with in `tzip bench`, through their npm
 * bindings: zstd (zstd-napi, libzstd) at levels 1 and 3, and LZ4 (lz4-napi, lz4_flex block
 * format with the size prepended). All run single-threaded on the calling thread.
 *
 * zstd-napi is an optional dependency (its install step compiles libzstd where no prebuilt binary
 * can be downloaded, and an installed tzip needs no compiler): without it the zstd rows are left
 * out and {@link MISSING_BASELINES} says so.
 */
import { compressSync as lz4Compress, uncompressSync as lz4Decompress } from 'lz4-napi';

const zstdNapi = await import('zstd-napi').catch(() => undefined);

/** A baseline compressor: one-shot, in memory. */
export interface Baseline {
  /** Label in reports, e.g. 'zstd-1'. */
  name: string;
  compress(input: Buffer): Buffer;
  decompress(compressed: Buffer): Buffer;
}

function zstd(z: NonNullable<typeof zstdNapi>, level: number): Baseline {
  return {
    name: `zstd-${level}`,
    compress: (input) => z.compress(input, { compressionLevel: level }),
    decompress: (compressed) => z.decompress(compressed),
  };
}

/** Baselines left out because their package is not installed (with the reason, for the report). */
export const MISSING_BASELINES: readonly string[] =
  zstdNapi === undefined ? ['zstd-1, zstd-3 (the optional package zstd-napi is not installed)'] : [];

/** The baselines `tzip bench` runs, in report order. */
export const BASELINES: readonly Baseline[] = [
  ...(zstdNapi !== undefined ? [zstd(zstdNapi, 1), zstd(zstdNapi, 3)] : []),
  { name: 'lz4', compress: (input) => lz4Compress(input), decompress: (compressed) => lz4Decompress(compressed) },
];
