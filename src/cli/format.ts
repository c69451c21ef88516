/**
 * Number formatting for the CLI's text output. Units: kB = 10^3, MB = 10^6, GB = 10^9 bytes; GB/s = 10^9 bytes per second.
 */

/** A size in decimal units with 2 decimals: "512 B", "4.51 kB", "90.87 MB", "1.20 GB" (k = 10^3, M = 10^6, G = 10^9). */
export function formatSize(bytes: number): string {
  if (bytes < 1e3) return `${bytes} B`;
  if (bytes < 1e6) return `${(bytes / 1e3).toFixed(2)} kB`;
  if (bytes < 1e9) return `${(bytes / 1e6).toFixed(2)} MB`;
  return `${(bytes / 1e9).toFixed(2)} GB`;
}

/** A byte count with thousands separators, e.g. "1,234,567". */
export function formatBytes(bytes: number): string {
  // Not toLocaleString: its first call loads ICU's locale data, a large part of `tzip inspect`'s run time.
  return String(bytes).replace(/\B(?=(\d{3})+(?!\d))/g, ',');
}

/** A compressed/original ratio with 4 decimals (lower is better); "-" when the original is empty. */
export function formatRatio(compressed: number, original: number): string {
  return original === 0 ? '-' : (compressed / original).toFixed(4);
}

/** A throughput in GB/s (10^9 bytes per second) with 3 significant decimals; "-" when not measured. */
export function formatGBps(gbps: number | undefined): string {
  if (gbps === undefined || !Number.isFinite(gbps)) return '-';
  return gbps >= 10 ? gbps.toFixed(1) : gbps >= 1 ? gbps.toFixed(2) : gbps.toFixed(3);
}

/** Throughput in GB/s (10^9 bytes per second) of `bytes` processed in `seconds`. */
export function gbPerSecond(bytes: number, seconds: number): number {
  return seconds > 0 ? bytes / seconds / 1e9 : Number.POSITIVE_INFINITY;
}

/** A shape as "[2, 0, 4096]". */
export function formatShape(shape: readonly number[]): string {
  return `[${shape.join(', ')}]`;
}
