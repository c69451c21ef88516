/**
 * `tzip inspect FILE.tzip`: one table row per entry (tensor or gap) with its dtype, shape, codec and
 * sizes, read from the index and each frame's header (no frame is decoded), plus totals.
 */
import type { Command } from 'commander';
import { openTzip } from '../reader.js';
import { formatBytes, formatSize, formatRatio, formatShape } from './format.js';
import type { GlobalOptions } from './options.js';
import { printResult } from './output.js';
import { makeTable } from './table.js';
import { printable } from '../printable.js';

/** One row of the listing (sizes in bytes). */
interface InspectRow {
  name: string;
  kind: 'tensor' | 'gap';
  /** dtype in the safetensors header. */
  dtype: string;
  /** dtype the frame was coded as ('U8' for unknown dtypes and gaps). */
  codecDtype: string;
  shape: number[];
  codec: string;
  chunks: number;
  bytesBefore: number;
  bytesAfter: number;
}

/** Adds the `inspect` command to `program`. */
export function registerInspect(program: Command): void {
  program
    .command('inspect')
    .description('list the tensors of a .tzip file with codec and sizes (reads headers only)')
    .argument('<file>', '.tzip file')
    .action(async (file: string, _opts: unknown, cmd: Command) => {
      const opts = cmd.optsWithGlobals<GlobalOptions>();
      const reader = await openTzip(file);
      try {
        const rows: InspectRow[] = [];
        for (const entry of reader.entries) {
          const frame = await reader.frameHeader(entry);
          rows.push({
            name: entry.name,
            kind: entry.kind,
            dtype: entry.fileDtype,
            codecDtype: entry.dtype,
            shape: entry.fileShape,
            codec: frame.codec,
            chunks: frame.nChunks,
            bytesBefore: entry.end - entry.begin,
            bytesAfter: entry.frameBytes,
          });
        }
        const dataBefore = rows.reduce((s, r) => s + r.bytesBefore, 0);
        const dataAfter = rows.reduce((s, r) => s + r.bytesAfter, 0);
        const doc = {
          command: 'inspect',
          file,
          fileBytes: reader.fileSize,
          originalBytes: reader.originalSize,
          headerBytes: reader.headerBytes.byteLength,
          metadata: reader.header.metadata ?? null,
          tensorCount: reader.tensorNames().length,
          entries: rows,
          totals: {
            dataBytesBefore: dataBefore,
            framesBytes: dataAfter,
            ratio: reader.originalSize === 0 ? null : reader.fileSize / reader.originalSize,
          },
        };
        printResult(opts.json, doc, () => {
          const table = makeTable(['name', 'dtype', 'shape', 'codec', 'bytes before', 'bytes after', 'ratio'], ['left', 'left', 'left', 'left', 'right', 'right', 'right']);
          for (const r of rows) {
            const dtype = r.codecDtype === r.dtype ? r.dtype : `${r.dtype} (as ${r.codecDtype})`;
            table.push([printable(r.name), printable(dtype), formatShape(r.shape), r.codec, formatBytes(r.bytesBefore), formatBytes(r.bytesAfter), formatRatio(r.bytesAfter, r.bytesBefore)]);
          }
          table.push([`data section (${rows.length} entries)`, '', '', '', formatBytes(dataBefore), formatBytes(dataAfter), formatRatio(dataAfter, dataBefore)]);
          table.push(['whole file (incl. header, index)', '', '', '', formatBytes(reader.originalSize), formatBytes(reader.fileSize), formatRatio(reader.fileSize, reader.originalSize)]);
          return `${file}: ${doc.tensorCount} tensors, original ${formatSize(reader.originalSize)}, .tzip ${formatSize(reader.fileSize)}\n${table.toString()}`;
        });
      } finally {
        await reader.close();
      }
    });
}
