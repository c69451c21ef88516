/**
 * `tzip verify FILE.tzip`: checks the container and decodes every frame, checking every digest.
 * Exits with code 2 when anything is wrong.
 */
import type { Command } from 'commander';
import { verifyFile } from '../restore.js';
import { EXIT_DATA } from './exit-codes.js';
import { formatGBps, formatSize, gbPerSecond } from './format.js';
import { threadsOption, type GlobalOptions } from './options.js';
import { printResult } from './output.js';
import { startProgress } from './progress.js';
import { printable } from '../printable.js';

interface VerifyOptions extends GlobalOptions {
  threads?: number;
}

/** Adds the `verify` command to `program`. */
export function registerVerify(program: Command): void {
  program
    .command('verify')
    .description('decode every frame of a .tzip file and check every checksum (exit 2 on any failure)')
    .argument('<file>', '.tzip file')
    .addOption(threadsOption())
    .action(async (file: string, _opts: unknown, cmd: Command) => {
      const opts = cmd.optsWithGlobals<VerifyOptions>();
      const progress = startProgress(file, opts.json !== true);
      let result;
      try {
        result = await verifyFile(file, { threads: opts.threads, onProgress: (d, t) => progress.update(d, t) });
      } finally {
        progress.stop();
      }
      const failures = result.entries.filter((e) => e.error !== undefined);
      printResult(opts.json, {
        command: 'verify',
        file,
        ok: result.ok,
        originalBytes: result.originalBytes,
        entries: result.entries.length,
        seconds: result.seconds,
        decodeGBps: gbPerSecond(result.originalBytes, result.seconds),
        failures: failures.map((f) => ({ name: f.entry.name, kind: f.entry.kind, code: f.error?.code, message: f.error?.message })),
      }, () => result.ok
        ? `${file}: OK: ${result.entries.length} entries, ${formatSize(result.originalBytes)} decoded and checked in ${result.seconds.toFixed(2)} s ` +
          `(${formatGBps(gbPerSecond(result.originalBytes, result.seconds))} GB/s)`
        : [`${file}: FAILED: ${failures.length} of ${result.entries.length} entries are bad`, ...failures.map((f) => `  ${printable(f.error?.message ?? '')}`)].join('\n'));
      if (!result.ok) process.exitCode = EXIT_DATA;
    });
}
