/**
 * `tzip decompress IN.tzip -o OUT.safetensors`: .tzip container -> the original safetensors file, byte for byte.
 * `tzip decompress DIR -o OUT_DIR`: a folder `tzip compress DIR` wrote -> the original folder, every file byte for byte.
 */
import type { Command } from 'commander';
import { isFolder } from '../is-folder.js';
import { decompressFile } from '../restore.js';
import { formatGBps, formatSize, gbPerSecond } from './format.js';
import { outputOption, threadsOption, type GlobalOptions } from './options.js';
import { printResult } from './output.js';
import { startProgress } from './progress.js';

interface DecompressOptions extends GlobalOptions {
  output: string;
  threads?: number;
}

/** Adds the `decompress` command to `program`. */
export function registerDecompress(program: Command): void {
  program
    .command('decompress')
    .description('rebuild the original safetensors file from a .tzip file (every digest is checked); ' +
      'a compressed checkpoint folder into a new folder: each NAME.tzip as NAME.safetensors, other files copied unchanged')
    .argument('<input>', '.tzip file, or a folder that `tzip compress DIR` wrote')
    .addOption(outputOption('safetensors file to write (for a folder: a new or empty folder)'))
    .addOption(threadsOption())
    .action(async (input: string, _opts: unknown, cmd: Command) => {
      const opts = cmd.optsWithGlobals<DecompressOptions>();
      if (await isFolder(input)) {
        // Loaded only for a folder: a single file needs neither (nor, for compress, the restore side they import).
        const [{ decompressFolder }, { printFolderResult }] = await Promise.all([import('../folder.js'), import('./folder-output.js')]);
        const result = await decompressFolder(input, opts.output, { threads: opts.threads, onShard: (path) => startProgress(path, opts.json !== true) });
        printFolderResult(opts.json, 'decompress', input, opts.output, result);
        return;
      }
      const progress = startProgress(input, opts.json !== true);
      let result;
      try {
        result = await decompressFile(input, opts.output, { threads: opts.threads, onProgress: (d, t) => progress.update(d, t) });
      } finally {
        progress.stop();
      }
      const gbps = gbPerSecond(result.outputBytes, result.seconds);
      printResult(opts.json, {
        command: 'decompress',
        input,
        output: opts.output,
        inputBytes: result.inputBytes,
        outputBytes: result.outputBytes,
        entries: result.entryCount,
        seconds: result.seconds,
        decompressGBps: gbps,
      }, () =>
        `${input} (${formatSize(result.inputBytes)}) -> ${opts.output} (${formatSize(result.outputBytes)}): ` +
        `${result.entryCount} entries, ${result.seconds.toFixed(2)} s, ${formatGBps(gbps)} GB/s`);
    });
}
