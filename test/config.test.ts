// The configuration of `tzip serve` (src/config.ts, docs/configuration.md): flags > environment > config file >
// defaults, for every key; the config file's location (--config, TZIP_CONFIG, XDG_CONFIG_HOME, ~/.config); errors for
// unknown keys, wrong values and unreadable files; `tzip serve --print-config` (text and --json) as a real process; the
// daemon's logs at the configured level and format. Real files in a temp folder, real environments.
import { execFile, spawn } from 'node:child_process';
import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { beforeAll, describe, expect, it } from 'vitest';
import { CONFIG_KEY_NAMES, CONFIG_KEYS, resolveConfig, type ConfigKey } from '../src/config.js';
import { defaultLimits, MIN_MAX_MESSAGE_BYTES } from '../src/daemon/limits.js';
import { parseRequest } from '../src/daemon/parse-request.js';
import { encodeMessage } from '../src/daemon/wire.js';
import { TzipError } from '../src/errors.js';
import { ensureBuilt } from './helpers/cli.js';
import { useTempDir } from './helpers/temp-dir.js';

const MAIN = fileURLToPath(new URL('../dist/src/cli/main.js', import.meta.url));
const DOC = fileURLToPath(new URL('../docs/configuration.md', import.meta.url));
const tmp = useTempDir('config');

/** A valid value of each key other than its default: as text (flag, env) and as the file's JSON value. */
const SAMPLES: Record<ConfigKey, { text: string; value: unknown }> = {
  socket: { text: '/tmp/tzip-config-test/x.sock', value: '/tmp/tzip-config-test/x.sock' },
  tcp_port: { text: '5555', value: 5555 },
  metrics_port: { text: '9464', value: 9464 },
  sm_budget: { text: '4', value: 4 },
  log_level: { text: 'debug', value: 'debug' },
  log_format: { text: 'json', value: 'json' },
  verbose: { text: 'true', value: true },
  lease_ms: { text: '2500', value: 2500 },
  max_message_bytes: { text: '2097152', value: 2097152 },
  max_batch: { text: '17', value: 17 },
  max_regions: { text: '33', value: 33 },
  max_ipc_handles: { text: '44', value: 44 },
  max_inflight_bytes: { text: '123456789', value: 123456789 },
  threads: { text: '3', value: 3 },
  idle_exit_s: { text: '1.5', value: 1.5 },
};
/** A second valid value of each key, different from the sample and the default. */
const OTHER: Record<ConfigKey, unknown> = {
  socket: '/tmp/tzip-config-test/y.sock', tcp_port: 6666, metrics_port: 9465, sm_budget: 0, log_level: 'warn', log_format: 'text',
  verbose: false, lease_ms: 3000, max_message_bytes: 65536, max_batch: 2, max_regions: 3, max_ipc_handles: 4,
  max_inflight_bytes: 5, threads: 1, idle_exit_s: 0.25,
};

/** An environment with no tzip variable and config folders of its own (the developer's real config stays out); `undefined` in
 * `extra` unsets a variable. */
function cleanEnv(extra: NodeJS.ProcessEnv = {}): NodeJS.ProcessEnv {
  const env: NodeJS.ProcessEnv = {};
  for (const [k, v] of Object.entries(process.env)) if (!k.startsWith('TZIP_') && k !== 'XDG_CONFIG_HOME') env[k] = v;
  env.HOME = join(tmp(), 'home');
  env.XDG_CONFIG_HOME = join(tmp(), 'no-config'); // an empty folder: no default config file
  return { ...env, ...extra };
}

function writeConfig(name: string, content: unknown): string {
  const path = join(tmp(), name);
  mkdirSync(join(path, '..'), { recursive: true });
  writeFileSync(path, typeof content === 'string' ? content : JSON.stringify(content));
  return path;
}

async function usageError(p: Promise<unknown>): Promise<TzipError> {
  const err = await p.then(() => undefined, (e: unknown) => e);
  expect(err).toBeInstanceOf(TzipError);
  return err as TzipError;
}

