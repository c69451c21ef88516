// The one error vocabulary (issue 15, item 6): src/errors.json is the table, and every other list of codes is checked
// against it here: the C++ enums (tzip::ErrorCode through the addon's compiled `errorCodes`, the enums of the generated
// header cuda/include/tzip/generated/constants.h), src/errors.ts, src/daemon/reply-error.ts, the error tables of docs/addon.md and docs/protocol.md, and every
// code literal in src/. (python-bridge/tests/test_error_codes.py checks the Python side.) Then out-of-memory really
// gets its own code: host allocations of the addon failing under a low RLIMIT_AS in a child process, and (GPU only)
// device allocations failing on a full GPU.
import { execFile } from 'node:child_process';
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { TZIP_ERROR_CODES, isOutOfMemory, toTzipError } from '../src/errors.js';
import { PROTOCOL_ERROR_CODES, REPLY_ERROR_CODES, toWireError } from '../src/daemon/reply-error.js';
import {
  addonAvailable,
  addonPath,
  compress,
  cudaMemGetInfo,
  gpu,
  gpuAlloc,
  gpuCompress,
  gpuCopyFromDevice,
  gpuCopyToDevice,
  gpuFree,
  maxCompressedSize,
} from '../src/native.js';
import { packageRoot } from '../src/package-root.js';
import { openSafetensors } from '../src/safetensors.js';

interface Row {
  name: string;
  value: number;
  layer: 'native' | 'files' | 'protocol';
  meaning: string;
  raised_by: string[];
  python?: string;
}

const ROOT = packageRoot();
const TABLE = (JSON.parse(readFileSync(join(ROOT, 'src', 'errors.json'), 'utf8')) as { codes: Row[] }).codes;
const NAMES = TABLE.map((r) => r.name);
const of = (layer: Row['layer']) => TABLE.filter((r) => r.layer === layer);
const RANGES: Record<Row['layer'], [number, number]> = { native: [1, 19], files: [20, 39], protocol: [40, 79] };
/** The C++ header generated from the table (scripts/gen-constants.mjs): tzip::ErrorCode, gpu::ErrorCode and the rest. */
const CPP_HEADER = 'cuda/include/tzip/generated/constants.h';
const RAISERS = new Set(['codec', 'gpu', 'addon', 'files', 'daemon', 'client']);

