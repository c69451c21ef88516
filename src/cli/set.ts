/**
 * `tzip set [JOB] codec=fast|max|auto|off sm_budget=N`: changes a job's settings (with JOB) or the
 * daemon's (without) in the running daemon, from its next request on (the `set` op of docs/protocol.md,
 * protocol version 3). `default` as a value clears the setting: a job then follows the daemon's
 * settings, the daemon each request's own.
 */
import type { Command } from 'commander';
import { TzipError } from '../errors.js';
import { SM_BUDGET_MAX } from '../generated/constants.js';
import { DaemonClient } from './daemon-client.js';
import { socketOption, type WireSettings } from './jobs.js';
import type { GlobalOptions } from './options.js';
import { printResult } from './output.js';

/** Codecs a setting may name (`off`: the daemon writes `raw` frames, still valid and lossless). */
export const SETTING_CODECS = ['fast', 'max', 'auto', 'off'] as const;
/** The largest SM budget the daemon takes (0 = all SMs of the GPU). */
export const MAX_SM_BUDGET = SM_BUDGET_MAX;
/** The value that clears a setting. */
const CLEAR = 'default';

function usage(message: string): TzipError {
  return new TzipError('TZIP_USAGE', message);
}

/** The fields of a `set` request. */
export interface SetPatch {
  job?: string;
  codec?: string | null;
  sm_budget?: number | null;
}

/**
 * Parses `[JOB] KEY=VALUE...` (keys: codec, sm_budget; each at most once; `default` clears).
 * @throws TzipError TZIP_USAGE (exit code 1) saying what is accepted.
 */
export function parseSetArgs(args: readonly string[]): SetPatch {
  const patch: SetPatch = {};
  let rest = args;
  if (rest.length > 0 && !(rest[0] as string).includes('=')) {
    patch.job = rest[0] as string;
    rest = rest.slice(1);
  }
  if (rest.length === 0) throw usage(`nothing to set: give codec=${SETTING_CODECS.join('|')}|${CLEAR} and/or sm_budget=0..${MAX_SM_BUDGET}|${CLEAR}`);
  for (const arg of rest) {
    const eq = arg.indexOf('=');
    if (eq < 0) throw usage(`'${arg}' is not KEY=VALUE (the job name, if any, comes first)`);
    const key = arg.slice(0, eq).replace(/-/g, '_');
    const value = arg.slice(eq + 1);
    if (key === 'codec') {
      if (patch.codec !== undefined) throw usage('codec is given twice');
      if (value !== CLEAR && !(SETTING_CODECS as readonly string[]).includes(value)) {
        throw usage(`codec '${value}' is not one of ${SETTING_CODECS.join(', ')}, ${CLEAR}`);
      }
      patch.codec = value === CLEAR ? null : value;
    } else if (key === 'sm_budget') {
      if (patch.sm_budget !== undefined) throw usage('sm_budget is given twice');
      if (value === CLEAR) {
        patch.sm_budget = null;
      } else {
        const n = Number(value);
        if (!/^\d+$/.test(value) || n > MAX_SM_BUDGET) throw usage(`sm_budget '${value}' is not an integer from 0 (all SMs) to ${MAX_SM_BUDGET}, or ${CLEAR}`);
        patch.sm_budget = n;
      }
    } else {
      throw usage(`unknown setting '${arg.slice(0, eq)}': the settings are codec and sm_budget`);
    }
  }
  return patch;
}

/** Settings in words. */
function settingsText(s: WireSettings): string {
  const sm = s.sm_budget === null || s.sm_budget === undefined ? 'default' : s.sm_budget === 0 ? '0 (all SMs)' : String(s.sm_budget);
  return `codec ${s.codec ?? 'default'}, sm_budget ${sm}`;
}

interface SetOptions extends GlobalOptions {
  socket?: string;
}

/** Adds the `set` command to `program`. */
export function registerSet(program: Command): void {
  program
    .command('set')
    .description('change a job\'s settings (or, without JOB, the daemon\'s) in the running daemon, from its next request: codec=fast|max|auto|off, sm_budget=N (0: all SMs); "default" clears one')
    .argument('<setting...>', '[JOB] codec=VALUE and/or sm_budget=N')
    .addOption(socketOption())
    .addHelpText('after', '\nExamples:\n  tzip set train-7b codec=off      # its requests get raw frames (its integrations then send plain data)\n  tzip set train-7b sm_budget=16   # its GPU kernels use at most 16 SMs\n  tzip set sm_budget=8             # the daemon\'s budget for requests that name none\n  tzip set train-7b codec=default  # back to the daemon\'s codec')
    .action(async (args: string[], _opts: unknown, cmd: Command) => {
      const opts = cmd.optsWithGlobals<SetOptions>();
      const patch = parseSetArgs(args);
      const client = DaemonClient.open({ socket: opts.socket });
      try {
        const reply = await client.request({ op: 'set', ...patch });
        const job = typeof reply.job === 'string' ? reply.job : null;
        const settings = (reply.settings ?? { codec: null, sm_budget: null }) as WireSettings;
        printResult(opts.json, { job, settings }, () => `${job === null ? 'daemon' : `job ${JSON.stringify(job)}`}: ${settingsText(settings)} (from the next request)`);
      } finally {
        client.close();
      }
    });
}
