// `tzip compress DIR -o OUT` and the other commands on checkpoint folders (src/folder.ts), on a real sharded Hugging
// Face layout: the bundled MiniLM bf16 weights split into 3 safetensors shards with model.safetensors.index.json,
// config.json, tokenizer files (text and binary), an empty file and a hidden one. Files are compared by sha256.
import { createHash, randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { cp, mkdir, readdir, readFile, rm, symlink, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { beforeAll, describe, expect, it } from 'vitest';
import { openSafetensors } from '../src/safetensors.js';
import { ensureBuilt, runTzip } from './helpers/cli.js';
import { buildSafetensors, flip, type TensorPiece } from './helpers/safetensors-builder.js';
import { useTempDir } from './helpers/temp-dir.js';

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const MODEL = join(ROOT, 'data', 'demo', 'minilm-weights-bf16.safetensors');
const SHARDS = ['model-00001-of-00003.safetensors', 'model-00002-of-00003.safetensors', 'model-00003-of-00003.safetensors'];
const OTHERS: Record<string, Buffer> = {
  'config.json': Buffer.from('{\n  "architectures": ["BertModel"],\n  "hidden_size": 384\n}'), // no final newline on purpose
  'tokenizer_config.json': Buffer.from('{"do_lower_case": true}\n'),
  'tokenizer.model': randomBytes(3000), // binary, as sentencepiece models are
  'added_tokens.json': Buffer.alloc(0),
  '.gitattributes': Buffer.from('*.safetensors filter=lfs diff=lfs merge=lfs -text\n'),
};

const tmp = useTempDir('cli-folders');
const run = (...args: string[]) => runTzip(args, tmp());
const sha256 = (b: Uint8Array): string => createHash('sha256').update(b).digest('hex');

/** sha256 of every file of `dir`, by name. */
async function digests(dir: string): Promise<Record<string, string>> {
  const out: Record<string, string> = {};
  for (const name of (await readdir(dir)).sort()) out[name] = sha256(await readFile(join(dir, name)));
  return out;
}

/** Tensor names of each shard, by shard name. */
const tensorsOf: Record<string, string[]> = {};

/** Writes the checkpoint folder `ckpt` under the temp folder: the model's tensors in 3 shards of unequal sizes. */
async function makeCheckpoint(): Promise<void> {
  const dir = join(tmp(), 'ckpt');
  await mkdir(dir);
  const model = await openSafetensors(MODEL);
  try {
    const tensors = model.header.tensors;
    const cuts = [0, 30, 75, tensors.length];
    const weightMap: Record<string, string> = {};
    for (const [i, name] of SHARDS.entries()) {
      const pieces: TensorPiece[] = [];
      for (const t of tensors.slice(cuts[i], cuts[i + 1])) {
        pieces.push({ kind: 'tensor', name: t.name, dtype: t.dtype, shape: t.shape, bytes: await model.read(t.begin, t.end) });
        weightMap[t.name] = name;
      }
      tensorsOf[name] = pieces.map((p) => p.name);
      await writeFile(join(dir, name), buildSafetensors(pieces, { metadata: { format: 'pt' } }));
    }
    const total = tensors.reduce((s, t) => s + t.end - t.begin, 0);
    await writeFile(join(dir, 'model.safetensors.index.json'), `${JSON.stringify({ metadata: { total_size: total }, weight_map: weightMap }, null, 2)}\n`);
  } finally {
    await model.close();
  }
  for (const [name, bytes] of Object.entries(OTHERS)) await writeFile(join(dir, name), bytes);
}

describe.skipIf(!existsSync(MODEL))('tzip on a checkpoint folder', () => {
  let original: Record<string, string>;

  beforeAll(async () => {
    ensureBuilt();
    await makeCheckpoint();
    original = await digests(join(tmp(), 'ckpt'));
  }, 120_000);

  it('compresses each shard to NAME.tzip, copies the other files, and decompresses every file byte-identically', async () => {
    const c = await run('compress', 'ckpt', '-o', 'packed', '--threads', '2');
    expect([c.code, c.stderr]).toEqual([0, '']);
    expect(c.stdout).toMatch(/ckpt \(.*\) -> packed \(.*\): 3 shards \(ratio 0\.6\d+\), 6 other files copied/);

    const packed = await digests(join(tmp(), 'packed'));
    const tzipNames = SHARDS.map((s) => s.replace(/\.safetensors$/, '.tzip'));
    expect(Object.keys(packed).sort()).toEqual([...tzipNames, ...Object.keys(OTHERS), 'model.safetensors.index.json'].sort());
    // The index and every other file are carried unchanged: it still names the shards by their safetensors names.
    for (const name of [...Object.keys(OTHERS), 'model.safetensors.index.json']) expect(packed[name], name).toBe(original[name]);

    // Each shard is an ordinary .tzip file: the single-file commands read it.
    const one = await run('decompress', join('packed', tzipNames[1] as string), '-o', 'one.safetensors');
    expect(one.code).toBe(0);
    expect(sha256(await readFile(join(tmp(), 'one.safetensors')))).toBe(original[SHARDS[1] as string]);

    const d = await run('decompress', 'packed', '-o', 'restored');
    expect([d.code, d.stderr]).toEqual([0, '']);
    expect(d.stdout).toContain('packed');
    expect(await digests(join(tmp(), 'restored'))).toEqual(original);
  }, 120_000);

  it('prints one JSON document listing every file with --json', async () => {
    const c = await run('--json', 'compress', 'ckpt', '-o', 'j-packed');
    expect(c.code).toBe(0);
    const doc = JSON.parse(c.stdout) as { folder: boolean; shards: number; copied: number; files: { name: string; output: string; kind: string; entries: number }[] };
    expect(doc).toMatchObject({ folder: true, shards: 3, copied: 6 });
    expect(doc.files.filter((f) => f.kind === 'shard').map((f) => [f.name, f.output, f.entries]))
      .toEqual(SHARDS.map((s) => [s, s.replace('.safetensors', '.tzip'), tensorsOf[s]?.length]));
    expect(doc.files.filter((f) => f.kind === 'copied').every((f) => f.name === f.output)).toBe(true);

    const d = JSON.parse((await run('decompress', 'j-packed', '-o', 'j-restored', '--json')).stdout) as { outputBytes: number; files: { kind: string }[] };
    expect(d.files).toHaveLength(Object.keys(original).length);
    expect(await digests(join(tmp(), 'j-restored'))).toEqual(original);
  }, 120_000);

  it('verifies every shard and the index against the shards; a damaged shard or a missing one fails with exit 2', async () => {
    await run('compress', 'ckpt', '-o', 'v');
    const ok = await run('verify', 'v');
    expect(ok.code).toBe(0);
    for (const s of SHARDS) expect(ok.stdout).toContain(`${s.replace('.safetensors', '.tzip')}: OK`);
    expect(ok.stdout).toContain('model.safetensors.index.json: OK');
    expect(ok.stdout).toMatch(/^v: OK: 3 shards, 104 entries/m);
    const okDoc = JSON.parse((await run('verify', 'v', '--json')).stdout) as { ok: boolean; shards: { ok: boolean }[]; indexProblems: unknown[]; notChecked: string[] };
    expect(okDoc).toMatchObject({ ok: true, indexProblems: [] });
    expect(okDoc.shards.map((s) => s.ok)).toEqual([true, true, true]);
    expect(okDoc.notChecked).toContain('config.json');

    // One flipped bit in the middle of the second shard's frames: that shard fails, naming a tensor; the others pass.
    await cp(join(tmp(), 'v'), join(tmp(), 'v-bad'), { recursive: true });
    const shard2 = join(tmp(), 'v-bad', 'model-00002-of-00003.tzip');
    const bytes = await readFile(shard2);
    flip(bytes, Math.floor(bytes.byteLength / 2), 0x10);
    await writeFile(shard2, bytes);
    const bad = await run('verify', 'v-bad', '--json');
    expect(bad.code).toBe(2);
    const badDoc = JSON.parse(bad.stdout) as { ok: boolean; shards: { file: string; ok: boolean; failures: { name: string }[] }[] };
    expect(badDoc.ok).toBe(false);
    expect(badDoc.shards.map((s) => s.ok)).toEqual([true, false, true]);
    expect(tensorsOf[SHARDS[1] as string]).toContain(badDoc.shards[1]?.failures[0]?.name);

    // A shard the index names is gone: one problem for that shard, exit 2.
    await cp(join(tmp(), 'v'), join(tmp(), 'v-missing'), { recursive: true });
    await rm(join(tmp(), 'v-missing', 'model-00003-of-00003.tzip'));
    const missing = await run('verify', 'v-missing');
    expect(missing.code).toBe(2);
    expect(missing.stdout).toContain(`model.safetensors.index.json: FAILED: names model-00003-of-00003.safetensors for ${tensorsOf[SHARDS[2] as string]?.length} tensors, and model-00003-of-00003.tzip is missing`);
  }, 120_000);

  it('inspects every shard of a folder', async () => {
    await run('compress', 'ckpt', '-o', 'i');
    const text = await run('inspect', 'i');
    expect(text.code).toBe(0);
    for (const s of SHARDS) expect(text.stdout).toContain(join('i', s.replace('.safetensors', '.tzip')));
    expect(text.stdout).toContain(join('i', 'config.json'));
    expect(text.stdout).toMatch(/^i: 3 shards, 104 tensors, original .* ratio 0\.6\d+; 6 other files$/m);
    const doc = JSON.parse((await run('--json', 'inspect', 'i')).stdout) as { folder: boolean; tensorCount: number; shards: { file: string; entries: { name: string }[] }[]; others: { name: string; bytes: number }[] };
    expect(doc.tensorCount).toBe(104);
    expect(doc.shards.map((s) => s.entries.map((e) => e.name).sort())).toEqual(SHARDS.map((s) => [...(tensorsOf[s] ?? [])].sort()));
    expect(doc.others.find((o) => o.name === 'tokenizer.model')?.bytes).toBe(3000);
  }, 120_000);

  it('takes a link to a file of the same folder as that file, and an empty output folder', async () => {
    const dir = join(tmp(), 'linked');
    await cp(join(tmp(), 'ckpt'), dir, { recursive: true });
    await symlink('config.json', join(dir, 'generation_config.json'));
    await mkdir(join(tmp(), 'empty-out'));
    const c = await run('compress', 'linked', '-o', 'empty-out');
    expect([c.code, c.stderr]).toEqual([0, '']);
    const d = await run('decompress', 'empty-out', '-o', 'linked-back');
    expect(d.code).toBe(0);
    const back = await digests(join(tmp(), 'linked-back'));
    expect(back['generation_config.json']).toBe(original['config.json']);
    expect(back).toEqual({ ...original, 'generation_config.json': original['config.json'] });
  }, 120_000);

  describe('refusals (exit 1, naming the file; no output folder written)', () => {
    /** A copy of the checkpoint under `name`, changed by `change`. */
    async function variant(name: string, change: (dir: string) => Promise<void>): Promise<void> {
      const dir = join(tmp(), name);
      await cp(join(tmp(), 'ckpt'), dir, { recursive: true });
      await change(dir);
    }
    /** Names of the temp folder's entries that start with `.` and end with `.tmp` (left-over temporary folders). */
    const leftovers = async (): Promise<string[]> => (await readdir(tmp())).filter((n) => n.startsWith('.') && n.endsWith('.tmp'));

    it('an output folder that exists and is not empty, or is a file', async () => {
      await mkdir(join(tmp(), 'full'));
      await writeFile(join(tmp(), 'full', 'keep.txt'), 'mine');
      const r = await run('compress', 'ckpt', '-o', 'full');
      expect(r.code).toBe(1);
      expect(r.stderr).toContain('tzip: full: exists and is not empty');
      expect(await readdir(join(tmp(), 'full'))).toEqual(['keep.txt']);
      await writeFile(join(tmp(), 'afile'), 'x');
      const f = await run('compress', 'ckpt', '-o', 'afile');
      expect([f.code, f.stderr]).toEqual([1, expect.stringContaining('afile: exists and is not a folder')]);
      const json = JSON.parse((await run('compress', 'ckpt', '-o', 'full', '--json')).stdout) as { error: { code: string; exitCode: number } };
      expect(json.error).toMatchObject({ code: 'TZIP_USAGE', exitCode: 1 });
    });

    it('an output folder inside the input folder', async () => {
      const r = await run('compress', 'ckpt', '-o', join('ckpt', 'new', 'out'));
      expect([r.code, r.stderr]).toEqual([1, expect.stringContaining('is inside the input folder')]);
      expect(existsSync(join(tmp(), 'ckpt', 'new'))).toBe(false);
    });

    it('a nested folder', async () => {
      await variant('nested', (dir) => mkdir(join(dir, '.cache')));
      const r = await run('compress', 'nested', '-o', 'nested-out');
      expect(r.code).toBe(1);
      expect(r.stderr).toContain(`${join('nested', '.cache')}: is a folder: tzip takes flat checkpoint folders`);
      expect(existsSync(join(tmp(), 'nested-out'))).toBe(false);
    });

    it('a symbolic link out of the folder, or to nothing', async () => {
      await variant('outlink', (dir) => symlink(MODEL, join(dir, 'extra.safetensors')));
      const r = await run('compress', 'outlink', '-o', 'outlink-out');
      expect([r.code, r.stderr]).toEqual([1, expect.stringContaining('extra.safetensors: is a symbolic link out of the folder')]);
      await variant('dangling', (dir) => symlink('nothing-here.json', join(dir, 'vocab.json')));
      const d = await run('compress', 'dangling', '-o', 'dangling-out');
      expect([d.code, d.stderr]).toEqual([1, expect.stringContaining('vocab.json: is a symbolic link to nothing')]);
      expect(existsSync(join(tmp(), 'outlink-out')) || existsSync(join(tmp(), 'dangling-out'))).toBe(false);
    });

    it('a .tzip file in a folder to compress, a .safetensors file in one to decompress, a folder without shards', async () => {
      await variant('has-tzip', (dir) => writeFile(join(dir, 'old.tzip'), 'x'));
      const t = await run('compress', 'has-tzip', '-o', 'has-tzip-out');
      expect([t.code, t.stderr]).toEqual([1, expect.stringContaining('old.tzip: is a .tzip file')]);
      await run('compress', 'ckpt', '-o', 'mixed');
      await writeFile(join(tmp(), 'mixed', 'stray.safetensors'), 'x');
      const s = await run('decompress', 'mixed', '-o', 'mixed-out');
      expect([s.code, s.stderr]).toEqual([1, expect.stringContaining('stray.safetensors: is a safetensors file')]);
      await mkdir(join(tmp(), 'no-shards'));
      await writeFile(join(tmp(), 'no-shards', 'config.json'), '{}');
      const n = await run('compress', 'no-shards', '-o', 'no-shards-out');
      expect([n.code, n.stderr]).toEqual([1, expect.stringContaining('no-shards: holds no .safetensors file')]);
      const v = await run('verify', 'ckpt');
      expect([v.code, v.stderr]).toEqual([1, expect.stringContaining('ckpt: holds no .tzip file')]);
    });

    it('a damaged shard fails the whole folder (exit 2): no output folder, no temporary folder left', async () => {
      await variant('broken', (dir) => writeFile(join(dir, SHARDS[2] as string), Buffer.from('not a safetensors file at all')));
      const r = await run('compress', 'broken', '-o', 'broken-out');
      expect(r.code).toBe(2);
      expect(r.stderr).toContain(join('broken', SHARDS[2] as string));
      expect(existsSync(join(tmp(), 'broken-out'))).toBe(false);
      expect(await leftovers()).toEqual([]);
    });
  });
});
