/**
 * How a safetensors data section is cut into the entries of a .tzip container (docs/container.md):
 * one entry per tensor, one per run of bytes no tensor covers (gaps and trailing bytes), in
 * ascending order, covering the data section without gaps. Empty tensors get an entry too.
 */
import { hadBytesLayout, type SafetensorsHeader } from './safetensors.js';

/** One entry of the plan. Offsets in bytes, relative to the data section. */
export interface PlannedEntry {
  /** 'tensor' for a tensor of the header, 'gap' for bytes no tensor covers. */
  kind: 'tensor' | 'gap';
  /** Tensor name (the header key); for a gap, a label `(gap @<begin>)` that no lookup matches. */
  name: string;
  /** First byte, relative to the data section. */
  begin: number;
  /** One past the last byte. */
  end: number;
  /** dtype as written in the header ('U8' for gaps). */
  fileDtype: string;
  /** shape as written in the header ([length] for gaps). */
  fileShape: number[];
  /** dtype passed to the codec (safetensors.ts codecLayout: the header's dtype, 'F32' for C64, or 'U8' for gaps, unknown dtypes and size mismatches). */
  dtype: string;
  /** shape passed to the codec. */
  shape: number[];
}

/**
 * Plans the entries for a validated header: tensors in the header's sorted order (position, then
 * name in UTF-8 byte order), a 'gap' entry ('U8', shape [length]) before any tensor that does not
 * start where the previous one ended, and one for trailing bytes after the last tensor.
 * @returns entries whose ranges are ascending and contiguous from 0 to header.dataLength.
 */
export function planEntries(header: SafetensorsHeader): PlannedEntry[] {
  const entries: PlannedEntry[] = [];
  let cursor = 0;
  const gapUntil = (end: number): void => {
    if (end > cursor) {
      entries.push({ kind: 'gap', name: `(gap @${cursor})`, begin: cursor, end, fileDtype: 'U8', fileShape: [end - cursor], dtype: 'U8', shape: [end - cursor] });
      cursor = end;
    }
  };
  for (const t of header.tensors) {
    gapUntil(t.begin);
    entries.push({ kind: 'tensor', name: t.name, begin: t.begin, end: t.end, fileDtype: t.dtype, fileShape: t.shape, dtype: t.codecDtype, shape: t.codecShape });
    cursor = t.end;
  }
  gapUntil(header.dataLength);
  return entries;
}

/**
 * Whether a frame that records `dtype` and `shape` may hold `entry`: the entry's codec layout, or, for a tensor that
 * writers before issue 36 coded as bytes (C64, more than 32 dimensions), 'U8' [bytes] (docs/container.md, "Earlier
 * layouts"). Both decode to the same bytes; what is checked is that the frame is this entry's.
 */
export function frameLayoutFits(entry: PlannedEntry, dtype: string, shape: readonly number[]): boolean {
  const same = (a: readonly number[], b: readonly number[]) => a.length === b.length && a.every((d, i) => d === b[i]);
  if (dtype === entry.dtype && same(shape, entry.shape)) return true;
  return entry.kind === 'tensor' && hadBytesLayout(entry.fileDtype, entry.fileShape) && dtype === 'U8' && same(shape, [entry.end - entry.begin]);
}
