/**
 * The configuration of `tzip serve`: every setting ("key") with its flag, environment variable,
 * config-file key and default, and how the value in effect is found (docs/configuration.md).
 *
 * Order of precedence, highest first: a flag (`--sm-budget 4`), the environment
 * (`TZIP_SM_BUDGET=4`), the config file (`{"sm_budget": 4}`), the default. The config file is
 * `--config PATH`, else `$TZIP_CONFIG`, else `$XDG_CONFIG_HOME/tzip/config.json` (when
 * XDG_CONFIG_HOME is an absolute path), else `~/.config/tzip/config.json`; a file named by
 * `--config` or TZIP_CONFIG must exist, the default one may be missing. The file is one JSON
 * object of the keys below; an unknown key or a value of the wrong kind is an error (zod), so a
 * typo never passes silently. An empty environment variable counts as unset.
 *
 * Flags and environment variables are strings, parsed by the key's kind (numbers, booleans
 * `1/0/true/false/yes/no/on/off`), then checked by the same zod schema as the file's values.
 * zod is loaded when a configuration is resolved, not when this module is: registering the
 * `serve` command (and every other command's start-up) does not pay for it.
 */
import { closeSync, lstatSync, openSync, readlinkSync, readSync, statSync } from 'node:fs';
import { homedir } from 'node:os';
import { dirname, isAbsolute, join, resolve } from 'node:path';
import type { z as Zod } from 'zod';
import { TzipError } from './errors.js';
import { SM_BUDGET_DEFAULT, SM_BUDGET_MAX } from './generated/constants.js';
import { defaultLimits, MIN_MAX_MESSAGE_BYTES, SESSION_LIMITS } from './daemon/limits.js';
import { defaultSocketPath } from './daemon/paths.js';
import { LOG_FORMATS, LOG_LEVELS, type LogFormat, type LogLevel } from './logger.js';

/** The settings of `tzip serve`, by config-file key. `null`: off / not set (see each key). */
export interface ServeConfig {
  socket: string;
  tcp_port: number | null;
  metrics_port: number | null;
  sm_budget: number;
  log_level: LogLevel;
  log_format: LogFormat;
  verbose: boolean;
  lease_ms: number;
  max_message_bytes: number;
  max_batch: number;
  max_regions: number;
  max_ipc_handles: number;
  max_inflight_bytes: number;
  threads: number | null;
  idle_exit_s: number;
}

/** A config key. */
export type ConfigKey = keyof ServeConfig;

/** How a flag's or environment variable's text becomes a value before the schema checks it. */
type Kind = 'string' | 'number' | 'boolean' | 'enum';

/** One key: where it is set, what it accepts, its default. */
export interface KeySpec<T> {
  /** The `tzip serve` flag (`--sm-budget`); its commander attribute is the camelCase name. */
  flag: string;
  /** The flag's argument placeholder (`<n>`); none for a boolean flag. */
  arg?: string;
  /** The environment variable: `TZIP_` and the key in capitals. */
  env: string;
  kind: Kind;
  /** What a valid value is, for messages ("an integer from 0 to 1024"). */
  expect: string;
  /** What the key does (the flag's help text and docs/configuration.md). */
  what: string;
  /** The zod schema of a value, built from zod when first needed. */
  schema: (z: typeof Zod) => Zod.ZodType<T>;
  /** The default value (`env`: the environment the configuration is resolved in). */
  default: (env: NodeJS.ProcessEnv) => T;
  /** How the default reads in help and `--print-config` when the value alone says too little. */
  defaultText?: string;
}

const port = (z: typeof Zod) => z.number().int().min(0).max(65535);
const positive = (z: typeof Zod) => z.number().int().min(1).max(Number.MAX_SAFE_INTEGER);
/** Codec worker threads the addon takes at most (src/native.ts: more fails every request). */
const MAX_THREADS = 1024;
/**
 * Longest lease, ms: 2^31 - 1, what a Node timer holds. Clients sleep a third of it between heartbeats; a longer one
 * overflows their timers (Python's threading waits raise OverflowError past about 9.2e9 s).
 */
const MAX_LEASE_MS = 2 ** 31 - 1;
const limits = defaultLimits();

/** The default socket path with the environment's TZIP_SOCKET left out (that variable is the key's own). */
function defaultSocket(env: NodeJS.ProcessEnv): string {
  return defaultSocketPath({ ...env, TZIP_SOCKET: undefined });
}

