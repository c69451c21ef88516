#!/usr/bin/env node
/**
 * Entry point of the `tzip` command line (commander): builds the program from one module per
 * command, runs it, and turns errors into messages on stderr (and a JSON document on stdout with
 * --json) and the exit codes of exit-codes.ts.
 */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { Command, CommanderError } from 'commander';
import { TzipError } from '../errors.js';
import { packageRoot } from '../package-root.js';
import { registerBench } from './bench.js';
import { registerCompress } from './compress.js';
import { registerDecompress } from './decompress.js';
import { EXIT_CODES_HELP, EXIT_INTERNAL, EXIT_IO, EXIT_OK, exitCodeFor } from './exit-codes.js';
import { registerExtract } from './extract.js';
import { registerInspect } from './inspect.js';
import { registerServe } from './serve.js';
import { registerVerify } from './verify.js';

function packageVersion(): string {
  const pkg = JSON.parse(readFileSync(join(packageRoot(), 'package.json'), 'utf8')) as { version?: unknown };
  return typeof pkg.version === 'string' ? pkg.version : '0.0.0';
}

/** Builds the `tzip` program with all its commands. Errors are thrown, not exited on (exitOverride). */
function buildProgram(): Command {
  const program = new Command('tzip')
    .description('lossless compression of AI tensors in safetensors files (bf16/fp16/fp32 weights, gradients, any dtype)')
    .version(packageVersion())
    .option('--json', 'print one JSON document on stdout instead of text')
    .exitOverride()
    .showHelpAfterError('(see `tzip --help`)')
    .addHelpText('after', `\n${EXIT_CODES_HELP}`);
  registerCompress(program);
  registerDecompress(program);
  registerVerify(program);
  registerInspect(program);
  registerExtract(program);
  registerBench(program);
  registerServe(program);
  return program;
}

/**
 * Runs the CLI on `argv` (as process.argv: node, script, args...).
 * @returns the exit code (0 ok, 1 usage, 2 bad data, 3 I/O, 4 internal).
 */
async function runCli(argv: readonly string[]): Promise<number> {
  const json = argv.includes('--json');
  try {
    await buildProgram().parseAsync([...argv]);
    return typeof process.exitCode === 'number' ? process.exitCode : EXIT_OK;
  } catch (err) {
    const code = exitCodeFor(err);
    if (err instanceof CommanderError) {
      // commander already printed its message (or the help/version text) on stderr/stdout.
      if (json && code !== EXIT_OK) process.stdout.write(`${JSON.stringify({ error: { code: 'TZIP_USAGE', message: err.message, exitCode: code } }, null, 2)}\n`);
      return code;
    }
    const message = err instanceof Error ? err.message : String(err);
    process.stderr.write(`tzip: ${message}\n`);
    if (code === EXIT_INTERNAL && err instanceof Error && err.stack !== undefined) process.stderr.write(`${err.stack}\n`);
    if (json) {
      const detail = err instanceof TzipError
        ? { code: err.code, message: err.message, file: err.file ?? null, tensor: err.tensor ?? null, exitCode: code }
        : { code: 'INTERNAL', message, file: null, tensor: null, exitCode: code };
      process.stdout.write(`${JSON.stringify({ error: detail }, null, 2)}\n`);
    }
    return code;
  }
}

// A failed write of the result (stdout on a full disk, /dev/full, a closed pipe) is an I/O error: exit 3 with the reason
// instead of an unhandled 'error' event (a stack trace and exit 1, the usage code). Node reports it a tick after the
// write, possibly after runCli returned.
let stdoutError: NodeJS.ErrnoException | undefined;
process.stdout.on('error', (err: NodeJS.ErrnoException) => {
  if (stdoutError !== undefined) return;
  stdoutError = err;
  process.stderr.write(`tzip: cannot write to stdout: ${err.message}\n`);
  process.exitCode = EXIT_IO;
});
const code = await runCli(process.argv);
process.exitCode = stdoutError !== undefined ? EXIT_IO : code;
