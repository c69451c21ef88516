/**
 * The byte layout of a .tzip container (spec: docs/container.md): the fixed 24-byte prefix,
 * the verbatim safetensors header, 16-byte aligned frames, the index and the 32-byte trailer.
 * This module encodes and decodes the fixed parts and checks them; reading and writing whole
 * files is in reader.ts and writer.ts.
 */
import type xxhash from 'xxhash-wasm';
import { TzipError } from './errors.js';

/** The 8 magic bytes at offset 0: "\x89TZIP\r\n\x1a". */
export const MAGIC = Buffer.from([0x89, 0x54, 0x5a, 0x49, 0x50, 0x0d, 0x0a, 0x1a]);
/** The 4 magic bytes near the end of the trailer. */
export const TRAILER_MAGIC = Buffer.from('TZIX', 'latin1');
/** Container version this code writes and reads. */
export const CONTAINER_VERSION = 1;
/** Bytes of the fixed prefix (magic, version, flags, header digest, original size). */
export const PREFIX_BYTES = 24;
/**
 * Prefix flag bit: the u32 at offset 12 holds the XXH32 (seed 0) of the verbatim safetensors header
 * (its 8 + N bytes at offset 24). Without it a flipped bit in a tensor name or in __metadata__ would
 * go unnoticed: no other digest covers those bytes. Files written before the flag existed have it clear.
 */
export const FLAG_HEADER_DIGEST = 0x0001;
/** Every flag bit this code knows; a file with any other bit set is refused as unsupported. */
const KNOWN_FLAGS = FLAG_HEADER_DIGEST;
/** Frames and the index start at offsets that are multiples of this many bytes. */
export const ALIGNMENT = 16;
/** Bytes per index entry. */
export const INDEX_ENTRY_BYTES = 32;
/** Bytes of the trailer at the very end of the file. */
export const TRAILER_BYTES = 32;

/** The fixed prefix at offset 0. */
export interface Prefix {
  /** Size in bytes of the original safetensors file. */
  originalSize: number;
  /**
   * XXH32 (seed 0) of the safetensors header's 8 + N bytes, stored with {@link FLAG_HEADER_DIGEST};
   * undefined for a file without that flag (written before it existed).
   */
  headerDigest?: number | undefined;
}

/** One index entry: which bytes of the data section a frame reproduces, and where the frame is. */
export interface IndexEntry {
  /** First byte reproduced, relative to the safetensors data section. */
  dataBegin: number;
  /** One past the last byte reproduced. */
  dataEnd: number;
  /** Absolute offset of the frame in the .tzip file (a multiple of 16). */
  frameOffset: number;
  /** Size of the frame in bytes. */
  frameBytes: number;
}

/** The trailer in the last 32 bytes. */
export interface Trailer {
  /** Absolute offset of the index (a multiple of 16). */
  indexOffset: number;
  entryCount: number;
  /** XXH32 (seed 0) of the index bytes. */
  indexDigest: number;
  /** Size in bytes of the original safetensors file (same as in the prefix). */
  originalSize: number;
}

/** Rounds `offset` up to the next multiple of {@link ALIGNMENT}. */
export function alignUp(offset: number): number {
  return Math.ceil(offset / ALIGNMENT) * ALIGNMENT;
}

let hasher: Promise<Awaited<ReturnType<typeof xxhash>>> | undefined;

/**
 * Inputs up to this many bytes are hashed by {@link xxh32Small} in JavaScript; larger ones by the xxhash-wasm package,
 * loaded (and its WebAssembly compiled) only then. The digests the container holds cover the safetensors header (a few
 * KB to a few MB) and the index (48 bytes an entry): every command that reads or writes a .tzip hashed them, and
 * importing and compiling the WebAssembly cost more of a command's start-up than the hashing (issue 36).
 */
const JS_XXH32_MAX_BYTES = 1 << 20;

const P1 = 0x9e3779b1;
const P2 = 0x85ebca77;
const P3 = 0xc2b2ae3d;
const P4 = 0x27d4eb2f;
const P5 = 0x165667b1;

function rotl(x: number, r: number): number {
  return (x << r) | (x >>> (32 - r));
}