/** The `| CODE | ...` rows of the section of a markdown file that starts with `heading`, as arrays of cells. */
function tableRows(file: string, heading: string): string[][] {
  const text = readFileSync(join(ROOT, file), 'utf8');
  const start = text.indexOf(`\n${heading}\n`);
  expect(start, `${file} has a "${heading}" section`).toBeGreaterThanOrEqual(0);
  const rest = text.slice(start + heading.length + 2);
  const end = rest.search(/\n## /);
  return (end < 0 ? rest : rest.slice(0, end)).split('\n')
    .filter((l) => /^\| TZIP_/.test(l))
    .map((l) => l.split('|').slice(1, -1).map((c) => c.trim()));
}

/** `Name = value,  // TZIP_NAME` lines of the C++ enum `enumHead` ("enum class ErrorCode") in `file`. */
function enumEntries(file: string, enumHead: string): { name: string; value: number }[] {
  const text = readFileSync(join(ROOT, file), 'utf8');
  const start = text.indexOf(enumHead);
  expect(start, `${file} declares ${enumHead}`).toBeGreaterThanOrEqual(0);
  const body = text.slice(start, text.indexOf('};', start));
  return [...body.matchAll(/^\s*\w+ = (\d+),\s*\/\/ (TZIP_[A-Z_]+)/gm)].map((m) => ({ name: m[2]!, value: Number(m[1]) }));
}

/** What `f` throws (undefined if nothing). */
function thrown(f: () => unknown): unknown {
  try {
    f();
  } catch (err) {
    return err;
  }
  return undefined;
}

function tsFiles(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((e) =>
    e.isDirectory() ? tsFiles(join(dir, e.name)) : e.name.endsWith('.ts') ? [join(dir, e.name)] : []);
}

describe('src/errors.json, the one error table', () => {
  it('has unique names and stable values in its layer\'s range, in value order, each with a meaning and its raisers', () => {
    expect(new Set(NAMES).size).toBe(NAMES.length);
    expect(new Set(TABLE.map((r) => r.value)).size).toBe(TABLE.length);
    for (const r of TABLE) {
      expect(r.name, r.name).toMatch(/^TZIP_[A-Z]+(_[A-Z]+)*$/);
      const [lo, hi] = RANGES[r.layer];
      expect(Number.isInteger(r.value) && r.value >= lo && r.value <= hi, `${r.name}: value ${r.value} in ${lo}..${hi} (${r.layer})`).toBe(true);
      expect(r.meaning.length, `${r.name}: meaning`).toBeGreaterThan(10);
      expect(r.raised_by.length, `${r.name}: raised_by`).toBeGreaterThan(0);
      for (const who of r.raised_by) expect(RAISERS.has(who), `${r.name}: raiser ${who}`).toBe(true);
      if (r.layer === 'native') expect(r.raised_by.some((w) => ['codec', 'gpu', 'addon'].includes(w)), `${r.name}: native`).toBe(true);
    }
    const values = TABLE.map((r) => r.value);
    expect(values).toEqual([...values].sort((a, b) => a - b));
    // The values these codes were published with (never renumber one).
    expect(Object.fromEntries(TABLE.map((r) => [r.name, r.value]))).toMatchObject({
      TZIP_INVALID_ARGUMENT: 1, TZIP_CORRUPT: 2, TZIP_TRUNCATED: 3, TZIP_CHECKSUM: 4, TZIP_UNSUPPORTED: 5, TZIP_CUDA: 6,
      TZIP_OUT_OF_MEMORY: 7,
    });
  });

  it('TypeScript: TZIP_ERROR_CODES are its native and files rows, PROTOCOL_ERROR_CODES its protocol rows, replies carry all', () => {
    expect([...TZIP_ERROR_CODES]).toEqual([...of('native'), ...of('files')].map((r) => r.name));
    expect([...PROTOCOL_ERROR_CODES]).toEqual(of('protocol').map((r) => r.name));
    expect([...REPLY_ERROR_CODES]).toEqual(NAMES);
  });

  it('C++: the addon as built exports exactly the native rows (tzip::ErrorCode), and the generated header says the same', () => {
    const native = Object.fromEntries(of('native').map((r) => [r.name, r.value]));
    expect(enumEntries(CPP_HEADER, 'enum class ErrorCode')).toEqual(of('native').map(({ name, value }) => ({ name, value })));
    expect(enumEntries(CPP_HEADER, 'enum class FilesErrorCode')).toEqual(of('files').map(({ name, value }) => ({ name, value })));
    expect(enumEntries(CPP_HEADER, 'enum class ProtocolErrorCode')).toEqual(of('protocol').map(({ name, value }) => ({ name, value })));
    for (const e of enumEntries(CPP_HEADER, 'enum ErrorCode')) expect(native[e.name], `gpu::ErrorCode ${e.name}`).toBe(e.value);
    expect(enumEntries(CPP_HEADER, 'enum ErrorCode').map((e) => e.name)).toEqual(
      of('native').filter((r) => r.raised_by.includes('gpu')).map((r) => r.name));
    if (!addonAvailable()) return;
    const addon = createRequire(import.meta.url)(addonPath()) as { errorCodes?: Record<string, number> };
    expect(addon.errorCodes, 'the addon exports errorCodes (rebuild it: cmake-js build)').toEqual(native);
  });

  it('docs: docs/protocol.md "Errors" has one row per code in the table\'s order; docs/addon.md "Errors" the native rows with their values', () => {
    expect(tableRows('docs/protocol.md', '## Errors').map((c) => c[0])).toEqual(NAMES);
    expect(tableRows('docs/addon.md', '## Errors').map((c) => [c[0], Number(c[1])])).toEqual(of('native').map((r) => [r.name, r.value]));
  });

  it('every code literal in src/ is a code of the table', () => {
    const known = new Set(NAMES);
    const unknown: string[] = [];
    // Literals where a code goes (an error's constructor, a `code` field or comparison), not every TZIP_ string:
    // environment variables (TZIP_SOCKET, TZIP_SM_BUDGET, ...) share the prefix.
    const codeSite = /(?:Error\(\s*|\bcode\s*(?:===|!==|:|=)\s*|\bcode\s*\?\?\s*)['"`](TZIP_[A-Z0-9_]+)['"`]/g;
    for (const f of tsFiles(join(ROOT, 'src'))) {
      for (const m of readFileSync(f, 'utf8').matchAll(codeSite)) {
        if (!known.has(m[1]!)) unknown.push(`${f.slice(ROOT.length + 1)}: ${m[1]}`);
      }
    }
    expect(unknown).toEqual([]);
  });
});

describe('TZIP_OUT_OF_MEMORY', () => {
  it('toTzipError and the daemon\'s toWireError map allocation failures to it, and keep the addon\'s code', () => {
    const v8 = new RangeError('Array buffer allocation failed');
    const enomem = Object.assign(new Error('ENOMEM: not enough memory, mmap'), { code: 'ENOMEM', syscall: 'mmap' });
    const addon = Object.assign(new Error('out of memory: cannot allocate 9 bytes for the frame'), { code: 'TZIP_OUT_OF_MEMORY' });
    for (const err of [v8, enomem, addon]) {
      expect(isOutOfMemory(err) || err === addon).toBe(true);
      expect(toTzipError(err, { file: 'x.tzip' })).toMatchObject({ code: 'TZIP_OUT_OF_MEMORY', file: 'x.tzip' });
      expect(toWireError(err, 3)).toMatchObject({ code: 'TZIP_OUT_OF_MEMORY', index: 3 });
    }
    expect(isOutOfMemory(new RangeError('Invalid array length'))).toBe(false);
    expect(toWireError(new TypeError('oops')).code).toBe('TZIP_INTERNAL');
  });

  const prlimit = ['/usr/bin/prlimit', '/bin/prlimit'].find((p) => existsSync(p));
  const hostSkip = !addonAvailable() ? 'the native addon is not built' : process.platform !== 'linux' ? 'needs Linux'
    : prlimit === undefined ? 'needs prlimit (util-linux)' : '';
  it.skipIf(hostSkip !== '')(`host allocations of the addon that fail under RLIMIT_AS (a child process) reject with it${hostSkip ? ` (skipped: ${hostSkip})` : ''}`, async () => {
    // The child compresses 64 MiB of bytes once, then lowers its own address-space limit to 32 MiB above what it maps
    // now (prlimit on its pid; the soft limit only, so that it can raise it again), so that neither the 64 MiB frame
    // of compress() nor the 64 MiB Buffer of decompress() without `out` can be allocated; afterwards it raises the
    // limit again and both work: the process stayed sound.
    const child = `
      const fs = require('node:fs');
      const { execFileSync } = require('node:child_process');
      const a = require(${JSON.stringify(addonPath())});
      const vmSize = () => Number(/VmSize:\\s+(\\d+)/.exec(fs.readFileSync('/proc/self/status', 'utf8'))[1]) * 1024;
      const limit = (as) => execFileSync(${JSON.stringify(prlimit)}, ['--pid', String(process.pid), '--as=' + as + ':']);
      const outcome = (p) => p.then((b) => ({ ok: b.length }), (e) => ({ code: e.code, message: e.message }));
      (async () => {
        const n = 64 << 20;
        const input = Buffer.alloc(n, 7);
        const opts = { dtype: 'U8', shape: [n], codec: 'bytes', inline: true };
        const frame = await a.compress(input, opts);
        limit(vmSize() + (32 << 20));
        const r = { compress: await outcome(a.compress(input, opts)), decompress: await outcome(a.decompress(frame, { inline: true })) };
        limit('unlimited');
        const back = await a.decompress(await a.compress(input, opts), { inline: true });
        r.after = back.equals(input);
        process.stdout.write(JSON.stringify(r));
      })().catch((e) => { process.stdout.write(JSON.stringify({ failed: String(e && e.stack) })); });`;
    const out = await new Promise<string>((resolve, reject) => {
      // The new space fixed at 16 MiB per semi-space (min = max: V8 never resizes it), so that V8's own heap never
      // has to commit more pages under the limit: with a growing new space the child itself died at random ("Committing
      // semi space failed") instead of the addon's allocations failing.
      execFile(process.execPath, ['--min-semi-space-size=16', '--max-semi-space-size=16', '-e', child], { timeout: 60_000 }, (err, stdout, stderr) =>
        err ? reject(new Error(`${err.message}\n${stderr}`)) : resolve(stdout));
    });
    const r = JSON.parse(out) as Record<string, unknown>;
    expect(r).toMatchObject({
      compress: { code: 'TZIP_OUT_OF_MEMORY', message: expect.stringMatching(/cannot allocate \d+ bytes for the frame/) },
      decompress: { code: 'TZIP_OUT_OF_MEMORY', message: expect.stringMatching(/cannot allocate 67108864 bytes for the decoded tensor/) },
      after: true,
    });
  });

  const probe = addonAvailable() ? gpu() : { available: false, reason: 'the native addon is not built', devices: [] };
  const gpuSkip = probe.available ? '' : ` (skipped: no GPU: ${probe.reason})`;
  it.skipIf(!probe.available)(`GPU: cudaMalloc of more than the device has rejects with it, and the next allocation works${gpuSkip}`, () => {
    const DEV = 0;
    expect(thrown(() => gpuAlloc(DEV, cudaMemGetInfo(DEV).total + 2 ** 30))).toMatchObject({ code: 'TZIP_OUT_OF_MEMORY' });
    const p = gpuAlloc(DEV, 1 << 20);
    gpuFree(p, DEV);
  });

  // Filling the GPU would make GPU tests of other files running at the same time fail: opt in, and run this file alone.
  const fill = process.env.TZIP_TEST_FILL_GPU === '1';
  const fillSkip = !probe.available ? gpuSkip
    : fill ? '' : ' (skipped: it fills the whole GPU for a moment; run this file alone with TZIP_TEST_FILL_GPU=1)';
  it.skipIf(!probe.available || !fill)(`GPU: the GPU codec's scratch memory on a full device rejects with it; then the codec works${fillSkip}`, async () => {
    const DEV = 0;
    // A real tensor (the MiniLM word embeddings, bf16) and its frame's memory, before the device is filled.
    const file = await openSafetensors(join(ROOT, 'data', 'demo', 'minilm-weights-bf16.safetensors'));
    const t = file.header.tensors.reduce((a, b) => (b.end - b.begin > a.end - a.begin ? b : a));
    const bytes = await file.read(t.begin, t.end);
    await file.close();
    const cap = maxCompressedSize(bytes.length, t.codecShape.length);
    const data = gpuAlloc(DEV, bytes.length);
    const frame = gpuAlloc(DEV, cap);
    gpuCopyToDevice(data, bytes, DEV);
    const item = { data, nbytes: bytes.length, dtype: t.codecDtype, codec: 'max' as const, shape: t.codecShape, frame, frameCapacity: cap };
    // Fill the device: this is the first GPU codec call of this process (vitest runs each file in its own), so the
    // codec has no scratch memory cached yet and must allocate it.
    const filler: bigint[] = [];
    try {
      for (let size = 2 ** 30; size >= 2 ** 16; size /= 4) {
        for (;;) {
          try {
            filler.push(gpuAlloc(DEV, size));
          } catch (err) {
            expect(err).toMatchObject({ code: 'TZIP_OUT_OF_MEMORY' });
            break;
          }
        }
      }
      await expect(gpuCompress([item], { device: DEV })).rejects.toMatchObject({ code: 'TZIP_OUT_OF_MEMORY' });
    } finally {
      for (const p of filler) gpuFree(p, DEV);
    }
    const [written] = await gpuCompress([item], { device: DEV });
    const gpuFrame = gpuCopyFromDevice(frame, Number(written!.frameBytes), DEV);
    const cpuFrame = await compress(bytes, { dtype: t.codecDtype, shape: t.codecShape, codec: 'max' });
    expect(Buffer.compare(gpuFrame, cpuFrame), 'GPU frame equals the CPU frame byte for byte').toBe(0);
    gpuFree(data, DEV);
    gpuFree(frame, DEV);
  });
});
