/**
 * The account of one compress/decompress request, kept by its handler: where it ran and, once it succeeded, how many
 * tensors and bytes it coded. The handler adds the bytes to the daemon's totals (stats.ts) through it; the server then
 * counts the request into its job's stream (jobs.ts) and the request observer's event from it.
 */
import type { DaemonStats } from './stats.js';

/** Where a request's codec work ran. */
export type RequestDevice = 'cpu' | 'gpu';

/** One request's account. */
export class RequestTally {
  /** Where the request was served (set when its handler picks the path), null before that. */
  device: RequestDevice | null = null;
  /** Tensors (compress) or frames (decompress) coded. */
  items = 0;
  /** Bytes read: tensor bytes (compress), frame bytes (decompress). */
  bytesIn = 0;
  /** Bytes written: frame bytes (compress), tensor bytes (decompress). */
  bytesOut = 0;

  constructor(private readonly stats: DaemonStats) {}

  /** Counts the request's coded batch, here and in the daemon's totals. */
  coded(dir: 'compress' | 'decompress', items: number, bytesIn: number, bytesOut: number): void {
    this.items += items;
    this.bytesIn += bytesIn;
    this.bytesOut += bytesOut;
    this.stats.addCodec(dir, items, bytesIn, bytesOut);
    if (this.device === 'gpu') this.stats.gpuRequests++;
  }
}
