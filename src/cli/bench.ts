/**
 * `tzip bench [FILE...]`: per file and per dtype, tzip's codecs against zstd -1, zstd -3 and LZ4 on
 * the same tensor bytes in the same run. Reports the ratio (compressed / original, lower is better)
 * beside the order-0 entropy bound from the addon, and compress/decompress throughput in GB/s of
 * original bytes (median of the timed runs after a warm-up) with --threads threads and per core.
 * Every round trip is checked byte for byte; a mismatch exits with code 2.
 */
import { readdir } from 'node:fs/promises';
import { availableParallelism } from 'node:os';
import { join, relative } from 'node:path';
import { Option, type Command } from 'commander';
import { measureBaseline, measureTzip, type Measurement, type RunPlan, type Sample } from '../bench/measure.js';
import { isFloatDtype } from '../dtype.js';
import { planEntries } from '../entries.js';
import { TzipError, toTzipError } from '../errors.js';
import { describeMachine, machineInfo } from '../machine.js';
import { entropy, type Codec } from '../native.js';
import { packageRoot } from '../package-root.js';
import { openSafetensors } from '../safetensors.js';
import { EXIT_DATA } from './exit-codes.js';
import { formatBytes, formatGBps, formatSize } from './format.js';
import { parsePositiveInt, threadsOption, type GlobalOptions } from './options.js';
import { printResult } from './output.js';
import { startProgress, type Progress } from './progress.js';
import { makeTable } from './table.js';

interface BenchOptions extends GlobalOptions {
  threads?: number;
  runs: number;
  warmup: number;
}

/** All tensors of one codec dtype in one file, and what was measured on them. */
interface DtypeReport {
  dtype: string;
  tensors: number;
  bytes: number;
  /** Sum over the tensors of the addon's order-0 entropy bound, in bytes. */
  entropyBoundBytes: number;
  /** entropyBoundBytes / bytes. */
  entropyBoundRatio: number | null;
  results: Measurement[];
}

interface FileReport {
  file: string;
  fileBytes: number;
  dtypes: DtypeReport[];
}

/** Files benchmarked when none are given: `<package root>/data/demo/*.safetensors` (written by `npm run demo`). */
async function defaultFiles(): Promise<string[]> {
  const dir = join(packageRoot(), 'data', 'demo');
  let names: string[];
  try {
    names = await readdir(dir);
  } catch (err) {
    throw toTzipError(err, { file: dir });
  }
  const files = names.filter((n) => n.endsWith('.safetensors')).sort().map((n) => join(dir, n));
  if (files.length === 0) throw new TzipError('TZIP_IO', 'no .safetensors files here; run `npm run demo` first or name files', { file: dir });
  return files;
}

/** Reads a file's tensors (not its gaps) into memory, grouped by the dtype they are coded as. */
async function loadSamples(path: string): Promise<{ fileBytes: number; groups: Map<string, Sample[]> }> {
  const source = await openSafetensors(path);
  try {
    const groups = new Map<string, Sample[]>();
    for (const entry of planEntries(source.header)) {
      if (entry.kind !== 'tensor') continue;
      const bytes = await source.read(entry.begin, entry.end);
      const list = groups.get(entry.dtype) ?? [];
      list.push({ name: entry.name, dtype: entry.dtype, shape: entry.shape, bytes });
      groups.set(entry.dtype, list);
    }
    return { fileBytes: source.fileSize, groups };
  } finally {
    await source.close();
  }
}

async function benchFile(path: string, threads: number, plan: RunPlan, progress: Progress): Promise<FileReport> {
  // The zstd and LZ4 bindings load here, not when the CLI starts: `tzip serve` and the codec commands never need them.
  const { BASELINES, MISSING_BASELINES } = await import('../bench/baselines.js');
  for (const missing of MISSING_BASELINES) process.stderr.write(`tzip bench: left out ${missing}\n`);
  const { fileBytes, groups } = await loadSamples(path);
  const steps = [...groups.keys()].reduce((n, d) => n + (isFloatDtype(d) ? 2 : 3) + BASELINES.length, 0);
  let done = 0;
  const step = (): void => progress.update(++done, steps);
  progress.update(0, steps);
  const dtypes: DtypeReport[] = [];
  for (const [dtype, samples] of [...groups].sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0))) {
    const bytes = samples.reduce((s, x) => s + x.bytes.byteLength, 0);
    let entropyBoundBytes = 0;
    for (const s of samples) entropyBoundBytes += entropy(s.bytes, s.dtype).boundBytes;
    const codecs: Codec[] = isFloatDtype(dtype) ? ['fast', 'max'] : ['fast', 'max', 'bytes'];
    const results: Measurement[] = [];
    for (const codec of codecs) {
      try {
        results.push(await measureTzip(samples, codec, threads, plan));
        step();
      } catch (err) {
        throw toTzipError(err, { file: path });
      }
    }
    for (const baseline of BASELINES) {
      results.push(await measureBaseline(samples, baseline, plan));
      step();
    }
    dtypes.push({ dtype, tensors: samples.length, bytes, entropyBoundBytes, entropyBoundRatio: bytes === 0 ? null : entropyBoundBytes / bytes, results });
  }
  return { file: path, fileBytes, dtypes };
}

