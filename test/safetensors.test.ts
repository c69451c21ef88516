// Header parsing, validation and the entry plan: no native addon needed.
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { planEntries } from '../src/entries.js';
import { TzipError } from '../src/errors.js';
import { MAX_HEADER_BYTES, parseSafetensorsHeader } from '../src/safetensors.js';
import { buildSafetensors, gap, randomTensor, type Piece } from './helpers/safetensors-builder.js';

const FILE = '/models/x.safetensors';

function parse(file: Buffer) {
  return parseSafetensorsHeader(file, file.byteLength, FILE);
}

/** A header-only file with the given JSON and `dataBytes` zero bytes of data. */
function rawFile(json: string, dataBytes = 0): Buffer {
  const prefix = Buffer.alloc(8);
  prefix.writeBigUInt64LE(BigInt(Buffer.byteLength(json)));
  return Buffer.concat([prefix, Buffer.from(json), Buffer.alloc(dataBytes)]);
}

function expectTzipError(fn: () => unknown, code: string, tensor?: string): TzipError {
  try {
    fn();
  } catch (err) {
    expect(err).toBeInstanceOf(TzipError);
    const e = err as TzipError;
    expect(e.code).toBe(code);
    expect(e.file).toBe(FILE);
    expect(e.message).toContain(FILE);
    if (tensor !== undefined) {
      expect(e.tensor).toBe(tensor);
      expect(e.message).toContain(tensor);
    }
    return e;
  }
  throw new Error('expected a TzipError');
}

