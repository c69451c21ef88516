/**
 * Replays the fuzz targets' reproducers (fuzz/regressions/<target>/, one file per crash found and fixed) and real
 * streams through the checks the fuzzers run (fuzz/js/targets.mjs, on dist/): a crash found once stays fixed, and
 * real inputs pass as accepted, so the checks are not vacuous. Native frame reproducers go through the addon.
 */
import { existsSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, describe, expect, it } from 'vitest';
import { TARGETS, cleanup } from '../fuzz/js/targets.mjs';
import { TzipError } from '../src/errors.js';
import { decompress, readHeader } from '../src/native.js';
import { openSafetensors } from '../src/safetensors.js';
import { compressFile } from '../src/writer.js';
import { buildSafetensors, type TensorPiece } from './helpers/safetensors-builder.js';
import { useTempDir } from './helpers/temp-dir.js';

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..');
const REGRESSIONS = join(ROOT, 'fuzz', 'regressions');
const reproducers = (target: string): string[] => {
  const dir = join(REGRESSIONS, target);
  return existsSync(dir) ? readdirSync(dir).sort().map((f) => join(dir, f)) : [];
};
const tmp = useTempDir('fuzz-regressions');
afterAll(() => cleanup());

describe.each(['container', 'safetensors', 'protocol'] as const)('js_%s reproducers', (name) => {
  const files = reproducers(`js_${name}`);
  it.skipIf(files.length === 0)(`replay (${files.length} files)`, async () => {
    for (const f of files) await TARGETS[name].check(readFileSync(f));
  });
});

describe.each(['fuzz_frame', 'fuzz_header'])('%s reproducers through the addon', (target) => {
  const files = reproducers(target);
  it.skipIf(files.length === 0)(`replay (${files.length} files)`, async () => {
    for (const f of files) {
      const bytes = readFileSync(f);
      try {
        readHeader(bytes);
        await decompress(bytes, { threads: 1 });
      } catch (err) {
        expect(err).toBeInstanceOf(TzipError);
      }
    }
  });
});

describe('real streams pass the fuzz checks as accepted inputs', () => {
  it('messages recorded from the Python client (fuzz/seeds/protocol)', async () => {
    const dir = join(ROOT, 'fuzz', 'seeds', 'protocol');
    const files = readdirSync(dir);
    expect(files.length).toBeGreaterThan(5);
    for (const f of files) expect(await TARGETS.protocol.check(readFileSync(join(dir, f))), f).toBe(true);
  });

  it('a safetensors file of MiniLM tensors and its .tzip; cut, both are refused as documented', async () => {
    const model = join(ROOT, 'data', 'demo', 'minilm-weights-bf16.safetensors');
    const file = await openSafetensors(model);
    const pieces: TensorPiece[] = [];
    try {
      for (const t of file.header.tensors.slice(0, 5)) {
        const n = Math.min((t.end - t.begin) / 2, 1000);
        pieces.push({ kind: 'tensor', name: t.name, dtype: t.dtype, shape: [n], bytes: await file.read(t.begin, t.begin + 2 * n) });
      }
    } finally {
      await file.close();
    }
    const st = buildSafetensors(pieces, { metadata: { format: 'pt' } });
    const stPath = join(tmp(), 'real.safetensors'), tzPath = join(tmp(), 'real.tzip');
    writeFileSync(stPath, st);
    await compressFile(stPath, tzPath, { codec: 'max', chunkSize: 4096, threads: 1 });
    const tz = readFileSync(tzPath);
    expect(await TARGETS.safetensors.check(st)).toBe(true);
    expect(await TARGETS.container.check(tz)).toBe(true);
    expect(await TARGETS.safetensors.check(st.subarray(0, st.byteLength - 1))).toBe(false);
    expect(await TARGETS.container.check(tz.subarray(0, tz.byteLength - 1))).toBe(false);
  });
});
