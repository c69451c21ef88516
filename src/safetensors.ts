/**
 * Parsing and validation of a safetensors header.
 *
 * A safetensors file is: a u64 little-endian header length N, N bytes of UTF-8 JSON, then the data
 * section (file bytes from 8+N to the end). The JSON maps tensor names to
 * `{dtype, shape, data_offsets: [begin, end]}` (offsets relative to the data section) and may hold
 * a `__metadata__` object. See https://github.com/huggingface/safetensors.
 */
import { constants as bufferConstants } from 'node:buffer';
import { DTYPE_BYTES, isKnownDtype, type KnownDtype } from './dtype.js';
import { TzipError } from './errors.js';
import { openReadOnly, readExactly } from './positioned-io.js';

/**
 * True when `text` has no lone UTF-16 surrogate: JSON's \uD800-\uDFFF escapes may make one, UTF-8 cannot hold it,
 * and the reference reader (the safetensors crate, serde_json) refuses it, as the Python reader does
 * (docs/container.md). With the u flag a surrogate pair is one code point, so the class matches lone halves only.
 */
function isWellFormed(text: string): boolean {
  return !/[\uD800-\uDFFF]/u.test(text);
}

/**
 * Deepest nesting of arrays and objects accepted in a header: serde_json's recursion limit, which the reference reader
 * (the safetensors crate) inherits, and far inside Python's, so that both of tzip's readers accept the same files.
 */
export const MAX_JSON_DEPTH = 128;

/** How deep the arrays and objects of the JSON `text` nest (brackets outside strings; the text is valid JSON). */
function jsonDepth(text: string): number {
  let depth = 0;
  let deepest = 0;
  let inString = false;
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    if (inString) {
      if (c === 0x5c) i++; // backslash: the next character is escaped
      else if (c === 0x22) inString = false;
    } else if (c === 0x22) {
      inString = true;
    } else if (c === 0x7b || c === 0x5b) {
      deepest = Math.max(deepest, ++depth);
    } else if (c === 0x7d || c === 0x5d) {
      depth--;
    }
  }
  return deepest;
}

/** Largest header accepted, in bytes of JSON (the limit of the reference implementation). */
export const MAX_HEADER_BYTES = 100_000_000;

/** Most dimensions the codec records in a frame (kMaxNdim in cuda/include/tzip/format.h); tensors with more are coded 1-D. */
export const CODEC_MAX_DIMS = 32;

/**
 * Complex safetensors dtypes and the dtype of their parts. A complex tensor is coded as pairs of floats with a
 * trailing dimension of 2 (real and imaginary parts interleaved is its memory layout), as the daemon codes a complex
 * tensor a client sends (src/daemon/dtype-map.ts): so one tensor gets one codec layout, and one codec choice, whether
 * `tzip compress` or the Python client codes it. Safetensors names only C64.
 */
const COMPLEX_PARTS: ReadonlyMap<string, KnownDtype> = new Map([['C64', 'F32']]);

/** The dtype and shape a frame records for a tensor (the codec dtype and shape). */
export interface CodecLayout {
  dtype: string;
  shape: number[];
}

/**
 * The codec dtype and shape of a tensor (docs/container.md, "Entries"), the rule the daemon applies to what a client
 * sends: a dtype the codec knows keeps dtype and shape; C64 is F32 with a trailing dimension of 2; a shape that would
 * have more than {@link CODEC_MAX_DIMS} dimensions is flattened to 1-D; any other dtype, and a byte length that is
 * not the shape's, is 'U8' [nbytes].
 * @param dtype safetensors dtype name as written in the file (any string).
 * @param shape shape as written in the file.
 * @param nbytes bytes of the tensor's data (end - begin).
 */
export function codecLayout(dtype: string, shape: readonly number[], nbytes: number): CodecLayout {
  const elements = elementCount(shape);
  if (isKnownDtype(dtype) && elements * BigInt(DTYPE_BYTES[dtype]) === BigInt(nbytes)) {
    return { dtype, shape: shape.length > CODEC_MAX_DIMS ? [Number(elements)] : [...shape] };
  }
  const part = COMPLEX_PARTS.get(dtype);
  if (part !== undefined && elements * 2n * BigInt(DTYPE_BYTES[part]) === BigInt(nbytes)) {
    return { dtype: part, shape: shape.length + 1 > CODEC_MAX_DIMS ? [Number(elements * 2n)] : [...shape, 2] };
  }
  return { dtype: 'U8', shape: [nbytes] };
}