describe('parseSafetensorsHeader', () => {
  it('parses tensors, metadata and sorts by offset', () => {
    const file = buildSafetensors([
      randomTensor('b', 'F32', [2, 3], 4),
      gap(5),
      randomTensor('a', 'BF16', [4], 2),
    ], { metadata: { format: 'pt' } });
    const h = parse(file);
    expect(h.metadata).toEqual({ format: 'pt' });
    expect(h.tensors.map((t) => [t.name, t.begin, t.end])).toEqual([['b', 0, 24], ['a', 29, 37]]);
    expect(h.dataOffset).toBe(8 + h.headerLength);
    expect(h.dataLength).toBe(37);
  });

  it('falls back to U8 [nbytes] for unknown dtypes and size mismatches, never an error', () => {
    const file = buildSafetensors([
      randomTensor('q', 'Q4_K', [3, 5], 1),
      { kind: 'tensor', name: 'bad', dtype: 'F32', shape: [3], bytes: Buffer.alloc(10) },
      randomTensor('ok', 'I64', [2], 8),
      randomTensor('deep', 'F16', new Array<number>(33).fill(1), 2),
    ]);
    const [q, bad, ok, deep] = parse(file).tensors;
    expect([deep?.codecDtype, deep?.codecShape]).toEqual(['F16', [1]]); // more than 32 dimensions: 1-D, as the daemon frames it
    expect([q?.codecDtype, q?.codecShape]).toEqual(['U8', [15]]);
    expect([bad?.codecDtype, bad?.codecShape, bad?.dtype, bad?.shape]).toEqual(['U8', [10], 'F32', [3]]);
    expect([ok?.codecDtype, ok?.codecShape]).toEqual(['I64', [2]]);
  });

  it('codes C64 as F32 pairs (shape + [2]) and float8 fnuz as bytes, the daemon\'s rule for the same tensors', () => {
    const file = buildSafetensors([
      randomTensor('c', 'C64', [8, 8], 8),
      randomTensor('scalar', 'C64', [], 8),
      randomTensor('empty', 'C64', [0, 3], 8),
      randomTensor('deep', 'C64', new Array<number>(32).fill(1), 8), // 33 frame dimensions: 1-D
      { kind: 'tensor', name: 'short', dtype: 'C64', shape: [3], bytes: Buffer.alloc(12) }, // size does not match
      randomTensor('fnuz', 'F8_E4M3FNUZ', [4, 4], 1),
      randomTensor('e5fnuz', 'F8_E5M2FNUZ', [5], 1),
    ]);
    const byName = new Map(parse(file).tensors.map((t) => [t.name, [t.codecDtype, t.codecShape]]));
    expect(Object.fromEntries(byName)).toEqual({
      c: ['F32', [8, 8, 2]], scalar: ['F32', [2]], empty: ['F32', [0, 3, 2]], deep: ['F32', [2]], short: ['U8', [12]],
      fnuz: ['U8', [16]], e5fnuz: ['U8', [5]],
    });
  });

  it('accepts empty tensors, also several at one offset and at a tensor boundary', () => {
    const file = buildSafetensors([
      randomTensor('z1', 'F32', [0], 4),
      randomTensor('t', 'F16', [8], 2),
      randomTensor('z3', 'BF16', [0, 4096], 2),
      randomTensor('z2', 'F32', [2, 0], 4),
    ]);
    expect(parse(file).tensors.map((t) => t.name)).toEqual(['z1', 't', 'z2', 'z3']);
  });

  it('rejects overlapping tensors, naming both', () => {
    const json = JSON.stringify({ a: { dtype: 'U8', shape: [10], data_offsets: [0, 10] }, b: { dtype: 'U8', shape: [4], data_offsets: [8, 12] } });
    const e = expectTzipError(() => parse(rawFile(json, 12)), 'TZIP_CORRUPT', 'b');
    expect(e.message).toContain("'a'");
  });

  it('rejects an empty tensor inside another tensor', () => {
    const json = JSON.stringify({ a: { dtype: 'U8', shape: [10], data_offsets: [0, 10] }, e: { dtype: 'U8', shape: [0], data_offsets: [5, 5] } });
    expectTzipError(() => parse(rawFile(json, 10)), 'TZIP_CORRUPT', 'e');
  });

  it('rejects offsets past the data section as truncated', () => {
    const json = JSON.stringify({ a: { dtype: 'U8', shape: [10], data_offsets: [0, 10] } });
    expectTzipError(() => parse(rawFile(json, 9)), 'TZIP_TRUNCATED', 'a');
  });

  it.each([
    ['reversed offsets', { dtype: 'U8', shape: [0], data_offsets: [4, 0] }],
    ['fractional offsets', { dtype: 'U8', shape: [1], data_offsets: [0, 1.5] }],
    ['negative offsets', { dtype: 'U8', shape: [1], data_offsets: [-1, 0] }],
    ['three offsets', { dtype: 'U8', shape: [1], data_offsets: [0, 1, 2] }],
    ['missing dtype', { shape: [1], data_offsets: [0, 1] }],
    ['string shape', { dtype: 'U8', shape: '1', data_offsets: [0, 1] }],
    ['negative dimension', { dtype: 'U8', shape: [-1], data_offsets: [0, 1] }],
    ['not an object', 42],
  ])('rejects %s', (_label, entry) => {
    expectTzipError(() => parse(rawFile(JSON.stringify({ t: entry }), 8)), 'TZIP_CORRUPT', 't');
  });

  it('rejects bad JSON, a non-object header and bad metadata', () => {
    expectTzipError(() => parse(rawFile('{"a": ', 0)), 'TZIP_CORRUPT');
    expectTzipError(() => parse(rawFile('[1, 2]', 0)), 'TZIP_CORRUPT');
    expectTzipError(() => parse(rawFile('{"__metadata__": 3}', 0)), 'TZIP_CORRUPT');
    const notUtf8 = rawFile('{"?": {}}');
    notUtf8[10] = 0xff; // the '?': 0xff never occurs in UTF-8
    expect(expectTzipError(() => parse(notUtf8), 'TZIP_CORRUPT').message).toContain('UTF-8');
    expectTzipError(() => parseSafetensorsHeader(rawFile('{"a": 1}').subarray(0, 10), 100, FILE), 'TZIP_TRUNCATED');
  });

  it('refuses what the reference reader and the Python reader refuse: a byte-order mark, lone surrogates, metadata values that are not strings', () => {
    // Each was accepted here and refused by tzip.load, so a .tzip the CLI wrote could not be read in Python.
    const t = '"t": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}';
    expect(parse(rawFile(`{${t}}`)).tensors).toHaveLength(1);
    const bom = Buffer.concat([Buffer.from([0xef, 0xbb, 0xbf]), Buffer.from(`{${t}}`)]);
    const withBom = Buffer.concat([Buffer.alloc(8), bom]);
    withBom.writeBigUInt64LE(BigInt(bom.byteLength));
    expect(expectTzipError(() => parse(withBom), 'TZIP_CORRUPT').message).toContain('not UTF-8 JSON');
    const lone = '"\\ud800": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}';
    expect(expectTzipError(() => parse(rawFile(`{${lone}}`)), 'TZIP_CORRUPT').message).toContain('lone UTF-16 surrogate');
    const pair = '"\\ud83d\\ude00": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}';
    expect(parse(rawFile(`{${pair}}`)).tensors[0]?.name).toBe('\u{1F600}');
    // Nesting: 128 levels (the top object, the entry, 126 arrays in an extra key) is read, 129 refused, on both sides
    // (Python's json.loads refused 100,000 levels that this reader took).
    const nested = (levels: number) => `{"n": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0], "x": ${'['.repeat(levels - 2)}${']'.repeat(levels - 2)}}}`;
    expect(parse(rawFile(nested(128))).tensors).toHaveLength(1);
    expect(expectTzipError(() => parse(rawFile(nested(129))), 'TZIP_CORRUPT').message).toContain('nested 129 levels deep');
    expect(expectTzipError(() => parse(rawFile(nested(100_000))), 'TZIP_CORRUPT').message).toContain('more than 128');
    // A dimension of 2^53 is refused for its size, not called negative or fractional.
    const big = '"b": {"dtype": "U8", "shape": [9007199254740992], "data_offsets": [0, 0]}';
    expect(expectTzipError(() => parse(rawFile(`{${big}}`)), 'TZIP_CORRUPT', 'b').message).toContain('from 0 to 2^53 - 1 (9007199254740992)');
    for (const meta of ['{"a": {"b": "c"}}', '{"a": 1}', '{"a": null}', '{"\\udc00": "x"}', '{"a": "\\ud800"}']) {
      expect(expectTzipError(() => parse(rawFile(`{"__metadata__": ${meta}, ${t}}`)), 'TZIP_CORRUPT').message).toContain('__metadata__');
    }
  });

  it('rejects header lengths beyond the file or the 100 MB limit', () => {
    const tooLong = Buffer.alloc(16);
    tooLong.writeBigUInt64LE(9n);
    expectTzipError(() => parse(tooLong), 'TZIP_TRUNCATED');
    const huge = Buffer.alloc(16);
    huge.writeBigUInt64LE(BigInt(MAX_HEADER_BYTES + 1));
    expectTzipError(() => parseSafetensorsHeader(huge, 2 * MAX_HEADER_BYTES, FILE), 'TZIP_CORRUPT');
    const enormous = Buffer.alloc(16);
    enormous.writeBigUInt64LE(2n ** 63n);
    expectTzipError(() => parse(enormous), 'TZIP_CORRUPT');
    expectTzipError(() => parse(Buffer.alloc(5)), 'TZIP_TRUNCATED');
    // a binary length that is absurd is not called text
    expect(expectTzipError(() => parse(enormous), 'TZIP_CORRUPT').message).not.toContain('not a safetensors file');
  });

  it('says a text file is not a safetensors file, keeping the error codes', () => {
    const json = Buffer.from('{\n  "architectures": ["BertModel"]\n}\n');
    const e = expectTzipError(() => parse(json), 'TZIP_CORRUPT'); // "{\n  \"arc" read as a u64 is over 100 MB
    expect(e.message).toContain('not a safetensors file: it starts with text ("{\\n  \\"arc")');
    const t = Buffer.from('hi there, a README');
    expect(expectTzipError(() => parse(t), 'TZIP_CORRUPT').message).toContain('it starts with text ("hi there")');
  });

  it('keeps a tensor named __proto__', () => {
    const h = parse(buildSafetensors([randomTensor('__proto__', 'U8', [2], 1), randomTensor('constructor', 'U8', [1], 1)]));
    expect(h.tensors.map((t) => t.name)).toEqual(['__proto__', 'constructor']);
  });

  it('accepts a header with no tensors and trailing NUL padding', () => {
    const h = parse(Buffer.concat([rawFile('{}      \0\0'), Buffer.alloc(3)]));
    expect(h.tensors).toEqual([]);
    expect(planEntries(h).map((e) => [e.kind, e.begin, e.end])).toEqual([['gap', 0, 3]]);
  });
});

