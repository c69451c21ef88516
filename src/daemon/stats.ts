/**
 * Counters the daemon keeps for `stats` (docs/protocol.md).
 */

/** Totals of one codec direction. */
export interface CodecTotals {
  /** Tensors (compress) or frames (decompress) done. */
  items: number;
  /** Bytes read: tensor bytes (compress) or frame bytes (decompress). */
  bytesIn: number;
  /** Bytes written: frame bytes (compress) or tensor bytes (decompress). */
  bytesOut: number;
}

/** The daemon's running counters. */
export class DaemonStats {
  readonly startedAt = Date.now();
  /** Requests answered, by op ('invalid' for undecodable/unknown ones). */
  readonly requests: Record<string, number> = {};
  /** Error replies, by code. */
  readonly errors: Record<string, number> = {};
  readonly compress: CodecTotals = { items: 0, bytesIn: 0, bytesOut: 0 };
  readonly decompress: CodecTotals = { items: 0, bytesIn: 0, bytesOut: 0 };
  /** Compress/decompress requests served on a GPU. */
  gpuRequests = 0;
  /** Sessions opened and ended, by reason. */
  sessionsOpened = 0;
  readonly sessionsEnded: Record<string, number> = {};

  countRequest(op: string): void {
    this.requests[op] = (this.requests[op] ?? 0) + 1;
  }

  countError(code: string): void {
    this.errors[code] = (this.errors[code] ?? 0) + 1;
  }

  countEnd(reason: string): void {
    this.sessionsEnded[reason] = (this.sessionsEnded[reason] ?? 0) + 1;
  }

  addCodec(dir: 'compress' | 'decompress', items: number, bytesIn: number, bytesOut: number): void {
    const t = this[dir];
    t.items += items;
    t.bytesIn += bytesIn;
    t.bytesOut += bytesOut;
  }
}