/**
 * Whether a tensor of `dtype` and `shape` was coded as 'U8' [nbytes] by writers before {@link codecLayout} coded it
 * otherwise (C64, more than {@link CODEC_MAX_DIMS} dimensions): readers accept a frame of that layout too, so that
 * files written then still read (docs/container.md, "Earlier layouts").
 */
export function hadBytesLayout(dtype: string, shape: readonly number[]): boolean {
  return COMPLEX_PARTS.has(dtype) || shape.length > CODEC_MAX_DIMS;
}

/** Bytes of the little-endian u64 length prefix. */
export const LENGTH_PREFIX_BYTES = 8;

/** One tensor of a safetensors file, validated. Offsets are in bytes, relative to the data section. */
export interface SafetensorsTensor {
  /** Key in the header JSON. */
  name: string;
  /** dtype as written in the file (may be one the codec does not know). */
  dtype: string;
  /** shape as written in the file. */
  shape: number[];
  /** First byte, relative to the data section. */
  begin: number;
  /** One past the last byte, relative to the data section. */
  end: number;
  /** dtype handed to the codec ({@link codecLayout}: `dtype`, 'F32' for C64, or 'U8' for opaque bytes). */
  codecDtype: string;
  /** shape handed to the codec ({@link codecLayout}: `shape`, `[...shape, 2]` for C64, 1-D beyond 32 dimensions, or `[end - begin]`). */
  codecShape: number[];
}

/** A validated safetensors header. */
export interface SafetensorsHeader {
  /** N: bytes of JSON after the 8-byte length prefix. */
  headerLength: number;
  /** 8 + N: where the data section starts in the file. */
  dataOffset: number;
  /** Bytes in the data section: file size - 8 - N. */
  dataLength: number;
  /** Tensors sorted by (begin, end, name in UTF-8 byte order); they do not overlap. */
  tensors: SafetensorsTensor[];
  /** The `__metadata__` object, if any. */
  metadata: Record<string, unknown> | undefined;
}

// Checked by hand, not with zod: this parser is a decoder entry point of the data path (fuzzed: fuzz/js), runs in
// every command that reads a file, and loading zod was most of `tzip inspect`'s start-up (docs/benchmarks.md).
function isPlainObject(v: unknown): v is Record<string, unknown> {
  return v !== null && typeof v === 'object' && !Array.isArray(v);
}

function isOffset(v: unknown): v is number {
  return typeof v === 'number' && Number.isSafeInteger(v) && v >= 0;
}

/** What is wrong with a tensor entry (`{dtype, shape, data_offsets}`), or null when nothing is. */
function tensorEntryProblem(v: unknown): string | null {
  if (!isPlainObject(v)) return 'not a JSON object';
  if (typeof v.dtype !== 'string' || v.dtype.length === 0) return 'dtype is not a non-empty string';
  if (!Array.isArray(v.shape)) return 'shape is not an array';
  const badDim = v.shape.findIndex((d) => !isOffset(d));
  if (badDim >= 0) return `shape[${badDim}] is not an integer from 0 to 2^53 - 1 (${JSON.stringify(v.shape[badDim])})`;
  const o = v.data_offsets;
  if (!Array.isArray(o) || o.length !== 2 || !isOffset(o[0]) || !isOffset(o[1])) {
    return 'data_offsets is not [begin, end] of integers from 0 to 2^53 - 1';
  }
  return null;
}

/** Orders tensors by position; ties (empty tensors at one offset) by name in UTF-8 byte order. */
export function compareTensors(a: SafetensorsTensor, b: SafetensorsTensor): number {
  return a.begin - b.begin || a.end - b.end || Buffer.compare(Buffer.from(a.name, 'utf8'), Buffer.from(b.name, 'utf8'));
}

function elementCount(shape: readonly number[]): bigint {
  return shape.reduce((acc, d) => acc * BigInt(d), 1n);
}

/**
 * "not a safetensors file: it starts with text ..." when the 8 bytes where a safetensors file keeps its header
 * length are all printable ASCII or whitespace (a config.json, a README, a tokenizer file passed by mistake: read
 * as a u64 those give lengths like 7234013700659612283, which alone told a user nothing); "" otherwise. A real
 * header length is below 2^27 (100 MB), so its high bytes are 0 and never all printable; and 8 printable bytes
 * always read as more than 100 MB (the top byte is at least 0x09), so only the TZIP_CORRUPT case needs the note.
 */
