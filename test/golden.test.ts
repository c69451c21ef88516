// Golden vectors (test/golden/, made by cuda/test/make_golden.cpp): the frame format is pinned.
// Re-encoding every golden input must give the stored frame byte for byte, with 1 or 4 threads, and every stored
// frame must decode to the stored input. A deliberate format change bumps the format version and regenerates the
// vectors (test/golden/README.md); any other difference here is a regression.
import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import xxhash from 'xxhash-wasm';
import { compress, decompress, formatVersion, maxCompressedSize, readHeader, type Codec } from '../src/native.js';

interface GoldenVector {
  name: string;
  dtype: string;
  shape: number[];
  codec: Codec;
  chunkSize?: number;
  frameCodec: string;
  nbytes: number;
  frameBytes: number;
  input: string;
  frame: string;
  inputSha256: string;
  frameSha256: string;
  formula: string;
}

const GOLDEN = join(dirname(fileURLToPath(import.meta.url)), 'golden');
const manifest = JSON.parse(readFileSync(join(GOLDEN, 'manifest.json'), 'utf8')) as {
  formatVersion: number;
  chunkDigests: { pattern: string; vectors: { length: number; digest: string }[] };
  vectors: GoldenVector[];
};
const vectors = manifest.vectors;

const sha256 = (b: Uint8Array): string => createHash('sha256').update(b).digest('hex');
const load = (file: string): Buffer => readFileSync(join(GOLDEN, file));

/** Byte-exact comparison with a readable failure: where the first difference is and the sizes. */
function expectSameBytes(actual: Uint8Array, expected: Uint8Array, what: string): void {
  const a = Buffer.from(actual.buffer, actual.byteOffset, actual.byteLength);
  if (a.equals(expected)) return;
  let i = 0;
  while (i < Math.min(a.length, expected.length) && a[i] === expected[i]) ++i;
  expect.fail(
    `${what}: ${a.length} bytes vs ${expected.length} expected, first difference at byte ${i} ` +
      `(got 0x${(a[i] ?? -1).toString(16)}, want 0x${(expected[i] ?? -1).toString(16)})`,
  );
}

describe('golden vectors', () => {
  it('manifest lists a broad set of vectors for this format version', () => {
    expect(manifest.formatVersion, 'the addon writes a different format version: regenerate test/golden on purpose').toBe(
      formatVersion(),
    );
    const codecs = new Set(vectors.map((v) => v.codec));
    for (const c of ['fast', 'max', 'bytes', 'raw', 'auto']) expect(codecs).toContain(c);
    expect(new Set(vectors.map((v) => v.name)).size).toBe(vectors.length);
  });

  describe.each(vectors.map((v) => [v.name, v] as const))('%s', (_name, v) => {
    const input = load(v.input);
    const frame = load(v.frame);
    const opts = { dtype: v.dtype, shape: v.shape, codec: v.codec, chunkSize: v.chunkSize };

    it('stored files match the manifest', () => {
      expect(input.length).toBe(v.nbytes);
      expect(frame.length).toBe(v.frameBytes);
      expect(sha256(input)).toBe(v.inputSha256);
      expect(sha256(frame)).toBe(v.frameSha256);
      expect(frame.length).toBeLessThanOrEqual(maxCompressedSize(v.nbytes, v.shape.length, v.chunkSize));
    });

    it('re-encodes to the identical frame with 1 and 4 threads', async () => {
      expectSameBytes(await compress(input, { ...opts, threads: 1 }), frame, 'threads 1');
      expectSameBytes(await compress(input, { ...opts, threads: 4 }), frame, 'threads 4');
    });

    it('decodes to the stored input', async () => {
      expectSameBytes(await decompress(frame, { threads: 1 }), input, 'decode, threads 1');
      expectSameBytes(await decompress(frame, { threads: 4 }), input, 'decode, threads 4');
      const out = new Uint8Array(v.nbytes);
      expect(await decompress(frame, { out })).toBe(out);
      expectSameBytes(out, input, 'decode into out');
    });

    it('header describes the vector', () => {
      const h = readHeader(frame);
      expect(h.formatVersion).toBe(manifest.formatVersion);
      expect(h.dtype).toBe(v.dtype);
      expect(h.codec).toBe(v.frameCodec);
      expect(h.shape).toEqual(v.shape);
      expect(h.nbytes).toBe(v.nbytes);
      expect(h.chunkSize).toBe(v.chunkSize ?? 65536);
      expect(h.nChunks).toBe(Math.ceil(v.nbytes / h.chunkSize));
      expect(h.frameBytes).toBe(frame.length);
      expect(h.headerBytes + h.payloadBytes).toBe(frame.length);
    });
  });
});

