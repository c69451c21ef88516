/**
 * General-purpose compressors that tzip is compared with in `tzip bench`, through their npm
 * bindings: zstd (zstd-napi, libzstd) at levels 1 and 3, and LZ4 (lz4-napi, lz4_flex block
 * format with the size prepended). All run single-threaded on the calling thread.
 */
import { compressSync as lz4Compress, uncompressSync as lz4Decompress } from 'lz4-napi';
import { compress as zstdCompress, decompress as zstdDecompress } from 'zstd-napi';

/** A baseline compressor: one-shot, in memory. */
export interface Baseline {
  /** Label in reports, e.g. 'zstd-1'. */
  name: string;
  compress(input: Buffer): Buffer;
  decompress(compressed: Buffer): Buffer;
}

function zstd(level: number): Baseline {
  return {
    name: `zstd-${level}`,
    compress: (input) => zstdCompress(input, { compressionLevel: level }),
    decompress: (compressed) => zstdDecompress(compressed),
  };
}

/** The baselines `tzip bench` runs, in report order. */
export const BASELINES: readonly Baseline[] = [
  zstd(1),
  zstd(3),
  { name: 'lz4', compress: (input) => lz4Compress(input), decompress: (compressed) => lz4Decompress(compressed) },
];
