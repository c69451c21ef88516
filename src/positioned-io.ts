/**
 * Positioned reads and writes of whole byte ranges (no file is ever read whole into memory).
 * Node's FileHandle.read/write may transfer fewer bytes than asked and rejects requests above
 * 2^31 - 1 bytes; these helpers loop in requests of at most 1 GiB.
 */
import { constants } from 'node:fs';
import { open, type FileHandle } from 'node:fs/promises';
import { TzipError, toTzipError } from './errors.js';

/** Largest single read/write request (Node rejects lengths above 2^31 - 1). */
const IO_CHUNK_BYTES = 1 << 30;

/**
 * Fills `target` from `handle` starting at file `position` (bytes), in reads of at most 1 GiB.
 * @throws TzipError TZIP_TRUNCATED when the file ends first, TZIP_IO on read errors, naming `file`.
 */
export async function readExactly(handle: FileHandle, target: Uint8Array, position: number, file: string): Promise<void> {
  let done = 0;
  while (done < target.byteLength) {
    const want = Math.min(IO_CHUNK_BYTES, target.byteLength - done);
    let bytesRead: number;
    try {
      ({ bytesRead } = await handle.read(target, done, want, position + done));
    } catch (err) {
      throw toTzipError(err, { file });
    }
    if (bytesRead === 0) {
      throw new TzipError('TZIP_TRUNCATED', `file ends at byte ${position + done}, expected ${target.byteLength - done} more bytes`, { file });
    }
    done += bytesRead;
  }
}

/**
 * Writes all of `source` to `handle` at file `position` (bytes), in writes of at most 1 GiB.
 * @throws TzipError TZIP_IO on write errors (disk full, ...), naming `file`.
 */
export async function writeExactly(handle: FileHandle, source: Uint8Array, position: number, file: string): Promise<void> {
  let done = 0;
  while (done < source.byteLength) {
    const want = Math.min(IO_CHUNK_BYTES, source.byteLength - done);
    try {
      const { bytesWritten } = await handle.write(source, done, want, position + done);
      done += bytesWritten;
    } catch (err) {
      throw toTzipError(err, { file });
    }
  }
}

/**
 * Opens `path` read-only and passes the handle to `use`; when `use` throws, the handle is closed.
 * Resolves to what `use` returns (which then owns the handle). Only regular files and block
 * devices are read: a FIFO or a socket has no positions to read at, and opening a FIFO that no
 * program writes would wait forever, so it is opened without blocking and refused.
 * @throws TzipError naming the file: TZIP_IO when the file cannot be opened or is not a regular file or block
 *   device, or `use`'s error mapped by toTzipError.
 */
export async function openReadOnly<T>(path: string, use: (handle: FileHandle) => Promise<T>): Promise<T> {
  let handle: FileHandle;
  try {
    handle = await open(path, constants.O_RDONLY | constants.O_NONBLOCK);
  } catch (err) {
    throw toTzipError(err, { file: path });
  }
  try {
    const info = await handle.stat();
    if (!info.isFile() && !info.isBlockDevice()) {
      const kind = info.isFIFO() ? 'a FIFO' : info.isSocket() ? 'a socket' : info.isDirectory() ? 'a folder' : 'not a regular file';
      throw new TzipError('TZIP_IO', `is ${kind}: tzip reads its input at positions, so it must be a regular file`, { file: path });
    }
  } catch (err) {
    await handle.close();
    throw toTzipError(err, { file: path });
  }
  try {
    return await use(handle);
  } catch (err) {
    await handle.close();
    throw toTzipError(err, { file: path });
  }
}
