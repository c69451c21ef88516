/**
 * Random access to a .tzip container: {@link openTzip} reads and checks the prefix, trailer, index
 * and safetensors header (a few KB, whatever the file's size); {@link TzipReader.readTensor} then
 * decodes only the one frame that holds the tensor asked for.
 */
import { constants as bufferConstants } from 'node:buffer';
import type { FileHandle } from 'node:fs/promises';
import {
  ALIGNMENT, alignUp, decodeIndex, decodePrefix, decodeTrailer, INDEX_ENTRY_BYTES, MAGIC, PREFIX_BYTES, TRAILER_BYTES, xxh32, type IndexEntry,
} from './container.js';
import { frameLayoutFits, planEntries, type PlannedEntry } from './entries.js';
import { TzipError, toTzipError } from './errors.js';
import { decompress, INLINE_MAX_BYTES, readHeader, type FrameHeader } from './native.js';
import { openReadOnly, readExactly } from './positioned-io.js';
import { LENGTH_PREFIX_BYTES, parseHeaderLength, parseSafetensorsHeader, type SafetensorsHeader } from './safetensors.js';

/** An entry of an opened container: its place in the data section and its frame. */
export interface TzipEntry extends PlannedEntry, IndexEntry {
  /** Position in the index (0-based). */
  index: number;
}

/** Options of the decoding methods. */
export interface DecodeOptions {
  /** Addon worker threads; default the addon's (all cores). */
  threads?: number | undefined;
}

/** Bytes read first when only a frame's header is wanted; more are read if the addon asks for them. */
const FRAME_HEADER_GUESS_BYTES = 4096;

/**
 * An open .tzip file. Obtain with {@link openTzip}; call {@link TzipReader.close} when done.
 * All offsets and sizes are in bytes.
 */
export class TzipReader {
  /** Path as given to {@link openTzip}. */
  readonly path: string;
  /** Size of the .tzip file. */
  readonly fileSize: number;
  /** Size of the original safetensors file. */
  readonly originalSize: number;
  /** The original file's first 8 + N bytes (length prefix and JSON header), verbatim. */
  readonly headerBytes: Buffer;
  /** The parsed safetensors header. */
  readonly header: SafetensorsHeader;
  /** All entries in data-section order (tensors and gaps). */
  readonly entries: readonly TzipEntry[];
  private readonly handle: FileHandle;
  private readonly byName: ReadonlyMap<string, TzipEntry>;

  /** @internal Use {@link openTzip}, which validates the container first. */
  constructor(handle: FileHandle, state: ReaderState) {
    this.handle = handle;
    this.path = state.path;
    this.fileSize = state.fileSize;
    this.originalSize = state.originalSize;
    this.headerBytes = state.headerBytes;
    this.header = state.header;
    this.entries = state.entries;
    this.byName = new Map(state.entries.filter((e) => e.kind === 'tensor').map((e) => [e.name, e]));
  }

  /** Names of the tensors, in data-section order. */
  tensorNames(): string[] {
    return this.entries.filter((e) => e.kind === 'tensor').map((e) => e.name);
  }

  /**
   * The entry of tensor `name`.
   * @throws TzipError TZIP_USAGE when no tensor has that name.
   */
  entry(name: string): TzipEntry {
    const entry = this.byName.get(name);
    if (entry === undefined) {
      throw new TzipError('TZIP_USAGE', `no tensor named '${name}' (${this.byName.size} tensors; \`tzip inspect\` lists them)`, { file: this.path, tensor: name });
    }
    return entry;
  }

  private context(entry: TzipEntry): { file: string; tensor: string | undefined } {
    return { file: this.path, tensor: entry.kind === 'tensor' ? entry.name : undefined };
  }

  /**
   * Reads an entry's whole frame with one positioned read.
   * @throws TzipError TZIP_IO / TZIP_TRUNCATED / TZIP_UNSUPPORTED (frame larger than a Node buffer), naming the file and tensor.
   */
  async readFrame(entry: TzipEntry): Promise<Buffer> {
    try {
      if (entry.frameBytes > bufferConstants.MAX_LENGTH) {
        throw new TzipError('TZIP_UNSUPPORTED', `frame of ${entry.frameBytes} bytes exceeds the largest Node buffer`);
      }
      const frame = Buffer.allocUnsafe(entry.frameBytes);
      await readExactly(this.handle, frame, entry.frameOffset, this.path);
      return frame;
    } catch (err) {
      throw toTzipError(err, this.context(entry));
    }
  }

