/**
 * A progress bar on stderr (cli-progress), counting bytes or steps, shown only when stderr is a
 * terminal and JSON output was not asked for, so that piped output and logs stay clean.
 */
import { createRequire } from 'node:module';
import type CliProgress from 'cli-progress';

/**
 * cli-progress (a CommonJS package, with string-width and its regexes) is loaded only when a bar is shown:
 * piped and logged runs, and every run under a benchmark, pay nothing for it (issue 36).
 */
function loadCliProgress(): typeof CliProgress {
  return createRequire(import.meta.url)('cli-progress') as typeof CliProgress;
}

/** A progress display; all methods are no-ops when no bar is shown. */
export interface Progress {
  /** Sets the done and total counts (bytes, or steps). */
  update(done: number, total: number): void;
  /** Removes the bar. */
  stop(): void;
}

/**
 * Starts a progress bar labelled `label` (e.g. the file name).
 * @param enabled false to show nothing (e.g. with --json).
 * @param unit 'MB' to show counts as MB (10^6 bytes), 'steps' to show them as they are.
 */
export function startProgress(label: string, enabled = true, unit: 'MB' | 'steps' = 'MB'): Progress {
  if (!enabled || !process.stderr.isTTY) return { update: () => undefined, stop: () => undefined };
  const cliProgress = loadCliProgress();
  const bar = new cliProgress.SingleBar({
    stream: process.stderr,
    format: `${label} [{bar}] {percentage}% | {doneText}/{totalText} ${unit} | {eta_formatted}`,
    hideCursor: true,
    clearOnComplete: true,
  }, cliProgress.Presets.shades_classic);
  let started = false;
  return {
    update(done, total) {
      const text = (n: number): string => (unit === 'MB' ? (n / 1e6).toFixed(1) : String(n));
      const payload = { doneText: text(done), totalText: text(total) };
      if (!started) {
        bar.start(Math.max(total, 1), done, payload);
        started = true;
      } else {
        bar.setTotal(Math.max(total, 1));
        bar.update(done, payload);
      }
    },
    stop() {
      if (started) bar.stop();
    },
  };
}
