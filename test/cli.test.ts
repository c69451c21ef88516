// The `tzip` command line, run as a child process: exit codes, --json documents, messages that
// name the file and tensor.
import { createHash } from 'node:crypto';
import { readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { beforeAll, describe, expect, it } from 'vitest';
import { ensureBuilt, runTzip } from './helpers/cli.js';
import { bf16From, buildSafetensors, flip, gap, randomTensor, weightLikeF32, type Piece, type TensorPiece } from './helpers/safetensors-builder.js';
import { useTempDir } from './helpers/temp-dir.js';

const tmp = useTempDir('cli');
const w = weightLikeF32('encoder.weight', [32, 48], 3);
const PIECES: Piece[] = [
  w,
  bf16From(w, 'encoder.weight.bf16'),
  gap(5),
  randomTensor('ids', 'I64', [2, 8], 8),
  randomTensor('odd', 'NF4', [9], 1),
  randomTensor('empty', 'F32', [0, 4096], 4),
  gap(2),
];
const TENSORS = PIECES.filter((p): p is TensorPiece => p.kind === 'tensor');
const sha256 = (b: Uint8Array): string => createHash('sha256').update(b).digest('hex');

let original: Buffer;
const run = (...args: string[]) => runTzip(args, tmp());

beforeAll(async () => {
  ensureBuilt();
  original = buildSafetensors(PIECES, { metadata: { format: 'pt' } });
  await writeFile(join(tmp(), 'model.safetensors'), original);
}, 120_000);

describe('tzip', () => {
  it('compresses, inspects, verifies, extracts and decompresses byte-identically', async () => {
    const c = await run('compress', 'model.safetensors', '-o', 'model.tzip', '--codec', 'max', '--threads', '2');
    expect(c.stderr).toBe('');
    expect(c.code).toBe(0);
    expect(c.stdout).toContain('model.tzip');

    const inspect = await run('inspect', 'model.tzip');
    expect(inspect.code).toBe(0);
    for (const t of TENSORS) expect(inspect.stdout).toContain(t.name);
    expect(inspect.stdout).toContain('NF4 (as U8)');

    const verify = await run('verify', 'model.tzip');
    expect([verify.code, verify.stdout]).toEqual([0, expect.stringContaining('OK')]);

    const extract = await run('extract', 'model.tzip', 'ids', '-o', 'ids.bin');
    expect(extract.code).toBe(0);
    expect((await readFile(join(tmp(), 'ids.bin'))).equals(TENSORS.find((t) => t.name === 'ids')?.bytes ?? Buffer.alloc(1))).toBe(true);

    const d = await run('decompress', 'model.tzip', '-o', 'restored.safetensors');
    expect(d.code).toBe(0);
    expect(sha256(await readFile(join(tmp(), 'restored.safetensors')))).toBe(sha256(original));
  });

  it('prints one JSON document per command with --json', async () => {
    const c = await run('compress', 'model.safetensors', '-o', 'j.tzip', '--json');
    expect(c.code).toBe(0);
    const compressed = JSON.parse(c.stdout) as { inputBytes: number; entries: unknown[] };
    expect(compressed.inputBytes).toBe(original.byteLength);

    const inspect = JSON.parse((await run('--json', 'inspect', 'j.tzip')).stdout) as { entries: { name: string; kind: string; dtype: string }[] };
    expect(inspect.entries.filter((e) => e.kind === 'tensor').map((e) => e.name).sort()).toEqual(TENSORS.map((t) => t.name).sort());
    expect(inspect.entries.find((e) => e.name === 'odd')?.dtype).toBe('NF4');

    const verify = JSON.parse((await run('verify', 'j.tzip', '--json')).stdout) as { ok: boolean };
    expect(verify.ok).toBe(true);
    const extract = JSON.parse((await run('extract', 'j.tzip', 'empty', '-o', 'e.bin', '--json')).stdout) as { bytes: number; shape: number[] };
    expect(extract).toMatchObject({ bytes: 0, shape: [0, 4096] });
    const d = JSON.parse((await run('decompress', 'j.tzip', '-o', 'j.safetensors', '--json')).stdout) as { outputBytes: number };
    expect(d.outputBytes).toBe(original.byteLength);
  });

  it('benchmarks a file against zstd and lz4 with verified round trips', async () => {
    const b = await run('bench', 'model.safetensors', '--runs', '1', '--warmup', '0', '--threads', '2', '--json');
    expect(b.code).toBe(0);
    const doc = JSON.parse(b.stdout) as { roundTripsIdentical: boolean; machine: { cores: number }; files: { dtypes: { dtype: string; results: { codec: string }[] }[] }[] };
    expect(doc.roundTripsIdentical).toBe(true);
    expect(doc.machine.cores).toBeGreaterThan(0);
    const f32 = doc.files[0]?.dtypes.find((d) => d.dtype === 'F32');
    expect(f32?.results.map((r) => r.codec)).toEqual(['fast', 'max', 'zstd-1', 'zstd-3', 'lz4']);
    const i64 = doc.files[0]?.dtypes.find((d) => d.dtype === 'I64');
    expect(i64?.results.map((r) => r.codec)).toContain('bytes');
    const text = await run('bench', 'model.safetensors', '--runs', '1', '--warmup', '0');
    expect(text.code).toBe(0);
    expect(text.stdout).toMatch(/CPU: .*cores/);
    expect(text.stdout).toContain('zstd-3');
  });

  it('exits 1 on usage errors', async () => {
    for (const args of [
      [],
      ['frobnicate'],
      ['compress', 'model.safetensors'], // no -o
      ['compress', 'model.safetensors', '-o', 'x.tzip', '--codec', 'zip'],
      ['compress', 'model.safetensors', '-o', 'x.tzip', '--threads', 'many'],
      ['compress', 'model.safetensors', '-o', 'x.tzip', '--threads', '0'],
      ['compress', 'model.safetensors', '-o', 'x.tzip', '--chunk-size', '12345'], // rejected by the codec
      ['inspect'],
      ['inspect', 'model.tzip', '--bogus'],
    ]) {
      const r = await run(...args);
      expect(r.code, args.join(' ')).toBe(1);
      expect(r.stderr.length, args.join(' ')).toBeGreaterThan(0);
    }
    const unknown = await run('extract', 'model.tzip', 'no.such', '-o', 'x.bin');
    expect(unknown.code).toBe(1);
    expect(unknown.stderr).toContain('model.tzip');
    expect(unknown.stderr).toContain('no.such');
    // Too many threads is an option's error, not a tensor's (it used to name the first tensor compressed).
    const threads = await run('compress', 'model.safetensors', '-o', 'x.tzip', '--threads', '1e9');
    expect(threads.code).toBe(1);
    expect(threads.stderr).toContain('--threads');
    expect(threads.stderr).not.toContain('tensor');
    const json = await run('compress', '--json');
    expect(json.code).toBe(1);
    expect((JSON.parse(json.stdout) as { error: { exitCode: number } }).error.exitCode).toBe(1);
  });

  it('documents the exit codes in --help', async () => {
    const r = await run('--help');
    expect(r.code).toBe(0);
    expect(r.stdout).toMatch(/Exit codes:[\s\S]*0 +ok[\s\S]*1 +usage[\s\S]*2 +bad or corrupt[\s\S]*3 +I\/O/);
  });

  it('exits 2 on corrupt data, naming the file and tensor', async () => {
    await writeFile(join(tmp(), 'junk.safetensors'), 'definitely not safetensors');
    const junk = await run('compress', 'junk.safetensors', '-o', 'junk.tzip');
    expect(junk.code).toBe(2);
    expect(junk.stderr).toContain('junk.safetensors');

    await writeFile(join(tmp(), 'junk.tzip'), Buffer.alloc(100, 7));
    for (const cmd of ['verify', 'inspect']) {
      const r = await run(cmd, 'junk.tzip');
      expect(r.code, cmd).toBe(2);
      expect(r.stderr).toContain('junk.tzip');
    }

    const good = await readFile(join(tmp(), 'model.tzip'));
    const info = JSON.parse((await run('inspect', 'model.tzip', '--json')).stdout) as { entries: { name: string }[] };
    expect(info.entries.length).toBeGreaterThan(0);
    // Flip a bit near the end of the encoder.weight frame (found through the index).
    const indexOffset = Number(good.readBigUInt64LE(good.byteLength - 32));
    const first = info.entries.findIndex((e) => e.name === 'encoder.weight');
    const frameOffset = Number(good.readBigUInt64LE(indexOffset + first * 32 + 16));
    const frameBytes = Number(good.readBigUInt64LE(indexOffset + first * 32 + 24));
    const bad = Buffer.from(good);
    flip(bad, frameOffset + frameBytes - 3, 0x08);
    await writeFile(join(tmp(), 'bad.tzip'), bad);

    const verify = await run('verify', 'bad.tzip');
    expect(verify.code).toBe(2);
    expect(verify.stdout).toContain('encoder.weight');
    const vj = JSON.parse((await run('verify', 'bad.tzip', '--json')).stdout) as { ok: boolean; failures: { name: string }[] };
    expect([vj.ok, vj.failures.map((f) => f.name)]).toEqual([false, ['encoder.weight']]);
    const d = await run('decompress', 'bad.tzip', '-o', 'bad.safetensors', '--json');
    expect(d.code).toBe(2);
    expect(d.stderr).toContain('bad.tzip');
    expect(d.stderr).toContain('encoder.weight');
    expect((JSON.parse(d.stdout) as { error: { tensor: string } }).error.tensor).toBe('encoder.weight');
  });

  it('says a JSON file given to compress is not a safetensors file, with the same exit code and error code', async () => {
    // A new user's first try (issue 36): the model folder's config.json. The message used to be only "safetensors
    // header length 7234013700659612283 exceeds the 100000000-byte limit".
    await writeFile(join(tmp(), 'config.json'), JSON.stringify({ architectures: ['BertModel'], hidden_size: 384 }, null, 2));
    const r = await run('compress', 'config.json', '-o', 'config.tzip');
    expect(r.code).toBe(2);
    expect(r.stderr).toContain('config.json: not a safetensors file: it starts with text ("{\\n  \\"arc")');
    const j = await run('compress', 'config.json', '-o', 'config.tzip', '--json');
    expect(j.code).toBe(2);
    const err = (JSON.parse(j.stdout) as { error: { code: string; exitCode: number; message: string } }).error;
    expect([err.code, err.exitCode]).toEqual(['TZIP_CORRUPT', 2]);
    expect(err.message).toContain('not a safetensors file');
  });

  it('prints tensor names and dtype strings from a file with their control characters escaped', async () => {
    // A name that would set the terminal title, colour the rest red and forge a table row (an adversarial pass found
    // them printed raw by inspect and in error messages).
    const evil = '\u001b]0;pwned\u0007\u001b[31mred\nfake row';
    const file = buildSafetensors([randomTensor(evil, 'F32', [4], 4), randomTensor('q', 'Q4\u001b[2J', [3], 1)]);
    await writeFile(join(tmp(), 'evil.safetensors'), file);
    expect((await run('compress', 'evil.safetensors', '-o', 'evil.tzip')).code).toBe(0);
    const inspect = await run('inspect', 'evil.tzip');
    expect(inspect.code).toBe(0);
    expect(inspect.stdout).not.toMatch(/[\u0000-\u0008\u000b-\u001f\u007f]/);
    expect(inspect.stdout).toContain('\\u001b]0;pwned\\u0007\\u001b[31mred\\nfake row');
    const missing = await run('extract', 'evil.tzip', `${evil}x`, '-o', 'x.bin');
    expect(missing.code).toBe(1);
    expect(missing.stderr).not.toMatch(/[\u0000-\u0008\u000b-\u001f\u007f]/);
    expect(missing.stderr.trimEnd().split('\n')).toHaveLength(1);
    const json = JSON.parse((await run('inspect', 'evil.tzip', '--json')).stdout) as { entries: { name: string }[] };
    expect(json.entries.map((e) => e.name)).toContain(evil); // JSON keeps the name exactly (as JSON escapes)
  });

  it('exits 3 on I/O errors, naming the file', async () => {
    const missing = await run('compress', 'nope.safetensors', '-o', 'nope.tzip');
    expect(missing.code).toBe(3);
    expect(missing.stderr).toContain('nope.safetensors');
    const json = await run('verify', 'nope.tzip', '--json');
    expect(json.code).toBe(3);
    expect((JSON.parse(json.stdout) as { error: { file: string; code: string } }).error).toMatchObject({ file: 'nope.tzip', code: 'TZIP_IO' });
    const unwritable = await run('decompress', 'model.tzip', '-o', join('no', 'such', 'dir', 'x.safetensors'));
    expect(unwritable.code).toBe(3);
    expect(unwritable.stderr).toContain('x.safetensors');
  });
});
