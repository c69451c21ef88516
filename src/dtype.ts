/**
 * Tensor element types, by their safetensors names, and their sizes in bytes.
 * These are the dtypes the native codec accepts (docs/addon.md); any other name found in a
 * safetensors header is compressed as opaque bytes ('U8').
 */

/** Element size in bytes of every dtype the codec knows. */
export const DTYPE_BYTES = {
  BOOL: 1,
  U8: 1,
  I8: 1,
  F8_E4M3: 1,
  F8_E5M2: 1,
  I16: 2,
  U16: 2,
  F16: 2,
  BF16: 2,
  I32: 4,
  U32: 4,
  F32: 4,
  I64: 8,
  U64: 8,
  F64: 8,
} as const;

/** A dtype name the codec knows. */
export type KnownDtype = keyof typeof DTYPE_BYTES;

/** Whether `name` is one of the codec's dtypes (case-sensitive, as in safetensors). */
export function isKnownDtype(name: string): name is KnownDtype {
  return Object.hasOwn(DTYPE_BYTES, name);
}

const FLOAT_DTYPES: ReadonlySet<KnownDtype> = new Set(['F8_E4M3', 'F8_E5M2', 'F16', 'BF16', 'F32', 'F64']);

/** Whether `name` is a floating-point dtype (the codec splits those into exponent and residual planes). */
export function isFloatDtype(name: string): boolean {
  return isKnownDtype(name) && FLOAT_DTYPES.has(name);
}