function textPrefixNote(prefix: Uint8Array): string {
  const head = prefix.subarray(0, LENGTH_PREFIX_BYTES);
  const printable = (b: number) => (b >= 0x20 && b <= 0x7e) || b === 0x09 || b === 0x0a || b === 0x0d;
  if (!head.every(printable)) return '';
  return `not a safetensors file: it starts with text (${JSON.stringify(Buffer.from(head).toString('latin1'))}) where a `
    + 'safetensors file starts with the length of its JSON header, an 8-byte little-endian integer; ';
}

/**
 * Reads the header length N from the first 8 bytes of a safetensors file.
 * @param fileSize size of the whole safetensors file in bytes.
 * @throws TzipError TZIP_TRUNCATED when fewer than 8 bytes exist or N > fileSize - 8;
 *   TZIP_CORRUPT when N exceeds {@link MAX_HEADER_BYTES}; when those 8 bytes are text (a JSON or text file that
 *   is not safetensors) its message starts with "not a safetensors file: it starts with text", the code being the
 *   same. Errors name `file`.
 */
export function parseHeaderLength(prefix: Uint8Array, fileSize: number, file: string): number {
  if (prefix.byteLength < LENGTH_PREFIX_BYTES || fileSize < LENGTH_PREFIX_BYTES) {
    throw new TzipError('TZIP_TRUNCATED', `safetensors file of ${fileSize} bytes has no 8-byte header length`, { file });
  }
  const n = Buffer.from(prefix.buffer, prefix.byteOffset, LENGTH_PREFIX_BYTES).readBigUInt64LE(0);
  if (n > BigInt(MAX_HEADER_BYTES)) {
    throw new TzipError('TZIP_CORRUPT',
      `${textPrefixNote(prefix)}safetensors header length ${n} exceeds the ${MAX_HEADER_BYTES}-byte limit`, { file });
  }
  const length = Number(n);
  if (length > fileSize - LENGTH_PREFIX_BYTES) {
    throw new TzipError('TZIP_TRUNCATED',
      `safetensors header length ${length} exceeds the ${fileSize - LENGTH_PREFIX_BYTES} bytes after the length prefix`, { file });
  }
  return length;
}

/**
 * Parses and validates a safetensors header.
 * @param prefix the file's first 8 + N bytes (length prefix and JSON; more bytes are ignored).
 * @param fileSize size of the whole safetensors file in bytes (the data section is what follows 8 + N).
 * @param file path used in error messages.
 * @throws TzipError TZIP_TRUNCATED (header or tensors reach past the end of the file) or TZIP_CORRUPT (bad JSON,
 *   bad fields, overlapping tensors), naming `file` and the tensor.
 */
