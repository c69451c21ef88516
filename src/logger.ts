/**
 * The daemon's log: leveled messages with structured fields, written as JSON lines by pino
 * (`--log-format json`, one object per line with `level`, `time`, `msg` and the fields) or as
 * the plain text lines tzip has always written (`tzip serve: message key=value ...`).
 *
 * Levels, lowest first: debug, info, warn, error; `silent` writes nothing. A message is written
 * when its level is at or above the logger's.
 */
import { writeSync } from 'node:fs';
import { createRequire } from 'node:module';
import type { pino as Pino } from 'pino';
import { printable } from './printable.js';

// pino is loaded by the first JSON logger, not by importing this module: the CLI's commands that never
// log JSON (and their start-up time) do not pay for it.
const require = createRequire(import.meta.url);

/** Log levels, lowest first, and `silent`. */
export const LOG_LEVELS = ['debug', 'info', 'warn', 'error', 'silent'] as const;
export type LogLevel = (typeof LOG_LEVELS)[number];
/** Output formats: pino's JSON lines, or text lines. */
export const LOG_FORMATS = ['text', 'json'] as const;
export type LogFormat = (typeof LOG_FORMATS)[number];

/** Structured fields of a message (JSON-serializable values). */
export type LogFields = Record<string, unknown>;

/** What the daemon logs through. */
export interface Logger {
  debug(msg: string, fields?: LogFields): void;
  info(msg: string, fields?: LogFields): void;
  warn(msg: string, fields?: LogFields): void;
  error(msg: string, fields?: LogFields): void;
}

const RANK: Record<LogLevel, number> = { debug: 0, info: 1, warn: 2, error: 3, silent: 4 };

/** `key=value` pairs of the fields, values as JSON where they are not plain words. */
function textFields(fields: LogFields | undefined): string {
  if (fields === undefined) return '';
  let out = '';
  for (const [k, v] of Object.entries(fields)) {
    if (v === undefined) continue;
    const s = typeof v === 'string' && /^[\w./:@+-]+$/.test(v) ? v : JSON.stringify(v);
    out += ` ${k}=${s}`;
  }
  return out;
}

/**
 * A logger that writes text lines through `write` (one call per line, no newline): `message`
 * and then the fields as `key=value`; warnings and errors are prefixed with their level.
 */
export function textLogger(write: (line: string) => void, level: LogLevel = 'info'): Logger {
  const at = (l: Exclude<LogLevel, 'silent'>) => (msg: string, fields?: LogFields) => {
    if (RANK[l] < RANK[level]) return;
    write(`${l === 'warn' || l === 'error' ? `${l}: ` : ''}${printable(msg)}${textFields(fields)}`);
  };
  return { debug: at('debug'), info: at('info'), warn: at('warn'), error: at('error') };
}

/** How to make a {@link Logger}. */
export interface LoggerOptions {
  level?: LogLevel | undefined;
  format?: LogFormat | undefined;
  /** Name put in every JSON line (`name`) and before every text line (`name: `). */
  name?: string | undefined;
  /** File descriptor written to (default 2, stderr). */
  fd?: number | undefined;
}

/**
 * The logger `tzip serve` uses: JSON lines through pino (synchronous writes, so a line is out
 * before the process exits), or text lines `name: message key=value`.
 */
export function createLogger(options: LoggerOptions = {}): Logger {
  const level = options.level ?? 'info';
  const fd = options.fd ?? 2;
  const name = options.name ?? 'tzip serve';
  if ((options.format ?? 'text') === 'text') {
    return textLogger((line) => {
      try {
        writeSync(fd, `${name}: ${line}\n`);
      } catch {
        // The log's reader went away (EPIPE: `tzip serve 2>&1 | head`, a log collector restarting): the line is
        // lost, the daemon serves on. A throw here would end the daemon (it logs from its receive loop).
      }
    }, level);
  }
  // Levels as words ("level":"info"), not pino's numbers: what log tools and people read.
  const { pino } = require('pino') as { pino: typeof Pino };
  const p = pino({ name, level, base: { pid: process.pid }, formatters: { level: (label) => ({ level: label }) } },
    pino.destination({ fd, sync: true }));
  const at = (l: Exclude<LogLevel, 'silent'>) => (msg: string, fields?: LogFields) => {
    if (fields === undefined) p[l](msg);
    else p[l](fields, msg);
  };
  return { debug: at('debug'), info: at('info'), warn: at('warn'), error: at('error') };
}