describe('planEntries', () => {
  const pieceArb: fc.Arbitrary<Piece> = fc.oneof(
    fc.record({ n: fc.nat(40), dtype: fc.constantFrom('F32', 'BF16', 'U8', 'I64', 'WEIRD') }).map(({ n, dtype }) =>
      randomTensor('t', dtype, [n], dtype === 'F32' ? 4 : dtype === 'BF16' ? 2 : dtype === 'I64' ? 8 : 1)),
    fc.integer({ min: 1, max: 30 }).map((n) => gap(n)),
  );

  it('covers the data section contiguously, one entry per tensor, gaps only where no tensor is', () => {
    fc.assert(fc.property(fc.array(pieceArb, { maxLength: 12 }), (generated) => {
      const pieces = generated.map((p, i): Piece => (p.kind === 'tensor' ? { ...p, name: `t${i}` } : p));
      const file = buildSafetensors(pieces);
      const h = parse(file);
      const entries = planEntries(h);
      let cursor = 0;
      for (const e of entries) {
        expect(e.begin).toBe(cursor);
        expect(e.end).toBeGreaterThanOrEqual(e.begin);
        if (e.kind === 'gap') expect(e.end).toBeGreaterThan(e.begin);
        cursor = e.end;
      }
      expect(cursor).toBe(h.dataLength);
      expect(entries.filter((e) => e.kind === 'tensor').map((e) => e.name).sort())
        .toEqual(pieces.filter((p) => p.kind === 'tensor').map((p) => (p as { name: string }).name).sort());
      // No two gaps in a row: adjacent uncovered bytes form one gap.
      entries.forEach((e, i) => { if (i > 0 && e.kind === 'gap') expect(entries[i - 1]?.kind).toBe('tensor'); });
    }), { numRuns: 200 });
  });
});
