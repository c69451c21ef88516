/**
 * Turns the bytes of one incoming message into a validated request, or into the error to answer
 * it with. Nothing here throws: a hostile message is an error value.
 */
import type { z } from 'zod';
import type { DaemonLimits } from './limits.js';
import { expandCompress, expandDecompress } from './handle-refs.js';
import { ReplyError } from './reply-error.js';
import { Envelope, OPS, REQUESTS, RequestId, type Op, type Request, type WireCompressRequest, type WireDecompressRequest } from './schema.js';
import { decodeMessage } from './wire.js';

/** What {@link parseRequest} found: the id to echo (null when there is none) and the request or the error. */
export type Parsed =
  | { id: number | null; request: Request; error?: undefined;
      /** The request carried a handle table (protocol version 2; its references are expanded in `request`). */
      handleTable?: boolean }
  | { id: number | null; request?: undefined; error: ReplyError };

/** At most this many characters of zod's description of what is wrong. */
const MAX_ISSUE_TEXT = 600;

/** Describes zod issues as `path: message; ...`. */
export function describeIssues(error: z.ZodError): string {
  const text = error.issues
    .slice(0, 8)
    .map((issue) => `${issue.path.length > 0 ? issue.path.join('.') : '(message)'}: ${issue.message}`)
    .join('; ');
  const more = error.issues.length > 8 ? `; and ${error.issues.length - 8} more` : '';
  const all = text + more;
  return all.length > MAX_ISSUE_TEXT ? `${all.slice(0, MAX_ISSUE_TEXT)}...` : all;
}

/** Validates the bytes of one request message against the size cap and the schemas. */
export function parseRequest(bytes: Uint8Array, limits: Pick<DaemonLimits, 'maxMessageBytes'>): Parsed {
  if (bytes.byteLength > limits.maxMessageBytes) {
    return { id: null, error: new ReplyError('TZIP_TOO_LARGE', `message of ${bytes.byteLength} bytes is above the cap of ${limits.maxMessageBytes} bytes (tensor bytes travel in shared memory, not in messages)`) };
  }
  let value: unknown;
  try {
    value = decodeMessage(bytes);
  } catch (err) {
    return { id: null, error: new ReplyError('TZIP_PROTOCOL', `not a MessagePack message: ${err instanceof Error ? err.message : String(err)}`) };
  }
  const envelope = Envelope.safeParse(value);
  if (!envelope.success || Array.isArray(value)) {
    return { id: null, error: new ReplyError('TZIP_PROTOCOL', 'a request is a MessagePack map with "id" and "op"') };
  }
  const idParse = RequestId.safeParse(envelope.data.id);
  const id = idParse.success ? idParse.data : null;
  const op = envelope.data.op;
  if (typeof op !== 'string') {
    return { id, error: new ReplyError('TZIP_PROTOCOL', `"op" must be a string, one of ${OPS.join(', ')}`) };
  }
  if (!Object.hasOwn(REQUESTS, op)) {
    return { id, error: new ReplyError('TZIP_PROTOCOL', `unknown op ${JSON.stringify(op.slice(0, 64))}; this daemon serves ${OPS.join(', ')}`) };
  }
  const parsed = REQUESTS[op as Op].safeParse(value);
  if (!parsed.success) {
    return { id, error: new ReplyError('TZIP_PROTOCOL', `bad ${op} request: ${describeIssues(parsed.error)}`) };
  }
  if (op === 'compress' || op === 'decompress') {
    try {
      const wire = parsed.data as WireCompressRequest | WireDecompressRequest;
      const request = wire.op === 'compress' ? expandCompress(wire) : expandDecompress(wire);
      return { id, request, handleTable: wire.handles !== undefined };
    } catch (err) {
      if (err instanceof ReplyError) return { id, error: err };
      throw err;
    }
  }
  return { id, request: parsed.data as Request };
}
