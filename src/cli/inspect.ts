/**
 * `tzip inspect FILE.tzip`: one table row per entry (tensor or gap) with its dtype, shape, codec and
 * sizes, read from the index and each frame's header (no frame is decoded), plus totals.
 * `tzip inspect DIR`: the same for every .tzip shard of a folder `tzip compress DIR` wrote.
 */
import { join } from 'node:path';
import type { Command } from 'commander';
import { isFolder, listFolder, TZIP_SUFFIX } from '../folder.js';
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

/** What `tzip inspect` says about one .tzip file: the JSON document and its text. */
interface Inspection {
  doc: {
    command: 'inspect'; file: string; fileBytes: number; originalBytes: number; headerBytes: number;
    metadata: Record<string, unknown> | null; tensorCount: number; entries: InspectRow[];
    totals: { dataBytesBefore: number; framesBytes: number; ratio: number | null };
  };
  text: string;
}

/** Reads the index and frame headers of the .tzip file `file` (no frame is decoded). */
async function inspectFile(file: string): Promise<Inspection> {
  const reader = await openTzip(file);
  try {
    const rows: InspectRow[] = [];
    for (const entry of reader.entries) {
      const frame = await reader.frameHeader(entry);
      rows.push({
        name: entry.name,
        kind: entry.kind,
        dtype: entry.fileDtype,
        codecDtype: frame.dtype, // the entry's codec dtype, or U8 in a file written before C64 was coded as F32 pairs
        shape: entry.fileShape,
        codec: frame.codec,
        chunks: frame.nChunks,
        bytesBefore: entry.end - entry.begin,
        bytesAfter: entry.frameBytes,
      });
    }
    const dataBefore = rows.reduce((s, r) => s + r.bytesBefore, 0);
    const dataAfter = rows.reduce((s, r) => s + r.bytesAfter, 0);
    const doc: Inspection['doc'] = {
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
    const table = makeTable(['name', 'dtype', 'shape', 'codec', 'bytes before', 'bytes after', 'ratio'], ['left', 'left', 'left', 'left', 'right', 'right', 'right']);
    for (const r of rows) {
      const dtype = r.codecDtype === r.dtype ? r.dtype : `${r.dtype} (as ${r.codecDtype})`;
      table.push([printable(r.name), printable(dtype), formatShape(r.shape), r.codec, formatBytes(r.bytesBefore), formatBytes(r.bytesAfter), formatRatio(r.bytesAfter, r.bytesBefore)]);
    }
    table.push([`data section (${rows.length} entries)`, '', '', '', formatBytes(dataBefore), formatBytes(dataAfter), formatRatio(dataAfter, dataBefore)]);
    table.push(['whole file (incl. header, index)', '', '', '', formatBytes(reader.originalSize), formatBytes(reader.fileSize), formatRatio(reader.fileSize, reader.originalSize)]);
    const text = `${file}: ${doc.tensorCount} tensors, original ${formatSize(reader.originalSize)}, .tzip ${formatSize(reader.fileSize)}\n${table.toString()}`;
    return { doc, text };
  } finally {
    await reader.close();
  }
}

/**
 * `tzip inspect DIR`: each .tzip shard's listing as for one file, the other files by name and size, then the folder's
 * totals. A shard that does not open stops the listing with its error, as `tzip inspect FILE` does.
 */
async function inspectFolder(dir: string, json: boolean | undefined): Promise<void> {
  const files = await listFolder(dir, { shardSuffix: TZIP_SUFFIX });
  const shards: Inspection[] = [];
  for (const f of files.filter((x) => x.kind === 'shard')) shards.push(await inspectFile(f.path));
  const others = files.filter((f) => f.kind === 'other').map((f) => ({ name: f.name, bytes: f.bytes }));
  const fileBytes = shards.reduce((s, i) => s + i.doc.fileBytes, 0);
  const originalBytes = shards.reduce((s, i) => s + i.doc.originalBytes, 0);
  const tensorCount = shards.reduce((s, i) => s + i.doc.tensorCount, 0);
  printResult(json, {
    command: 'inspect',
    file: dir,
    folder: true,
    fileBytes,
    originalBytes,
    tensorCount,
    shards: shards.map((i) => i.doc),
    others,
    totals: { ratio: originalBytes === 0 ? null : fileBytes / originalBytes },
  }, () => [
    ...shards.map((i) => i.text),
    ...others.map((o) => `${printable(join(dir, o.name))}: ${formatBytes(o.bytes)} bytes, carried unchanged`),
    `${printable(dir)}: ${shards.length} shards, ${tensorCount} tensors, original ${formatSize(originalBytes)}, .tzip ${formatSize(fileBytes)}, ` +
      `ratio ${formatRatio(fileBytes, originalBytes)}; ${others.length} other files`,
  ].join('\n'));
}

/** Adds the `inspect` command to `program`. */
export function registerInspect(program: Command): void {
  program
    .command('inspect')
    .description('list the tensors of a .tzip file with codec and sizes (reads headers only); for a compressed checkpoint folder, of every shard')
    .argument('<file>', '.tzip file, or a folder that `tzip compress DIR` wrote')
    .action(async (file: string, _opts: unknown, cmd: Command) => {
      const opts = cmd.optsWithGlobals<GlobalOptions>();
      if (await isFolder(file)) {
        await inspectFolder(file, opts.json);
        return;
      }
      const { doc, text } = await inspectFile(file);
      printResult(opts.json, doc, () => text);
    });
}