function sessionLimit(name: keyof typeof SESSION_LIMITS, key: string, defaultValue: number): KeySpec<number> {
  const l = SESSION_LIMITS[name];
  return {
    flag: l.flag, arg: '<n>', env: `TZIP_${key.toUpperCase()}`, kind: 'number', expect: 'a positive integer',
    what: `most ${l.what}`, schema: positive, default: () => defaultValue,
  };
}

/**
 * Every key of the configuration, in the order `--print-config` and docs/configuration.md list
 * them. The defaults of the limits are those of src/daemon/limits.ts.
 */
export const CONFIG_KEYS: { readonly [K in ConfigKey]: KeySpec<ServeConfig[K]> } = {
  socket: {
    flag: '--socket', arg: '<path>', env: 'TZIP_SOCKET', kind: 'string', expect: 'a socket path',
    what: 'the socket the daemon listens on (a relative path in the config file is relative to the file\'s folder)',
    schema: (z) => z.string().min(1), default: defaultSocket,
    defaultText: '$XDG_RUNTIME_DIR/tzip/tzip.sock, else /tmp/tzip-$UID/tzip.sock',
  },
  tcp_port: {
    flag: '--tcp', arg: '<port>', env: 'TZIP_TCP_PORT', kind: 'number', expect: 'a TCP port (0-65535; 0 picks a free one)',
    what: 'also listen on tcp://127.0.0.1:PORT, CURVE only: clients need the keys in the socket folder\'s curve/ (0: a free port)',
    schema: (z) => port(z).nullable(), default: () => null, defaultText: 'off',
  },
  metrics_port: {
    flag: '--metrics', arg: '<port>', env: 'TZIP_METRICS_PORT', kind: 'number', expect: 'a TCP port (0-65535; 0 picks a free one)',
    what: 'serve Prometheus metrics on http://127.0.0.1:PORT/metrics (0: a free port, printed when listening)',
    schema: (z) => port(z).nullable(), default: () => null, defaultText: 'off',
  },
  sm_budget: {
    flag: '--sm-budget', arg: '<n>', env: 'TZIP_SM_BUDGET', kind: 'number', expect: `an integer from 0 to ${SM_BUDGET_MAX}`,
    what: 'SMs the GPU kernels of a request use unless the request or its job says otherwise (0: all SMs); `tzip set sm_budget=N` changes it while the daemon runs',
    schema: (z) => z.number().int().min(0).max(SM_BUDGET_MAX), default: () => SM_BUDGET_DEFAULT,
  },
  log_level: {
    flag: '--log-level', arg: '<level>', env: 'TZIP_LOG_LEVEL', kind: 'enum', expect: `one of ${LOG_LEVELS.join(', ')}`,
    what: `lowest level of the messages logged on stderr (${LOG_LEVELS.join(', ')})`,
    schema: (z) => z.enum(LOG_LEVELS), default: () => 'info',
  },
  log_format: {
    flag: '--log-format', arg: '<format>', env: 'TZIP_LOG_FORMAT', kind: 'enum', expect: `one of ${LOG_FORMATS.join(', ')}`,
    what: 'log lines as text (`tzip serve: message key=value`) or JSON (one pino object per line)',
    schema: (z) => z.enum(LOG_FORMATS), default: () => 'text',
  },
  verbose: {
    flag: '--verbose', env: 'TZIP_VERBOSE', kind: 'boolean', expect: 'a boolean (1/0, true/false, yes/no, on/off)',
    what: 'log sessions and connections at level info (else they are debug messages)',
    schema: (z) => z.boolean(), default: () => false,
  },
  lease_ms: {
    flag: '--lease-ms', arg: '<ms>', env: 'TZIP_LEASE_MS', kind: 'number', expect: `an integer from 1 to ${MAX_LEASE_MS} (24.8 days)`,
    what: 'a client silent for this long loses its session, ms (clients are asked for a heartbeat every third of it)',
    schema: (z) => z.number().int().min(1).max(MAX_LEASE_MS), default: () => limits.leaseMs,
  },
  max_message_bytes: {
    flag: '--max-message-bytes', arg: '<bytes>', env: 'TZIP_MAX_MESSAGE_BYTES', kind: 'number',
    expect: `an integer of at least ${MIN_MAX_MESSAGE_BYTES} (64 KiB)`,
    what: `largest request message served, bytes; at least ${MIN_MAX_MESSAGE_BYTES}, which holds the largest hello (17.6 kB) and a request of one tensor: with less, clients could get no reply at all`,
    schema: (z) => z.number().int().min(MIN_MAX_MESSAGE_BYTES).max(Number.MAX_SAFE_INTEGER), default: () => limits.maxMessageBytes,
  },
  max_batch: {
    flag: '--max-batch', arg: '<n>', env: 'TZIP_MAX_BATCH', kind: 'number', expect: 'a positive integer',
    what: 'most tensors per compress/decompress request', schema: positive, default: () => limits.maxBatch,
  },
  max_regions: sessionLimit('maxRegionsPerSession', 'max_regions', limits.maxRegionsPerSession),
  max_ipc_handles: sessionLimit('maxIpcHandlesPerSession', 'max_ipc_handles', limits.maxIpcHandlesPerSession),
  max_inflight_bytes: sessionLimit('maxInflightBytesPerSession', 'max_inflight_bytes', limits.maxInflightBytesPerSession),
  threads: {
    flag: '--threads', arg: '<n>', env: 'TZIP_THREADS', kind: 'number', expect: `an integer from 1 to ${MAX_THREADS}`,
    what: 'codec worker threads', schema: (z) => z.number().int().min(1).max(MAX_THREADS).nullable(), default: () => null, defaultText: 'all cores',
  },
  idle_exit_s: {
    flag: '--idle-exit', arg: '<seconds>', env: 'TZIP_IDLE_EXIT_S', kind: 'number', expect: 'a number of seconds >= 0',
    what: 'exit after this long without any client, seconds (0: never)',
    schema: (z) => z.number().min(0).max(1e9), default: () => 0,
  },
};

