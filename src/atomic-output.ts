/**
 * Atomic creation of an output file: the bytes go to a temporary file in the target's folder,
 * which is renamed over the target only when everything was written. A failed or interrupted
 * run never leaves a half-written target behind.
 */
import { randomBytes } from 'node:crypto';
import { open, rename, unlink, type FileHandle } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { toTzipError } from './errors.js';

/**
 * Runs `write` on a fresh temporary file next to `target`, then fsyncs it and renames it to `target`.
 * When `write` throws, the temporary file is removed and the error is rethrown.
 * @param target path of the file to create or replace.
 * @param write receives the open handle (positioned writes) and the temporary file's path.
 * @returns what `write` returned.
 * @throws TzipError TZIP_IO naming `target` when the temporary file cannot be created, synced or renamed;
 *   otherwise whatever `write` throws.
 */
export async function writeAtomically<T>(target: string, write: (handle: FileHandle, tempPath: string) => Promise<T>): Promise<T> {
  const tempPath = join(dirname(target), `.${basename(target)}.${process.pid}.${randomBytes(4).toString('hex')}.tmp`);
  let handle: FileHandle;
  try {
    handle = await open(tempPath, 'wx');
  } catch (err) {
    throw toTzipError(err, { file: target });
  }
  let result: T;
  try {
    result = await write(handle, tempPath);
    await handle.sync();
    await handle.close();
  } catch (err) {
    await handle.close().catch(() => undefined);
    await unlink(tempPath).catch(() => undefined);
    throw err instanceof Error && 'syscall' in err ? toTzipError(err, { file: target }) : err;
  }
  try {
    await rename(tempPath, target);
  } catch (err) {
    await unlink(tempPath).catch(() => undefined);
    throw toTzipError(err, { file: target });
  }
  return result;
}
