// The configuration of `tzip serve` (src/config.ts, docs/configuration.md) given what careless or hostile users write:
// numbers as text with junk, spaces, signs, exponents and huge values in variables and flags; config files that are
// not JSON objects, hold wrong types or unknown keys, begin with a byte-order mark, are folders or symbolic links
// (dangling ones too); values the daemon or its clients cannot run with (threads above the addon's 1024, a lease
// longer than a timer holds). Real files and links in a temp folder; the addon's own limit checked with a real call.
import { spawn } from 'node:child_process';
import { mkdirSync, symlinkSync, writeFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { resolveConfig, type ConfigKey } from '../src/config.js';
import { TzipError } from '../src/errors.js';
import { compress } from '../src/native.js';
import { bf16Weights } from './helpers/bf16-weights.js';
import { ensureBuilt } from './helpers/cli.js';
import { useTempDir } from './helpers/temp-dir.js';

const tmp = useTempDir('hostile-config');

/** An environment with no TZIP_ variable and an empty config folder of its own, plus `extra`. */
function env(extra: NodeJS.ProcessEnv = {}, xdg = join(tmp(), 'empty-xdg')): NodeJS.ProcessEnv {
  const out: NodeJS.ProcessEnv = {};
  for (const [k, v] of Object.entries(process.env)) if (!k.startsWith('TZIP_') && k !== 'XDG_CONFIG_HOME') out[k] = v;
  out.HOME = join(tmp(), 'home');
  out.XDG_CONFIG_HOME = xdg;
  return { ...out, ...extra };
}

function file(name: string, text: string): string {
  const path = join(tmp(), name);
  mkdirSync(join(path, '..'), { recursive: true });
  writeFileSync(path, text);
  return path;
}

async function refused(p: Promise<unknown>, code = 'TZIP_USAGE'): Promise<TzipError> {
  const err = await p.then(() => undefined, (e: unknown) => e);
  expect(err).toBeInstanceOf(TzipError);
  expect((err as TzipError).code).toBe(code);
  return err as TzipError;
}

describe('numbers as text (environment and flags)', () => {
  it('reads what is a number, refuses junk, and names the variable and the text', async () => {
    const accepted: Record<string, number> = { ' 7 ': 7, '\t7\n': 7, '+7': 7, '7.0': 7, '1e1': 10, '0': 0, '1024': 1024 };
    for (const [text, value] of Object.entries(accepted)) {
      const c = await resolveConfig({ env: env({ TZIP_SM_BUDGET: text }) });
      expect(c.values.sm_budget, JSON.stringify(text)).toBe(value);
      expect((await resolveConfig({ env: env(), flags: { sm_budget: text } })).values.sm_budget).toBe(value);
    }
    for (const text of ['10abc', '0x10', '1_0', '7 7', '-1', '1025', '1.5', '1e400', '99999999999999999999', 'NaN', 'Infinity', '-0x1', '७', ' ']) {
      const e = await refused(resolveConfig({ env: env({ TZIP_SM_BUDGET: text }) }));
      expect(e.message, JSON.stringify(text)).toContain(`TZIP_SM_BUDGET: '${text}'`);
      const f = await refused(resolveConfig({ env: env(), flags: { sm_budget: text } }));
      expect(f.message).toContain('--sm-budget');
    }
    // empty: unset, the default
    expect((await resolveConfig({ env: env({ TZIP_SM_BUDGET: '' }) })).sources.sm_budget).toEqual({ from: 'default' });
    for (const key of ['TZIP_TCP_PORT', 'TZIP_METRICS_PORT'] as const) {
      await refused(resolveConfig({ env: env({ [key]: '65536' }) }));
      await refused(resolveConfig({ env: env({ [key]: '-1' }) }));
    }
    for (const text of ['2', 'yes please', '']) {
      if (text === '') expect((await resolveConfig({ env: env({ TZIP_VERBOSE: text }) })).values.verbose).toBe(false);
      else await refused(resolveConfig({ env: env({ TZIP_VERBOSE: text }) }));
    }
  });

  it('reads a level or format with spaces around it as the word, and refuses another spelling with the choices', async () => {
    expect((await resolveConfig({ env: env({ TZIP_LOG_LEVEL: ' debug ' }) })).values.log_level).toBe('debug');
    expect((await resolveConfig({ env: env(), flags: { log_format: 'json\n' } })).values.log_format).toBe('json');
    const e = await refused(resolveConfig({ env: env({ TZIP_LOG_LEVEL: 'DEBUG' }) }));
    expect(e.message).toContain('debug, info, warn, error, silent');
  });

  it('refuses what the daemon or its clients cannot run with: threads above the addon\'s 1024, a lease past a timer\'s 2^31-1 ms', async () => {
    const data = bf16Weights(4096, 1);
    // the addon's own bound: every request of a daemon started with more threads would fail
    expect((await compress(data, { dtype: 'BF16', shape: [4096], threads: 1024 })).length).toBeGreaterThan(0);
    await expect(compress(data, { dtype: 'BF16', shape: [4096], threads: 1025 })).rejects.toThrow(/1024/);
    for (const [key, variable, flag, over, max] of [
      ['threads', 'TZIP_THREADS', '--threads', 1025, 1024],
      ['lease_ms', 'TZIP_LEASE_MS', '--lease-ms', 2 ** 31, 2 ** 31 - 1],
    ] as const) {
      const k = key as ConfigKey;
      expect((await refused(resolveConfig({ env: env({ [variable]: String(over) }) }))).message).toContain(variable);
      expect((await refused(resolveConfig({ env: env(), flags: { [k]: String(over) } }))).message).toContain(flag);
      expect((await refused(resolveConfig({ env: env(), configPath: file(`${key}-over.json`, JSON.stringify({ [key]: over })) }))).message).toContain(key);
      expect((await resolveConfig({ env: env({ [variable]: String(max) }) })).values[k]).toBe(max);
    }
  });
});

describe('config files a careless user writes', () => {
  it('refuses what is not one JSON object of known keys and right types, naming the key and the value as written', async () => {
    for (const text of ['', '{', '{"sm_budget": 4,}', "{'sm_budget': 4}", '[]', 'null', '"sm_budget"', '42', '{"sm_budget": 4} {}', '// c\n{}']) {
      await refused(resolveConfig({ env: env(), configPath: file('bad.json', text) }));
    }
    const wrong: Record<string, string> = {
      '{"sm_budget": "4"}': "sm_budget: '4'", '{"verbose": "true"}': 'verbose', '{"tcp_port": -1}': 'tcp_port: -1', '{"threads": 0}': 'threads: 0',
      '{"sm_budget": 1e400}': 'sm_budget: Infinity', '{"lease_ms": 1.5}': 'lease_ms: 1.5', '{"sm_budget": null}': 'sm_budget: null',
      '{"smbudget": 4}': "unknown key 'smbudget'", '{"__proto__": {"sm_budget": 4}}': "unknown key '__proto__'", '{"socket": ""}': 'socket',
    };
    for (const [text, says] of Object.entries(wrong)) {
      const e = await refused(resolveConfig({ env: env(), configPath: file('wrong.json', text) }));
      expect(e.message, text).toContain(says);
    }
    // null where a key may be off is off
    expect((await resolveConfig({ env: env(), configPath: file('null.json', '{"tcp_port": null, "threads": null}') })).values.tcp_port).toBe(null);
  });

  it('refuses a file over 1 MiB at once (a checkpoint named by mistake, /dev/zero), reads a pipe', async () => {
    const big = file('big.json', `{"sm_budget": 4, "x": "${'y'.repeat(3 << 20)}"}`);
    expect((await refused(resolveConfig({ env: env(), configPath: big }))).message).toContain('over 1048576 bytes');
    expect((await refused(resolveConfig({ env: env(), configPath: '/dev/zero' }))).message).toContain('over 1048576 bytes');
    // a pipe, as --config <(echo ...) gives one
    const { spawn, spawnSync } = await import('node:child_process');
    const fifo = join(tmp(), 'config.fifo');
    expect(spawnSync('mkfifo', [fifo]).status).toBe(0);
    // the writer is another process (the config is read synchronously: a writer in this one would never run)
    const writer = spawn('sh', ['-c', `printf '{"sm_budget": 6}' > '${fifo}'`], { stdio: 'ignore' });
    try {
      expect((await resolveConfig({ env: env(), configPath: fifo })).values.sm_budget).toBe(6);
    } finally {
      writer.kill();
    }
  });

  it('reads a file that begins with a byte-order mark (as some editors save it)', async () => {
    const c = await resolveConfig({ env: env(), configPath: file('bom.json', '\ufeff{"sm_budget": 5}') });
    expect(c.values.sm_budget).toBe(5);
  });

  it('folders, links and missing files: a folder or a dangling link is an error wherever it is, a link to a file is read', async () => {
    const dir = join(tmp(), 'a-folder');
    mkdirSync(dir, { recursive: true });
    expect((await refused(resolveConfig({ env: env(), configPath: dir }), 'TZIP_IO')).message).toContain('folder');
    expect((await refused(resolveConfig({ env: env({ TZIP_CONFIG: dir }) }), 'TZIP_IO')).message).toContain('folder');
    const target = file('target.json', '{"sm_budget": 9}');
    const link = join(tmp(), 'link.json');
    symlinkSync(target, link);
    expect((await resolveConfig({ env: env(), configPath: link })).values.sm_budget).toBe(9);
    const dangling = join(tmp(), 'dangling.json');
    symlinkSync(join(tmp(), 'nothing-here.json'), dangling);
    await refused(resolveConfig({ env: env(), configPath: dangling }), 'TZIP_IO');
    await refused(resolveConfig({ env: env(), configPath: join(tmp(), 'missing.json') }), 'TZIP_IO');

    // the default location: missing is fine (defaults); a folder or a link to nothing there is a mistake to report
    const xdg = join(tmp(), 'xdg-default');
    mkdirSync(join(xdg, 'tzip'), { recursive: true });
    expect((await resolveConfig({ env: env({}, xdg) })).file.found).toBe(false);
    symlinkSync(join(tmp(), 'moved-away.json'), join(xdg, 'tzip', 'config.json'));
    const e = await refused(resolveConfig({ env: env({}, xdg) }), 'TZIP_IO');
    expect(e.message).toContain('link');
    const xdgDir = join(tmp(), 'xdg-folder');
    mkdirSync(join(xdgDir, 'tzip', 'config.json'), { recursive: true });
    await refused(resolveConfig({ env: env({}, xdgDir) }), 'TZIP_IO');
    // a relative XDG_CONFIG_HOME is ignored (the XDG rule), HOME's .config is used
    expect((await resolveConfig({ env: env({}, 'relative/xdg') })).file.path).toBe(join(tmp(), 'home', '.config', 'tzip', 'config.json'));
  });

  it.skipIf(process.getuid?.() === 0)('an unreadable config file is a TZIP_IO error (skipped as root: root reads every file)', async () => {
    const path = file('unreadable.json', '{}');
    const { chmodSync } = await import('node:fs');
    chmodSync(path, 0o000);
    await refused(resolveConfig({ env: env(), configPath: path }), 'TZIP_IO');
  });

  it('precedence holds with junk around: a valid flag wins over a junk variable, a valid variable over the file', async () => {
    const path = file('prec.json', '{"sm_budget": 1, "lease_ms": 1111}');
    const c = await resolveConfig({ env: env({ TZIP_SM_BUDGET: '10abc', TZIP_LEASE_MS: ' 2222 ' }), flags: { sm_budget: '3' }, configPath: path });
    expect(c.values.sm_budget).toBe(3);
    expect(c.sources.sm_budget).toEqual({ from: 'flag', name: '--sm-budget' });
    expect(c.values.lease_ms).toBe(2222);
    expect(c.sources.lease_ms).toEqual({ from: 'env', name: 'TZIP_LEASE_MS' });
  });
});

describe('tzip serve given a tiny idle time', () => {
  it('--idle-exit 0.0004 exits when idle, as any time above 0 does (rounded to 0 ms it meant never)', async () => {
    ensureBuilt();
    const main = fileURLToPath(new URL('../dist/src/cli/main.js', import.meta.url));
    const child = spawn(process.execPath, [main, 'serve', '--socket', join(tmp(), 'idle', 'tzip.sock'), '--idle-exit', '0.0004'], { env: env(), stdio: 'ignore' });
    const code = await Promise.race([
      new Promise<number | null>((r) => child.once('exit', (c) => r(c))),
      new Promise<string>((r) => setTimeout(() => r('still running after 10 s'), 10_000)),
    ]);
    child.kill('SIGKILL');
    expect(code).toBe(0);
  }, 20_000);
});