describe('resolveConfig', () => {
  it('gives the defaults (those of limits.ts) with no flag, variable or file', async () => {
    const xdg = join(tmp(), 'xdg-empty');
    const c = await resolveConfig({ env: cleanEnv({ XDG_CONFIG_HOME: xdg, XDG_RUNTIME_DIR: '/run/user/4242' }) });
    expect(c.file).toEqual({ path: join(xdg, 'tzip', 'config.json'), chosenBy: 'default', found: false });
    const d = defaultLimits();
    expect(c.values).toEqual({
      socket: '/run/user/4242/tzip/tzip.sock', tcp_port: null, metrics_port: null, sm_budget: 10, log_level: 'info',
      log_format: 'text', verbose: false, lease_ms: d.leaseMs, max_message_bytes: d.maxMessageBytes, max_batch: d.maxBatch,
      max_regions: d.maxRegionsPerSession, max_ipc_handles: d.maxIpcHandlesPerSession,
      max_inflight_bytes: d.maxInflightBytesPerSession, threads: null, idle_exit_s: 0,
    });
    for (const key of CONFIG_KEY_NAMES) expect(c.sources[key]).toEqual({ from: 'default' });
  });

  it('takes every key from its flag over its variable over the file over the default', async () => {
    // The file sets every key to OTHER; the variable and the flag to SAMPLES; each layer is peeled off in turn.
    const file = writeConfig('every/config.json', OTHER);
    const envAll: NodeJS.ProcessEnv = {};
    const flagsAll: Partial<Record<ConfigKey, string | boolean>> = {};
    for (const key of CONFIG_KEY_NAMES) {
      envAll[CONFIG_KEYS[key].env] = SAMPLES[key].text;
      flagsAll[key] = key === 'verbose' ? true : SAMPLES[key].text;
    }
    const fromFlags = await resolveConfig({ configPath: file, env: cleanEnv({ ...envAll, TZIP_VERBOSE: 'no' }), flags: flagsAll });
    const fromEnv = await resolveConfig({ configPath: file, env: cleanEnv(envAll) });
    const fromFile = await resolveConfig({ configPath: file, env: cleanEnv() });
    for (const key of CONFIG_KEY_NAMES) {
      expect(fromFlags.values[key], key).toEqual(SAMPLES[key].value);
      expect(fromFlags.sources[key], key).toEqual({ from: 'flag', name: CONFIG_KEYS[key].flag });
      expect(fromEnv.values[key], key).toEqual(SAMPLES[key].value);
      expect(fromEnv.sources[key], key).toEqual({ from: 'env', name: CONFIG_KEYS[key].env });
      expect(fromFile.values[key], key).toEqual(OTHER[key]);
      expect(fromFile.sources[key], key).toEqual({ from: 'file', path: file });
    }
    // One key from each layer at once.
    const mixed = await resolveConfig({ configPath: writeConfig('mixed.json', { sm_budget: 4, lease_ms: 1234, max_batch: 9 }),
      env: cleanEnv({ TZIP_SM_BUDGET: '6', TZIP_LEASE_MS: '4321' }), flags: { sm_budget: '8' } });
    expect([mixed.values.sm_budget, mixed.values.lease_ms, mixed.values.max_batch, mixed.values.max_regions])
      .toEqual([8, 4321, 9, defaultLimits().maxRegionsPerSession]);
    expect([mixed.sources.sm_budget.from, mixed.sources.lease_ms.from, mixed.sources.max_batch.from, mixed.sources.max_regions.from])
      .toEqual(['flag', 'env', 'file', 'default']);
  });

  it('finds the file through --config, then TZIP_CONFIG, then XDG_CONFIG_HOME, then ~/.config', async () => {
    const byFlag = writeConfig('by-flag.json', { sm_budget: 1 });
    const byEnv = writeConfig('by-env.json', { sm_budget: 2 });
    const xdg = join(tmp(), 'xdg');
    writeConfig('xdg/tzip/config.json', { sm_budget: 3 });
    writeConfig('home/.config/tzip/config.json', { sm_budget: 5 });
    const flag = await resolveConfig({ configPath: byFlag, env: cleanEnv({ TZIP_CONFIG: byEnv, XDG_CONFIG_HOME: xdg }) });
    expect([flag.values.sm_budget, flag.file.chosenBy, flag.file.found]).toEqual([1, 'flag', true]);
    const env = await resolveConfig({ env: cleanEnv({ TZIP_CONFIG: byEnv, XDG_CONFIG_HOME: xdg }) });
    expect([env.values.sm_budget, env.file.chosenBy, env.file.path]).toEqual([2, 'env', byEnv]);
    const xdgFile = await resolveConfig({ env: cleanEnv({ XDG_CONFIG_HOME: xdg }) });
    expect([xdgFile.values.sm_budget, xdgFile.file.chosenBy, xdgFile.file.path]).toEqual([3, 'default', join(xdg, 'tzip', 'config.json')]);
    // A relative XDG_CONFIG_HOME is ignored (the XDG spec), as an unset one: ~/.config.
    for (const value of [undefined, 'relative/dir']) {
      const home = await resolveConfig({ env: cleanEnv({ XDG_CONFIG_HOME: value }) });
      expect([home.values.sm_budget, home.file.path]).toEqual([5, join(tmp(), 'home', '.config', 'tzip', 'config.json')]);
    }
  });

  it('refuses a missing file named by --config or TZIP_CONFIG (TZIP_IO), not a missing default one', async () => {
    const missing = join(tmp(), 'nope', 'config.json');
    const a = await usageError(resolveConfig({ configPath: missing, env: cleanEnv() }));
    expect([a.code, a.file]).toEqual(['TZIP_IO', missing]);
    expect(a.message).toContain('named by --config');
    const b = await usageError(resolveConfig({ env: cleanEnv({ TZIP_CONFIG: missing }) }));
    expect(b.code).toBe('TZIP_IO');
    expect(b.message).toContain('named by TZIP_CONFIG');
    const folder = await usageError(resolveConfig({ configPath: tmp(), env: cleanEnv() }));
    expect(folder.message).toContain('is a folder');
  });

  it('refuses unknown keys, values of the wrong kind and files that are not one JSON object (TZIP_USAGE)', async () => {
    const cases: [unknown, RegExp][] = [
      [{ sm_budget: 4, sm_budgets: 5 }, /unknown key 'sm_budgets' \(the keys are socket, .*sm_budget/],
      [{ smBudget: 4, Socket: 'x' }, /unknown keys 'smBudget', 'Socket'/],
      [{ sm_budget: 2000 }, /sm_budget: 2000 is not an integer from 0 to 1024/],
      [{ sm_budget: '4' }, /sm_budget: '4' is not an integer from 0 to 1024/],
      [{ lease_ms: 0 }, /lease_ms: 0 is not an integer from 1 to 2147483647/],
      [{ lease_ms: 1.5 }, /lease_ms: 1.5 is not an integer from 1 to 2147483647/],
      [{ metrics_port: 70000 }, /metrics_port: 70000 is not a TCP port/],
      [{ log_level: 'verbose' }, /log_level: 'verbose' is not one of debug, info, warn, error, silent/],
      [{ verbose: 1 }, /verbose: 1 is not a boolean/],
      [{ idle_exit_s: -1 }, /idle_exit_s: -1 is not a number of seconds >= 0/],
      ['{"sm_budget": 4,}', /not JSON/],
      ['[1, 2]', /one JSON object/],
      ['null', /one JSON object/],
    ];
    for (const [content, message] of cases) {
      const path = writeConfig('bad.json', content);
      const err = await usageError(resolveConfig({ configPath: path, env: cleanEnv() }));
      expect(err.code, JSON.stringify(content)).toBe('TZIP_USAGE');
      expect(err.file).toBe(path);
      expect(err.message, JSON.stringify(content)).toMatch(message);
    }
  });

  it('refuses bad flag and variable values, naming the flag or variable; an empty variable is unset', async () => {
    const flag = await usageError(resolveConfig({ env: cleanEnv(), flags: { sm_budget: '2000' } }));
    expect(flag.message).toBe("--sm-budget: '2000' is not an integer from 0 to 1024");
    const env = await usageError(resolveConfig({ env: cleanEnv({ TZIP_LEASE_MS: '10s' }) }));
    expect(env.message).toBe("TZIP_LEASE_MS: '10s' is not an integer from 1 to 2147483647 (24.8 days)");
    const bool = await usageError(resolveConfig({ env: cleanEnv({ TZIP_VERBOSE: 'maybe' }) }));
    expect(bool.message).toMatch(/^TZIP_VERBOSE: 'maybe' is not a boolean/);
    const level = await usageError(resolveConfig({ env: cleanEnv({ TZIP_LOG_FORMAT: 'yaml' }) }));
    expect(level.message).toBe("TZIP_LOG_FORMAT: 'yaml' is not one of text, json");
    expect((await resolveConfig({ env: cleanEnv({ TZIP_SM_BUDGET: '' }) })).sources.sm_budget).toEqual({ from: 'default' });
    for (const [text, value] of [['1', true], ['YES', true], ['on', true], ['0', false], ['False', false], ['off', false]] as const) {
      expect((await resolveConfig({ env: cleanEnv({ TZIP_VERBOSE: text }) })).values.verbose, text).toBe(value);
    }
  });

  it('refuses a max_message_bytes below 64 KiB (flag, variable, file): the largest hello, job and one-tensor request must fit', async () => {
    expect(MIN_MAX_MESSAGE_BYTES).toBe(65536);
    const flag = await usageError(resolveConfig({ env: cleanEnv(), flags: { max_message_bytes: '1' } }));
    expect(flag.message).toBe("--max-message-bytes: '1' is not an integer of at least 65536 (64 KiB)");
    const env = await usageError(resolveConfig({ env: cleanEnv({ TZIP_MAX_MESSAGE_BYTES: '65535' }) }));
    expect(env.message).toBe("TZIP_MAX_MESSAGE_BYTES: '65535' is not an integer of at least 65536 (64 KiB)");
    const file = await usageError(resolveConfig({ configPath: writeConfig('tiny.json', { max_message_bytes: 1000 }), env: cleanEnv() }));
    expect(file.message).toMatch(/max_message_bytes: 1000 is not an integer of at least 65536/);
    expect((await resolveConfig({ env: cleanEnv(), flags: { max_message_bytes: '65536' } })).values.max_message_bytes).toBe(65536);
    expect(CONFIG_KEYS.max_message_bytes.what).toContain('at least 65536');

    // The bound's reason, checked: the largest messages the schemas admit (every string at its longest, in 3-byte
    // UTF-8 characters) are served at the bound.
    const wide = (n: number) => '\u20ac'.repeat(n);
    const job = { name: wide(200), user: wide(200), rank: 2 ** 31 - 1, world_size: 2 ** 31 - 1, devices: Array.from({ length: 64 }, () => wide(80)), mps: true };
    const hello = { id: Number.MAX_SAFE_INTEGER, op: 'hello', versions: Array.from({ length: 32 }, () => 65535), pid: 2 ** 31 - 1,
      shm_prefix: `tzip-1234567890-${'f'.repeat(32)}-`, name: wide(200), job };
    const sid = 'a'.repeat(32);
    const cuda = (size: number) => ({ kind: 'cuda_ipc', device_uuid: wide(80), device_index: 65535, handle: Uint8Array.from([1, 0x65, ...Array(4094).fill(7)]),
      offset: Number.MAX_SAFE_INTEGER, size, ref_counter_handle: Buffer.from(`/${'t'.repeat(254)}`), ref_counter_offset: Number.MAX_SAFE_INTEGER });
    const tensor = { device: { type: 2, id: 65535 }, dtype: { code: 4, bits: 16, lanes: 1 }, shape: Array.from({ length: 64 }, () => 1),
      strides: Array.from({ length: 64 }, () => Number.MAX_SAFE_INTEGER), byte_offset: Number.MAX_SAFE_INTEGER, data: cuda(2) };
    const compress = { id: Number.MAX_SAFE_INTEGER, op: 'compress', sid, codec: 'auto', stream: 'checkpoint', sm_budget: 1024, threads: 1024, chunk_size: 65536,
      wait_event: new Uint8Array(64), tensors: [{ tensor, out: cuda(1 << 20), codec: 'auto' }] };
    const jobOp = { id: Number.MAX_SAFE_INTEGER, op: 'job', sid, job, attached: true };
    for (const message of [hello, jobOp, compress]) {
      const bytes = encodeMessage(message);
      expect(bytes.byteLength, message.op).toBeLessThanOrEqual(MIN_MAX_MESSAGE_BYTES);
      expect(bytes.byteLength, message.op).toBeGreaterThan(message.op === 'compress' ? 8000 : 16_000); // the worst case, not a small one
      const parsed = parseRequest(bytes, { maxMessageBytes: MIN_MAX_MESSAGE_BYTES });
      expect(parsed.error?.message, message.op).toBeUndefined();
    }
  });

  it('reads a relative socket path in the file against the file\'s folder, in a flag or variable against the current one', async () => {
    const path = writeConfig('rel/config.json', { socket: 'sub/d.sock' });
    expect((await resolveConfig({ configPath: path, env: cleanEnv() })).values.socket).toBe(join(tmp(), 'rel', 'sub', 'd.sock'));
    expect((await resolveConfig({ configPath: writeConfig('rel/ipc.json', { socket: 'ipc:///abs/e.sock' }), env: cleanEnv() })).values.socket)
      .toBe('ipc:///abs/e.sock');
    expect((await resolveConfig({ configPath: path, env: cleanEnv({ TZIP_SOCKET: 'here.sock' }) })).values.socket).toBe('here.sock');
  });
});

describe('docs/configuration.md', () => {
  it('names every key with its flag, variable and default', () => {
    const doc = readFileSync(DOC, 'utf8');
    expect(doc).toContain('flags > environment > config file > defaults');
    for (const key of CONFIG_KEY_NAMES) {
      const spec = CONFIG_KEYS[key];
      const row = doc.split('\n').find((l) => l.startsWith(`| \`${key}\``));
      expect(row, key).toBeDefined();
      expect(row, key).toContain(`\`${spec.flag}`);
      expect(row, key).toContain(`\`${spec.env}\``);
    }
  });
});

/** Runs `tzip ...args` with `env`; resolves with its exit code and output. */
function tzip(args: string[], env: NodeJS.ProcessEnv): Promise<{ code: number; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    execFile(process.execPath, [MAIN, ...args], { env, timeout: 30_000 }, (error, stdout, stderr) => {
      resolve({ code: error === null ? 0 : typeof error.code === 'number' ? error.code : -1, stdout, stderr });
    });
  });
}