/** XXH32 with seed 0 of `bytes` in JavaScript (the reference algorithm, 32-bit arithmetic with Math.imul). */
export function xxh32Small(bytes: Uint8Array): number {
  const n = bytes.byteLength;
  const view = new DataView(bytes.buffer, bytes.byteOffset, n);
  let i = 0;
  let h: number;
  if (n >= 16) {
    let v1 = (P1 + P2) | 0;
    let v2 = P2;
    let v3 = 0;
    let v4 = -P1 | 0;
    for (const limit = n - 16; i <= limit; i += 16) {
      v1 = Math.imul(rotl((v1 + Math.imul(view.getUint32(i, true), P2)) | 0, 13), P1);
      v2 = Math.imul(rotl((v2 + Math.imul(view.getUint32(i + 4, true), P2)) | 0, 13), P1);
      v3 = Math.imul(rotl((v3 + Math.imul(view.getUint32(i + 8, true), P2)) | 0, 13), P1);
      v4 = Math.imul(rotl((v4 + Math.imul(view.getUint32(i + 12, true), P2)) | 0, 13), P1);
    }
    h = (rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18)) | 0;
  } else {
    h = P5;
  }
  h = (h + n) | 0;
  for (; i + 4 <= n; i += 4) h = Math.imul(rotl((h + Math.imul(view.getUint32(i, true), P3)) | 0, 17), P4);
  for (; i < n; i++) h = Math.imul(rotl((h + Math.imul(bytes[i] as number, P5)) | 0, 11), P1);
  h = Math.imul(h ^ (h >>> 15), P2);
  h = Math.imul(h ^ (h >>> 13), P3);
  return (h ^ (h >>> 16)) >>> 0;
}

/** XXH32 with seed 0 of `bytes`: {@link xxh32Small} up to 1 MiB, the xxhash-wasm package above. */
export async function xxh32(bytes: Uint8Array): Promise<number> {
  if (bytes.byteLength <= JS_XXH32_MAX_BYTES) return xxh32Small(bytes);
  hasher ??= import('xxhash-wasm').then((m) => m.default());
  return (await hasher).h32Raw(bytes, 0) >>> 0;
}

function readU64(buf: Buffer, at: number, what: string, file: string): number {
  const v = buf.readBigUInt64LE(at);
  if (v > BigInt(Number.MAX_SAFE_INTEGER)) throw new TzipError('TZIP_CORRUPT', `${what} ${v} is out of range`, { file });
  return Number(v);
}

/** Encodes the 24-byte prefix; with `headerDigest` it sets {@link FLAG_HEADER_DIGEST} and stores the digest at offset 12. */
export function encodePrefix(prefix: Prefix): Buffer {
  const buf = Buffer.alloc(PREFIX_BYTES);
  MAGIC.copy(buf, 0);
  buf.writeUInt16LE(CONTAINER_VERSION, 8);
  buf.writeUInt16LE(prefix.headerDigest === undefined ? 0 : FLAG_HEADER_DIGEST, 10);
  buf.writeUInt32LE((prefix.headerDigest ?? 0) >>> 0, 12);
  buf.writeBigUInt64LE(BigInt(prefix.originalSize), 16);
  return buf;
}

/**
 * Decodes and checks the 24-byte prefix. The header digest, when present, is checked by the caller
 * once it has read the header bytes.
 * @throws TzipError TZIP_CORRUPT (bad magic, version 0, non-zero field at offset 12 without
 *   {@link FLAG_HEADER_DIGEST}) or TZIP_UNSUPPORTED (newer version, unknown flags), naming `file`.
 */
export function decodePrefix(buf: Buffer, file: string): Prefix {
  if (buf.byteLength < PREFIX_BYTES || !buf.subarray(0, MAGIC.byteLength).equals(MAGIC)) {
    throw new TzipError('TZIP_CORRUPT', 'not a .tzip file (bad magic bytes)', { file });
  }
  const version = buf.readUInt16LE(8);
  if (version > CONTAINER_VERSION) {
    throw new TzipError('TZIP_UNSUPPORTED', `container version ${version} is newer than the supported ${CONTAINER_VERSION}`, { file });
  }
  if (version !== CONTAINER_VERSION) throw new TzipError('TZIP_CORRUPT', `bad container version ${version}`, { file });
  const flags = buf.readUInt16LE(10);
  if ((flags & ~KNOWN_FLAGS) !== 0) throw new TzipError('TZIP_UNSUPPORTED', `unknown container flags 0x${flags.toString(16)}`, { file });
  const field = buf.readUInt32LE(12);
  // Without the flag the field is reserved and zero; a non-zero one there also catches a flip that cleared the flag.
  if ((flags & FLAG_HEADER_DIGEST) === 0 && field !== 0) {
    throw new TzipError('TZIP_CORRUPT', 'reserved prefix field is not zero (and the header digest flag is not set)', { file });
  }
  return {
    originalSize: readU64(buf, 16, 'original file size', file),
    headerDigest: (flags & FLAG_HEADER_DIGEST) !== 0 ? field : undefined,
  };
}