/** Every key, in {@link CONFIG_KEYS}' order. */
export const CONFIG_KEY_NAMES = Object.keys(CONFIG_KEYS) as ConfigKey[];

/** The commander attribute of a flag: `--max-ipc-handles` -> `maxIpcHandles`. */
export function flagAttribute(flag: string): string {
  return flag.replace(/^--/, '').replace(/-([a-z])/g, (_m, c: string) => c.toUpperCase());
}

/** Where a value came from. */
export type ValueSource =
  | { from: 'flag'; name: string }
  | { from: 'env'; name: string }
  | { from: 'file'; path: string }
  | { from: 'default' };

/** The config file consulted: its path, why that one, and whether it was there. */
export interface ConfigFile {
  path: string;
  /** `--config`, `TZIP_CONFIG`, or the default location. */
  chosenBy: 'flag' | 'env' | 'default';
  found: boolean;
}

/** The configuration in effect and where each value came from. */
export interface ResolvedConfig {
  values: ServeConfig;
  sources: { [K in ConfigKey]: ValueSource };
  file: ConfigFile;
}

/** What {@link resolveConfig} reads. */
export interface ConfigInputs {
  /** Flag values as typed on the command line, by key (strings; `true` for a boolean flag). */
  flags?: Partial<Record<ConfigKey, string | boolean>>;
  /** `--config PATH`. */
  configPath?: string | undefined;
  /** The environment (default: process.env). */
  env?: NodeJS.ProcessEnv;
}

/** The config file to read: `--config`, else TZIP_CONFIG, else the XDG default. */
export function configFileLocation(configPath: string | undefined, env: NodeJS.ProcessEnv): Omit<ConfigFile, 'found'> {
  if (configPath !== undefined && configPath !== '') return { path: resolve(configPath), chosenBy: 'flag' };
  const fromEnv = env.TZIP_CONFIG;
  if (fromEnv !== undefined && fromEnv !== '') return { path: resolve(fromEnv), chosenBy: 'env' };
  const xdg = env.XDG_CONFIG_HOME;
  const base = xdg !== undefined && xdg !== '' && isAbsolute(xdg) ? xdg : join(env.HOME !== undefined && env.HOME !== '' ? env.HOME : homedir(), '.config');
  return { path: join(base, 'tzip', 'config.json'), chosenBy: 'default' };
}

/** The text of a flag or variable as a value of `kind`, before the schema checks it (NaN and the text itself fail there). */
function fromText(kind: Kind, text: string): unknown {
  const t = text.trim();
  switch (kind) {
    case 'number':
      return /^[+-]?(\d+\.?\d*|\.\d+)(e[+-]?\d+)?$/i.test(t) ? Number(t) : Number.NaN;
    case 'boolean': {
      const l = t.toLowerCase();
      if (['1', 'true', 'yes', 'on'].includes(l)) return true;
      if (['0', 'false', 'no', 'off'].includes(l)) return false;
      return text;
    }
    case 'enum':
      return t;
    default:
      return text;
  }
}

function show(value: unknown): string {
  // String(): JSON.stringify writes Infinity (a file's 1e400) as null.
  return typeof value === 'string' ? `'${value}'` : typeof value === 'number' ? String(value) : JSON.stringify(value);
}