export function parseSafetensorsHeader(prefix: Uint8Array, fileSize: number, file: string): SafetensorsHeader {
  const headerLength = parseHeaderLength(prefix, fileSize, file);
  if (prefix.byteLength < LENGTH_PREFIX_BYTES + headerLength) {
    throw new TzipError('TZIP_TRUNCATED', `safetensors header needs ${LENGTH_PREFIX_BYTES + headerLength} bytes, got ${prefix.byteLength}`, { file });
  }
  const dataOffset = LENGTH_PREFIX_BYTES + headerLength;
  const dataLength = fileSize - dataOffset;

  let json: unknown;
  try {
    // ignoreBOM: a leading byte-order mark stays in the text, where JSON.parse refuses it (docs/container.md).
    const text = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true }).decode(prefix.subarray(LENGTH_PREFIX_BYTES, dataOffset));
    json = JSON.parse(text.replace(/\0+$/, ''));
    const depth = jsonDepth(text);
    if (depth > MAX_JSON_DEPTH) throw new Error(`nested ${depth} levels deep, more than ${MAX_JSON_DEPTH}`);
  } catch (err) {
    throw new TzipError('TZIP_CORRUPT', `safetensors header is not UTF-8 JSON: ${(err as Error).message}`, { file, cause: err });
  }
  if (!isPlainObject(json)) throw new TzipError('TZIP_CORRUPT', 'safetensors header is not a JSON object', { file });

  let metadata: Record<string, unknown> | undefined;
  const tensors: SafetensorsTensor[] = [];
  // Iterate JSON.parse's own object, never a copy: a copy made by assignment would turn a tensor
  // named "__proto__" into a prototype and lose it.
  for (const [name, value] of Object.entries(json as Record<string, unknown>)) {
    if (name === '__metadata__') {
      if (!isPlainObject(value)) throw new TzipError('TZIP_CORRUPT', '__metadata__ is not a JSON object', { file });
      const bad = Object.entries(value).find(([k, v]) => typeof v !== 'string' || !isWellFormed(k) || !isWellFormed(v));
      if (bad !== undefined) {
        throw new TzipError('TZIP_CORRUPT', `__metadata__ entry ${JSON.stringify(bad[0])} is not a string of Unicode text (the format's map of strings to strings)`, { file });
      }
      metadata = value;
      continue;
    }
    if (!isWellFormed(name)) {
      throw new TzipError('TZIP_CORRUPT', 'tensor name with a lone UTF-16 surrogate (\\ud800-\\udfff unpaired): not Unicode text', { file, tensor: name });
    }
    const problem = tensorEntryProblem(value);
    if (problem !== null) throw new TzipError('TZIP_CORRUPT', `bad tensor entry: ${problem}`, { file, tensor: name });
    const entry = value as { dtype: string; shape: number[]; data_offsets: [number, number] };
    const { dtype, data_offsets: [begin, end] } = entry;
    const shape = [...entry.shape];
    if (begin > end) {
      throw new TzipError('TZIP_CORRUPT', `data_offsets [${begin}, ${end}] are reversed`, { file, tensor: name });
    }
    if (end > dataLength) {
      throw new TzipError('TZIP_TRUNCATED', `data_offsets [${begin}, ${end}] reach past the ${dataLength}-byte data section`, { file, tensor: name });
    }
    const codec = codecLayout(dtype, shape, end - begin);
    tensors.push({ name, dtype, shape, begin, end, codecDtype: codec.dtype, codecShape: codec.shape });
  }

  tensors.sort(compareTensors);
  let cursor = 0;
  let previous: SafetensorsTensor | undefined;
  for (const t of tensors) {
    if (previous !== undefined && t.begin < cursor) {
      throw new TzipError('TZIP_CORRUPT',
        `data_offsets [${t.begin}, ${t.end}] overlap tensor '${previous.name}' at [${previous.begin}, ${previous.end}]`, { file, tensor: t.name });
    }
    if (t.end > cursor) {
      cursor = t.end;
      previous = t;
    }
  }
  return { headerLength, dataOffset, dataLength, tensors, metadata };
}

/** An open safetensors file: its validated header and positioned reads of its data section. */
export interface SafetensorsFile {
  /** Path as given to {@link openSafetensors}. */
  path: string;
  /** Size of the file in bytes. */
  fileSize: number;
  /** The file's first 8 + N bytes (length prefix and JSON), verbatim. */
  headerBytes: Buffer;
  header: SafetensorsHeader;
  /**
   * Reads data-section bytes [begin, end) (offsets relative to the data section) with positioned reads.
   * @throws TzipError TZIP_IO / TZIP_TRUNCATED naming the file; TZIP_UNSUPPORTED when the range exceeds Node's largest buffer.
   */
  read(begin: number, end: number): Promise<Buffer>;
  /** Closes the file. */
  close(): Promise<void>;
}

/**
 * Opens a safetensors file and reads and validates its header (only the first 8 + N bytes are read).
 * @throws TzipError naming the file: TZIP_IO (cannot open/read), or as {@link parseSafetensorsHeader}.
 */
export async function openSafetensors(path: string): Promise<SafetensorsFile> {
  return openReadOnly(path, async (handle) => {
    const fileSize = (await handle.stat()).size;
    const lengthBytes = Buffer.alloc(LENGTH_PREFIX_BYTES);
    const { bytesRead } = await handle.read(lengthBytes, 0, LENGTH_PREFIX_BYTES, 0);
    const headerLength = parseHeaderLength(lengthBytes.subarray(0, bytesRead), fileSize, path);
    const headerBytes = Buffer.alloc(LENGTH_PREFIX_BYTES + headerLength);
    lengthBytes.copy(headerBytes);
    await readExactly(handle, headerBytes.subarray(LENGTH_PREFIX_BYTES), LENGTH_PREFIX_BYTES, path);
    const header = parseSafetensorsHeader(headerBytes, fileSize, path);
    return {
      path,
      fileSize,
      headerBytes,
      header,
      read: async (begin, end) => {
        if (end - begin > bufferConstants.MAX_LENGTH) {
          throw new TzipError('TZIP_UNSUPPORTED', `${end - begin} bytes exceed the largest buffer Node can allocate (${bufferConstants.MAX_LENGTH})`, { file: path });
        }
        const bytes = Buffer.allocUnsafe(end - begin);
        await readExactly(handle, bytes, header.dataOffset + begin, path);
        return bytes;
      },
      close: () => handle.close(),
    };
  });
}
