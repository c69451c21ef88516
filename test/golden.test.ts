// Golden vectors (test/golden/, made by cuda/test/make_golden.cpp): the frame format is pinned.
// Re-encoding every golden input must give the stored frame byte for byte, with 1 or 4 threads, and every stored
// frame must decode to the stored input. A deliberate format change bumps the format version and regenerates the
// vectors (test/golden/README.md); any other difference here is a regression.
import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
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
