/**
 * A rate over a sliding window: bytes added per second of wall clock, kept in one-second buckets, read as the bytes
 * of the last `windowS` seconds over `windowS` seconds (the `jobs` op's `daemon.rates`, docs/protocol.md).
 */

/** Bytes per second over the last few seconds. */
export class RateWindow {
  /** Bytes of second `start + i` at index `i % windowS` (the current second's bucket is still filling). */
  private readonly buckets: number[];
  private readonly seconds: number[];

  constructor(readonly windowS = 10) {
    this.buckets = new Array<number>(windowS).fill(0);
    this.seconds = new Array<number>(windowS).fill(-1);
  }

  /** Counts `bytes` at time `now` (ms since the epoch). */
  add(bytes: number, now: number = Date.now()): void {
    const s = Math.floor(now / 1000);
    const i = s % this.windowS;
    if (this.seconds[i] !== s) {
      this.seconds[i] = s;
      this.buckets[i] = 0;
    }
    this.buckets[i] = (this.buckets[i] as number) + bytes;
  }

  /** Bytes counted in the last `windowS` seconds up to `now` (the current second included), per second. */
  perSecond(now: number = Date.now()): number {
    const s = Math.floor(now / 1000);
    let sum = 0;
    for (let i = 0; i < this.windowS; i++) {
      const at = this.seconds[i] as number;
      if (at > s - this.windowS && at <= s) sum += this.buckets[i] as number;
    }
    return sum / this.windowS;
  }
}
