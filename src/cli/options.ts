/**
 * Parsers and definitions of the options several `tzip` commands share. A bad value becomes
 * commander's InvalidArgumentError (exit code 1).
 *
 * No zod here: every command that takes --threads or --chunk-size imports this module, and zod's
 * ESM build is about a hundred modules (every locale among them), some 60 ms of a 2-core machine's
 * start-up for one integer check (issue 36).
 */
import { createRequire } from 'node:module';
import { CODECS } from '../native.js';

// require(), as main.ts does: commander through the ESM loader is parsed twice (issue 36).
const { InvalidArgumentError, Option } = createRequire(import.meta.url)('commander') as typeof import('commander');
type Option = InstanceType<typeof Option>;

/**
 * Parses a positive integer option value, e.g. "--threads 4": what `Number()` makes of it (as zod's
 * `z.coerce.number().int().positive().max(Number.MAX_SAFE_INTEGER)` did, so "0x10" and "1e3" are
 * accepted), a whole number from 1 to 2^53 - 1; blank is refused.
 */
export function parsePositiveInt(value: string): number {
  const n = value.trim() === '' ? Number.NaN : Number(value);
  if (!Number.isInteger(n) || n <= 0 || n > Number.MAX_SAFE_INTEGER) throw new InvalidArgumentError(`'${value}' is not a positive integer.`);
  return n;
}

/** Most addon worker threads a call takes (the addon's own bound, addon.cpp threads_opt). */
export const MAX_THREADS = 1024;

/** Parses `--threads`: 1 to {@link MAX_THREADS}, checked here so that the usage error names the option, not a tensor. */
export function parseThreads(value: string): number {
  const n = parsePositiveInt(value);
  if (n > MAX_THREADS) throw new InvalidArgumentError(`'${value}' is above ${MAX_THREADS}, the most threads a call takes.`);
  return n;
}

/** `--threads N`: addon worker threads (default: all cores). */
export function threadsOption(): Option {
  return new Option('--threads <n>', `worker threads, 1 to ${MAX_THREADS} (default: all cores)`).argParser(parseThreads);
}

/** `--codec NAME`: one of auto, fast, max, bytes, raw. */
export function codecOption(): Option {
  return new Option('--codec <codec>', 'codec: auto picks per dtype; fast/max trade speed for ratio; bytes = byte planes; raw = stored')
    .choices(CODECS)
    .default('auto');
}

/** `--chunk-size BYTES`: bytes of original data per independently coded chunk. */
export function chunkSizeOption(): Option {
  return new Option('--chunk-size <bytes>', 'bytes of original data per independently coded chunk: a multiple of 256 from 4096 to 65536 (default: 65536)').argParser(parsePositiveInt);
}

/** `-o, --output PATH` (required). */
export function outputOption(what: string): Option {
  return new Option('-o, --output <path>', what).makeOptionMandatory();
}

/** Options every command receives from the root program (commander's optsWithGlobals()). */
export interface GlobalOptions {
  /** Print one JSON document on stdout instead of text. */
  json?: boolean;
}
