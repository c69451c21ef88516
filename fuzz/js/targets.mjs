// The TypeScript decoders' fuzz targets (run by fuzz/js/run.mjs, replayed by test/fuzz-regressions.test.ts), on the
// compiled sources in dist/. Each check(bytes) resolves when the decoder handled the input correctly (decoded it
// consistently, or refused it with the error its docs promise) and throws FuzzFailure otherwise.
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { isDeepStrictEqual } from 'node:util';
import { TzipError } from '../../dist/src/errors.js';
import { openTzip } from '../../dist/src/reader.js';
import { parseSafetensorsHeader } from '../../dist/src/safetensors.js';
import { compressFile } from '../../dist/src/writer.js';
import { parseRequest } from '../../dist/src/daemon/parse-request.js';
import { encodeMessage } from '../../dist/src/daemon/wire.js';

/** A broken property: what the fuzzer reports as a crash. */
export class FuzzFailure extends Error {}
const fail = (what, cause) => { throw new FuzzFailure(what + (cause ? `: ${cause?.stack ?? cause}` : ''), { cause }); };

/** Rethrows anything but a TzipError with one of `codes` as a failure. */
function expectTzip(err, codes, where) {
  if (err instanceof FuzzFailure) throw err;
  if (!(err instanceof TzipError)) fail(`${where} threw a ${err?.constructor?.name ?? typeof err}, not a TzipError`, err);
  if (!codes.includes(err.code)) fail(`${where} refused with ${err.code}, not one of ${codes.join(', ')}`, err);
}

let scratch;
function scratchDir() {
  scratch ??= mkdtempSync(join(tmpdir(), 'tzip-fuzz-'));
  return scratch;
}
/** Removes the scratch folder (the runner calls it at exit). */
export function cleanup() {
  if (scratch) rmSync(scratch, { recursive: true, force: true });
  scratch = undefined;
}

const FILE_CODES = ['TZIP_CORRUPT', 'TZIP_TRUNCATED', 'TZIP_UNSUPPORTED', 'TZIP_CHECKSUM'];

/** Opens `bytes` as a .tzip file and decodes every entry; returns the entries' bytes, or null when refused. */
async function decodeAll(path) {
  let reader;
  try {
    reader = await openTzip(path);
  } catch (err) {
    expectTzip(err, FILE_CODES, 'openTzip');
    return null;
  }
  try {
    const parts = [];
    for (const e of reader.entries) {
      try {
        await reader.frameHeader(e);
        const bytes = await reader.decodeEntry(e, { threads: 1 });
        if (bytes.byteLength !== e.end - e.begin) fail(`entry ${e.index} decoded to ${bytes.byteLength} bytes, not ${e.end - e.begin}`);
        parts.push(bytes);
      } catch (err) {
        expectTzip(err, FILE_CODES, `decodeEntry(${e.index})`);
        return null;
      }
    }
    return { headerBytes: reader.headerBytes, codecs: reader.entries, parts };
  } finally {
    await reader.close();
  }
}

/**
 * The .tzip container reader (src/container.ts, src/reader.ts): openTzip checks prefix, trailer, index and header,
 * then every entry's frame header and frame are decoded. Property on a success: the safetensors file it holds,
 * compressed again by the real writer, opens and decodes to the same bytes.
 */
export const container = {
  async check(bytes) {
    const path = join(scratchDir(), 'in.tzip');
    writeFileSync(path, bytes);
    const first = await decodeAll(path);
    if (first === null) return false;
    const original = Buffer.concat([first.headerBytes, ...first.parts]);
    const st = join(scratchDir(), 'again.safetensors'), again = join(scratchDir(), 'again.tzip');
    writeFileSync(st, original);
    await compressFile(st, again, { threads: 1, chunkSize: 4096 });
    const second = await decodeAll(again);
    if (second === null) fail('the re-written .tzip of a readable one is refused');
    if (!Buffer.concat([second.headerBytes, ...second.parts]).equals(original)) fail('re-written .tzip decodes to other bytes');
    return true;
  },
};

