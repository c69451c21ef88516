/**
 * `tzip verify FILE.tzip`: checks the container and decodes every frame, checking every digest.
 * `tzip verify DIR`: the same for every .tzip shard of a folder `tzip compress DIR` wrote, and every
 * `*.safetensors.index.json` there against the shards (each tensor it names is in its shard).
 * Exits with code 2 when anything is wrong.
 */
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import type { Command } from 'commander';
import { TzipError } from '../errors.js';
import { checkIndexes, INDEX_SUFFIX, isFolder, listFolder, TZIP_SUFFIX } from '../folder.js';
import { openTzip } from '../reader.js';
import { verifyFile, type VerifyFileResult } from '../restore.js';
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
    .description('decode every frame of a .tzip file and check every checksum (exit 2 on any failure); ' +
      'for a compressed checkpoint folder, every shard, and its index against the shards')
    .argument('<file>', '.tzip file, or a folder that `tzip compress DIR` wrote')
    .addOption(threadsOption())
    .action(async (file: string, _opts: unknown, cmd: Command) => {
      const opts = cmd.optsWithGlobals<VerifyOptions>();
      if (await isFolder(file)) {
        await verifyFolder(file, opts);
        return;
      }
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

/** Error codes that say a shard's bytes are bad (exit 2), as verifyFile reports a frame's; others stop the check. */
const DATA_ERRORS: ReadonlySet<string> = new Set(['TZIP_CORRUPT', 'TZIP_TRUNCATED', 'TZIP_CHECKSUM', 'TZIP_UNSUPPORTED']);

/** One shard's outcome in {@link verifyFolder}: its check, or the error that its container raised on opening. */
interface ShardCheck {
  name: string;
  result: VerifyFileResult | undefined;
  error: TzipError | undefined;
}

/**
 * `tzip verify DIR`: every .tzip shard checked as `tzip verify FILE` checks it (a shard whose container is damaged is a
 * failure of that shard; the others are still checked), then the indexes against the shards. Other files are carried
 * verbatim and have no digest of their own: they are listed as not checked.
 */
async function verifyFolder(dir: string, opts: VerifyOptions): Promise<void> {
  const started = performance.now();
  const files = await listFolder(dir, { shardSuffix: TZIP_SUFFIX });
  const checks: ShardCheck[] = [];
  for (const f of files.filter((x) => x.kind === 'shard')) {
    const progress = startProgress(f.path, opts.json !== true);
    try {
      checks.push({ name: f.name, result: await verifyFile(f.path, { threads: opts.threads, onProgress: (d, t) => progress.update(d, t) }), error: undefined });
    } catch (err) {
      if (!(err instanceof TzipError) || !DATA_ERRORS.has(err.code)) throw err;
      checks.push({ name: f.name, result: undefined, error: err });
    } finally {
      progress.stop();
    }
  }
  const indexProblems = await checkIndexes(files, async (name) => {
    const check = checks.find((c) => c.name === name);
    if (check?.result === undefined) return null; // its container is damaged: already a failure of its own
    const reader = await openTzip(join(dir, name));
    try {
      return new Set(reader.tensorNames());
    } finally {
      await reader.close();
    }
  });
  const seconds = (performance.now() - started) / 1000;
  const originalBytes = checks.reduce((s, c) => s + (c.result?.originalBytes ?? 0), 0);
  const entries = checks.reduce((s, c) => s + (c.result?.entries.length ?? 0), 0);
  const shardOk = (c: ShardCheck): boolean => c.result?.ok === true;
  const ok = checks.every(shardOk) && indexProblems.length === 0;
  const failuresOf = (c: ShardCheck) => c.error !== undefined
    ? [{ name: null, kind: 'container', code: c.error.code, message: c.error.message }]
    : (c.result?.entries ?? []).filter((e) => e.error !== undefined)
      .map((e) => ({ name: e.entry.name, kind: e.entry.kind, code: e.error?.code, message: e.error?.message }));
  printResult(opts.json, {
    command: 'verify',
    file: dir,
    folder: true,
    ok,
    originalBytes,
    entries,
    seconds,
    decodeGBps: gbPerSecond(originalBytes, seconds),
    shards: checks.map((c) => ({
      file: c.name, ok: shardOk(c), originalBytes: c.result?.originalBytes ?? null, entries: c.result?.entries.length ?? null, failures: failuresOf(c),
    })),
    indexProblems,
    notChecked: files.filter((f) => f.kind === 'other').map((f) => f.name),
  }, () => [
    ...checks.map((c) => shardOk(c)
      ? `  ${printable(c.name)}: OK: ${c.result?.entries.length ?? 0} entries, ${formatSize(c.result?.originalBytes ?? 0)} decoded and checked`
      : [`  ${printable(c.name)}: FAILED`, ...failuresOf(c).map((f) => `    ${printable(f.message ?? '')}`)].join('\n')),
    ...indexProblems.map((p) => `  ${printable(p.index)}: FAILED: ${printable(p.message)}`),
    ...files.filter((f) => f.kind === 'other').map((f) => f.name.endsWith(INDEX_SUFFIX)
      ? (indexProblems.some((p) => p.index === f.name) ? '' : `  ${printable(f.name)}: OK: every tensor it names is in its shard`)
      : `  ${printable(f.name)}: not a shard, carried unchanged (no digest to check)`).filter((line) => line !== ''),
    ok
      ? `${printable(dir)}: OK: ${checks.length} shards, ${entries} entries, ${formatSize(originalBytes)} decoded and checked in ${seconds.toFixed(2)} s ` +
        `(${formatGBps(gbPerSecond(originalBytes, seconds))} GB/s)`
      : `${printable(dir)}: FAILED: ${checks.filter((c) => !shardOk(c)).length} of ${checks.length} shards bad, ${indexProblems.length} index problems`,
  ].join('\n'));
  if (!ok) process.exitCode = EXIT_DATA;
}
