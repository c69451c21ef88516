#!/usr/bin/env node
/**
 * Entry point of the `tzip` command line (commander): builds the program from one module per
 * command, runs it, and turns errors into messages on stderr (and a JSON document on stdout with
 * --json) and the exit codes of exit-codes.ts.
 *
 * A command's module (and what it needs: the codec addon, ZeroMQ, zod, ink...) is loaded only when
 * that command runs, so `tzip --version` loads no command and `tzip inspect` or `tzip jobs` only their
 * own (src/bench/cli-startup.ts measures their start-up against a bare `node`). Help and unknown
 * commands load them all, so that `tzip --help` lists every command and commander can suggest the
 * nearest name.
 */
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { join } from 'node:path';
import type { Command as CommandType } from 'commander';
import { TzipError } from '../errors.js';
import { packageRoot } from '../package-root.js';
import { EXIT_CODES_HELP, EXIT_INTERNAL, EXIT_IO, EXIT_OK, exitCodeFor } from './exit-codes.js';
import { printable } from '../printable.js';

// commander is a CommonJS package: require() loads it without the ESM loader's detour through CommonJS (a second
// parse for its export names), which is start-up time every command pays.
const { Command, CommanderError } = createRequire(import.meta.url)('commander') as typeof import('commander');
type Command = CommandType;

type Register = (program: Command) => void;

/** Each command's module, by name, in the order `tzip --help` lists them. */
const COMMANDS: Record<string, () => Promise<Register>> = {
  compress: async () => (await import('./compress.js')).registerCompress,
  decompress: async () => (await import('./decompress.js')).registerDecompress,
  verify: async () => (await import('./verify.js')).registerVerify,
  inspect: async () => (await import('./inspect.js')).registerInspect,
  extract: async () => (await import('./extract.js')).registerExtract,
  bench: async () => (await import('./bench.js')).registerBench,
  serve: async () => (await import('./serve.js')).registerServe,
  jobs: async () => (await import('./jobs.js')).registerJobs,
  top: async () => (await import('./top.js')).registerTop,
  set: async () => (await import('./set.js')).registerSet,
};

/**
 * The commands to load for `args` (the arguments after the script): the command named by the first
 * argument that is not an option (the root program's options take no value), none for a bare
 * `--version`, every one otherwise (help, no command, an unknown one).
 */
function commandsFor(args: readonly string[]): string[] {
  const first = args.find((a) => !a.startsWith('-'));
  if (first !== undefined && Object.hasOwn(COMMANDS, first)) return [first];
  if (first === undefined && (args.includes('-V') || args.includes('--version')) && !args.includes('-h') && !args.includes('--help')) return [];
  return Object.keys(COMMANDS);
}

function packageVersion(): string {
  const pkg = JSON.parse(readFileSync(join(packageRoot(), 'package.json'), 'utf8')) as { version?: unknown };
  return typeof pkg.version === 'string' ? pkg.version : '0.0.0';
}

/** Builds the `tzip` program with the commands `args` need. Errors are thrown, not exited on (exitOverride). */
async function buildProgram(args: readonly string[]): Promise<Command> {
  const program = new Command('tzip')
    .description('lossless compression of AI tensors in safetensors files (bf16/fp16/fp32 weights, gradients, any dtype)')
    .version(packageVersion())
    .option('--json', 'print one JSON document on stdout instead of text')
    .exitOverride()
    .showHelpAfterError('(see `tzip --help`)')
    .addHelpText('after', `\n${EXIT_CODES_HELP}`);
  const names = commandsFor(args);
  const registers = await Promise.all(names.map((name) => (COMMANDS[name] as () => Promise<Register>)()));
  for (const register of registers) register(program);
  return program;
}

/**
 * Runs the CLI on `argv` (as process.argv: node, script, args...).
 * @returns the exit code (0 ok, 1 usage, 2 bad data, 3 I/O, 4 internal).
 */
async function runCli(argv: readonly string[]): Promise<number> {
  const json = argv.includes('--json');
  try {
    await (await buildProgram(argv.slice(2))).parseAsync([...argv]);
    return typeof process.exitCode === 'number' ? process.exitCode : EXIT_OK;
  } catch (err) {
    const code = exitCodeFor(err);
    if (err instanceof CommanderError) {
      // commander already printed its message (or the help/version text) on stderr/stdout.
      if (json && code !== EXIT_OK) process.stdout.write(`${JSON.stringify({ error: { code: 'TZIP_USAGE', message: err.message, exitCode: code } }, null, 2)}\n`);
      return code;
    }
    const message = err instanceof Error ? err.message : String(err);
    process.stderr.write(`tzip: ${printable(message)}\n`);
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
