// The .tzip container end to end through the native addon: byte-identical round trips, random
// access, and rejection of damaged files with the file (and tensor) named.
import { createHash } from 'node:crypto';
import { readdir, readFile, truncate, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import fc from 'fast-check';
import { beforeAll, describe, expect, it } from 'vitest';
import { alignUp, encodeIndex, encodePrefix, encodeTrailer, FLAG_HEADER_DIGEST, INDEX_ENTRY_BYTES, PREFIX_BYTES, TRAILER_BYTES, xxh32 } from '../src/container.js';
import { TzipError } from '../src/errors.js';
import { frameLayoutFits, planEntries, type PlannedEntry } from '../src/entries.js';
import { CODECS, compress, readHeader, type Codec } from '../src/native.js';
import { openTzip } from '../src/reader.js';
import { decompressFile, verifyFile } from '../src/restore.js';
import { parseSafetensorsHeader } from '../src/safetensors.js';
import { compressFile } from '../src/writer.js';
import { bf16From, buildSafetensors, flip, gap, randomTensor, weightLikeF32, type Piece, type TensorPiece } from './helpers/safetensors-builder.js';
import { ensureBuilt, runTzip } from './helpers/cli.js';
import { useTempDir } from './helpers/temp-dir.js';

const tmp = useTempDir('container');

function sha256(bytes: Uint8Array): string {
  return createHash('sha256').update(bytes).digest('hex');
}

const weights = weightLikeF32('layer.0.weight', [64, 96], 7);

/** Every kind of entry: floats, ints, unknown dtype, size mismatch, gaps, empty tensors, trailing bytes. */
const RICH: Piece[] = [
  gap(13), // bytes before the first tensor
  weights,
  bf16From(weights, 'layer.0.weight.bf16'),
  randomTensor('f16', 'F16', [3, 5, 7], 2),
  randomTensor('ids', 'I64', [1, 512], 8),
  gap(3),
  randomTensor('mask', 'BOOL', [33], 1),
  randomTensor('fp8', 'F8_E4M3', [100], 1),
  randomTensor('quant', 'Q4_K', [17, 3], 1), // unknown dtype
  { kind: 'tensor', name: 'mismatch', dtype: 'F32', shape: [5], bytes: Buffer.alloc(7, 1) }, // size does not match
  randomTensor('empty.a', 'F32', [0], 4),
  randomTensor('empty.b', 'BF16', [2, 0], 2),
  randomTensor('empty.c', 'F16', [0, 4096], 2),
  randomTensor('u16', 'U16', [9], 2),
  randomTensor('f64', 'F64', [4, 4], 8),
  randomTensor('名前/ü', 'I32', [6], 4), // non-ASCII name
  randomTensor('__proto__', 'U8', [4], 1), // a name that is special to JavaScript objects
  gap(21), // trailing bytes
];

describe('compress / decompress round trip', () => {
  let source: string;
  let original: Buffer;
  beforeAll(async () => {
    original = buildSafetensors(RICH, { metadata: { format: 'pt', note: 'test' } });
    source = join(tmp(), 'rich.safetensors');
    await writeFile(source, original);
  });

  it.each(CODECS)('is byte-identical with codec %s', async (codec: Codec) => {
    const packed = join(tmp(), `rich.${codec}.tzip`);
    const restored = join(tmp(), `rich.${codec}.safetensors`);
    const result = await compressFile(source, packed, { codec });
    expect(result.inputBytes).toBe(original.byteLength);
    expect(result.entries.filter((e) => e.kind === 'tensor')).toHaveLength(RICH.filter((p) => p.kind === 'tensor').length);
    expect((await verifyFile(packed)).ok).toBe(true);
    await decompressFile(packed, restored);
    expect(sha256(await readFile(restored))).toBe(sha256(original));
  });

  it('writes the documented layout', async () => {
    const packed = join(tmp(), 'layout.tzip');
    const result = await compressFile(source, packed);
    const bytes = await readFile(packed);
    expect(bytes.subarray(0, 8)).toEqual(Buffer.from([0x89, 0x54, 0x5a, 0x49, 0x50, 0x0d, 0x0a, 0x1a]));
    expect(bytes.readUInt16LE(8)).toBe(1);
    expect(bytes.readBigUInt64LE(16)).toBe(BigInt(original.byteLength));
    const headerBytes = 8 + Number(original.readBigUInt64LE(0));
    expect(bytes.subarray(PREFIX_BYTES, PREFIX_BYTES + headerBytes)).toEqual(original.subarray(0, headerBytes));
    expect(bytes.readUInt16LE(10)).toBe(FLAG_HEADER_DIGEST);
    expect(bytes.readUInt32LE(12)).toBe(await xxh32(original.subarray(0, headerBytes)));
    const trailer = bytes.subarray(bytes.byteLength - TRAILER_BYTES);
    expect(trailer.subarray(24, 28).toString('latin1')).toBe('TZIX');
    const indexOffset = Number(trailer.readBigUInt64LE(0));
    expect(indexOffset % 16).toBe(0);
    expect(trailer.readUInt32LE(8)).toBe(result.entries.length);
    expect(indexOffset + result.entries.length * INDEX_ENTRY_BYTES + TRAILER_BYTES).toBe(bytes.byteLength);
    let expectedBegin = 0;
    for (let i = 0; i < result.entries.length; i++) {
      const at = indexOffset + i * INDEX_ENTRY_BYTES;
      expect(Number(bytes.readBigUInt64LE(at))).toBe(expectedBegin);
      expectedBegin = Number(bytes.readBigUInt64LE(at + 8));
      expect(Number(bytes.readBigUInt64LE(at + 16)) % 16).toBe(0);
    }
    expect(expectedBegin).toBe(original.byteLength - headerBytes);
  });

  it('reads every tensor by name, identical to its bytes in the original', async () => {
    const packed = join(tmp(), 'random-access.tzip');
    await compressFile(source, packed, { codec: 'max' });
    const reader = await openTzip(packed);
    try {
      const tensors = RICH.filter((p): p is TensorPiece => p.kind === 'tensor');
      expect(reader.tensorNames().sort()).toEqual(tensors.map((t) => t.name).sort());
      for (const t of tensors) expect((await reader.readTensor(t.name)).equals(t.bytes)).toBe(true);
      const e = await reader.readTensor('no.such.tensor').catch((err: unknown) => err);
      expect(e).toBeInstanceOf(TzipError);
      expect((e as TzipError).code).toBe('TZIP_USAGE');
      expect((e as TzipError).message).toContain(packed);
      const quant = reader.entry('quant');
      expect([quant.fileDtype, quant.fileShape, quant.dtype, quant.shape]).toEqual(['Q4_K', [17, 3], 'U8', [51]]);
      const header = await reader.frameHeader(reader.entry('empty.c'));
      expect([header.nbytes, header.shape]).toEqual([0, [0, 4096]]);
    } finally {
      await reader.close();
    }
  });

  it('reads frame headers whose chunk table is larger than the first read', async () => {
    const big = weightLikeF32('big', [512, 1024], 11); // 2 MiB: 512 chunks of 4096 bytes
    const src = join(tmp(), 'big.safetensors');
    await writeFile(src, buildSafetensors([big]));
    await compressFile(src, join(tmp(), 'big.tzip'), { chunkSize: 4096 });
    const reader = await openTzip(join(tmp(), 'big.tzip'));
    try {
      const header = await reader.frameHeader(reader.entry('big'));
      expect(header.nChunks).toBe(512);
      expect(header.headerBytes).toBeGreaterThan(4096);
      expect((await reader.readTensor('big')).equals(big.bytes)).toBe(true);
    } finally {
      await reader.close();
    }
  });

  it('round-trips files with no tensors and with no data at all', async () => {
    for (const [name, file] of [
      ['header-only', buildSafetensors([], { metadata: { a: 'b' } })],
      ['gap-only', buildSafetensors([gap(1000)])],
      ['empty-only', buildSafetensors([randomTensor('e', 'F32', [0], 4)])],
      ['unpadded', buildSafetensors([randomTensor('x', 'U8', [3], 1)], { headerPadding: 0 })],
      ['wide-padding', buildSafetensors([randomTensor('x', 'F32', [3], 4)], { headerPadding: 77 })],
    ] as const) {
      const src = join(tmp(), `${name}.safetensors`);
      await writeFile(src, file);
      await compressFile(src, join(tmp(), `${name}.tzip`));
      await decompressFile(join(tmp(), `${name}.tzip`), join(tmp(), `${name}.out`));
      expect(sha256(await readFile(join(tmp(), `${name}.out`))), name).toBe(sha256(file));
    }
  });

  it('round-trips random layouts byte for byte', async () => {
    const dtypes = [['F32', 4], ['BF16', 2], ['F16', 2], ['U8', 1], ['I64', 8], ['X9', 1]] as const;
    const piece = fc.oneof(
      fc.record({ d: fc.constantFrom(...dtypes), shape: fc.array(fc.nat(6), { maxLength: 3 }) })
        .map(({ d, shape }): Piece => randomTensor('t', d[0], shape, d[1])),
      fc.integer({ min: 1, max: 50 }).map((n) => gap(n)),
    );
    let run = 0;
    await fc.assert(fc.asyncProperty(fc.array(piece, { maxLength: 8 }), fc.constantFrom<Codec>('auto', 'fast', 'max'), async (generated, codec) => {
      const pieces = generated.map((p, i): Piece => (p.kind === 'tensor' ? { ...p, name: `t${i}` } : p));
      const file = buildSafetensors(pieces);
      const base = join(tmp(), `prop-${run++}`);
      await writeFile(`${base}.safetensors`, file);
      await compressFile(`${base}.safetensors`, `${base}.tzip`, { codec });
      await decompressFile(`${base}.tzip`, `${base}.out`);
      expect((await readFile(`${base}.out`)).equals(file)).toBe(true);
    }), { numRuns: 25 });
  });
});

describe('damaged input', () => {
  let good: Buffer;
  let packedPath: string;
  let indexOffset: number;
  beforeAll(async () => {
    const src = join(tmp(), 'damage.safetensors');
    await writeFile(src, buildSafetensors(RICH));
    packedPath = join(tmp(), 'damage.tzip');
    await compressFile(src, packedPath);
    good = await readFile(packedPath);
    indexOffset = Number(good.readBigUInt64LE(good.byteLength - TRAILER_BYTES));
  });

  async function damaged(name: string, edit: (b: Buffer) => Buffer): Promise<string> {
    const path = join(tmp(), `${name}.tzip`);
    await writeFile(path, edit(Buffer.from(good)));
    return path;
  }

  async function expectOpenError(path: string, codes: string[]): Promise<TzipError> {
    const err = await openTzip(path).then(async (r) => { await r.close(); return undefined; }, (e: unknown) => e);
    expect(err).toBeInstanceOf(TzipError);
    const e = err as TzipError;
    expect(codes).toContain(e.code);
    expect(e.file).toBe(path);
    expect(e.message).toContain(path);
    return e;
  }

  it('rejects a bad magic, version and flags', async () => {
    await expectOpenError(await damaged('magic', (b) => { b[1] = 0x55; return b; }), ['TZIP_CORRUPT']);
    await expectOpenError(await damaged('version', (b) => { b.writeUInt16LE(2, 8); return b; }), ['TZIP_UNSUPPORTED']);
    await expectOpenError(await damaged('flags', (b) => { b.writeUInt16LE(FLAG_HEADER_DIGEST | 2, 10); return b; }), ['TZIP_UNSUPPORTED']);
    await expectOpenError(await damaged('flags-high', (b) => { b.writeUInt16LE(FLAG_HEADER_DIGEST | 0x8000, 10); return b; }), ['TZIP_UNSUPPORTED']);
  });

  it('rejects a corrupted index (digest mismatch)', async () => {
    const e = await expectOpenError(await damaged('index', (b) => { flip(b, indexOffset + 20, 0x10); return b; }), ['TZIP_CORRUPT']);
    expect(e.message).toContain('digest');
  });

  it('rejects a corrupted trailer', async () => {
    await expectOpenError(await damaged('trailer-magic', (b) => { flip(b, b.byteLength - 6, 1); return b; }), ['TZIP_CORRUPT']);
    await expectOpenError(await damaged('trailer-offset', (b) => { flip(b, b.byteLength - TRAILER_BYTES, 0x20); return b; }), ['TZIP_CORRUPT']);
    await expectOpenError(await damaged('trailer-size', (b) => { flip(b, b.byteLength - 16, 1); return b; }), ['TZIP_CORRUPT']);
  });

  it('rejects truncated files', async () => {
    for (const keep of [good.byteLength - 1, indexOffset, 200, 40, 10, 0]) {
      const path = join(tmp(), `truncated-${keep}.tzip`);
      await writeFile(path, good);
      await truncate(path, keep);
      await expectOpenError(path, ['TZIP_CORRUPT', 'TZIP_TRUNCATED']);
    }
  });

  it('rejects a changed safetensors header that no longer matches the index (a file without the header digest)', async () => {
    // Shift one tensor's offsets by one byte: the header still parses but its layout differs from the index.
    // With the header digest this is a TZIP_CHECKSUM (below); a file written before the digest existed still
    // catches it by the layout.
    const e = await expectOpenError(await damaged('header', (b) => {
      asWrittenBeforeTheHeaderDigest(b);
      const text = b.toString('latin1');
      const m = /"f16":\{"dtype":"F16","shape":\[3,5,7\],"data_offsets":\[(\d+),(\d+)\]\}/.exec(text);
      if (m === null) throw new Error('test setup: f16 entry not found');
      const replaced = m[0].replace(`[${m[1]},${m[2]}]`, `[${Number(m[1]) + 1},${Number(m[2]) + 1}]`);
      if (replaced.length !== m[0].length) throw new Error('test setup: length changed');
      b.write(replaced, m.index, 'latin1');
      return b;
    }), ['TZIP_CORRUPT']);
    expect(e.message).toMatch(/index|overlap/);
  });

  it('reports a damaged frame for its tensor in verify, readTensor and decompress', async () => {
    const reader = await openTzip(packedPath);
    const entry = reader.entry('layer.0.weight');
    await reader.close();
    const path = await damaged('frame', (b) => { flip(b, entry.frameOffset + entry.frameBytes - 5, 0x40); return b; });
    const verified = await verifyFile(path);
    expect(verified.ok).toBe(false);
    const bad = verified.entries.filter((e) => e.error !== undefined);
    expect(bad.map((e) => e.entry.name)).toEqual(['layer.0.weight']);
    expect(['TZIP_CHECKSUM', 'TZIP_CORRUPT']).toContain(bad[0]?.error?.code);
    expect(bad[0]?.error?.message).toContain(path);
    expect(bad[0]?.error?.message).toContain('layer.0.weight');

    const damagedReader = await openTzip(path);
    try {
      const err = await damagedReader.readTensor('layer.0.weight').catch((e: unknown) => e);
      expect(err).toBeInstanceOf(TzipError);
      expect((err as TzipError).tensor).toBe('layer.0.weight');
      expect((await damagedReader.readTensor('f16')).byteLength).toBe(3 * 5 * 7 * 2); // other tensors still readable
    } finally {
      await damagedReader.close();
    }

    const err = await decompressFile(path, join(tmp(), 'frame.out')).catch((e: unknown) => e);
    expect((err as TzipError).tensor).toBe('layer.0.weight');
    // The failed decompression left no temporary or partial file behind.
    expect((await readdir(tmp())).filter((n) => n.startsWith('.frame.out') || n === 'frame.out')).toEqual([]);
  });

  it('names the file for missing inputs and invalid safetensors', async () => {
    const missing = join(tmp(), 'missing.safetensors');
    const err = await compressFile(missing, join(tmp(), 'missing.tzip')).catch((e: unknown) => e);
    expect((err as TzipError).code).toBe('TZIP_IO');
    expect((err as TzipError).message).toContain(missing);

    const junk = join(tmp(), 'junk.safetensors');
    await writeFile(junk, Buffer.from('this is not a safetensors file at all'));
    const err2 = await compressFile(junk, join(tmp(), 'junk.tzip')).catch((e: unknown) => e);
    expect(['TZIP_CORRUPT', 'TZIP_TRUNCATED']).toContain((err2 as TzipError).code);
    expect((err2 as TzipError).message).toContain(junk);
    expect((await readdir(tmp())).filter((n) => n.includes('junk.tzip'))).toEqual([]);
  });
});

/** Turns a file of this writer into the file the writer made before the header digest existed (flags 0, field 0). */
function asWrittenBeforeTheHeaderDigest(b: Buffer): Buffer {
  b.writeUInt16LE(0, 10);
  b.writeUInt32LE(0, 12);
  return b;
}

describe('safetensors header digest (prefix flag 0x0001)', () => {
  let good: Buffer;
  let original: Buffer;
  let headerLength: number;
  beforeAll(async () => {
    ensureBuilt();
    original = buildSafetensors([randomTensor('embeddings', 'F32', [8, 16], 4), randomTensor('bias', 'BF16', [16], 2)],
      { metadata: { format: 'pt', note: 'step 100' } });
    headerLength = Number(original.readBigUInt64LE(0));
    await writeFile(join(tmp(), 'digest.safetensors'), original);
    await compressFile(join(tmp(), 'digest.safetensors'), join(tmp(), 'digest.tzip'));
    good = await readFile(join(tmp(), 'digest.tzip'));
  });

  /** Offset in the .tzip of `text` inside the stored JSON header (each test's text occurs there once). */
  function inHeader(text: string): number {
    const at = good.indexOf(text, PREFIX_BYTES + 8, 'latin1');
    if (at < 0 || at + text.length > PREFIX_BYTES + 8 + headerLength) throw new Error(`test setup: ${text} not in the header`);
    return at;
  }

  const flips: [string, () => [number, number]][] = [
    ['a tensor name ("embeddings" -> "elbeddings")', () => [inHeader('"embeddings"') + 2, 0x01]],
    ['a __metadata__ value', () => [inHeader('step 100') + 5, 0x02]],
    ['a dtype', () => [inHeader('"BF16"') + 1, 0x04]],
    ['the header length N (bit 0)', () => [PREFIX_BYTES, 0x01]],
    ['the header length N (bit 3)', () => [PREFIX_BYTES, 0x08]],
    ['the stored digest', () => [13, 0x10]],
  ];

  it.each(flips)('a flip in %s is TZIP_CHECKSUM from openTzip, verifyFile, decompressFile and the CLI', async (what, where) => {
    const [at, mask] = where();
    const bad = Buffer.from(good);
    flip(bad, at, mask);
    const path = join(tmp(), `digest-${at}-${mask}.tzip`);
    await writeFile(path, bad);
    const attempts = [async () => (await openTzip(path)).close(), () => verifyFile(path), () => decompressFile(path, join(tmp(), 'digest.out'))];
    for (const attempt of attempts) {
      const err = await attempt().then(() => undefined, (e: unknown) => e);
      expect(err, what).toBeInstanceOf(TzipError);
      expect((err as TzipError).code, what).toBe('TZIP_CHECKSUM');
      expect((err as TzipError).message).toContain(path);
      expect((err as TzipError).message).toContain('header digest');
    }
    expect((await readdir(tmp())).filter((n) => n.includes('digest.out'))).toEqual([]);
    for (const command of ['verify', 'decompress']) {
      const args = command === 'verify' ? ['--json', 'verify', path] : ['--json', 'decompress', path, '-o', join(tmp(), 'digest.out')];
      const r = await runTzip(args, tmp());
      expect(r.code, `${command}: ${r.stderr}`).toBe(2);
      expect((JSON.parse(r.stdout) as { error: { code: string } }).error.code).toBe('TZIP_CHECKSUM');
    }
    expect((await readdir(tmp())).filter((n) => n.includes('digest.out'))).toEqual([]);
  });

  it('a flip that clears the flag leaves a non-zero reserved field: TZIP_CORRUPT', async () => {
    const bad = Buffer.from(good);
    flip(bad, 10, FLAG_HEADER_DIGEST);
    const path = join(tmp(), 'digest-flag-cleared.tzip');
    await writeFile(path, bad);
    const err = await openTzip(path).then(async (r) => { await r.close(); return undefined; }, (e: unknown) => e);
    expect((err as TzipError).code).toBe('TZIP_CORRUPT');
    expect((err as TzipError).message).toContain('reserved prefix field');
  });

  it('a file written before the header digest (flags 0) still opens, verifies and decompresses byte for byte', async () => {
    const path = join(tmp(), 'digest-old-format.tzip');
    await writeFile(path, asWrittenBeforeTheHeaderDigest(Buffer.from(good)));
    const reader = await openTzip(path);
    try {
      expect(reader.tensorNames().sort()).toEqual(['bias', 'embeddings']);
      expect(reader.headerBytes.equals(original.subarray(0, 8 + headerLength))).toBe(true);
    } finally {
      await reader.close();
    }
    expect((await verifyFile(path)).ok).toBe(true);
    await decompressFile(path, join(tmp(), 'digest-old.out'));
    expect((await readFile(join(tmp(), 'digest-old.out'))).equals(original)).toBe(true);
    const r = await runTzip(['verify', path], tmp());
    expect(r.code, r.stderr).toBe(0);
  });
});

describe('verify of a tensor too large to hold', () => {
  /**
   * A valid .tzip of one BF16 tensor of 2^32 + 65536 bytes (more than a Buffer holds: Node 20's kMaxLength is 2^32),
   * made of 65537 copies of the codec's own frame chunk for 64 KiB of zeros: about 4 MB on disk.
   */
  async function tooLargeToHold(): Promise<string> {
    const one = await compress(Buffer.alloc(65536), { dtype: 'BF16', shape: [32768], codec: 'max' });
    const T = 64; // align16(48 + 8 * ndim), ndim 1
    const size = one.readUInt32LE(T + 8);
    const digest = one.readUInt32LE(T + 12);
    const chunk = one.subarray(T + 16, T + 16 + size);
    const n = 65537;
    const nbytes = n * 65536;
    const step = alignUp(size);
    const H = T + 16 * n;
    const payload = (n - 1) * step + size;
    const frame = Buffer.alloc(H + payload);
    one.copy(frame, 0, 0, T);
    frame.writeBigUInt64LE(BigInt(nbytes), 16);
    frame.writeBigUInt64LE(BigInt(payload), 24);
    frame.writeUInt32LE(n, 32);
    frame.writeBigUInt64LE(BigInt(nbytes / 2), 48);
    const digests = Buffer.alloc(4 * n);
    for (let i = 0; i < n; i++) {
      frame.writeBigUInt64LE(BigInt(i * step), T + 16 * i);
      frame.writeUInt32LE(size, T + 16 * i + 8);
      frame.writeUInt32LE(digest, T + 16 * i + 12);
      digests.writeUInt32LE(digest, 4 * i);
      chunk.copy(frame, H + i * step);
    }
    frame.writeUInt32LE(await xxh32(digests), 36);
    frame.writeUInt32LE(0, 40);
    frame.writeUInt32LE(await xxh32(frame.subarray(0, H)), 40);
    const json = Buffer.from(JSON.stringify({ t: { dtype: 'BF16', shape: [nbytes / 2], data_offsets: [0, nbytes] } }));
    const st = Buffer.alloc(8 + json.length);
    st.writeBigUInt64LE(BigInt(json.length));
    json.copy(st, 8);
    const originalSize = st.length + nbytes;
    const frameOffset = alignUp(PREFIX_BYTES + st.length);
    const indexOffset = alignUp(frameOffset + frame.length);
    const index = encodeIndex([{ dataBegin: 0, dataEnd: nbytes, frameOffset, frameBytes: frame.length }]);
    const file = Buffer.alloc(indexOffset + index.length + TRAILER_BYTES);
    encodePrefix({ originalSize, headerDigest: await xxh32(st) }).copy(file, 0);
    st.copy(file, PREFIX_BYTES);
    frame.copy(file, frameOffset);
    index.copy(file, indexOffset);
    encodeTrailer({ indexOffset, entryCount: 1, indexDigest: await xxh32(index), originalSize }).copy(file, indexOffset + index.length);
    const path = join(tmp(), 'too-large-to-hold.tzip');
    await writeFile(path, file);
    return path;
  }

  it('is refused with one error and one exit code by verify, extract and decompress, and the process lives', async () => {
    // An adversarial pass's file of this kind killed the process ('free(): double free', the addon's Buffer made
    // above Node's size limit); verify also called memory that ran out a bad entry where extract gave exit 3.
    const path = await tooLargeToHold();
    const result = await verifyFile(path);
    expect(result.ok).toBe(false);
    expect(result.entries[0]?.error?.code).toBe('TZIP_UNSUPPORTED');
    expect(result.entries[0]?.error?.message).toContain("above Node's Buffer size limit");
    const runs = await Promise.all([
      runTzip(['verify', path], tmp()),
      runTzip(['extract', path, 't', '-o', 't.bin'], tmp()),
      runTzip(['decompress', path, '-o', 't.safetensors'], tmp()),
    ]);
    expect(runs.map((r) => r.code)).toEqual([2, 2, 2]);
    for (const r of runs) expect(r.stdout + r.stderr).toContain("above Node's Buffer size limit");
  }, 60_000);
});

describe('complex64 tensors (issue 36): coded as F32 pairs, files of the earlier U8 layout still read', () => {
  const GOLDEN = join(dirname(fileURLToPath(import.meta.url)), 'golden', 'containers');
  const LEGACY = join(GOLDEN, 'legacy_c64.tzip');
  const LEGACY_INPUT = join(GOLDEN, 'legacy_c64.safetensors');
  const c64 = weightLikeF32('c64.w', [16, 24, 2], 11); // float pairs with weight-like values, stored as C64 [16, 24]
  const COMPLEX: Piece[] = [
    { ...c64, dtype: 'C64', shape: [16, 24] },
    randomTensor('odd', 'U8', [3], 1), // the C64 tensors after it start at odd offsets
    { ...weightLikeF32('c64.scalar', [2], 3), dtype: 'C64', shape: [] },
    randomTensor('c64.empty', 'C64', [0, 5], 8),
    weightLikeF32('f32', [40], 5),
  ];
  let source: string;
  let original: Buffer;
  beforeAll(async () => {
    original = buildSafetensors(COMPLEX);
    source = join(tmp(), 'complex.safetensors');
    await writeFile(source, original);
  });

  it.each(CODECS)('frames C64 [..] as F32 [.., 2], the frame the codec makes of those bytes as F32 pairs (codec %s)', async (codec: Codec) => {
    const packed = join(tmp(), `complex.${codec}.tzip`);
    await compressFile(source, packed, { codec });
    const reader = await openTzip(packed);
    try {
      for (const [name, shape] of [['c64.w', [16, 24, 2]], ['c64.scalar', [2]], ['c64.empty', [0, 5, 2]]] as const) {
        const entry = reader.entry(name);
        expect([entry.fileDtype, entry.dtype, entry.shape]).toEqual(['C64', 'F32', shape]);
        const frame = await reader.readFrame(entry);
        const h = await reader.frameHeader(entry);
        expect([h.dtype, h.shape]).toEqual(['F32', shape]);
        // the very frame a client's complex64 tensor of these bytes gets from the daemon (src/daemon/dtype-map.ts)
        const bytes = await reader.readTensor(name);
        expect(frame.equals(await compress(bytes, { dtype: 'F32', shape, codec }))).toBe(true);
      }
    } finally {
      await reader.close();
    }
    expect((await verifyFile(packed)).ok).toBe(true);
    const restored = join(tmp(), `complex.${codec}.safetensors`);
    await decompressFile(packed, restored);
    expect(sha256(await readFile(restored))).toBe(sha256(original));
  });

  it('auto picks the codec it picks for the same bytes as F32 (not bytes)', async () => {
    const packed = join(tmp(), 'complex.auto.tzip');
    await compressFile(source, packed, { codec: 'auto' });
    const reader = await openTzip(packed);
    try {
      const h = await reader.frameHeader(reader.entry('c64.w'));
      expect(h.codec).not.toBe('bytes');
      expect(h.codec).toBe(readHeader(await compress(c64.bytes, { dtype: 'F32', shape: [16, 24, 2] })).codec);
    } finally {
      await reader.close();
    }
  });

  it('still decompresses, verifies, inspects and extracts the legacy fixture (C64 and 33-dim tensors in U8 frames)', async () => {
    expect(sha256(await readFile(LEGACY))).toBe('db0cc58addbcd45f2f1c7d56eeacb47e10b6307b8970e1a037cd3b90b750549f');
    const input = await readFile(LEGACY_INPUT);
    const restored = join(tmp(), 'legacy.safetensors');
    await decompressFile(LEGACY, restored);
    expect(sha256(await readFile(restored))).toBe(sha256(input));
    expect((await verifyFile(LEGACY)).ok).toBe(true);
    const reader = await openTzip(LEGACY);
    try {
      // the header now plans F32 pairs / 1-D, the frames hold the earlier U8 [nbytes]: accepted, same bytes
      expect([reader.entry('c64.weight').dtype, reader.entry('f16.deep').shape]).toEqual(['F32', [6]]);
      for (const [name, nbytes] of [['c64.weight', 512], ['c64.scalar', 8], ['c64.empty', 0], ['f16.deep', 12]] as const) {
        const h = await reader.frameHeader(reader.entry(name));
        expect([h.dtype, h.shape, h.codec]).toEqual(['U8', [nbytes], 'bytes']);
        expect((await reader.readTensor(name)).byteLength).toBe(nbytes);
      }
    } finally {
      await reader.close();
    }
    ensureBuilt();
    const doc = JSON.parse((await runTzip(['--json', 'inspect', LEGACY], tmp())).stdout) as { entries: { name: string; dtype: string; codecDtype: string }[] };
    expect(doc.entries.find((e) => e.name === 'c64.weight')).toMatchObject({ dtype: 'C64', codecDtype: 'U8' });
    expect(doc.entries.find((e) => e.name === 'f32.bias')).toMatchObject({ dtype: 'F32', codecDtype: 'F32' });
    const x = await runTzip(['extract', LEGACY, 'c64.weight', '-o', 'legacy.c64.bin'], tmp());
    expect(x.code, x.stderr).toBe(0);
    const headerLength = Number(input.readBigUInt64LE(0));
    const spec = (JSON.parse(input.subarray(8, 8 + headerLength).toString()) as Record<string, { data_offsets: [number, number] }>)['c64.weight'];
    const [b, e] = spec?.data_offsets ?? [0, 0];
    expect((await readFile(join(tmp(), 'legacy.c64.bin'))).equals(input.subarray(8 + headerLength + b, 8 + headerLength + e))).toBe(true);
  });

  it('accepts the earlier U8 layout only for the tensors that had it, and only with their byte count', () => {
    const file = buildSafetensors([
      randomTensor('c', 'C64', [4], 8), randomTensor('f', 'F32', [8], 4), randomTensor('deep', 'I8', new Array<number>(33).fill(1), 1), gap(5),
    ]);
    const plan = planEntries(parseSafetensorsHeader(file, file.byteLength, 'plan.safetensors'));
    const [c, f, deep, g] = plan as [PlannedEntry, PlannedEntry, PlannedEntry, PlannedEntry];
    expect([frameLayoutFits(c, 'F32', [4, 2]), frameLayoutFits(c, 'U8', [32])]).toEqual([true, true]);
    expect([frameLayoutFits(c, 'U8', [31]), frameLayoutFits(c, 'F32', [8]), frameLayoutFits(c, 'U8', [4, 8])]).toEqual([false, false, false]);
    expect([frameLayoutFits(f, 'F32', [8]), frameLayoutFits(f, 'U8', [32])]).toEqual([true, false]);
    expect([frameLayoutFits(deep, 'I8', [1]), frameLayoutFits(deep, 'U8', [1])]).toEqual([true, true]);
    expect([frameLayoutFits(g, 'U8', [5]), frameLayoutFits(g, 'I8', [5])]).toEqual([true, false]);
  });
});
