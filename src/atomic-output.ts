/**
 * Atomic creation of an output file: the bytes go to a temporary file in the target's folder,
 * which is renamed over the target only when everything was written. A failed or interrupted
 * run never leaves a half-written target behind.
 *
 * What is replaced is the file the path names, as `cp` and `zstd -o` would write it: a symbolic
 * link is followed (the link stays, its destination gets the new bytes), an existing file keeps
 * its permission bits, and a device (/dev/null, /dev/full) is written in place, never renamed
 * over: replacing /dev/null with a regular file, as a rename would, breaks the machine for every
 * other program. A FIFO or socket is refused (the output is written at positions, not streamed).
 */
import { randomBytes } from 'node:crypto';
import { chmod, lstat, open, readlink, rename, stat, unlink, type FileHandle } from 'node:fs/promises';
import type { Stats } from 'node:fs';
import { basename, dirname, isAbsolute, join } from 'node:path';
import { TzipError, toTzipError } from './errors.js';

/** Symbolic links followed before a target is called a loop (Linux's own limit, MAXSYMLINKS). */
const MAX_LINKS = 40;

/**
 * The path `target` finally names: its symbolic links followed, also a dangling one (whose
 * destination is then created).
 * @throws TzipError TZIP_IO naming `target` when links loop or cannot be read.
 */
async function followLinks(target: string): Promise<string> {
  let path = target;
  for (let hops = 0; hops <= MAX_LINKS; hops++) {
    let info: Stats;
    try {
      info = await lstat(path);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === 'ENOENT') return path;
      throw toTzipError(err, { file: target });
    }
    if (!info.isSymbolicLink()) return path;
    let link: string;
    try {
      link = await readlink(path);
    } catch (err) {
      throw toTzipError(err, { file: target });
    }
    path = isAbsolute(link) ? link : join(dirname(path), link);
  }
  throw new TzipError('TZIP_IO', `more than ${MAX_LINKS} symbolic links in a row (a loop?)`, { file: target });
}

/** stat() of `path`, or null when nothing is there. */
async function statOrNull(path: string, target: string): Promise<Stats | null> {
  try {
    return await stat(path);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') return null;
    throw toTzipError(err, { file: target });
  }
}

/**
 * Runs `write` on a fresh temporary file next to the file `target` names, then fsyncs it and
 * renames it over that file (keeping an existing file's permission bits). A character or block
 * device is opened and written in place instead.
 * @param target path of the file to create or replace; a symbolic link is followed.
 * @param write receives the open handle (positioned writes) and the path being written (the
 *   temporary file, or the device itself).
 * @returns what `write` returned.
 * @throws TzipError TZIP_IO naming `target` when the temporary file cannot be created, synced,
 *   given the old file's mode or renamed, when a device cannot be written (ENOSPC from /dev/full),
 *   when the target is a FIFO or a socket, or when symbolic links loop; otherwise whatever `write` throws.
 */
export async function writeAtomically<T>(target: string, write: (handle: FileHandle, tempPath: string) => Promise<T>): Promise<T> {
  const path = await followLinks(target);
  const existing = await statOrNull(path, target);
  if (existing !== null && (existing.isFIFO() || existing.isSocket())) {
    const kind = existing.isFIFO() ? 'a FIFO' : 'a socket';
    throw new TzipError('TZIP_IO', `is ${kind}: tzip writes its output at positions, so it must be a file or a device`, { file: target });
  }
  // A device is written where it is; anything else through a temporary file renamed over it.
  const inPlace = existing !== null && !existing.isFile() && !existing.isDirectory();
  const writePath = inPlace ? path : join(dirname(path), `.${basename(path)}.${process.pid}.${randomBytes(4).toString('hex')}.tmp`);
  let handle: FileHandle;
  try {
    handle = await open(writePath, inPlace ? 'w' : 'wx');
  } catch (err) {
    throw toTzipError(err, { file: target });
  }
  let result: T;
  try {
    result = await write(handle, writePath);
    if (!inPlace) await handle.sync();
    await handle.close();
    // A folder as target fails at the rename below (EISDIR), as before; a file keeps its mode.
    if (existing !== null && existing.isFile()) await chmod(writePath, existing.mode & 0o7777);
  } catch (err) {
    await handle.close().catch(() => undefined);
    if (!inPlace) await unlink(writePath).catch(() => undefined);
    throw err instanceof Error && 'syscall' in err ? toTzipError(err, { file: target }) : err;
  }
  if (inPlace) return result;
  try {
    await rename(writePath, path);
  } catch (err) {
    await unlink(writePath).catch(() => undefined);
    throw toTzipError(err, { file: target });
  }
  return result;
}