/** Encodes the index: 32 bytes per entry. */
export function encodeIndex(entries: readonly IndexEntry[]): Buffer {
  const buf = Buffer.alloc(entries.length * INDEX_ENTRY_BYTES);
  entries.forEach((e, i) => {
    const at = i * INDEX_ENTRY_BYTES;
    buf.writeBigUInt64LE(BigInt(e.dataBegin), at);
    buf.writeBigUInt64LE(BigInt(e.dataEnd), at + 8);
    buf.writeBigUInt64LE(BigInt(e.frameOffset), at + 16);
    buf.writeBigUInt64LE(BigInt(e.frameBytes), at + 24);
  });
  return buf;
}

/**
 * Decodes the index (its digest must have been checked against the trailer already).
 * @throws TzipError TZIP_CORRUPT when a field exceeds 2^53 - 1, naming `file`.
 */
export function decodeIndex(buf: Buffer, file: string): IndexEntry[] {
  const entries: IndexEntry[] = [];
  for (let at = 0; at + INDEX_ENTRY_BYTES <= buf.byteLength; at += INDEX_ENTRY_BYTES) {
    entries.push({
      dataBegin: readU64(buf, at, 'index data_begin', file),
      dataEnd: readU64(buf, at + 8, 'index data_end', file),
      frameOffset: readU64(buf, at + 16, 'index frame_offset', file),
      frameBytes: readU64(buf, at + 24, 'index frame_bytes', file),
    });
  }
  return entries;
}

/** Encodes the 32-byte trailer. */
export function encodeTrailer(trailer: Trailer): Buffer {
  const buf = Buffer.alloc(TRAILER_BYTES);
  buf.writeBigUInt64LE(BigInt(trailer.indexOffset), 0);
  buf.writeUInt32LE(trailer.entryCount, 8);
  buf.writeUInt32LE(trailer.indexDigest >>> 0, 12);
  buf.writeBigUInt64LE(BigInt(trailer.originalSize), 16);
  TRAILER_MAGIC.copy(buf, 24);
  buf.writeUInt32LE(0, 28);
  return buf;
}

/**
 * Decodes the trailer and checks that the index lies, aligned, right before it.
 * @param fileSize size of the .tzip file in bytes.
 * @throws TzipError TZIP_CORRUPT (no "TZIX" magic, e.g. an incompletely written or truncated file;
 *   non-zero reserved field; index not where the trailer says), naming `file`.
 */
export function decodeTrailer(buf: Buffer, fileSize: number, file: string): Trailer {
  if (buf.byteLength !== TRAILER_BYTES || !buf.subarray(24, 28).equals(TRAILER_MAGIC)) {
    throw new TzipError('TZIP_CORRUPT', "no 'TZIX' trailer at the end of the file (truncated or incompletely written?)", { file });
  }
  if (buf.readUInt32LE(28) !== 0) throw new TzipError('TZIP_CORRUPT', 'reserved trailer field is not zero', { file });
  const trailer: Trailer = {
    indexOffset: readU64(buf, 0, 'index offset', file),
    entryCount: buf.readUInt32LE(8),
    indexDigest: buf.readUInt32LE(12),
    originalSize: readU64(buf, 16, 'original file size', file),
  };
  if (trailer.indexOffset % ALIGNMENT !== 0 ||
      trailer.indexOffset + trailer.entryCount * INDEX_ENTRY_BYTES + TRAILER_BYTES !== fileSize) {
    throw new TzipError('TZIP_CORRUPT',
      `trailer places ${trailer.entryCount} index entries at offset ${trailer.indexOffset}, which does not end at the trailer of this ${fileSize}-byte file`, { file });
  }
  return trailer;
}
