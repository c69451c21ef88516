/**
 * Test helper: writes safetensors files from a list of data-section pieces, independently of the
 * code under test (its own header encoder), so tests can build layouts that real writers never
 * make: gaps between tensors, trailing bytes, unknown dtypes, empty tensors, odd header padding.
 */
import { randomBytes } from 'node:crypto';

/** A tensor placed at the current end of the data section. */
export interface TensorPiece {
  kind: 'tensor';
  name: string;
  dtype: string;
  shape: number[];
  /** The tensor's bytes (any length: mismatches with dtype/shape are allowed on purpose). */
  bytes: Buffer;
}

/** Bytes no tensor covers (a gap, or trailing bytes when last). */
export interface GapPiece {
  kind: 'gap';
  bytes: Buffer;
}

export type Piece = TensorPiece | GapPiece;

/** Options of {@link buildSafetensors}. */
export interface BuildOptions {
  metadata?: Record<string, string>;
  /** Spaces appended to the JSON; default: pad the header to a multiple of 8 bytes, as the reference writer does. */
  headerPadding?: number;
}

/** Encodes a safetensors file: u64 LE header length, JSON header (+ padding), data section. */
export function buildSafetensors(pieces: readonly Piece[], options: BuildOptions = {}): Buffer {
  const header: Record<string, unknown> = {};
  if (options.metadata !== undefined) header.__metadata__ = options.metadata;
  let offset = 0;
  for (const p of pieces) {
    if (p.kind === 'tensor') {
      // defineProperty, not assignment, so that a tensor named "__proto__" becomes a key.
      const value = { dtype: p.dtype, shape: p.shape, data_offsets: [offset, offset + p.bytes.byteLength] };
      Object.defineProperty(header, p.name, { value, enumerable: true, writable: true, configurable: true });
    }
    offset += p.bytes.byteLength;
  }
  const json = Buffer.from(JSON.stringify(header), 'utf8');
  const padding = options.headerPadding ?? (8 - ((8 + json.byteLength) % 8)) % 8;
  const prefix = Buffer.alloc(8);
  prefix.writeBigUInt64LE(BigInt(json.byteLength + padding));
  return Buffer.concat([prefix, json, Buffer.alloc(padding, 0x20), ...pieces.map((p) => p.bytes)]);
}

/** A tensor of random bytes of the right size for a dtype of `elementBytes` bytes. */
export function randomTensor(name: string, dtype: string, shape: number[], elementBytes: number): TensorPiece {
  return { kind: 'tensor', name, dtype, shape, bytes: randomBytes(shape.reduce((a, b) => a * b, 1) * elementBytes) };
}

/** A float32 tensor with values like trained weights (small normal-ish numbers), little-endian. */
export function weightLikeF32(name: string, shape: number[], seed = 1): TensorPiece {
  const n = shape.reduce((a, b) => a * b, 1);
  const values = new Float32Array(n);
  let s = seed >>> 0;
  const next = (): number => {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    return s / 2 ** 32;
  };
  for (let i = 0; i < n; i++) values[i] = (next() + next() + next() - 1.5) * 0.05;
  return { kind: 'tensor', name, dtype: 'F32', shape, bytes: Buffer.from(values.buffer) };
}

/** The raw bytes of BF16 values: the upper halves of float32 values (truncation; fine for test data). */
export function bf16From(piece: TensorPiece, name: string): TensorPiece {
  const f32 = piece.bytes;
  const out = Buffer.alloc(f32.byteLength / 2);
  for (let i = 0; i < out.byteLength; i += 2) out.writeUInt16LE(f32.readUInt16LE(i * 2 + 2), i);
  return { kind: 'tensor', name, dtype: 'BF16', shape: piece.shape, bytes: out };
}

/** A gap of random bytes. */
export function gap(length: number): GapPiece {
  return { kind: 'gap', bytes: randomBytes(length) };
}

/** XORs `mask` into the byte at `offset` of `bytes` (to damage files on purpose). */
export function flip(bytes: Buffer, offset: number, mask: number): void {
  bytes.writeUInt8(bytes.readUInt8(offset) ^ mask, offset);
}
