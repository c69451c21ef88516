/**
 * MessagePack encoding of the protocol's messages (msgpackr).
 *
 * Decoding: plain maps become plain objects, bin becomes a Buffer, 64-bit integers outside
 * [-2^53, 2^53] become bigints (which every schema then refuses), msgpackr's own extensions
 * (records, structured clones) are off, so a message is exactly what a standard MessagePack
 * library (Python's msgpack) writes.
 * Encoding: integers at or above 2^32 in magnitude are written as MessagePack integers
 * (msgpackr would write them as float64), so clients read sizes as integers.
 */
import { Packr, Unpackr } from 'msgpackr';

// One coder of each kind for the process: with records and structured clones off, no message's meaning depends on an
// earlier one (no shared record structures; each call is synchronous), so every daemon in the process may use them.
// 'auto' (numbers within 2^53, bigints beyond) is supported by msgpackr but missing from its typings.
const unpackr = new Unpackr({ useRecords: false, mapsAsObjects: true, int64AsType: 'auto' as 'bigint', structuredClone: false });
const packr = new Packr({ useRecords: false, structuredClone: false, variableMapSize: true });

/**
 * Decodes one message. Trailing bytes after the first value are an error.
 * @throws Error when the bytes are not exactly one MessagePack value.
 */
export function decodeMessage(bytes: Uint8Array): unknown {
  return unpackr.unpack(bytes);
}

const TWO_32 = 2 ** 32;

/** A copy of `value` with large integers as bigints (so msgpackr writes them as integers). */
function wireInts(value: unknown): unknown {
  if (typeof value === 'number') {
    return Number.isInteger(value) && Math.abs(value) >= TWO_32 ? BigInt(value) : value;
  }
  if (Array.isArray(value)) return value.map(wireInts);
  if (value !== null && typeof value === 'object' && !(value instanceof Uint8Array)) {
    const out: Record<string, unknown> = {};
    for (const [k, v] of Object.entries(value)) if (v !== undefined) out[k] = wireInts(v);
    return out;
  }
  return value;
}

/** Encodes one reply. */
export function encodeMessage(value: unknown): Buffer {
  return packr.pack(wireInts(value));
}