/**
 * The safetensors header reader (src/safetensors.ts) on a whole file's bytes. Refusals are TZIP_CORRUPT or
 * TZIP_TRUNCATED; a parsed header has its tensors sorted, disjoint and inside the data section, and the header
 * rebuilt from what was parsed parses to the same tensors and metadata.
 */
export const safetensors = {
  async check(bytes) {
    let h;
    try {
      h = parseSafetensorsHeader(bytes, bytes.byteLength, 'fuzz.safetensors');
    } catch (err) {
      expectTzip(err, ['TZIP_CORRUPT', 'TZIP_TRUNCATED'], 'parseSafetensorsHeader');
      return false;
    }
    if (h.dataOffset !== 8 + h.headerLength || h.dataLength !== bytes.byteLength - h.dataOffset) fail('header sizes');
    let cursor = 0;
    for (const t of h.tensors) {
      if (t.begin > t.end || t.end > h.dataLength) fail(`tensor ${t.name} outside the data section`);
      if (t.begin < cursor && t.begin !== t.end) fail(`tensor ${t.name} overlaps the previous one`);
      cursor = Math.max(cursor, t.end);
    }
    const json = {};
    if (h.metadata !== undefined) json.__metadata__ = h.metadata;
    for (const t of h.tensors) json[t.name] = { dtype: t.dtype, shape: t.shape, data_offsets: [t.begin, t.end] };
    const text = Buffer.from(JSON.stringify(json));
    const len = Buffer.alloc(8);
    len.writeBigUInt64LE(BigInt(text.byteLength));
    const rebuilt = Buffer.concat([len, text, bytes.subarray(h.dataOffset)]);
    let h2;
    try {
      h2 = parseSafetensorsHeader(rebuilt, rebuilt.byteLength, 'rebuilt.safetensors');
    } catch (err) {
      fail('the header rebuilt from a parsed one is refused', err);
    }
    if (!isDeepStrictEqual(h2.tensors, h.tensors) || !isDeepStrictEqual(h2.metadata, h.metadata)) fail('rebuilt header parses differently');
    return true;
  },
};

const LIMITS = { maxMessageBytes: 1 << 20 };

/**
 * The daemon's protocol message decoder (src/daemon/wire.ts, parse-request.ts, schema.ts): parseRequest never
 * throws (a hostile message is an error value with a TZIP_ code); a request it accepts, encoded again, parses to
 * the same request.
 */
export const protocol = {
  async check(bytes) {
    let r;
    try {
      r = parseRequest(bytes, LIMITS);
    } catch (err) {
      fail('parseRequest threw', err);
    }
    if (r.error !== undefined) {
      if (typeof r.error.code !== 'string' || !r.error.code.startsWith('TZIP_')) fail(`error without a TZIP_ code: ${r.error.code}`);
      if (r.id !== null && !Number.isSafeInteger(r.id)) fail('id is not an integer');
      return false;
    }
    let again;
    try {
      again = parseRequest(encodeMessage(r.request), LIMITS);
    } catch (err) {
      fail('parseRequest threw on a re-encoded request', err);
    }
    if (again.error !== undefined) fail(`a re-encoded request is refused: ${again.error.code} ${again.error.message}`);
    if (!isDeepStrictEqual(normalize(again.request), normalize(r.request))) fail('a re-encoded request parses differently');
    return true;
  },
};

/** Buffers and Uint8Arrays compare by bytes. */
function normalize(v) {
  if (v instanceof Uint8Array) return { bytes: Buffer.from(v).toString('hex') };
  if (Array.isArray(v)) return v.map(normalize);
  if (v !== null && typeof v === 'object') return Object.fromEntries(Object.entries(v).map(([k, x]) => [k, normalize(x)]));
  return v;
}

export const TARGETS = { container, safetensors, protocol };