/** Bytes a config file may have at most (a few keys: a larger file is one named by mistake). */
const MAX_CONFIG_BYTES = 1 << 20;

/**
 * The text of `path`, read up to {@link MAX_CONFIG_BYTES}: `--config model.safetensors` (a tab completion away) or
 * `/dev/zero` fails at once instead of reading gigabytes, or forever. Pipes (`--config <(...)`) are read as files.
 * @throws TzipError TZIP_USAGE for a larger file; the fs errors of opening and reading.
 */
function readBounded(path: string): string {
  const fd = openSync(path, 'r');
  try {
    const buf = Buffer.alloc(MAX_CONFIG_BYTES + 1);
    let n = 0;
    for (let got = -1; got !== 0 && n < buf.length;) {
      got = readSync(fd, buf, n, buf.length - n, null);
      n += got;
    }
    if (n > MAX_CONFIG_BYTES) throw new TzipError('TZIP_USAGE', `the config file is over ${MAX_CONFIG_BYTES} bytes: not a config file (one JSON object of a few keys)`, { file: path });
    return buf.toString('utf8', 0, n);
  } finally {
    closeSync(fd);
  }
}

/** Reads and checks the config file; `undefined` when the default one is missing. */
function readConfigFile(file: Omit<ConfigFile, 'found'>, z: typeof Zod): Record<string, unknown> | undefined {
  let text: string;
  try {
    if (statSync(file.path).isDirectory()) throw new TzipError('TZIP_IO', 'the config file is a folder', { file: file.path });
    text = readBounded(file.path);
  } catch (err) {
    if (err instanceof TzipError) throw err;
    const code = (err as NodeJS.ErrnoException).code;
    if (code === 'ENOENT' && file.chosenBy === 'default') {
      // A link to a file moved away is a config the user meant to have: said, not replaced by the defaults in silence.
      if (lstatSync(file.path, { throwIfNoEntry: false })?.isSymbolicLink() === true) {
        throw new TzipError('TZIP_IO', `the config file is a symbolic link to ${JSON.stringify(readlinkSync(file.path))}, which does not exist`, { file: file.path, cause: err });
      }
      return undefined;
    }
    const by = file.chosenBy === 'flag' ? ' (named by --config)' : file.chosenBy === 'env' ? ' (named by TZIP_CONFIG)' : '';
    throw new TzipError('TZIP_IO', `cannot read the config file${by}: ${(err as Error).message}`, { file: file.path, cause: err });
  }
  let json: unknown;
  try {
    // A byte-order mark (some editors save UTF-8 with one) is not part of the JSON text.
    json = JSON.parse(text.startsWith('\ufeff') ? text.slice(1) : text);
  } catch (err) {
    throw new TzipError('TZIP_USAGE', `the config file is not JSON: ${(err as Error).message}`, { file: file.path });
  }
  if (typeof json !== 'object' || json === null || Array.isArray(json)) {
    throw new TzipError('TZIP_USAGE', 'the config file must hold one JSON object of settings, e.g. {"sm_budget": 8}', { file: file.path });
  }
  const raw = json as Record<string, unknown>;
  const shape: Record<string, Zod.ZodType> = {};
  for (const key of CONFIG_KEY_NAMES) shape[key] = CONFIG_KEYS[key].schema(z).optional();
  const checked = z.strictObject(shape).safeParse(raw);
  if (!checked.success) {
    const problems = checked.error.issues.map((issue) => {
      if (issue.code === 'unrecognized_keys') {
        return `unknown key${issue.keys.length > 1 ? 's' : ''} ${issue.keys.map((k) => `'${k}'`).join(', ')} (the keys are ${CONFIG_KEY_NAMES.join(', ')})`;
      }
      const key = String(issue.path[0]) as ConfigKey;
      const spec = CONFIG_KEYS[key] as KeySpec<unknown> | undefined;
      return spec !== undefined ? `${key}: ${show(raw[key])} is not ${spec.expect}` : `${issue.path.join('.')}: ${issue.message}`;
    });
    throw new TzipError('TZIP_USAGE', `invalid config file: ${problems.join('; ')}`, { file: file.path });
  }
  return checked.data as Record<string, unknown>;
}

/**
 * The configuration in effect: each key from its flag, else its environment variable, else the
 * config file, else its default.
 * @throws TzipError TZIP_USAGE for an invalid value (naming the flag, variable or file and key),
 *   a config file that is not a JSON object, or an unknown key in it; TZIP_IO when a config
 *   file named by `--config` or TZIP_CONFIG (or an existing default one) cannot be read.
 */
