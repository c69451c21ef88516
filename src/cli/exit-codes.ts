/**
 * Process exit codes of the `tzip` CLI and the mapping from errors to them.
 */
import { createRequire } from 'node:module';
import { TzipError } from '../errors.js';

// require(), as main.ts does: importing commander (a CommonJS package) through the ESM loader makes Node parse it a
// second time for its export names, start-up time every command pays (issue 36). Same class as commander's ESM export.
const { CommanderError } = createRequire(import.meta.url)('commander') as typeof import('commander');

/** Success. */
export const EXIT_OK = 0;
/** Usage error: bad or missing arguments/options (commander's own errors too), unknown tensor name. */
export const EXIT_USAGE = 1;
/** Bad or corrupt data, or a failed verification/round trip. */
export const EXIT_DATA = 2;
/** I/O error (missing file, permission denied, disk full) or out of memory. */
export const EXIT_IO = 3;
/** Internal error: a bug in tzip (an error no other code describes). */
export const EXIT_INTERNAL = 4;

/** The text appended to `tzip --help`. */
export const EXIT_CODES_HELP = `Exit codes:
  ${EXIT_OK}  ok
  ${EXIT_USAGE}  usage error (bad arguments or options, unknown tensor name)
  ${EXIT_DATA}  bad or corrupt data, failed verification or round trip
  ${EXIT_IO}  I/O error (missing file, permission denied, disk full) or out of memory
  ${EXIT_INTERNAL}  internal error (a bug: please report it)`;

/** The exit code for an error thrown by a command. */
export function exitCodeFor(err: unknown): number {
  if (err instanceof CommanderError) return err.exitCode;
  if (err instanceof TzipError) {
    switch (err.code) {
      case 'TZIP_USAGE':
      case 'TZIP_INVALID_ARGUMENT':
        return EXIT_USAGE;
      case 'TZIP_IO':
      case 'TZIP_OUT_OF_MEMORY':
        return EXIT_IO;
      case 'TZIP_CORRUPT':
      case 'TZIP_TRUNCATED':
      case 'TZIP_CHECKSUM':
      case 'TZIP_UNSUPPORTED':
        return EXIT_DATA;
    }
  }
  return EXIT_INTERNAL;
}
