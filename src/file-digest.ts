/**
 * SHA-256 of a file, streamed (node:crypto), for byte-exact comparisons of large files.
 */
import { createHash } from 'node:crypto';
import { createReadStream } from 'node:fs';
import { pipeline } from 'node:stream/promises';
import { toTzipError } from './errors.js';

/**
 * SHA-256 of the file at `path`, as 64 lowercase hex digits. Reads the file as a stream (constant memory).
 * @throws TzipError TZIP_IO naming the file when it cannot be read.
 */
export async function sha256File(path: string): Promise<string> {
  const hash = createHash('sha256');
  try {
    await pipeline(createReadStream(path), hash);
  } catch (err) {
    throw toTzipError(err, { file: path });
  }
  return hash.digest('hex');
}
