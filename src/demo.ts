/**
 * `npm run demo`: writes the four real demo files (all-MiniLM-L6-v2 weights and gradients, F32 and
 * BF16) with `.venv/bin/python -m tzip.demo_data --out data/demo`, then for each file and codec
 * (auto, max): compress, verify, decompress, and compare the SHA-256 of the original and the round
 * trip. Prints one table; exits with code 2 if any round trip is not byte-identical.
 * Outputs stay in data/demo/out/.
 */
import { spawnSync } from 'node:child_process';
import { mkdir } from 'node:fs/promises';
import { basename, join } from 'node:path';
import { formatGBps, formatRatio, gbPerSecond } from './cli/format.js';
import { makeTable } from './cli/table.js';
import { planEntries } from './entries.js';
import { TzipError } from './errors.js';
import { sha256File } from './file-digest.js';
import { describeMachine, machineInfo } from './machine.js';
import { entropy, type Codec } from './native.js';
import { packageRoot } from './package-root.js';
import { decompressFile, verifyFile } from './restore.js';
import { openSafetensors } from './safetensors.js';
import { compressFile } from './writer.js';

/** The files tzip.demo_data writes, in report order. */
const DEMO_FILES = ['minilm-weights-f32', 'minilm-weights-bf16', 'minilm-grads-f32', 'minilm-grads-bf16'];
const CODECS: Codec[] = ['auto', 'max'];

/** What the demo measured for one file and codec. Sizes in bytes, throughput in GB/s (10^9 original bytes/s). */
interface DemoRow {
  file: string;
  /** dtypes of the file's tensors, most bytes first. */
  dtypes: string[];
  bytes: number;
  codec: Codec;
  compressedBytes: number;
  /** (header bytes + sum of the order-0 entropy bounds of all entries) / file size. */
  entropyBoundRatio: number;
  compressGBps: number;
  decompressGBps: number;
  verified: boolean;
  identical: boolean;
}

/**
 * The order-0 entropy bound of a whole safetensors file in bytes: its header verbatim plus the addon's
 * entropy bound of every entry (tensors by their dtype, gaps as U8); also the file's dtypes by byte count.
 */
async function entropyBound(path: string): Promise<{ boundBytes: number; dtypes: string[] }> {
  const source = await openSafetensors(path);
  try {
    let boundBytes = source.headerBytes.byteLength;
    const bytesByDtype = new Map<string, number>();
    for (const entry of planEntries(source.header)) {
      boundBytes += entropy(await source.read(entry.begin, entry.end), entry.dtype).boundBytes;
      if (entry.kind === 'tensor') bytesByDtype.set(entry.fileDtype, (bytesByDtype.get(entry.fileDtype) ?? 0) + entry.end - entry.begin);
    }
    return { boundBytes, dtypes: [...bytesByDtype].sort((a, b) => b[1] - a[1]).map(([d]) => d) };
  } finally {
    await source.close();
  }
}

function writeDemoData(root: string, outDir: string): void {
  const python = join(root, '.venv', 'bin', 'python');
  const result = spawnSync(python, ['-m', 'tzip.demo_data', '--out', outDir], { cwd: root, stdio: 'inherit' });
  if (result.error !== undefined) throw new TzipError('TZIP_IO', `cannot run: ${result.error.message} (run \`bash scripts/setup.sh\`)`, { file: python });
  if (result.status !== 0) throw new TzipError('TZIP_IO', `python -m tzip.demo_data exited with status ${result.status ?? result.signal}`, { file: outDir });
}

async function runFile(path: string, outDir: string, codec: Codec, bound: { boundBytes: number; dtypes: string[] }): Promise<DemoRow> {
  const name = basename(path, '.safetensors');
  const tzipPath = join(outDir, `${name}.${codec}.tzip`);
  const roundTripPath = join(outDir, `${name}.${codec}.roundtrip.safetensors`);
  const compressed = await compressFile(path, tzipPath, { codec });
  const verified = await verifyFile(tzipPath);
  const restored = await decompressFile(tzipPath, roundTripPath);
  const [a, b] = await Promise.all([sha256File(path), sha256File(roundTripPath)]);
  return {
    file: name,
    dtypes: bound.dtypes,
    bytes: compressed.inputBytes,
    codec,
    compressedBytes: compressed.outputBytes,
    entropyBoundRatio: bound.boundBytes / compressed.inputBytes,
    compressGBps: gbPerSecond(compressed.inputBytes, compressed.seconds),
    decompressGBps: gbPerSecond(restored.outputBytes, restored.seconds),
    verified: verified.ok,
    identical: a === b,
  };
}

async function main(): Promise<number> {
  const root = packageRoot();
  const dataDir = join(root, 'data', 'demo');
  const outDir = join(dataDir, 'out');
  writeDemoData(root, dataDir);
  await mkdir(outDir, { recursive: true });
  process.stdout.write(`\n${describeMachine(machineInfo())}\n`);

  const rows: DemoRow[] = [];
  for (const name of DEMO_FILES) {
    const path = join(dataDir, `${name}.safetensors`);
    const bound = await entropyBound(path);
    for (const codec of CODECS) {
      process.stderr.write(`demo: ${name} codec ${codec}...\n`);
      rows.push(await runFile(path, outDir, codec, bound));
    }
  }

  const table = makeTable(
    ['file', 'dtype', 'MB', 'codec', 'ratio', 'entropy bound', 'compress GB/s', 'decompress GB/s', 'verify', 'sha256 identical'],
    ['left', 'left', 'right', 'left', 'right', 'right', 'right', 'right', 'left', 'left'],
  );
  for (const r of rows) {
    table.push([r.file, r.dtypes.join('+'), (r.bytes / 1e6).toFixed(2), r.codec, formatRatio(r.compressedBytes, r.bytes),
      r.entropyBoundRatio.toFixed(4), formatGBps(r.compressGBps), formatGBps(r.decompressGBps), r.verified ? 'ok' : 'FAILED', r.identical ? 'yes' : 'NO']);
  }
  process.stdout.write(`${table.toString()}\n` +
    'ratio = .tzip size / original size (lower is better); entropy bound = order-0 bound of the same fields, same denominator;\n' +
    `GB/s = 10^9 original bytes per second of one whole-file run with all cores (wall clock); MB = 10^6 bytes. Outputs: ${outDir}\n`);
  const ok = rows.every((r) => r.identical && r.verified);
  if (!ok) process.stderr.write('demo: a round trip was NOT byte-identical or did not verify\n');
  return ok ? 0 : 2;
}

try {
  process.exitCode = await main();
} catch (err) {
  process.stderr.write(`demo: ${err instanceof Error ? err.message : String(err)}\n`);
  process.exitCode = err instanceof TzipError && err.code === 'TZIP_IO' ? 3 : 2;
}
