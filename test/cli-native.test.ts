// The native CLI (build/Release/tzip-native, run by bin/tzip) against the Node CLI (dist/src/cli/main.js), as real
// processes on real files: the same .tzip bytes for every demo file, codec, chunk size and thread count; decompress
// restores the original bytes; every input or situation it does not handle (hostile headers, damaged containers,
// bad options, odd outputs) gives exactly the Node CLI's stdout, stderr and exit code, and leaves no temporary file.
import { execFile, spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import { chmod, lstat, mkdir, readFile, readdir, readlink, rename, rm, stat, symlink, writeFile } from 'node:fs/promises';
import { existsSync, readdirSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { beforeAll, describe, expect, it } from 'vitest';
import { ensureBuilt } from './helpers/cli.js';
import { bf16From, buildSafetensors, flip, gap, randomTensor, weightLikeF32, type Piece } from './helpers/safetensors-builder.js';
import { useTempDir } from './helpers/temp-dir.js';

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const MAIN = join(ROOT, 'dist', 'src', 'cli', 'main.js');
const LAUNCHER = join(ROOT, 'bin', 'tzip');
const NATIVE = join(ROOT, 'build', 'Release', 'tzip-native');
const DEMO = join(ROOT, 'data', 'demo');
const BUILT = existsSync(NATIVE);
const DEMO_FILES = existsSync(DEMO) ? readdirSync(DEMO).filter((f) => f.endsWith('.safetensors')).sort() : [];
const CODECS = ['auto', 'fast', 'max', 'bytes', 'raw'];

interface Run { code: number; stdout: string; stderr: string }

function exec(file: string, args: readonly string[], cwd: string, env: NodeJS.ProcessEnv = {}): Promise<Run> {
  return new Promise((resolve) => {
    execFile(file, args, { cwd, maxBuffer: 64 << 20, env: { ...process.env, FORCE_COLOR: '0', TZIP_NATIVE: undefined, TZIP_NATIVE_DEBUG: undefined, ...env } },
      (error, stdout, stderr) => resolve({ code: error === null ? 0 : typeof error.code === 'number' ? error.code : -1, stdout, stderr }));
  });
}
const viaNode = (args: readonly string[], cwd: string): Promise<Run> => exec(process.execPath, [MAIN, ...args], cwd);
const viaLauncher = (args: readonly string[], cwd: string, env: NodeJS.ProcessEnv = {}): Promise<Run> => exec(LAUNCHER, args, cwd, env);
/** The summary line with its two measured numbers (seconds, GB/s) blanked. */
const timeless = (s: string): string => s.replace(/, \d+\.\d\d s, [0-9.-]+ GB\/s$/gm, ', T s, R GB/s');
const sha256 = (b: Uint8Array): string => createHash('sha256').update(b).digest('hex');

const tmp = useTempDir('cli-native');

beforeAll(() => {
  ensureBuilt();
}, 120_000);

async function tempFiles(dir: string): Promise<string[]> {
  return (await readdir(dir)).filter((f) => f.endsWith('.tmp'));
}

/**
 * Runs `args` (whose output path is `out`, in the temp folder) through the Node CLI and then through bin/tzip with
 * the native CLI, and expects the same exit code, stdout (timings aside), stderr, output bytes, and no temporary file.
 */
async function expectSameAsNode(args: string[], out: string | undefined): Promise<Run> {
  const dir = tmp();
  const node = await viaNode(args, dir);
  const nodeOut = out !== undefined && existsSync(join(dir, out)) ? await readFile(join(dir, out)) : undefined;
  if (out !== undefined) await rm(join(dir, out), { force: true });
  const native = await viaLauncher(args, dir);
  expect({ code: native.code, stdout: timeless(native.stdout), stderr: native.stderr })
    .toEqual({ code: node.code, stdout: timeless(node.stdout), stderr: node.stderr });
  if (out !== undefined) {
    const nativeOut = existsSync(join(dir, out)) ? await readFile(join(dir, out)) : undefined;
    expect(nativeOut?.equals(nodeOut ?? Buffer.alloc(0)) ?? nodeOut === undefined).toBe(true);
    await rm(join(dir, out), { force: true });
  }
  expect(await tempFiles(dir)).toEqual([]);
  return node;
}

describe.skipIf(!BUILT)('tzip-native (skipped: build/Release/tzip-native is not built; npm run build:native)', () => {
  describe.skipIf(DEMO_FILES.length === 0)('on the demo files (skipped: no data/demo; scripts/setup.sh fetches them)', () => {
    for (const name of DEMO_FILES) {
      it(`writes the Node CLI's bytes for ${name} with every codec, 1 or 2 threads, and restores it`, async () => {
        const dir = tmp();
        const input = join(DEMO, name);
        const original = await readFile(input);
        for (const codec of CODECS) {
          const node = await viaNode(['compress', input, '-o', 'n.tzip', '--codec', codec], dir);
          expect(node.code).toBe(0);
          const nodeBytes = await readFile(join(dir, 'n.tzip'));
          for (const threads of ['1', '2']) {
            const native = await viaLauncher(['compress', input, '-o', 'n.tzip', '--codec', codec, '--threads', threads], dir, { TZIP_NATIVE_DEBUG: '1' });
            expect(native.stderr).toBe(''); // not handed to Node
            expect(native.code).toBe(0);
            expect(timeless(native.stdout)).toBe(timeless(node.stdout));
            expect(sha256(await readFile(join(dir, 'n.tzip')))).toBe(sha256(nodeBytes));
          }
          const back = await viaLauncher(['decompress', 'n.tzip', '-o', 'back.safetensors'], dir, { TZIP_NATIVE_DEBUG: '1' });
          expect(back.stderr).toBe('');
          expect(back.code).toBe(0);
          expect(back.stdout).toMatch(/^n\.tzip \(.*\) -> back\.safetensors \(.*\): \d+ entries, /);
          expect(sha256(await readFile(join(dir, 'back.safetensors')))).toBe(sha256(original));
        }
        // A chunk size other than the default, in both spellings of the option.
        const node = await viaNode(['compress', input, '-o', 'c.tzip', '--chunk-size', '16384'], dir);
        const native = await viaLauncher(['compress', input, '--chunk-size=16384', '--output=c2.tzip', '--threads=2'], dir, { TZIP_NATIVE_DEBUG: '1' });
        expect([node.code, native.code, native.stderr]).toEqual([0, 0, '']);
        expect(sha256(await readFile(join(dir, 'c2.tzip')))).toBe(sha256(await readFile(join(dir, 'c.tzip'))));
        const decoded = await viaLauncher(['decompress', 'c2.tzip', '-o', 'c.safetensors', '--threads', '1'], dir, { TZIP_NATIVE_DEBUG: '1' });
        expect([decoded.code, decoded.stderr]).toEqual([0, '']);
        expect(sha256(await readFile(join(dir, 'c.safetensors')))).toBe(sha256(original));
        expect(await tempFiles(dir)).toEqual([]);
      }, 300_000);
    }
  });

  it.skipIf(DEMO_FILES.length === 0)('removes its temporary file when interrupted (SIGINT)', async () => {
    const dir = tmp();
    await mkdir(join(dir, 'sig'));
    const input = join(DEMO, DEMO_FILES[DEMO_FILES.length - 1] as string);
    // max on one thread with small chunks: several hundred milliseconds, ample time to see the temporary file.
    const child = spawn(LAUNCHER, ['compress', input, '-o', 'sig/out.tzip', '--codec', 'max', '--threads', '1', '--chunk-size', '4096'],
      { cwd: dir, stdio: 'ignore', env: { ...process.env, TZIP_NATIVE: undefined } });
    const exited = new Promise<string | null>((resolve) => child.once('exit', (_code, signal) => resolve(signal)));
    let seen: string[] = [];
    for (let i = 0; i < 1000 && seen.length === 0 && child.exitCode === null; i++) {
      seen = await tempFiles(join(dir, 'sig'));
      if (seen.length === 0) await new Promise((r) => setTimeout(r, 2));
    }
    expect(seen).toHaveLength(1);
    child.kill('SIGINT');
    expect(await exited).toBe('SIGINT');
    expect(await readdir(join(dir, 'sig'))).toEqual([]);
  }, 60_000);

  describe('hands what it does not handle to the Node CLI: same output, message and exit code', () => {
    const w = weightLikeF32('encoder.weight', [32, 48], 3);
    const PIECES: Piece[] = [w, bf16From(w, 'encoder.weight.bf16'), gap(5), randomTensor('ids', 'I64', [2, 8], 8),
      randomTensor('odd', 'NF4', [9], 1), randomTensor('empty', 'F32', [0, 4096], 4), gap(2)];
    const model = buildSafetensors(PIECES, { metadata: { format: 'pt' } });

    /** A safetensors file with the JSON header `json` and `dataBytes` bytes of data. */
    function rawFile(json: string, dataBytes = 0): Buffer {
      const prefix = Buffer.alloc(8);
      prefix.writeBigUInt64LE(BigInt(Buffer.byteLength(json)));
      return Buffer.concat([prefix, Buffer.from(json), Buffer.alloc(dataBytes, 7)]);
    }
    const t = (name: string, dtype = 'U8', shape = '[4]', offsets = '[0, 4]') => `"${name}": {"dtype": "${dtype}", "shape": ${shape}, "data_offsets": ${offsets}}`;
    const lengthOnly = (n: bigint, total = 16): Buffer => {
      const b = Buffer.alloc(total);
      b.writeBigUInt64LE(n);
      return b;
    };
    const bom = Buffer.from([0xef, 0xbb, 0xbf]);
    const notUtf8 = rawFile(`{${t('?')}}`, 4);
    notUtf8[10] = 0xff;

    const SAFETENSORS: Record<string, Buffer> = {
      'model': model,
      'empty file': Buffer.alloc(0),
      'five bytes': Buffer.alloc(5),
      'length past the end': lengthOnly(9n),
      'length above 100 MB': lengthOnly(2n ** 63n),
      'a config.json': Buffer.from('{\n  "architectures": ["BertModel"]\n}\n'),
      'cut JSON': rawFile('{"a": '),
      'an array': rawFile('[1, 2]'),
      'metadata not an object': rawFile('{"__metadata__": 3}'),
      'metadata with a number': rawFile(`{"__metadata__": {"a": 1}, ${t('x')}}`, 4),
      'not UTF-8': notUtf8,
      'a byte-order mark': Buffer.concat([lengthOnly(BigInt(3 + `{${t('x')}}`.length), 8), bom, Buffer.from(`{${t('x')}}`), Buffer.alloc(4)]),
      'a lone surrogate': rawFile(`{${t('\\ud800')}}`, 4),
      'a surrogate pair (valid)': rawFile(`{${t('\\ud83d\\ude00')}}`, 4),
      'an escaped name (valid)': rawFile(`{${t('a\\u0041\\n')}}`, 4),
      'nested 129 deep': rawFile(`{"n": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0], "x": ${'['.repeat(127)}${']'.repeat(127)}}}`),
      'an extra key (valid)': rawFile(`{"n": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4], "x": [[1]]}}`, 4),
      'a duplicate tensor (valid)': rawFile(`{${t('a', 'U8', '[9]', '[0, 9]')}, ${t('a')}}`, 6),
      'a dimension of 2^53': rawFile(`{${t('b', 'U8', '[9007199254740992]', '[0, 0]')}}`),
      'a dimension 4.0 (valid)': rawFile(`{${t('f', 'U8', '[4.0]')}}`, 4),
      'a dimension 4e0 (valid)': rawFile(`{${t('f', 'U8', '[4e0]')}}`, 4),
      'a negative dimension': rawFile(`{${t('f', 'U8', '[-4]')}}`, 4),
      'an empty dtype': rawFile(`{${t('d', '')}}`, 4),
      'reversed offsets': rawFile(`{${t('r', 'U8', '[4]', '[4, 0]')}}`, 4),
      'offsets past the data': rawFile(`{${t('p', 'U8', '[4]', '[0, 40]')}}`, 4),
      'overlapping tensors': rawFile(`{${t('a', 'U8', '[4]', '[0, 4]')}, ${t('b', 'U8', '[4]', '[2, 6]')}}`, 8),
      'an empty tensor inside another': rawFile(`{${t('a', 'U8', '[4]', '[0, 4]')}, ${t('e', 'U8', '[0]', '[2, 2]')}}`, 4),
      'NUL padding (valid)': Buffer.concat([rawFile(`{${t('z')}}  \0\0`), Buffer.alloc(4, 1)]),
      'text after the object': rawFile(`{${t('z')}} x`, 4),
      'a size mismatch and a deep shape (valid)': rawFile(`{${t('m', 'F32', '[3]', '[0, 10]')}, ${t('k', 'F16', `[${new Array(33).fill(1).join(',')}]`, '[10, 12]')}}`, 12),
      'a complex64 tensor and a deep one (valid)': rawFile(`{${t('c', 'C64', '[2, 1]', '[0, 16]')}, ${t('d', 'C64', `[${new Array(32).fill(1).join(',')}]`, '[16, 24]')}}`, 24),
      'no tensors, a gap (valid)': Buffer.concat([rawFile('{}'), Buffer.alloc(3, 9)]),
      'only metadata, no data (valid)': rawFile('{"__metadata__": {"format": "pt"}}'),
      // 1,125 bytes print as "1.13 kB": toFixed rounds the tie 1.125 up, C's printf to even ("1.12").
      'a 1125-byte file (valid)': rawFile('{}', 1115),
      'escaped keys, names and metadata (valid)': rawFile(`{"__metadata__": {"k\\u00e9": "a\\"b\\\\\\/\\t\\ud83d\\ude00"}, "n\\u0000\\u0061me": {"dt\\u0079pe": "U8", "shape": [4], "data_offsets": [0, 4]}}`, 4),
      'a lone surrogate in metadata': rawFile(`{"__metadata__": {"a": "\\ud800"}, ${t('x')}}`, 4),
      'a metadata key escaped, not an object': rawFile(`{"__meta\\u0064ata__": 3, ${t('x')}}`, 4),
      'a cut escape': rawFile(`{"a\\u00": 1}`),
    };

    for (const [label, bytes] of Object.entries(SAFETENSORS)) {
      it(`compress: ${label}`, async () => {
        await writeFile(join(tmp(), 'in.safetensors'), bytes);
        await expectSameAsNode(['compress', 'in.safetensors', '-o', 'out.tzip'], 'out.tzip');
      }, 60_000);
    }

    it('decompress: damaged containers', async () => {
      const dir = tmp();
      await writeFile(join(dir, 'model.safetensors'), model);
      expect((await viaNode(['compress', 'model.safetensors', '-o', 'good.tzip'], dir)).code).toBe(0);
      const good = await readFile(join(dir, 'good.tzip'));
      const headerLength = Number(good.readBigUInt64LE(24));
      const indexOffset = Number(good.readBigUInt64LE(good.length - 32));
      const entryCount = good.readUInt32LE(good.length - 24);
      // The largest frame (a float tensor's): a flip in its middle is a chunk's payload.
      let largest = { offset: 0, bytes: 0 };
      for (let i = 0; i < entryCount; i++) {
        const at = indexOffset + 32 * i;
        const bytes = Number(good.readBigUInt64LE(at + 24));
        if (bytes > largest.bytes) largest = { offset: Number(good.readBigUInt64LE(at + 16)), bytes };
      }
      const damaged: Record<string, Buffer> = { 'good': good, 'empty': Buffer.alloc(0), 'a safetensors file': model, 'cut': good.subarray(0, good.length - 10) };
      const flips: Record<string, number> = {
        magic: 0, version: 8, flags: 10, 'header digest': 12, 'original size': 16, 'header length': 24, 'header JSON': 40,
        'first frame magic': (32 + headerLength + 15) & ~15, 'a frame header': largest.offset + 20,
        'a frame payload': largest.offset + Math.floor(largest.bytes / 2), 'an index entry': indexOffset + 8,
        'trailer offset': good.length - 32, 'trailer count': good.length - 24, 'trailer magic': good.length - 8,
        'trailer reserved': good.length - 2,
      };
      for (const [label, at] of Object.entries(flips)) {
        const b = Buffer.from(good);
        flip(b, at, 0x10);
        damaged[label] = b;
      }
      for (const [label, bytes] of Object.entries(damaged)) {
        await writeFile(join(dir, 'in.tzip'), bytes);
        const node = await expectSameAsNode(['decompress', 'in.tzip', '-o', 'out.safetensors'], 'out.safetensors');
        expect({ label, ok: node.code === 0 }).toEqual({ label, ok: label === 'good' });
      }
    }, 120_000);

    it('options, paths and outputs it leaves to Node', async () => {
      const dir = tmp();
      await writeFile(join(dir, 'm.safetensors'), model);
      const c = (...rest: string[]) => ['compress', 'm.safetensors', ...rest];
      for (const args of [
        c('-o', 'o.tzip', '--threads', '0'), c('-o', 'o.tzip', '--threads', '2000'), c('-o', 'o.tzip', '--threads', '0x2'),
        c('-o', 'o.tzip', '--chunk-size', '1000'), c('-o', 'o.tzip', '--codec', 'nope'), c(), c('-o'), c('-o', 'o.tzip', 'extra'), c('-o', 'o.tzip', '--codec', 'max', '--codec', 'raw'),
        c('-oo.tzip'), c('-o', 'o.tzip', '--help'), ['compress', 'missing.safetensors', '-o', 'o.tzip'],
        c('-o', 'no/such/folder/o.tzip'), c('-o', dir),
        ['decompress', 'm.safetensors', '-o', 'o.tzip', '--codec', 'fast'], ['decompress', '-o', 'o.tzip'],
      ]) {
        await expectSameAsNode(args, 'o.tzip');
        expect((await readFile(join(dir, 'm.safetensors'))).equals(model)).toBe(true);
      }
      // A device is written in place by the Node CLI (here: /dev/full, which fails with ENOSPC).
      await expectSameAsNode(c('-o', '/dev/full'), undefined);
    }, 120_000);

    it('keeps an existing output\'s mode, and follows a link to the output as the Node CLI does', async () => {
      const dir = tmp();
      await writeFile(join(dir, 'm.safetensors'), model);
      await writeFile(join(dir, 'ro.tzip'), 'old');
      await chmod(join(dir, 'ro.tzip'), 0o640);
      const native = await viaLauncher(['compress', 'm.safetensors', '-o', 'ro.tzip'], dir, { TZIP_NATIVE_DEBUG: '1' });
      expect([native.code, native.stderr]).toEqual([0, '']);
      expect((await stat(join(dir, 'ro.tzip'))).mode & 0o7777).toBe(0o640);

      await symlink('target.tzip', join(dir, 'link.tzip'));
      const node = await viaNode(['compress', 'm.safetensors', '-o', 'link.tzip'], dir);
      await rename(join(dir, 'target.tzip'), join(dir, 'node-target.tzip'));
      const linked = await viaLauncher(['compress', 'm.safetensors', '-o', 'link.tzip'], dir, { TZIP_NATIVE_DEBUG: '1' });
      expect(linked.stderr).toContain('tzip-native: running the Node CLI: output is not a regular file');
      expect([node.code, linked.code]).toEqual([0, 0]);
      expect((await lstat(join(dir, 'link.tzip'))).isSymbolicLink()).toBe(true);
      expect(await readlink(join(dir, 'link.tzip'))).toBe('target.tzip');
      expect((await readFile(join(dir, 'target.tzip'))).equals(await readFile(join(dir, 'node-target.tzip')))).toBe(true);
      expect(await tempFiles(dir)).toEqual([]);
    }, 60_000);

    it('says when it hands a run to Node (TZIP_NATIVE_DEBUG=1), and TZIP_NATIVE=0 skips it', async () => {
      const dir = tmp();
      await writeFile(join(dir, 'm.safetensors'), model);
      const json = await viaLauncher(['compress', 'm.safetensors', '-o', 'j.tzip', '--json'], dir, { TZIP_NATIVE_DEBUG: '1' });
      expect(json.code).toBe(0);
      expect(json.stderr).toBe('tzip-native: running the Node CLI: option --json\n');
      expect(JSON.parse(json.stdout)).toMatchObject({ command: 'compress', output: 'j.tzip' });
      const plain = await viaLauncher(['compress', 'm.safetensors', '-o', 'p.tzip'], dir, { TZIP_NATIVE_DEBUG: '1' });
      expect([plain.code, plain.stderr]).toEqual([0, '']);
      const forced = await viaLauncher(['compress', 'm.safetensors', '-o', 'f.tzip'], dir, { TZIP_NATIVE_DEBUG: '1', TZIP_NATIVE: '0' });
      expect([forced.code, forced.stderr]).toEqual([0, '']); // the Node CLI itself: no native line at all
      expect((await readFile(join(dir, 'f.tzip'))).equals(await readFile(join(dir, 'p.tzip')))).toBe(true);
      expect((await readFile(join(dir, 'j.tzip'))).equals(await readFile(join(dir, 'p.tzip')))).toBe(true);
      const header = await viaLauncher(['compress', 'm.safetensors', '-o', 'x.tzip', '--codec', 'nope'], dir, { TZIP_NATIVE_DEBUG: '1' });
      expect(header.stderr.split('\n')[0]).toBe('tzip-native: running the Node CLI: codec nope');
    }, 60_000);

    it('a failed write of the result line is the Node CLI\'s error (stdout on /dev/full)', async () => {
      const dir = tmp();
      await writeFile(join(dir, 'm.safetensors'), model);
      const run = (cli: string) => exec('/bin/sh', ['-c', `${cli} compress m.safetensors -o o.tzip > /dev/full`], dir);
      const node = await run(`'${process.execPath}' '${MAIN}'`);
      const native = await run(`'${LAUNCHER}'`);
      expect(node.code).toBe(3);
      expect({ code: native.code, stderr: native.stderr }).toEqual({ code: node.code, stderr: node.stderr });
      expect(await tempFiles(dir)).toEqual([]);
    }, 60_000);

    it('a folder goes to the Node CLI', async () => {
      const dir = tmp();
      await mkdir(join(dir, 'ckpt'));
      await writeFile(join(dir, 'ckpt', 'model.safetensors'), model);
      await writeFile(join(dir, 'ckpt', 'config.json'), '{}');
      const node = await viaNode(['compress', 'ckpt', '-o', 'out-node'], dir);
      const native = await viaLauncher(['compress', 'ckpt', '-o', 'out-native'], dir, { TZIP_NATIVE_DEBUG: '1' });
      expect([node.code, native.code]).toEqual([0, 0]);
      expect(native.stderr).toMatch(/^tzip-native: running the Node CLI: .*ckpt/);
      expect((await readFile(join(dir, 'out-native', 'model.tzip'))).equals(await readFile(join(dir, 'out-node', 'model.tzip')))).toBe(true);
    }, 60_000);
  });
});
