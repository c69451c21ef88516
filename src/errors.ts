/**
 * The one error type that tzip's TypeScript layer throws: {@link TzipError}. Errors from the native
 * addon (which carry a `.code`) and from node:fs (ENOENT, EACCES, ...) are mapped into it, and the
 * file and tensor they concern are attached so that every message names them.
 */

import { TZIP_ERROR_CODES } from './generated/constants.js';

/**
 * Codes a {@link TzipError} carries: the native codes (tzip::ErrorCode: the codec core's and the addon's), then the
 * file layer's, in value order. Generated (src/generated/constants.ts, by scripts/gen-constants.mjs) from the one table,
 * src/errors.json, which gives every code of tzip with its value and meaning.
 */
export { TZIP_ERROR_CODES };

/** One of {@link TZIP_ERROR_CODES}. */
export type TzipErrorCode = (typeof TZIP_ERROR_CODES)[number];

/** Where an error happened: the file and, when known, the tensor (safetensors name). */
export interface ErrorContext {
  /** Path of the file the error concerns, as the caller gave it. */
  file?: string | undefined;
  /** Name of the tensor the error concerns (safetensors header key). */
  tensor?: string | undefined;
}

/** Options of the {@link TzipError} constructor. */
export interface TzipErrorOptions extends ErrorContext {
  /** For TZIP_TRUNCATED from the addon's readHeader: how many bytes of the frame are needed. */
  needBytes?: number | undefined;
  /** For a batched GPU decode (gpuDecompress): per item, its error code, or '' for an item that decoded. */
  itemErrors?: string[] | undefined;
  /** The underlying error. */
  cause?: unknown;
}

function isTzipErrorCode(code: unknown): code is TzipErrorCode {
  return typeof code === 'string' && (TZIP_ERROR_CODES as readonly string[]).includes(code);
}

/**
 * An error with a machine-readable {@link TzipErrorCode}, the file and the tensor it concerns.
 * `message` is `"<file>: tensor '<tensor>': <detail>"` (parts that are unknown are left out);
 * `detail` is the bare description.
 */
export class TzipError extends Error {
  override readonly name = 'TzipError';
  readonly code: TzipErrorCode;
  readonly detail: string;
  readonly file: string | undefined;
  readonly tensor: string | undefined;
  readonly needBytes: number | undefined;
  /** For a batched GPU decode (gpuDecompress): per item, its error code, or '' for an item that decoded. */
  readonly itemErrors: string[] | undefined;

  constructor(code: TzipErrorCode, detail: string, options: TzipErrorOptions = {}) {
    const where = [
      options.file !== undefined ? options.file : undefined,
      options.tensor !== undefined ? `tensor '${options.tensor}'` : undefined,
    ].filter((s) => s !== undefined);
    super([...where, detail].join(': '), { cause: options.cause });
    this.code = code;
    this.detail = detail;
    this.file = options.file;
    this.tensor = options.tensor;
    this.needBytes = options.needBytes;
    this.itemErrors = options.itemErrors;
  }

  /**
   * A copy of this error with `file`/`tensor` filled in where they are still unknown
   * (context already present is kept: the innermost caller knows best).
   */
  withContext(context: ErrorContext): TzipError {
    const file = this.file ?? context.file;
    const tensor = this.tensor ?? context.tensor;
    if (file === this.file && tensor === this.tensor) return this;
    const copy = new TzipError(this.code, this.detail, {
      file, tensor, needBytes: this.needBytes, itemErrors: this.itemErrors, cause: this.cause,
    });
    copy.stack = this.stack;
    return copy;
  }
}

/** Node's system errors (fs, child_process) carry a string `code` such as 'ENOENT' and a `syscall`. */
function isSystemError(err: unknown): err is NodeJS.ErrnoException {
  return err instanceof Error && typeof (err as NodeJS.ErrnoException).code === 'string' &&
    typeof (err as NodeJS.ErrnoException).syscall === 'string';
}

/**
 * Whether `err` says that memory ran out: V8's "Array buffer allocation failed" RangeError (a Buffer or typed array
 * that could not be allocated), Node's ERR_MEMORY_ALLOCATION_FAILED, or a system call's ENOMEM.
 */
export function isOutOfMemory(err: unknown): boolean {
  if (!(err instanceof Error)) return false;
  const code = (err as { code?: unknown }).code;
  if (code === 'ENOMEM' || code === 'ERR_MEMORY_ALLOCATION_FAILED') return true;
  return err instanceof RangeError && /allocation failed/i.test(err.message);
}

/**
 * Maps any thrown value into a {@link TzipError} with the given context:
 * - a TzipError gets the missing context added;
 * - an addon error (an Error whose `.code` is one of {@link TZIP_ERROR_CODES}) keeps its code, message,
 *   `needBytes` and `itemErrors`;
 * - memory that ran out ({@link isOutOfMemory}) becomes TZIP_OUT_OF_MEMORY;
 * - a Node system error (ENOENT, EACCES, EISDIR, ENOSPC, ...) becomes TZIP_IO with the errno code in the text;
 * - anything else is rethrown unchanged (a bug, not bad input).
 * @throws the input itself when it is none of the above.
 */
export function toTzipError(err: unknown, context: ErrorContext = {}): TzipError {
  if (err instanceof TzipError) return err.withContext(context);
  const code = err instanceof Error ? (err as { code?: unknown }).code : undefined;
  if (err instanceof Error && isTzipErrorCode(code)) {
    const needBytes = (err as { needBytes?: unknown }).needBytes;
    const itemErrors = (err as { itemErrors?: unknown }).itemErrors;
    return new TzipError(code, err.message, {
      ...context,
      needBytes: typeof needBytes === 'number' ? needBytes : undefined,
      itemErrors: Array.isArray(itemErrors) ? itemErrors.map(String) : undefined,
      cause: err,
    });
  }
  if (isOutOfMemory(err)) {
    return new TzipError('TZIP_OUT_OF_MEMORY', `out of memory: ${(err as Error).message}`, { ...context, cause: err });
  }
  if (isSystemError(err)) {
    // "ENOENT: no such file or directory, open '/x'" -> "ENOENT: no such file or directory (open)"
    const text = err.message.replace(/, \w+ '.*'$/s, '');
    return new TzipError('TZIP_IO', `${text} (${err.syscall})`, { ...context, file: context.file ?? err.path, cause: err });
  }
  throw err;
}
