/**
 * `tzip extract FILE.tzip TENSOR -o OUT.bin`: random access to one tensor; writes its raw bytes
 * (exactly as in the original safetensors data section) and decodes no other frame.
 */
import type { Command } from 'commander';
import { writeAtomically } from '../atomic-output.js';
import { writeExactly } from '../positioned-io.js';
import { openTzip } from '../reader.js';
import { formatSize, formatShape } from './format.js';
import { outputOption, threadsOption, type GlobalOptions } from './options.js';
import { printResult } from './output.js';
import { printable } from '../printable.js';

interface ExtractOptions extends GlobalOptions {
  output: string;
  threads?: number;
}

/** Adds the `extract` command to `program`. */
export function registerExtract(program: Command): void {
  program
    .command('extract')
    .description("write one tensor's raw bytes, decoding only that tensor's frame")
    .argument('<file>', '.tzip file')
    .argument('<tensor>', 'tensor name (as listed by `tzip inspect`)')
    .addOption(outputOption('file to write the raw tensor bytes to'))
    .addOption(threadsOption())
    .action(async (file: string, tensor: string, _opts: unknown, cmd: Command) => {
      const opts = cmd.optsWithGlobals<ExtractOptions>();
      const reader = await openTzip(file);
      try {
        const entry = reader.entry(tensor);
        const bytes = await reader.decodeEntry(entry, { threads: opts.threads });
        await writeAtomically(opts.output, (out) => writeExactly(out, bytes, 0, opts.output));
        printResult(opts.json, {
          command: 'extract', file, tensor, output: opts.output, dtype: entry.fileDtype, shape: entry.fileShape, bytes: bytes.byteLength,
        }, () => `${file}: tensor '${printable(tensor)}' (${printable(entry.fileDtype)} ${formatShape(entry.fileShape)}, ${formatSize(bytes.byteLength)}) -> ${opts.output}`);
      } finally {
        await reader.close();
      }
    });
}
