/**
 * Whole-file operations on a .tzip container: {@link decompressFile} rebuilds the original
 * safetensors file byte for byte; {@link verifyFile} decodes every frame and checks every digest
 * without writing anything. Both go entry by entry (memory holds about three entries' worth).
 */
import { performance } from 'node:perf_hooks';
import { writeAtomically } from './atomic-output.js';
import { TzipError } from './errors.js';
import { writeExactly } from './positioned-io.js';
import { openTzip, type TzipEntry } from './reader.js';

/** Options of {@link decompressFile} and {@link verifyFile}. */
export interface RestoreOptions {
  /** Addon worker threads; default the addon's (all cores). */
  threads?: number | undefined;
  /** Called after each entry with the data-section bytes done so far and in all. */
  onProgress?: ((doneBytes: number, totalBytes: number) => void) | undefined;
}

/** Result of {@link decompressFile}. Sizes in bytes, time in seconds (wall clock). */
export interface DecompressFileResult {
  inputBytes: number;
  outputBytes: number;
  entryCount: number;
  seconds: number;
}

/**
 * Rebuilds the original safetensors file from the .tzip file `inPath` into `outPath` (written to a
 * temporary file in the same folder and renamed at the end): the verbatim header, then every entry's
 * decoded bytes at its data-section offset. Every frame's digests are checked while decoding.
 * @throws TzipError naming the file and tensor: TZIP_IO, TZIP_CORRUPT, TZIP_TRUNCATED, TZIP_CHECKSUM, TZIP_UNSUPPORTED.
 */
export async function decompressFile(inPath: string, outPath: string, options: RestoreOptions = {}): Promise<DecompressFileResult> {
  const started = performance.now();
  const reader = await openTzip(inPath);
  try {
    const { header } = reader;
    await writeAtomically(outPath, async (out) => {
      await writeExactly(out, reader.headerBytes, 0, outPath);
      let doneBytes = 0;
      // Frame i + 1 is read while frame i is decoded, and entry i is written while frame i + 1 is decoded.
      const readAhead = (i: number): Promise<Buffer> | undefined => {
        const next = reader.entries[i];
        if (next === undefined) return undefined;
        const pending = reader.readFrame(next);
        pending.catch(() => undefined); // handled when awaited in its own iteration
        return pending;
      };
      let nextFrame = readAhead(0);
      let pendingWrite: Promise<void> = Promise.resolve();
      for (const [i, entry] of reader.entries.entries()) {
        const frame = await (nextFrame as Promise<Buffer>);
        nextFrame = readAhead(i + 1);
        const bytes = await reader.decodeFrame(entry, frame, { threads: options.threads });
        await pendingWrite;
        pendingWrite = writeExactly(out, bytes, header.dataOffset + entry.begin, outPath);
        pendingWrite.catch(() => undefined); // handled by the next await
        doneBytes += bytes.byteLength;
        options.onProgress?.(doneBytes, header.dataLength);
      }
      await pendingWrite;
      await out.truncate(reader.originalSize);
    });
    return { inputBytes: reader.fileSize, outputBytes: reader.originalSize, entryCount: reader.entries.length, seconds: (performance.now() - started) / 1000 };
  } finally {
    await reader.close();
  }
}

/** Outcome of one entry in {@link verifyFile}. */
export interface VerifiedEntry {
  entry: TzipEntry;
  /** The error that decoding raised, or undefined when the frame decoded and its digests matched. */
  error: TzipError | undefined;
}

/** Result of {@link verifyFile}. */
export interface VerifyFileResult {
  /** True when every frame decoded and every digest matched. */
  ok: boolean;
  /** Bytes of original data checked. */
  originalBytes: number;
  entries: VerifiedEntry[];
  seconds: number;
}

/** Error codes that say a frame's bytes are bad (exit 2), as opposed to the machine failing the check. */
const DATA_ERRORS: ReadonlySet<string> = new Set(['TZIP_CORRUPT', 'TZIP_TRUNCATED', 'TZIP_CHECKSUM', 'TZIP_UNSUPPORTED']);

/**
 * Checks a .tzip file completely: the container structure (as {@link openTzip}), then every frame
 * decoded with its chunk digests checked. A bad frame does not stop the check; it is reported in
 * its entry.
 * @throws TzipError naming the file when the container structure itself is bad, the file cannot be read (TZIP_IO) or
 *   an entry's bytes cannot be allocated (TZIP_OUT_OF_MEMORY); a frame whose data is bad (TZIP_CORRUPT, TZIP_TRUNCATED,
 *   TZIP_CHECKSUM, TZIP_UNSUPPORTED) is reported in its entry instead.
 */
export async function verifyFile(path: string, options: RestoreOptions = {}): Promise<VerifyFileResult> {
  const started = performance.now();
  const reader = await openTzip(path);
  try {
    const entries: VerifiedEntry[] = [];
    let doneBytes = 0;
    for (const entry of reader.entries) {
      let error: TzipError | undefined;
      try {
        await reader.decodeEntry(entry, { threads: options.threads });
      } catch (err) {
        // Only what the data says is a bad entry; memory that ran out or a failed read is the check's own failure
        // (exit 3, as decompress and extract give for the same file), not a verdict on the frame.
        if (!(err instanceof TzipError) || !DATA_ERRORS.has(err.code)) throw err;
        error = err;
      }
      entries.push({ entry, error });
      doneBytes += entry.end - entry.begin;
      options.onProgress?.(doneBytes, reader.header.dataLength);
    }
    return {
      ok: entries.every((e) => e.error === undefined),
      originalBytes: reader.originalSize,
      entries,
      seconds: (performance.now() - started) / 1000,
    };
  } finally {
    await reader.close();
  }
}
