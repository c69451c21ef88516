/**
 * Tensor element types, by their safetensors names, and their sizes in bytes.
 * These are the dtypes the native codec accepts (docs/addon.md); any other name found in a
 * safetensors header is compressed as opaque bytes ('U8').
 */
import { DTYPE_BYTES as GENERATED_DTYPE_BYTES, FLOAT_DTYPES as GENERATED_FLOAT_DTYPES } from './generated/constants.js';

/** Element size in bytes of every dtype the codec knows (generated from src/errors.json: src/generated/constants.ts). */
export const DTYPE_BYTES = GENERATED_DTYPE_BYTES;

/** A dtype name the codec knows. */
export type KnownDtype = keyof typeof DTYPE_BYTES;

/** Whether `name` is one of the codec's dtypes (case-sensitive, as in safetensors). */
export function isKnownDtype(name: string): name is KnownDtype {
  return Object.hasOwn(DTYPE_BYTES, name);
}

const FLOAT_DTYPES: ReadonlySet<KnownDtype> = new Set(GENERATED_FLOAT_DTYPES);

/** Whether `name` is a floating-point dtype (the codec splits those into exponent and residual planes). */
export function isFloatDtype(name: string): boolean {
  return isKnownDtype(name) && FLOAT_DTYPES.has(name);
}