  /**
   * Decodes an entry's frame header (reads only the header and chunk table from disk) and checks it
   * against the index and the safetensors header.
   * @throws TzipError TZIP_CORRUPT when the frame does not describe this entry, naming the file and tensor.
   */
  async frameHeader(entry: TzipEntry): Promise<FrameHeader> {
    try {
      let length = Math.min(entry.frameBytes, FRAME_HEADER_GUESS_BYTES);
      for (;;) {
        const prefix = Buffer.allocUnsafe(length);
        await readExactly(this.handle, prefix, entry.frameOffset, this.path);
        try {
          return this.checkFrame(entry, readHeader(prefix));
        } catch (err) {
          const needBytes = err instanceof TzipError && err.code === 'TZIP_TRUNCATED' ? err.needBytes : undefined;
          if (needBytes === undefined || needBytes <= length || needBytes > entry.frameBytes) throw err;
          length = needBytes;
        }
      }
    } catch (err) {
      throw toTzipError(err, this.context(entry));
    }
  }

  private checkFrame(entry: TzipEntry, h: FrameHeader): FrameHeader {
    const problems: string[] = [];
    if (h.frameBytes !== entry.frameBytes) problems.push(`frame is ${h.frameBytes} bytes, index says ${entry.frameBytes}`);
    if (h.nbytes !== entry.end - entry.begin) problems.push(`frame holds ${h.nbytes} bytes, index says ${entry.end - entry.begin}`);
    // (a C64 tensor or one of more than 32 dimensions may also be in the U8 layout earlier writers gave it)
    if (!frameLayoutFits(entry, h.dtype, h.shape)) {
      if (h.dtype !== entry.dtype) problems.push(`frame dtype ${h.dtype}, header says ${entry.dtype}`);
      if (h.shape.length !== entry.shape.length || h.shape.some((d, i) => d !== entry.shape[i])) {
        problems.push(`frame shape [${h.shape.join(', ')}], header says [${entry.shape.join(', ')}]`);
      }
    }
    if (problems.length > 0) throw new TzipError('TZIP_CORRUPT', `frame does not match its entry: ${problems.join('; ')}`, this.context(entry));
    return h;
  }

  /**
   * Decodes one entry: reads its frame, checks it against the index and header, decodes it and
   * checks the chunk digests (the addon does).
   * @returns the entry's original bytes (entry.end - entry.begin of them).
   * @throws TzipError TZIP_CORRUPT / TZIP_TRUNCATED / TZIP_CHECKSUM / TZIP_IO, naming the file and tensor.
   */
  async decodeEntry(entry: TzipEntry, options: DecodeOptions = {}): Promise<Buffer> {
    return this.decodeFrame(entry, await this.readFrame(entry), options);
  }

  /**
   * Decodes a frame already read with {@link readFrame}, checking it against its entry and its digests.
   * @returns the entry's original bytes.
   * @throws TzipError TZIP_CORRUPT / TZIP_TRUNCATED / TZIP_CHECKSUM, naming the file and tensor.
   */
  async decodeFrame(entry: TzipEntry, frame: Buffer, options: DecodeOptions = {}): Promise<Buffer> {
    try {
      this.checkFrame(entry, readHeader(frame));
      const bytes = await decompress(frame, { threads: options.threads, verify: true, inline: entry.end - entry.begin <= INLINE_MAX_BYTES });
      if (bytes.byteLength !== entry.end - entry.begin) {
        throw new TzipError('TZIP_CORRUPT', `decoded ${bytes.byteLength} bytes, expected ${entry.end - entry.begin}`);
      }
      return bytes;
    } catch (err) {
      throw toTzipError(err, this.context(entry));
    }
  }

  /**
   * Decodes one tensor by name, reading only its frame.
   * @returns the tensor's raw bytes exactly as stored in the original safetensors file (little-endian).
   * @throws TzipError TZIP_USAGE for an unknown name; otherwise as {@link decodeEntry}.
   */
  async readTensor(name: string, options: DecodeOptions = {}): Promise<Buffer> {
    return this.decodeEntry(this.entry(name), options);
  }

  /** Closes the file. */
  async close(): Promise<void> {
    await this.handle.close();
  }
}

/** What {@link openTzip} learned and checked. */
export interface ReaderState {
  path: string;
  fileSize: number;
  originalSize: number;
  headerBytes: Buffer;
  header: SafetensorsHeader;
  entries: TzipEntry[];
}

