/**
 * `tzip compress IN.safetensors -o OUT.tzip`: safetensors file -> .tzip container.
 * `tzip compress DIR -o OUT_DIR`: a checkpoint folder -> a folder of one .tzip per shard, other files copied
 * (src/folder.ts).
 */
import type { Command } from 'commander';
import type { Codec } from '../native.js';
import { isFolder } from '../is-folder.js';
import { compressFile } from '../writer.js';
import { formatGBps, formatSize, formatRatio, gbPerSecond } from './format.js';
import { chunkSizeOption, codecOption, outputOption, threadsOption, type GlobalOptions } from './options.js';
import { printResult } from './output.js';
import { startProgress } from './progress.js';

interface CompressOptions extends GlobalOptions {
  output: string;
  codec: Codec;
  threads?: number;
  chunkSize?: number;
}

/** Adds the `compress` command to `program`. */
export function registerCompress(program: Command): void {
  program
    .command('compress')
    .description('compress a safetensors file into a .tzip file (lossless, byte-identical on decompress); ' +
      'a checkpoint folder into a new folder: each NAME.safetensors as NAME.tzip, other files copied unchanged')
    .argument('<input>', 'safetensors file, or a flat checkpoint folder (config, tokenizer, *.safetensors shards, index)')
    .addOption(outputOption('.tzip file to write (for a folder: a new or empty folder)'))
    .addOption(codecOption())
    .addOption(threadsOption())
    .addOption(chunkSizeOption())
    .action(async (input: string, _opts: unknown, cmd: Command) => {
      const opts = cmd.optsWithGlobals<CompressOptions>();
      if (await isFolder(input)) {
        // Loaded only for a folder: a single file needs neither (nor, for compress, the restore side they import).
        const [{ compressFolder }, { printFolderResult }] = await Promise.all([import('../folder.js'), import('./folder-output.js')]);
        const result = await compressFolder(input, opts.output, {
          codec: opts.codec,
          threads: opts.threads,
          chunkSize: opts.chunkSize,
          onShard: (path) => startProgress(path, opts.json !== true),
        });
        printFolderResult(opts.json, 'compress', input, opts.output, result, { codec: opts.codec });
        return;
      }
      const progress = startProgress(input, opts.json !== true);
      let result;
      try {
        result = await compressFile(input, opts.output, {
          codec: opts.codec,
          threads: opts.threads,
          chunkSize: opts.chunkSize,
          onProgress: (done, total) => progress.update(done, total),
        });
      } finally {
        progress.stop();
      }
      const gbps = gbPerSecond(result.inputBytes, result.seconds);
      printResult(opts.json, {
        command: 'compress',
        input,
        output: opts.output,
        codec: opts.codec,
        inputBytes: result.inputBytes,
        outputBytes: result.outputBytes,
        ratio: result.inputBytes === 0 ? null : result.outputBytes / result.inputBytes,
        seconds: result.seconds,
        compressGBps: gbps,
        entries: result.entries.map((e) => ({
          name: e.name, kind: e.kind, dtype: e.fileDtype, codecDtype: e.dtype, shape: e.shape,
          dataBegin: e.dataBegin, dataEnd: e.dataEnd, frameOffset: e.frameOffset, frameBytes: e.frameBytes,
        })),
      }, () =>
        `${input} (${formatSize(result.inputBytes)}) -> ${opts.output} (${formatSize(result.outputBytes)}): ` +
        `ratio ${formatRatio(result.outputBytes, result.inputBytes)}, ${result.entries.length} entries, ` +
        `${result.seconds.toFixed(2)} s, ${formatGBps(gbps)} GB/s`);
    });
}