function ratioText(r: number | null): string {
  return r === null ? '-' : r.toFixed(4);
}

function renderFile(report: FileReport, threads: number): string {
  const table = makeTable(['dtype', 'size', 'codec', 'ratio', 'entropy bound', `compress GB/s (${threads} thr)`, `decompress GB/s (${threads} thr)`,
      'compress GB/s/core', 'decompress GB/s/core', 'round trip'], ['left', 'right', 'left', 'right', 'right', 'right', 'right', 'right', 'right', 'left']);
  for (const d of report.dtypes) {
    d.results.forEach((m, i) => {
      table.push([
        i === 0 ? `${d.dtype} (${d.tensors} tensors)` : '',
        i === 0 ? formatSize(d.bytes) : '',
        m.engine === 'tzip' ? `tzip ${m.codec}` : m.codec,
        ratioText(m.ratio),
        i === 0 ? ratioText(d.entropyBoundRatio) : '',
        formatGBps(m.parallel?.compressGBps ?? (m.engine === 'tzip' ? m.perCore.compressGBps : undefined)),
        formatGBps(m.parallel?.decompressGBps ?? (m.engine === 'tzip' ? m.perCore.decompressGBps : undefined)),
        formatGBps(m.perCore.compressGBps),
        formatGBps(m.perCore.decompressGBps),
        m.roundTripIdentical ? 'identical' : 'MISMATCH',
      ]);
    });
  }
  return `${report.file} (${formatSize(report.fileBytes)}, ${formatBytes(report.fileBytes)} bytes)\n${table.toString()}`;
}

/** Adds the `bench` command to `program`. */
export function registerBench(program: Command): void {
  program
    .command('bench')
    .description('measure ratio and GB/s of tzip codecs vs zstd -1/-3 and lz4 per file and dtype (default files: data/demo/*.safetensors)')
    .argument('[files...]', 'safetensors files')
    .addOption(threadsOption())
    .addOption(new Option('--runs <n>', 'timed runs per measurement; the median is reported').argParser(parsePositiveInt).default(5))
    .addOption(new Option('--warmup <n>', 'untimed runs before the timed ones').argParser((v) => (v === '0' ? 0 : parsePositiveInt(v))).default(1))
    .action(async (files: string[], _opts: unknown, cmd: Command) => {
      const opts = cmd.optsWithGlobals<BenchOptions>();
      const threads = opts.threads ?? availableParallelism();
      const plan: RunPlan = { runs: opts.runs, warmup: opts.warmup };
      const paths = files.length > 0 ? files : await defaultFiles();
      const machine = machineInfo();
      const commandLine = ['tzip', ...process.argv.slice(2)].join(' ');
      if (opts.json !== true) {
        process.stdout.write(`${commandLine}\n${describeMachine(machine)}\n` +
          `threads ${threads}; ${plan.runs} timed runs after ${plan.warmup} warm-up, median reported; ` +
          'ratio = compressed/original (lower is better); GB/s = 10^9 original bytes per second\n\n');
      }
      const reports: FileReport[] = [];
      for (const path of paths) {
        const progress = startProgress(`bench ${path}`, opts.json !== true, 'steps');
        let report: FileReport;
        try {
          report = await benchFile(path, threads, plan, progress);
        } finally {
          progress.stop();
        }
        reports.push(report);
        if (opts.json !== true) process.stdout.write(`${renderFile({ ...report, file: relative(process.cwd(), report.file) || report.file }, threads)}\n\n`);
      }
      const identical = reports.every((r) => r.dtypes.every((d) => d.results.every((m) => m.roundTripIdentical)));
      printResult(opts.json, { command: 'bench', commandLine, machine, threads, runs: plan.runs, warmup: plan.warmup, roundTripsIdentical: identical, files: reports },
        () => (identical ? 'every round trip was byte-identical' : 'round trip MISMATCH: see the table(s) above'));
      if (!identical) process.exitCode = EXIT_DATA;
    });
}
