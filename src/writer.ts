/**
 * Compression of a safetensors file into a .tzip container (layout: docs/container.md).
 * Works entry by entry with positioned reads and writes, so memory holds about three entries
 * (the next one being read, the one being compressed, the frame being written), never the whole file.
 */
import { performance } from 'node:perf_hooks';
import { writeAtomically } from './atomic-output.js';
import { alignUp, encodeIndex, encodePrefix, encodeTrailer, PREFIX_BYTES, xxh32, type IndexEntry } from './container.js';
import { planEntries, type PlannedEntry } from './entries.js';
import { toTzipError } from './errors.js';
import { compress, INLINE_MAX_BYTES, maxCompressedSize, type Codec } from './native.js';
import { writeExactly } from './positioned-io.js';
import { openSafetensors } from './safetensors.js';

/** Options of {@link compressFile}. */
export interface CompressFileOptions {
  /** Codec for every entry; default 'auto'. */
  codec?: Codec | undefined;
  /** Addon worker threads; default the addon's (all cores). */
  threads?: number | undefined;
  /** Chunk size in bytes of original data; default the addon's. */
  chunkSize?: number | undefined;
  /** Called after each entry is compressed with the data-section bytes done so far and in all. */
  onProgress?: ((doneBytes: number, totalBytes: number) => void) | undefined;
}

/** One written entry. */
export interface WrittenEntry extends PlannedEntry, IndexEntry {}

/** Result of {@link compressFile}. Sizes in bytes, time in seconds (wall clock, performance.now()). */
export interface CompressFileResult {
  inputBytes: number;
  outputBytes: number;
  /** Bytes of the verbatim safetensors header (8 + N). */
  headerBytes: number;
  entries: WrittenEntry[];
  seconds: number;
}

/**
 * Compresses the safetensors file `inPath` into the .tzip file `outPath` (written to a temporary
 * file in the same folder and renamed at the end). Each tensor becomes one frame compressed with
 * its dtype and shape; bytes between or after tensors become 'U8' frames.
 * @throws TzipError naming the file and tensor: TZIP_IO (missing input, unwritable output),
 *   TZIP_CORRUPT / TZIP_TRUNCATED (invalid safetensors header), TZIP_INVALID_ARGUMENT (bad codec options or chunk size).
 */
export async function compressFile(inPath: string, outPath: string, options: CompressFileOptions = {}): Promise<CompressFileResult> {
  const started = performance.now();
  // Reject a bad chunk size before any work, even for files without tensors (the addon's own check).
  if (options.chunkSize !== undefined) maxCompressedSize(0, 1, options.chunkSize);
  const input = await openSafetensors(inPath);
  try {
    const { header, headerBytes, fileSize: inputBytes } = input;
    const plan = planEntries(header);

    const written = await writeAtomically(outPath, async (out) => {
      await writeExactly(out, encodePrefix({ originalSize: inputBytes, headerDigest: await xxh32(headerBytes) }), 0, outPath);
      await writeExactly(out, headerBytes, PREFIX_BYTES, outPath);
      let position = alignUp(PREFIX_BYTES + headerBytes.byteLength);
      let doneBytes = 0;
      const entries: WrittenEntry[] = [];
      // Entry i + 1 is read while entry i is compressed, and entry i is written while entry i + 1
      // is compressed: at most two entries' input and one frame are in memory.
      const readAhead = (i: number): Promise<Buffer> | undefined => {
        const next = plan[i];
        if (next === undefined) return undefined;
        const pending = input.read(next.begin, next.end);
        pending.catch(() => undefined); // handled when awaited in its own iteration
        return pending;
      };
      let nextRead = readAhead(0);
      let pendingWrite: Promise<void> = Promise.resolve();
      for (const [i, entry] of plan.entries()) {
        let frame: Buffer;
        try {
          const raw = await (nextRead as Promise<Buffer>);
          nextRead = readAhead(i + 1);
          frame = await compress(raw, {
            dtype: entry.dtype,
            shape: entry.shape,
            codec: options.codec,
            threads: options.threads,
            chunkSize: options.chunkSize,
            inline: raw.byteLength <= INLINE_MAX_BYTES,
          });
        } catch (err) {
          throw toTzipError(err, { file: inPath, tensor: entry.kind === 'tensor' ? entry.name : undefined });
        }
        await pendingWrite;
        entries.push({ ...entry, dataBegin: entry.begin, dataEnd: entry.end, frameOffset: position, frameBytes: frame.byteLength });
        pendingWrite = writeExactly(out, frame, position, outPath);
        pendingWrite.catch(() => undefined); // handled by the next await; avoids an unhandled rejection if compression fails first
        position = alignUp(position + frame.byteLength);
        doneBytes += entry.end - entry.begin;
        options.onProgress?.(doneBytes, header.dataLength);
      }
      await pendingWrite;
      const index = encodeIndex(entries);
      await writeExactly(out, index, position, outPath);
      const trailer = encodeTrailer({ indexOffset: position, entryCount: entries.length, indexDigest: await xxh32(index), originalSize: inputBytes });
      await writeExactly(out, trailer, position + index.byteLength, outPath);
      return { entries, outputBytes: position + index.byteLength + trailer.byteLength };
    });
    return { inputBytes, headerBytes: headerBytes.byteLength, ...written, seconds: (performance.now() - started) / 1000 };
  } finally {
    await input.close();
  }
}