// The chunk digest (docs/format.md, section 9): 16-byte stripes dealt round-robin to 32 lanes, XXH32 per lane, XXH32
// of the 32 lane digests. make_golden wrote these values with the C++ chunk_digest; docs/format.md publishes them.
describe('chunk digest', () => {
  const PUBLISHED: Record<number, number> = {
    0: 0x74afa0fa, 1: 0x34421e72, 16: 0xf838c2e9, 17: 0x7efb1ffd, 512: 0xdb7fc382, 513: 0x4bab301e,
    4096: 0xd35d33d1, 65536: 0x4fbb03e1,
  };
  const pattern = (n: number): Uint8Array => Uint8Array.from({ length: n }, (_, i) => (31 * i + 7) & 0xff);

  /** The definition, written out independently with xxhash-wasm. */
  async function chunkDigest(b: Uint8Array): Promise<number> {
    const { h32Raw } = await xxhash();
    const lanes = Buffer.alloc(128);
    for (let l = 0; l < 32; l++) {
      const parts: Uint8Array[] = [];
      for (let s = l; 16 * s < b.length; s += 32) parts.push(b.subarray(16 * s, Math.min(16 * s + 16, b.length)));
      lanes.writeUInt32LE(h32Raw(Buffer.concat(parts), 0) >>> 0, 4 * l);
    }
    return h32Raw(lanes, 0) >>> 0;
  }

  it('the manifest holds the published vectors, and the definition gives them', async () => {
    expect(manifest.chunkDigests.pattern).toBe('byte i = (31*i + 7) mod 256');
    const listed = Object.fromEntries(manifest.chunkDigests.vectors.map((v) => [v.length, parseInt(v.digest, 16)]));
    expect(listed).toEqual(PUBLISHED);
    for (const [len, digest] of Object.entries(PUBLISHED)) expect(await chunkDigest(pattern(Number(len)))).toBe(digest);
  });

  it('the codec writes it in the chunk table (codec raw, U8 [n]: table entry at 64, digest at 76)', async () => {
    for (const len of Object.keys(PUBLISHED).map(Number)) {
      const frame = await compress(pattern(len), { dtype: 'U8', shape: [len], codec: 'raw' });
      const checksum = frame.readUInt32LE(36);
      if (len === 0) {
        expect(checksum).toBe(0x02cc5d05); // XXH32 of no digests
        continue;
      }
      expect(frame.readUInt32LE(76), `length ${len}`).toBe(PUBLISHED[len]);
      const { h32Raw } = await xxhash();
      expect(checksum).toBe(h32Raw(frame.subarray(76, 80), 0) >>> 0);
    }
  });

  it('the codec and the definition agree on odd lengths, unaligned input and every chunk of a frame', async () => {
    const data = Uint8Array.from({ length: 3 * 4352 + 1001 }, (_, i) => (i * 2654435761) >>> 24);
    for (const len of [15, 31, 33, 527, 528, 4095, 4352, 3 * 4352 + 1000]) {
      const input = data.subarray(1, 1 + len);
      const frame = await compress(input, { dtype: 'U8', shape: [len], codec: 'bytes', chunkSize: 4352 });
      const h = readHeader(frame);
      for (let i = 0; i < h.nChunks; i++) {
        const chunk = input.subarray(i * 4352, Math.min((i + 1) * 4352, len));
        expect(frame.readUInt32LE(64 + 16 * i + 12), `length ${len}, chunk ${i}`).toBe(await chunkDigest(chunk));
      }
      expectSameBytes(await decompress(frame), input, `length ${len}`);
    }
  });
});
