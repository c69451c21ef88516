/**
 * The result of `tzip compress DIR` and `tzip decompress DIR` on stdout: one line per file and a line for the folder,
 * or one JSON document whose `files` list every file (src/folder.ts's FolderResult).
 */
import type { FolderResult } from '../folder.js';
import { formatGBps, formatRatio, formatSize, gbPerSecond } from './format.js';
import { printResult } from './output.js';
import { printable } from '../printable.js';

/**
 * Prints `result` of `command` run on the folder `input` into `output`. The throughput is over the shards' original
 * (safetensors) bytes, as for a single file; `extra` goes into the JSON document (the codec).
 */
export function printFolderResult(json: boolean | undefined, command: 'compress' | 'decompress', input: string, output: string,
  result: FolderResult, extra: Record<string, unknown> = {}): void {
  const shards = result.files.filter((f) => f.kind === 'shard');
  const copied = result.files.filter((f) => f.kind === 'copied');
  const original = (f: { inputBytes: number; outputBytes: number }): number => (command === 'compress' ? f.inputBytes : f.outputBytes);
  const packed = (f: { inputBytes: number; outputBytes: number }): number => (command === 'compress' ? f.outputBytes : f.inputBytes);
  const shardOriginal = shards.reduce((s, f) => s + original(f), 0);
  const shardPacked = shards.reduce((s, f) => s + packed(f), 0);
  const gbps = gbPerSecond(shardOriginal, result.seconds);
  printResult(json, {
    command,
    input,
    output,
    folder: true,
    ...extra,
    inputBytes: result.inputBytes,
    outputBytes: result.outputBytes,
    shards: shards.length,
    copied: copied.length,
    // The shards' ratio: copied files are the same size on both sides and would only pull it towards 1.
    ratio: shardOriginal === 0 ? null : shardPacked / shardOriginal,
    seconds: result.seconds,
    [command === 'compress' ? 'compressGBps' : 'decompressGBps']: gbps,
    files: result.files.map((f) => ({ ...f, ratio: f.kind === 'copied' || original(f) === 0 ? null : packed(f) / original(f) })),
  }, () => [
    ...result.files.map((f) => f.kind === 'shard'
      ? `  ${printable(f.name)} (${formatSize(f.inputBytes)}) -> ${printable(f.output)} (${formatSize(f.outputBytes)}): ` +
        `ratio ${formatRatio(packed(f), original(f))}, ${f.entries} entries, ${f.seconds.toFixed(2)} s`
      : `  ${printable(f.name)} (${formatSize(f.inputBytes)}): copied unchanged`),
    `${printable(input)} (${formatSize(result.inputBytes)}) -> ${printable(output)} (${formatSize(result.outputBytes)}): ` +
      `${shards.length} shard${shards.length === 1 ? '' : 's'} (ratio ${formatRatio(shardPacked, shardOriginal)}), ` +
      `${copied.length} other file${copied.length === 1 ? '' : 's'} copied, ${result.seconds.toFixed(2)} s, ${formatGBps(gbps)} GB/s`,
  ].join('\n'));
}