describe('tzip serve', () => {
  beforeAll(() => ensureBuilt());

  it('--print-config shows each value and where it came from, then exits (text and --json)', async () => {
    const file = writeConfig('print/config.json', { sm_budget: 4, max_batch: 9, log_format: 'json' });
    const env = cleanEnv({ XDG_CONFIG_HOME: join(tmp(), 'print-xdg'), TZIP_CONFIG: file, TZIP_SM_BUDGET: '6', TZIP_METRICS_PORT: '9999' });
    const text = await tzip(['serve', '--print-config', '--sm-budget', '8', '--lease-ms', '700'], env);
    expect(text.code, text.stderr).toBe(0);
    const lines = text.stdout.split('\n');
    expect(lines[0]).toBe(`config file: ${file} (TZIP_CONFIG)`);
    expect(lines[1]).toBe('precedence: flags > environment > config file > defaults');
    const row = (key: string) => (lines.find((l) => l.startsWith(`${key} `)) ?? '').split(/\s{2,}/);
    expect(row('sm_budget')).toEqual(['sm_budget', '8', 'flag --sm-budget']);
    expect(row('lease_ms')).toEqual(['lease_ms', '700', 'flag --lease-ms']);
    expect(row('metrics_port')).toEqual(['metrics_port', '9999', 'env TZIP_METRICS_PORT']);
    expect(row('max_batch')).toEqual(['max_batch', '9', `file ${file}`]);
    expect(row('log_format')).toEqual(['log_format', 'json', `file ${file}`]);
    expect(row('tcp_port')).toEqual(['tcp_port', 'off', 'default']);
    expect(row('threads')).toEqual(['threads', 'all cores', 'default']);
    expect(lines.filter((l) => /^[a-z_]+ {2,}/.test(l))).toHaveLength(CONFIG_KEY_NAMES.length);

    const json = await tzip(['serve', '--print-config', '--json', '--verbose'], env);
    expect(json.code, json.stderr).toBe(0);
    const doc = JSON.parse(json.stdout);
    expect(doc.config_file).toEqual({ path: file, chosen_by: 'env', found: true });
    expect(doc.precedence).toEqual(['flag', 'env', 'file', 'default']);
    expect(Object.keys(doc.values)).toEqual(CONFIG_KEY_NAMES);
    expect(doc.values.sm_budget).toMatchObject({ value: 6, source: 'env', env: 'TZIP_SM_BUDGET' });
    expect(doc.values.verbose).toMatchObject({ value: true, source: 'flag', flag: '--verbose' });
    expect(doc.values.max_batch).toMatchObject({ value: 9, source: 'file', file });
    expect(doc.values.lease_ms).toMatchObject({ value: defaultLimits().leaseMs, source: 'default' });
  });

  it('exits 1 with the reason on a bad value or config file, before serving', async () => {
    const sock = join(tmp(), 'never', 'tzip.sock');
    const env = cleanEnv({ XDG_CONFIG_HOME: join(tmp(), 'bad-xdg') });
    const flag = await tzip(['serve', '--socket', sock, '--sm-budget', '2000'], env);
    expect(flag.code).toBe(1);
    expect(flag.stderr).toContain("--sm-budget: '2000' is not an integer from 0 to 1024");
    // A message cap too small for a hello: no client could ever be answered.
    const tiny = await tzip(['serve', '--socket', sock, '--max-message-bytes', '1'], env);
    expect(tiny.code).toBe(1);
    expect(tiny.stderr).toContain("--max-message-bytes: '1' is not an integer of at least 65536 (64 KiB)");
    expect(existsSync(sock)).toBe(false);
    const bad = writeConfig('bad-xdg/tzip/config.json', { sm_budget: 4, colour: 'blue' });
    const file = await tzip(['serve', '--socket', sock], env);
    expect(file.code).toBe(1);
    expect(file.stderr).toContain(`${bad}: invalid config file: unknown key 'colour'`);
    const missing = await tzip(['serve', '--socket', sock, '--config', join(tmp(), 'missing.json')], env);
    expect(missing.code).toBe(3);
    expect(missing.stderr).toContain('cannot read the config file (named by --config)');
    // A socket that is not one the daemon can listen on, named by where it came from.
    const tcpEnv = await tzip(['serve'], cleanEnv({ TZIP_SOCKET: 'tcp://127.0.0.1:5555' }));
    expect(tcpEnv.code).toBe(1);
    expect(tcpEnv.stderr).toContain('TZIP_SOCKET is tcp://127.0.0.1:5555: the daemon listens on an ipc socket');
    const tcpFile = writeConfig('tcp.json', { socket: 'tcp://127.0.0.1:5555' });
    const viaFile = await tzip(['serve', '--config', tcpFile], cleanEnv());
    expect(viaFile.code).toBe(1);
    expect(viaFile.stderr).toContain(`${tcpFile}: the config file's socket "tcp://127.0.0.1:5555": the daemon listens on an ipc socket`);
  });

  it('listens on TZIP_SOCKET in ZeroMQ\'s spelling ipc:///abs/path', async () => {
    const sock = join(tmp(), 'ipc-env', 'tzip.sock');
    const r = await tzip(['serve', '--idle-exit', '0.2', '--json'], cleanEnv({ TZIP_SOCKET: `ipc://${sock}` }));
    expect(r.code, r.stderr).toBe(0);
    expect(JSON.parse(r.stdout.split('\n')[0] as string)).toMatchObject({ event: 'listening', socket: sock, endpoint: `ipc://${sock}` });
  });

  it('logs at the configured level and format: JSON lines with --log-format json, nothing below --log-level', async () => {
    /** Runs a daemon that exits by itself (--idle-exit) and returns its stderr lines. */
    const run = async (args: string[], env: NodeJS.ProcessEnv) => {
      const sock = join(tmp(), `log-${Math.random().toString(16).slice(2)}`, 'tzip.sock');
      const r = await tzip(['serve', '--socket', sock, '--idle-exit', '0.2', ...args], env);
      expect(r.code, r.stderr).toBe(0);
      expect(r.stdout).toContain('listening');
      return r.stderr.split('\n').filter((l) => l !== '');
    };
    const env = cleanEnv({ XDG_CONFIG_HOME: join(tmp(), 'log-xdg') });
    const text = await run([], env);
    expect(text.some((l) => /^tzip serve: stopped: idle for/.test(l))).toBe(true);

    const json = await run(['--log-format', 'json'], env);
    expect(json.length).toBeGreaterThan(0);
    const records = json.map((l) => JSON.parse(l) as Record<string, unknown>);
    for (const r of records) expect(r).toMatchObject({ level: expect.stringMatching(/^(debug|info|warn|error)$/), name: 'tzip serve', pid: expect.any(Number), time: expect.any(Number), msg: expect.any(String) });
    expect(records.some((r) => String(r.msg).startsWith('stopped: idle for'))).toBe(true);
    // Structured fields are keys of their line: the metrics URL on the metrics line.
    const withMetrics = (await run(['--log-format', 'json', '--metrics', '0'], env)).map((l) => JSON.parse(l) as Record<string, unknown>);
    expect(withMetrics.find((r) => String(r.msg).startsWith('metrics on '))).toMatchObject({ level: 'info', metrics: expect.stringMatching(/^http:\/\/127\.0\.0\.1:\d+\/metrics$/) });

    // From the environment, and from a config file: the same, by precedence.
    const viaEnv = await run([], { ...env, TZIP_LOG_FORMAT: 'json', TZIP_LOG_LEVEL: 'warn' });
    expect(viaEnv.filter((l) => (JSON.parse(l) as { level: string }).level === 'info')).toEqual([]);
    const quiet = await run(['--config', writeConfig('quiet.json', { log_level: 'silent' })], env);
    expect(quiet).toEqual([]);
  });

  it('--metrics shows in the ready line; a port in use fails the start (exit 3) and leaves no socket', async () => {
    const env = cleanEnv({ XDG_CONFIG_HOME: join(tmp(), 'ready-xdg') });
    const sock = join(tmp(), 'ready', 'tzip.sock');
    const child = spawn(process.execPath, [MAIN, 'serve', '--socket', sock, '--metrics', '0', '--json'], { env, stdio: ['ignore', 'pipe', 'pipe'] });
    try {
      const ready = await new Promise<Record<string, unknown>>((resolve, reject) => {
        let out = '';
        child.stdout.on('data', (d: Buffer) => {
          out += d.toString();
          if (out.includes('\n')) resolve(JSON.parse(out.split('\n')[0] as string) as Record<string, unknown>);
        });
        child.on('exit', (code) => reject(new Error(`daemon exited ${code}`)));
      });
      expect(ready).toMatchObject({ event: 'listening', socket: sock, metrics: expect.stringMatching(/^http:\/\/127\.0\.0\.1:\d+\/metrics$/) });
      const port = new URL(ready.metrics as string).port;
      const second = await tzip(['serve', '--socket', join(tmp(), 'ready2', 'tzip.sock'), '--metrics', port], env);
      expect(second.code).toBe(3);
      expect(second.stderr).toContain(`cannot serve metrics on 127.0.0.1:${port}`);
      expect(existsSync(join(tmp(), 'ready2', 'tzip.sock'))).toBe(false);
    } finally {
      const exited = new Promise((resolve) => child.on('exit', resolve));
      child.kill('SIGTERM');
      await exited;
    }
  });
});
