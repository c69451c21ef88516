// Round trips and hostile input through the native codec (CPU backend). Every comparison is on raw bytes.
import { describe, expect, it } from 'vitest';
import fc from 'fast-check';
import xxhash from 'xxhash-wasm';
import {
  compress,
  decompress,
  defaultChunkSize,
  maxCompressedSize,
  readHeader,
  type Codec,
} from '../src/native.js';
import { TzipError } from '../src/errors.js';
import { spawnSync } from 'node:child_process';
import { chmodSync, existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { pathToFileURL } from 'node:url';

const CODECS: Codec[] = ['auto', 'fast', 'max', 'bytes', 'raw'];
const SIZES: Record<string, number> = {
  BOOL: 1, U8: 1, I8: 1, F8_E4M3: 1, F8_E5M2: 1, I16: 2, U16: 2, F16: 2, BF16: 2,
  I32: 4, U32: 4, F32: 4, I64: 8, U64: 8, F64: 8,
};
const DTYPES = Object.keys(SIZES);

function u16(values: number[]): Uint8Array {
  return new Uint8Array(Uint16Array.from(values).buffer);
}
function u32(values: number[]): Uint8Array {
  return new Uint8Array(Uint32Array.from(values).buffer);
}
function f32(values: number[]): Uint8Array {
  return new Uint8Array(Float32Array.from(values).buffer);
}
function range(a: number, b: number): number[] {
  return Array.from({ length: b - a + 1 }, (_, i) => a + i);
}

/** Compresses, checks the bound and header, decompresses and compares bytes; returns the frame. */
async function roundTrip(input: Uint8Array, dtype: string, shape: number[], codec: Codec, threads?: number): Promise<Buffer> {
  const frame = await compress(input, { dtype, shape, codec, threads });
  expect(frame.length).toBeLessThanOrEqual(maxCompressedSize(input.length, shape.length));
  const h = readHeader(frame);
  expect(h.frameBytes).toBe(frame.length);
  expect(h.nbytes).toBe(input.length);
  expect(h.shape).toEqual(shape);
  expect(h.dtype).toBe(dtype);
  const back = await decompress(frame, { threads });
  expect(Buffer.compare(Buffer.from(back), Buffer.from(input.buffer, input.byteOffset, input.byteLength))).toBe(0);
  return frame;
}

async function expectTzipError(p: Promise<unknown>, codes: string[]): Promise<void> {
  await expect(p).rejects.toBeInstanceOf(TzipError);
  await p.catch((e: TzipError) => expect(codes).toContain(e.code));
}

describe('zero-entropy inputs give tiny frames', () => {
  // [name, dtype, input, shape, largest frame allowed in bytes]
  const cases: [string, string, Uint8Array, number[], number][] = [
    ['fp32 [2048] of 0.0', 'F32', new Uint8Array(2048 * 4), [2048], 200],
    ['bf16 [4096] all 0xFFFF', 'BF16', new Uint8Array(4096 * 2).fill(0xff), [4096], 200],
    // Two values, so order-0 codes need one bit per element (512 bytes here) plus tables: under 1/10 of 16 KiB.
    ['fp32 alternating 0.0, 1.0', 'F32', f32(Array.from({ length: 4096 }, (_, i) => i % 2)), [4096], 1638],
  ];
  for (const [name, dtype, input, shape, most] of cases) {
    for (const codec of ['auto', 'fast', 'max', 'bytes'] as Codec[]) {
      it(`${name} with ${codec}`, async () => {
        const frame = await roundTrip(input, dtype, shape, codec);
        expect(frame.length).toBeLessThanOrEqual(most);
      });
    }
  }
});

describe('lengths around chunk boundaries', () => {
  const chunkElems = defaultChunkSize() / 2;
  for (const n of [1, 17, chunkElems - 1, chunkElems, chunkElems + 1, 3 * chunkElems + 5]) {
    for (const codec of CODECS) {
      it(`bf16 [${n}] ${codec}`, async () => {
        const v = Array.from({ length: n }, (_, i) => 0x3c00 + ((i * 2654435761) >>> 22)); // exponents near 1.0
        await roundTrip(u16(v), 'BF16', [n], codec);
      });
    }
  }
  it('uint8 [33]', async () => {
    for (const codec of CODECS) await roundTrip(Uint8Array.from(range(0, 32), (x) => x * 7), 'U8', [33], codec);
  });
});

describe('incompressible input stays within the documented bound', () => {
  it('65,536 random bytes as bf16 [32768]', async () => {
    const input = new Uint8Array(65536);
    let s = 12345;
    for (let i = 0; i < input.length; i++) input[i] = (s = (s * 1103515245 + 12345) >>> 0) >>> 24;
    for (const codec of CODECS) {
      const frame = await roundTrip(input, 'BF16', [32768], codec);
      const bound = maxCompressedSize(65536, 1);
      expect(frame.length).toBeLessThanOrEqual(bound);
      // bound = 64-byte fixed header with one dimension + one 16-byte chunk entry + the input
      expect(bound).toBe(65536 + 64 + 16);
    }
  });
});

describe('empty tensors keep their shapes', () => {
  for (const shape of [[0], [2, 0], [0, 4096]]) {
    it(`bf16 ${JSON.stringify(shape)}`, async () => {
      for (const codec of CODECS) {
        const frame = await roundTrip(new Uint8Array(0), 'BF16', shape, codec);
        expect(readHeader(frame).nChunks).toBe(0);
      }
    });
  }
});

describe('special float encodings come back bit for bit', () => {
  const cases: [string, string, Uint8Array, number][] = [
    ['bf16 NaNs 0x7F81-0x7FFF, 0xFF81-0xFFFF, +-Inf', 'BF16',
      u16([...range(0x7f81, 0x7fff), ...range(0xff81, 0xffff), 0x7f80, 0xff80]), 2],
    ['fp32 NaN payloads and max finite', 'F32', u32([0x7f800001, 0xffbfffff, 0x7f7fffff, 0x7f800000, 0xff800000]), 4],
    ['fp16 NaNs 0x7C01-0x7FFF', 'F16', u16(range(0x7c01, 0x7fff)), 2],
    ['fp32 [0.0, -0.0] x 8', 'F32', u32(Array.from({ length: 16 }, (_, i) => (i % 2 ? 0x80000000 : 0))), 4],
    ['bf16 0x8000 among 1,000 zeros', 'BF16', u16(Array.from({ length: 1001 }, (_, i) => (i === 500 ? 0x8000 : 0))), 2],
  ];
  for (const [name, dtype, input, size] of cases) {
    it(name, async () => {
      for (const codec of CODECS) await roundTrip(input, dtype, [input.length / size], codec);
    });
  }
});

describe('views at unaligned offsets', () => {
  it('bf16 [15] split into [3,5,7] at byte offsets 0, 6 and 16', async () => {
    const base = u16(range(1, 15).map((x) => 0x3f80 + x));
    const parts: [number, number][] = [[0, 3], [6, 5], [16, 7]];
    for (const codec of CODECS) {
      for (const [off, n] of parts) await roundTrip(base.subarray(off, off + 2 * n), 'BF16', [n], codec);
    }
  });
  it('a uint8 buffer starting at offset 1', async () => {
    const buf = Uint8Array.from(range(0, 199), (x) => (x * 31) & 0xff);
    for (const codec of CODECS) await roundTrip(buf.subarray(1), 'U8', [199], codec);
  });
  it('decompress into a caller-provided buffer at an odd offset', async () => {
    const input = u16(range(0, 999).map((x) => 0x3c00 + (x % 97)));
    const frame = await compress(input, { dtype: 'BF16', shape: [1000], codec: 'fast' });
    const backing = new Uint8Array(input.length + 3);
    const out = backing.subarray(3);
    const filled = await decompress(frame, { out });
    expect(filled).toBe(out);
    expect(Buffer.compare(Buffer.from(out), Buffer.from(input))).toBe(0);
    expect(backing.subarray(0, 3)).toEqual(new Uint8Array(3));
  });
  it('compress into a caller-provided buffer at an odd offset: the same frame, bytes around it untouched', async () => {
    const input = u16(range(0, 70_000).map((x) => 0x3c00 + ((x * 7919) % 301)));  // 3 chunks of 64 KiB
    for (const codec of CODECS) {
      const own = await compress(input, { dtype: 'BF16', shape: [70_001], codec, chunkSize: 65536 });
      const cap = maxCompressedSize(input.length, 1, 65536);
      const backing = new Uint8Array(cap + 3 + 5).fill(0xa5);
      const out = backing.subarray(3, 3 + cap);
      const frame = await compress(input, { dtype: 'BF16', shape: [70_001], codec, chunkSize: 65536, out });
      expect(Buffer.isBuffer(frame)).toBe(true);
      expect(frame.byteOffset - out.byteOffset).toBe(0);
      expect(frame.buffer).toBe(backing.buffer);
      expect(Buffer.compare(frame, own)).toBe(0);
      expect(backing.subarray(0, 3)).toEqual(new Uint8Array(3).fill(0xa5));
      expect(backing.subarray(3 + cap)).toEqual(new Uint8Array(5).fill(0xa5));
    }
  });
  it('compress refuses an out smaller than maxCompressedSize or overlapping the input', async () => {
    const input = u16(range(0, 999));
    const cap = maxCompressedSize(input.length, 1, defaultChunkSize());
    await expect(compress(input, { dtype: 'BF16', shape: [1000], out: new Uint8Array(cap - 1) }))
      .rejects.toMatchObject({ code: 'TZIP_INVALID_ARGUMENT' });
    const shared = new Uint8Array(cap + input.length);
    shared.set(input, cap - 10);
    await expect(compress(shared.subarray(cap - 10, cap - 10 + input.length), { dtype: 'BF16', shape: [1000], out: shared.subarray(0, cap) }))
      .rejects.toMatchObject({ code: 'TZIP_INVALID_ARGUMENT' });
    await expect(compress(input, { dtype: 'BF16', shape: [1000], out: [1, 2] as unknown as Uint8Array }))
      .rejects.toMatchObject({ code: 'TZIP_INVALID_ARGUMENT' });
  });
});

describe('thread count never changes the bytes', () => {
  it('1 vs 2 vs 7 threads, every codec, 5 chunks', async () => {
    const n = (defaultChunkSize() / 4) * 5 - 3;
    const v = Array.from({ length: n }, (_, i) => Math.sin(i) * 1e-3);
    const input = f32(v);
    for (const codec of CODECS) {
      const frames = await Promise.all([1, 2, 7].map((threads) => compress(input, { dtype: 'F32', shape: [n], codec, threads })));
      expect(Buffer.compare(frames[0]!, frames[1]!)).toBe(0);
      expect(Buffer.compare(frames[0]!, frames[2]!)).toBe(0);
    }
  });
  it('inline (on the calling thread) gives the same frames, bytes and errors as the thread pool', async () => {
    const input = u16(range(0, 40_000).map((x) => 0x3f00 + ((x * 13) % 211)));
    for (const codec of CODECS) {
      const pooled = await compress(input, { dtype: 'BF16', shape: [40_001], codec });
      const here = await compress(input, { dtype: 'BF16', shape: [40_001], codec, inline: true });
      expect(Buffer.compare(here, pooled)).toBe(0);
      const back = await decompress(here, { inline: true });
      expect(Buffer.compare(back, Buffer.from(input))).toBe(0);
    }
    const frame = await compress(input, { dtype: 'BF16', shape: [40_001], codec: 'max' });
    const bad = Buffer.from(frame);
    bad[bad.length - 3]! ^= 0x10;
    await expect(decompress(bad, { inline: true })).rejects.toMatchObject({ code: 'TZIP_CHECKSUM' });
    await expect(compress(input, { dtype: 'BF16', shape: [3], inline: true })).rejects.toMatchObject({ code: 'TZIP_INVALID_ARGUMENT' });
  });
});

// A process that may not start more threads (a container's pids limit, RLIMIT_NPROC): the codec runs on those it got.
// Needs root to drop to an unprivileged user whose process count prlimit can cap.
const canCapThreads = process.getuid?.() === 0 && ['/usr/bin/setpriv', '/usr/bin/prlimit'].every((p) => existsSync(p));
describe.skipIf(!canCapThreads)(`thread limits${canCapThreads ? '' : ' (skipped: needs root, setpriv and prlimit)'}`, () => {
  it('threads: 1024 under a 60-process cap still codes the same bytes, in the pool and inline', () => {
    const dir = mkdtempSync(join(tmpdir(), 'tzip-nproc-'));
    chmodSync(dir, 0o755);
    const script = join(dir, 'cap.mjs');
    writeFileSync(script, `import { compress } from ${JSON.stringify(pathToFileURL(resolve('dist/src/native.js')).href)};
const input = new Uint8Array(8 << 20).map((_, i) => (i * 2654435761) >>> 24);
const ref = await compress(input, { dtype: 'F32', shape: [2 << 20], codec: 'bytes', threads: 1 });
for (const inline of [false, true]) {
  const f = await compress(input, { dtype: 'F32', shape: [2 << 20], codec: 'bytes', threads: 1024, inline });
  console.log(inline, Buffer.compare(f, ref));
}
`);
    chmodSync(script, 0o644);
    const r = spawnSync('/usr/bin/setpriv', ['--reuid=65534', '--regid=65534', '--clear-groups', '/usr/bin/prlimit', '--nproc=60',
      process.execPath, script], { encoding: 'utf8', timeout: 60_000 });
    rmSync(dir, { recursive: true, force: true });
    expect(r.stderr).toBe('');
    expect(r.status).toBe(0);
    expect(r.stdout).toBe('false 0\ntrue 0\n');
  });
});

describe('hostile frames are rejected with an error, never a crash', () => {
  async function sampleFrame(): Promise<Buffer> {
    return compress(u16(range(1, 16)), { dtype: 'BF16', shape: [16], codec: 'fast' });
  }

  it('bf16 [16] = 1..16 truncated at every length', async () => {
    const frame = await sampleFrame();
    const { headerBytes } = readHeader(frame);
    for (let len = 0; len < frame.length; len++) {
      const cut = frame.subarray(0, len);
      await expectTzipError(decompress(cut), ['TZIP_TRUNCATED']);
      // readHeader needs only the fixed header, shape and chunk table.
      if (len < headerBytes) expect(() => readHeader(cut)).toThrow(TzipError);
      else expect(readHeader(cut).frameBytes).toBe(frame.length);
    }
  });

  it('a header cut short says how many bytes it needs (needBytes), at every stage of the header', async () => {
    // 300 chunks of 4 KiB: a chunk table of several KiB, longer than the first read of `tzip inspect`.
    const n = 300 * 2048;
    const frame = await compress(new Uint8Array(2 * n).map((_, i) => (i * 2654435761) >>> 24), {
      dtype: 'BF16', shape: [n], codec: 'fast', chunkSize: 4096,
    });
    const { headerBytes } = readHeader(frame);
    expect(headerBytes).toBeGreaterThan(4096);
    for (const len of [10, 48, 60, headerBytes - 1]) {
      let err: unknown;
      try {
        readHeader(frame.subarray(0, len));
      } catch (e) {
        err = e;
      }
      expect(err).toBeInstanceOf(TzipError);
      expect((err as TzipError).code).toBe('TZIP_TRUNCATED');
      const need = (err as TzipError).needBytes;
      expect(need).toBeGreaterThan(len);
      expect(need).toBeLessThanOrEqual(headerBytes);
      // Given what it asked for (again, until the whole header), readHeader succeeds.
      let have = need as number;
      for (;;) {
        try {
          expect(readHeader(frame.subarray(0, have)).headerBytes).toBe(headerBytes);
          break;
        } catch (e) {
          expect((e as TzipError).needBytes).toBeGreaterThan(have);
          have = (e as TzipError).needBytes as number;
        }
      }
    }
  });

  it('length field set to 2^64-1, with and without a matching header digest', async () => {
    const { h32Raw } = await xxhash();
    const frame = Buffer.from(await sampleFrame());
    frame.writeBigUInt64LE(0xffffffffffffffffn, 16);
    await expectTzipError(decompress(frame), ['TZIP_CORRUPT']);
    // Re-sign the header so only the semantic checks stand between the field and the decoder.
    const h = readHeaderBytes(frame);
    frame.writeUInt32LE(0, 40);
    frame.writeUInt32LE(h32Raw(frame.subarray(0, h), 0), 40);
    await expectTzipError(decompress(frame), ['TZIP_CORRUPT']);
    expect(() => readHeader(frame)).toThrow(/shape does not match|chunk count/);
  });

  it('every single-byte flip of a multi-chunk max frame is caught', async () => {
    const n = 4096;
    const input = u16(Array.from({ length: n }, (_, i) => 0x3c00 + ((i * 40503) & 0x3ff)));
    const frame = await compress(input, { dtype: 'BF16', shape: [n], codec: 'max', chunkSize: 4096 });
    const step = Math.max(1, Math.floor(frame.length / 400));
    for (let i = 0; i < frame.length; i += step) {
      const bad = Buffer.from(frame);
      bad[i]! ^= 0x5a;
      await expectTzipError(decompress(bad), ['TZIP_CORRUPT', 'TZIP_CHECKSUM', 'TZIP_TRUNCATED', 'TZIP_UNSUPPORTED']);
    }
  });

  it('random bytes and wrong arguments', async () => {
    await fc.assert(
      fc.asyncProperty(fc.uint8Array({ minLength: 0, maxLength: 512 }), async (bytes) => {
        await expectTzipError(decompress(bytes), ['TZIP_CORRUPT', 'TZIP_TRUNCATED', 'TZIP_UNSUPPORTED']);
      }),
      { numRuns: 200 },
    );
    await expectTzipError(compress(new Uint8Array(6), { dtype: 'F32', shape: [2] }), ['TZIP_INVALID_ARGUMENT']);
    await expectTzipError(compress(new Uint8Array(4), { dtype: 'F33', shape: [1] }), ['TZIP_INVALID_ARGUMENT']);
    await expectTzipError(compress(new Uint8Array(4), { dtype: 'F32', shape: [1], codec: 'zip' as Codec }), ['TZIP_INVALID_ARGUMENT']);
    await expectTzipError(compress(new Uint8Array(4), { dtype: 'F32', shape: [1], chunkSize: 1000 }), ['TZIP_INVALID_ARGUMENT']);
    const frame = await sampleFrame();
    await expectTzipError(decompress(frame, { out: new Uint8Array(31) }), ['TZIP_INVALID_ARGUMENT']);
  });

  it('a newer format version is refused as unsupported', async () => {
    const frame = Buffer.from(await sampleFrame());
    expect(frame.readUInt16LE(4)).toBe(2);
    frame.writeUInt16LE(3, 4);
    await expectTzipError(decompress(frame), ['TZIP_UNSUPPORTED']);
  });

  it('a version-1 (pre-release) frame is refused as unsupported, even with a valid header digest', async () => {
    const { h32Raw } = await xxhash();
    const frame = Buffer.from(await sampleFrame());
    frame.writeUInt16LE(1, 4);
    for (const reseal of [false, true]) {
      if (reseal) {
        frame.writeUInt32LE(0, 40);
        frame.writeUInt32LE(h32Raw(frame.subarray(0, readHeaderBytes(frame)), 0), 40);
      }
      await expectTzipError(decompress(frame), ['TZIP_UNSUPPORTED']);
      await expect(decompress(frame)).rejects.toThrow(/version 1.*pre-release.*re-compress/);
      expect(() => readHeader(frame)).toThrow(/pre-release/);
    }
    frame.writeUInt16LE(0, 4);
    await expectTzipError(decompress(frame), ['TZIP_CORRUPT']);
  });
});

/** Header bytes of a frame (fixed header + shape + chunk table), from its own fields. */
function readHeaderBytes(frame: Buffer): number {
  const ndim = frame[8]!;
  const nChunks = frame.readUInt32LE(32);
  return Math.ceil((48 + 8 * ndim) / 16) * 16 + 16 * nChunks;
}

describe('property: any dtype, shape and values round-trip bit for bit', () => {
  it('random tensors', async () => {
    const tensor = fc
      .record({
        dtype: fc.constantFrom(...DTYPES),
        shape: fc.array(fc.integer({ min: 0, max: 40 }), { minLength: 0, maxLength: 4 }),
        codec: fc.constantFrom(...CODECS),
        chunkSize: fc.constantFrom(4096, 8192, 65536),
        seed: fc.integer(),
        kind: fc.constantFrom('random', 'smallExponents', 'repeats'),
      })
      .filter((t) => t.shape.reduce((a, b) => a * b, 1) * SIZES[t.dtype]! <= 300_000);
    await fc.assert(
      fc.asyncProperty(tensor, async (t) => {
        const n = t.shape.reduce((a, b) => a * b, 1);
        const bytes = new Uint8Array(n * SIZES[t.dtype]!);
        let s = t.seed >>> 0;
        for (let i = 0; i < bytes.length; i++) {
          s = (s * 1664525 + 1013904223) >>> 0;
          bytes[i] = t.kind === 'random' ? s >>> 24 : t.kind === 'repeats' ? (i >> 5) & 3 : (i & 1 ? 0x3c + ((s >>> 30) & 1) : s >>> 24);
        }
        const frame = await compress(bytes, { dtype: t.dtype, shape: t.shape, codec: t.codec, chunkSize: t.chunkSize });
        expect(frame.length).toBeLessThanOrEqual(maxCompressedSize(bytes.length, t.shape.length, t.chunkSize));
        const back = await decompress(frame);
        expect(Buffer.compare(Buffer.from(back), Buffer.from(bytes))).toBe(0);
        expect(readHeader(frame).shape).toEqual(t.shape);
      }),
      { numRuns: 150 },
    );
  });
});
