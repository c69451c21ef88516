/**
 * Wall-clock timing of a repeated operation: warm-up runs, then the median of timed runs
 * (performance.now(), monotonic, sub-millisecond).
 */
import { performance } from 'node:perf_hooks';

/** Median and all timed runs, in seconds. */
export interface Timing {
  medianSeconds: number;
  runsSeconds: number[];
}

/**
 * Runs `fn` `warmup` times untimed, then `runs` times timed.
 * @returns the median of the timed runs in seconds (mean of the middle two for even counts).
 */
export async function timeMedian(fn: () => unknown, runs: number, warmup = 1): Promise<Timing> {
  for (let i = 0; i < warmup; i++) await fn();
  const runsSeconds: number[] = [];
  for (let i = 0; i < runs; i++) {
    const t0 = performance.now();
    await fn();
    runsSeconds.push((performance.now() - t0) / 1000);
  }
  const sorted = [...runsSeconds].sort((a, b) => a - b);
  const mid = sorted.length >> 1;
  const medianSeconds = sorted.length % 2 === 1 ? (sorted[mid] as number) : ((sorted[mid - 1] as number) + (sorted[mid] as number)) / 2;
  return { medianSeconds, runsSeconds };
}
