/**
 * From a DLPack tensor description to what the codec is given: the frame's dtype (a safetensors
 * name) and shape. docs/protocol.md ("Tensors and frames") states the same rules for clients,
 * which size output regions with them.
 *
 * - DLPack types with a safetensors twin keep their dtype and shape.
 * - Complex numbers (kDLComplex, 32/64/128 bits) are pairs of floats: F16/F32/F64 with a
 *   trailing dimension of 2 (so their real and imaginary parts compress as floats).
 * - Anything else whose element is a whole number of bytes (float8 fnuz/e8m0 variants, opaque
 *   handles, vector lanes, ...) is opaque bytes: U8 with shape [nbytes]; the client keeps the
 *   true dtype next to the frame.
 * - A frame holds at most 32 dimensions: a tensor with more is given as 1-D ([elements], or
 *   [2 * elements] for complex).
 * Element types that are not a whole number of bytes are refused.
 */
import type { KnownDtype } from '../dtype.js';
import { ReplyError } from './reply-error.js';
import type { DataType } from './schema.js';

/** DLDataTypeCode values (dlpack.h). */
export const DL = {
  Int: 0,
  UInt: 1,
  Float: 2,
  OpaqueHandle: 3,
  Bfloat: 4,
  Complex: 5,
  Bool: 6,
  Float8_e4m3fn: 10,
  Float8_e5m2: 12,
} as const;

/** DLDeviceType values the daemon knows (dlpack.h). */
export const DL_DEVICE = { CPU: 1, CUDA: 2, CUDAHost: 3, CUDAManaged: 13 } as const;

/** Most dimensions of a frame (docs/format.md). */
export const MAX_FRAME_NDIM = 32;

const TWINS = new Map<string, KnownDtype>([
  [`${DL.Int}:8`, 'I8'], [`${DL.Int}:16`, 'I16'], [`${DL.Int}:32`, 'I32'], [`${DL.Int}:64`, 'I64'],
  [`${DL.UInt}:8`, 'U8'], [`${DL.UInt}:16`, 'U16'], [`${DL.UInt}:32`, 'U32'], [`${DL.UInt}:64`, 'U64'],
  [`${DL.Float}:16`, 'F16'], [`${DL.Float}:32`, 'F32'], [`${DL.Float}:64`, 'F64'],
  [`${DL.Bfloat}:16`, 'BF16'],
  [`${DL.Bool}:8`, 'BOOL'],
  [`${DL.Float8_e4m3fn}:8`, 'F8_E4M3'],
  [`${DL.Float8_e5m2}:8`, 'F8_E5M2'],
]);

const COMPLEX_PARTS = new Map<number, KnownDtype>([[32, 'F16'], [64, 'F32'], [128, 'F64']]);

/** What the codec sees of a tensor. */
export interface FrameLayout {
  /** The frame's dtype. */
  dtype: KnownDtype;
  /** The frame's shape (at most 32 dimensions). */
  shape: number[];
  /** Bytes of the tensor. */
  nbytes: number;
  /** Bytes per element of the DLPack type. */
  elementBytes: number;
  /** Whether the tensor is carried as opaque bytes (U8, [nbytes]). */
  opaque: boolean;
}

/**
 * The frame dtype and shape of a DLPack tensor of `dtype` and `shape`.
 * @throws ReplyError TZIP_UNSUPPORTED for elements that are not whole bytes; TZIP_TOO_LARGE when
 *   the byte count is beyond 2^53.
 */
export function frameLayout(dtype: DataType, shape: readonly number[]): FrameLayout {
  const elementBits = dtype.bits * dtype.lanes;
  if (elementBits % 8 !== 0) {
    throw new ReplyError('TZIP_UNSUPPORTED', `DLPack type code ${dtype.code} of ${dtype.bits} bits x ${dtype.lanes} lanes is not a whole number of bytes; send packed sub-byte types as bytes (code 1, 8 bits)`);
  }
  const elementBytes = elementBits / 8;
  let elements = 1;
  for (const d of shape) elements *= d;
  const nbytes = elements * elementBytes;
  if (!Number.isSafeInteger(elements) || !Number.isSafeInteger(nbytes)) {
    throw new ReplyError('TZIP_TOO_LARGE', `tensor of shape [${shape.join(', ')}] is beyond 2^53 bytes`);
  }
  if (dtype.lanes === 1) {
    const twin = TWINS.get(`${dtype.code}:${dtype.bits}`);
    if (twin !== undefined) {
      return { dtype: twin, shape: shape.length > MAX_FRAME_NDIM ? [elements] : [...shape], nbytes, elementBytes, opaque: false };
    }
    const part = dtype.code === DL.Complex ? COMPLEX_PARTS.get(dtype.bits) : undefined;
    if (part !== undefined) {
      return { dtype: part, shape: shape.length + 1 > MAX_FRAME_NDIM ? [elements * 2] : [...shape, 2], nbytes, elementBytes, opaque: false };
    }
  }
  return { dtype: 'U8', shape: [nbytes], nbytes, elementBytes, opaque: true };
}

/** Whether `strides` (in elements) describe the compact C-order layout of `shape` (dimensions of size 1 may have any stride). */
export function isCompactCOrder(shape: readonly number[], strides: readonly number[] | null | undefined): boolean {
  if (strides === null || strides === undefined) return true;
  if (strides.length !== shape.length) return false;
  if (shape.some((d) => d === 0)) return true;
  let expected = 1;
  for (let i = shape.length - 1; i >= 0; i--) {
    const d = shape[i] as number;
    if (d !== 1 && strides[i] !== expected) return false;
    expected *= d;
  }
  return true;
}
