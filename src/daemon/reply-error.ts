/**
 * Errors the daemon answers with: an error reply `{id, ok: false, error: {code, message, ...}}`
 * (docs/protocol.md, "Errors"). The codec's and the file layer's {@link TzipError} codes pass
 * through unchanged (TZIP_OUT_OF_MEMORY, TZIP_CUDA, TZIP_INTERNAL among them); the protocol adds its own.
 */
import { TZIP_ERROR_CODES, TzipError, isOutOfMemory, type TzipErrorCode } from '../errors.js';
import { PROTOCOL_ERROR_CODES } from '../generated/constants.js';

/**
 * Codes of error replies that only the protocol produces: the "protocol" rows of the one error table,
 * src/errors.json, in value order (generated: src/generated/constants.ts).
 */
export { PROTOCOL_ERROR_CODES };

/** A code of an error reply. */
export type ReplyErrorCode = TzipErrorCode | (typeof PROTOCOL_ERROR_CODES)[number];

/** Every code an error reply may carry: every code of src/errors.json. */
export const REPLY_ERROR_CODES: readonly ReplyErrorCode[] = [...TZIP_ERROR_CODES, ...PROTOCOL_ERROR_CODES];

/** Extra fields of an error reply. */
export interface ReplyErrorExtra {
  /** Position in the request's batch of the tensor or frame at fault. */
  index?: number | undefined;
  /** For a too small output region: the bytes it needs. */
  need?: number | undefined;
  /** For TZIP_VERSION: the versions this daemon speaks. */
  versions?: number[] | undefined;
}

/** An error to answer a request with. */
export class ReplyError extends Error {
  override readonly name = 'ReplyError';

  constructor(readonly code: ReplyErrorCode, message: string, readonly extra: ReplyErrorExtra = {}) {
    super(message);
  }

  /** This error with the batch index set (kept when already set). */
  at(index: number): ReplyError {
    if (this.extra.index !== undefined) return this;
    return new ReplyError(this.code, this.message, { ...this.extra, index });
  }
}

/** The wire form of an error reply's `error` field. */
export interface WireError {
  code: ReplyErrorCode;
  message: string;
  index?: number;
  need?: number;
  versions?: number[];
}

/**
 * Turns anything a handler threw into the `error` of a reply: ReplyError and TzipError keep their
 * codes, as does an error carrying one of {@link REPLY_ERROR_CODES} (the addon's); memory that ran out
 * ({@link isOutOfMemory}) is TZIP_OUT_OF_MEMORY; anything else is a daemon bug (TZIP_INTERNAL) whose
 * message is passed on.
 */
export function toWireError(err: unknown, index?: number): WireError {
  let out: WireError;
  if (err instanceof ReplyError) {
    out = { code: err.code, message: err.message };
    if (err.extra.index !== undefined) out.index = err.extra.index;
    if (err.extra.need !== undefined) out.need = err.extra.need;
    if (err.extra.versions !== undefined) out.versions = err.extra.versions;
  } else if (err instanceof TzipError) {
    out = { code: err.code, message: err.message };
  } else {
    const code = err instanceof Error ? (err as { code?: unknown }).code : undefined;
    if (typeof code === 'string' && (REPLY_ERROR_CODES as readonly string[]).includes(code)) {
      out = { code: code as ReplyErrorCode, message: (err as Error).message };
    } else if (isOutOfMemory(err)) {
      out = { code: 'TZIP_OUT_OF_MEMORY', message: `out of memory: ${(err as Error).message}` };
    } else {
      out = { code: 'TZIP_INTERNAL', message: `internal error: ${err instanceof Error ? err.message : String(err)}` };
    }
  }
  if (index !== undefined && out.index === undefined) out.index = index;
  return out;
}