async function validate(path: string, handle: FileHandle): Promise<ReaderState> {
  const fileSize = (await handle.stat()).size;
  const read = async (position: number, length: number): Promise<Buffer> => {
    const buf = Buffer.alloc(length);
    await readExactly(handle, buf, position, path);
    return buf;
  };
  const fixed = await read(0, Math.min(fileSize, PREFIX_BYTES + LENGTH_PREFIX_BYTES));
  if (fileSize < PREFIX_BYTES + LENGTH_PREFIX_BYTES + TRAILER_BYTES) {
    const seen = fixed.subarray(0, MAGIC.byteLength);
    if (seen.byteLength > 0 && seen.equals(MAGIC.subarray(0, seen.byteLength))) {
      throw new TzipError('TZIP_TRUNCATED', `file of ${fileSize} bytes is too short to be a .tzip`, { file: path });
    }
    throw new TzipError('TZIP_CORRUPT', 'not a .tzip file (bad magic bytes)', { file: path });
  }
  const { originalSize, headerDigest } = decodePrefix(fixed, path);
  const headerLength = parseHeaderLength(fixed.subarray(PREFIX_BYTES), originalSize, path);
  const headerEnd = PREFIX_BYTES + LENGTH_PREFIX_BYTES + headerLength;
  if (headerEnd + TRAILER_BYTES > fileSize) {
    throw new TzipError('TZIP_TRUNCATED', `the ${headerLength}-byte safetensors header and trailer need more than the file's ${fileSize} bytes`, { file: path });
  }
  // The header digest is checked before N or the JSON are used for anything else, so a flipped bit
  // in the length, a tensor name or __metadata__ is reported as what it is, not as a layout mismatch.
  const headerBytes = await read(PREFIX_BYTES, LENGTH_PREFIX_BYTES + headerLength);
  if (headerDigest !== undefined) {
    const actual = await xxh32(headerBytes);
    if (actual !== headerDigest) {
      throw new TzipError('TZIP_CHECKSUM',
        `safetensors header digest mismatch (stored 0x${headerDigest.toString(16)}, computed 0x${actual.toString(16)} over its ${headerBytes.byteLength} bytes): ` +
        'the stored header length, tensor names, dtypes, shapes, offsets or __metadata__ are damaged', { file: path });
    }
  }

  const trailer = decodeTrailer(await read(fileSize - TRAILER_BYTES, TRAILER_BYTES), fileSize, path);
  if (trailer.originalSize !== originalSize) {
    throw new TzipError('TZIP_CORRUPT', `trailer says the original is ${trailer.originalSize} bytes, prefix says ${originalSize}`, { file: path });
  }
  if (trailer.indexOffset < alignUp(headerEnd)) {
    throw new TzipError('TZIP_CORRUPT', `index offset ${trailer.indexOffset} lies inside the safetensors header`, { file: path });
  }
  const indexBytes = await read(trailer.indexOffset, trailer.entryCount * INDEX_ENTRY_BYTES);
  const digest = await xxh32(indexBytes);
  if (digest !== trailer.indexDigest) {
    throw new TzipError('TZIP_CORRUPT',
      `index digest mismatch (stored 0x${trailer.indexDigest.toString(16)}, computed 0x${digest.toString(16)})`, { file: path });
  }
  const index = decodeIndex(indexBytes, path);

  const header = parseSafetensorsHeader(headerBytes, originalSize, path);
  const plan = planEntries(header);
  if (plan.length !== index.length) {
    throw new TzipError('TZIP_CORRUPT', `index has ${index.length} entries, the safetensors header needs ${plan.length}`, { file: path });
  }
  let framesEnd = alignUp(headerEnd);
  const entries = plan.map((planned, i): TzipEntry => {
    const e = index[i] as IndexEntry;
    const tensor = planned.kind === 'tensor' ? planned.name : undefined;
    if (e.dataBegin !== planned.begin || e.dataEnd !== planned.end) {
      throw new TzipError('TZIP_CORRUPT',
        `index entry ${i} covers data bytes [${e.dataBegin}, ${e.dataEnd}), the header says [${planned.begin}, ${planned.end})`, { file: path, tensor });
    }
    if (e.frameOffset % ALIGNMENT !== 0 || e.frameOffset < framesEnd || e.frameOffset + e.frameBytes > trailer.indexOffset) {
      throw new TzipError('TZIP_CORRUPT',
        `index entry ${i} puts its ${e.frameBytes}-byte frame at offset ${e.frameOffset}, outside the free, aligned frame area [${framesEnd}, ${trailer.indexOffset})`,
        { file: path, tensor });
    }
    framesEnd = e.frameOffset + e.frameBytes;
    return { ...planned, ...e, index: i };
  });
  return { path, fileSize, originalSize, headerBytes, header, entries };
}

/**
 * Opens a .tzip file for random access, reading and checking its prefix, safetensors header (its
 * XXH32 digest where the file has one), trailer, index (XXH32 digest) and the placement of every
 * frame. Frames themselves are not read.
 * @throws TzipError naming the file: TZIP_IO (cannot open), TZIP_CORRUPT / TZIP_TRUNCATED (bad container),
 *   TZIP_CHECKSUM (the stored safetensors header does not match its digest), TZIP_UNSUPPORTED (newer
 *   container version, unknown flags).
 */
export async function openTzip(path: string): Promise<TzipReader> {
  return openReadOnly(path, async (handle) => new TzipReader(handle, await validate(path, handle)));
}