export async function resolveConfig(inputs: ConfigInputs = {}): Promise<ResolvedConfig> {
  const { z } = await import('zod');
  const env = inputs.env ?? process.env;
  const flags = inputs.flags ?? {};
  const location = configFileLocation(inputs.configPath, env);
  const fileValues = readConfigFile(location, z);
  const values: Record<string, unknown> = {};
  const sources: Record<string, ValueSource> = {};
  for (const key of CONFIG_KEY_NAMES) {
    const spec = CONFIG_KEYS[key] as KeySpec<unknown>;
    const flag = flags[key];
    const envText = env[spec.env];
    let value: unknown;
    let source: ValueSource;
    let label: string;
    if (flag !== undefined) {
      value = typeof flag === 'boolean' ? flag : fromText(spec.kind, flag);
      source = { from: 'flag', name: spec.flag };
      label = spec.flag;
    } else if (envText !== undefined && envText !== '') {
      value = fromText(spec.kind, envText);
      source = { from: 'env', name: spec.env };
      label = spec.env;
    } else if (fileValues !== undefined && fileValues[key] !== undefined) {
      value = fileValues[key];
      if (key === 'socket' && typeof value === 'string' && !value.includes('://')) value = resolve(dirname(location.path), value);
      values[key] = value;
      sources[key] = { from: 'file', path: location.path };
      continue; // checked with the file
    } else {
      values[key] = spec.default(env);
      sources[key] = { from: 'default' };
      continue;
    }
    const checked = spec.schema(z).safeParse(value);
    if (!checked.success) {
      const given = typeof flag === 'boolean' ? String(flag) : (flag ?? envText ?? '');
      throw new TzipError('TZIP_USAGE', `${label}: '${given}' is not ${spec.expect}`);
    }
    values[key] = checked.data;
    sources[key] = source;
  }
  return {
    values: values as unknown as ServeConfig,
    sources: sources as ResolvedConfig['sources'],
    file: { ...location, found: fileValues !== undefined },
  };
}

/** A source as `--print-config` writes it: `flag --sm-budget`, `env TZIP_SM_BUDGET`, `file PATH`, `default`. */
export function sourceText(source: ValueSource): string {
  switch (source.from) {
    case 'flag':
      return `flag ${source.name}`;
    case 'env':
      return `env ${source.name}`;
    case 'file':
      return `file ${source.path}`;
    default:
      return 'default';
  }
}

function valueText(key: ConfigKey, value: unknown): string {
  if (value === null) return (CONFIG_KEYS[key] as KeySpec<unknown>).defaultText ?? 'null';
  return typeof value === 'string' ? value : JSON.stringify(value);
}

/** `tzip serve --print-config` as text: the file consulted, the precedence, then one line per key (value, source). */
export function formatConfigText(config: ResolvedConfig): string {
  const f = config.file;
  const by = f.chosenBy === 'flag' ? '--config' : f.chosenBy === 'env' ? 'TZIP_CONFIG' : 'default location';
  const lines = [
    `config file: ${f.path} (${by}${f.found ? '' : ', not found'})`,
    'precedence: flags > environment > config file > defaults',
    '',
  ];
  const width = Math.max(...CONFIG_KEY_NAMES.map((k) => k.length));
  const rows = CONFIG_KEY_NAMES.map((k) => [k, valueText(k, config.values[k]), sourceText(config.sources[k])] as const);
  const valueWidth = Math.max(...rows.map((r) => r[1].length));
  for (const [k, v, s] of rows) lines.push(`${k.padEnd(width)}  ${v.padEnd(valueWidth)}  ${s}`);
  return `${lines.join('\n')}\n`;
}

/** `tzip serve --print-config --json`: `{config_file: {path, chosen_by, found}, precedence, values: {KEY: {value, source, ...}}}`. */
export function configJson(config: ResolvedConfig): object {
  const values: Record<string, unknown> = {};
  for (const key of CONFIG_KEY_NAMES) {
    const s = config.sources[key];
    const spec = CONFIG_KEYS[key] as KeySpec<unknown>;
    values[key] = { value: config.values[key], source: s.from, ...(s.from === 'flag' ? { flag: s.name } : {}),
      ...(s.from === 'env' ? { env: s.name } : {}), ...(s.from === 'file' ? { file: s.path } : {}), flag_name: spec.flag, env_name: spec.env };
  }
  return {
    config_file: { path: config.file.path, chosen_by: config.file.chosenBy, found: config.file.found },
    precedence: ['flag', 'env', 'file', 'default'],
    values,
  };
}
