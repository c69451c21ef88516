// Endpoint spellings of --socket and TZIP_SOCKET (src/daemon/paths.ts): the parser's answers and refusals, and the
// compiled CLI reaching a real daemon (in this process, with its CURVE TCP socket) in every accepted spelling: a plain
// path, a relative path, ipc:///abs/path, TZIP_SOCKET in both, tcp://127.0.0.1:PORT with the keys of the socket folder's
// curve/ (found next to the default socket, or by TZIP_CURVE_DIR); `tzip serve --socket ipc:///abs` listens on /abs,
// not on ./ipc:/abs, and `tzip serve --socket tcp://...` is refused, pointing to --tcp.
import { execFile, spawn } from 'node:child_process';
import { existsSync, mkdirSync } from 'node:fs';
import { join, relative } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defaultLimits } from '../src/daemon/limits.js';
import { curveDirFor, defaultEndpoint, defaultSocketPath, parseEndpoint, resolveEndpoint, resolveSocketPath } from '../src/daemon/paths.js';
import { Daemon } from '../src/daemon/server.js';
import { TzipError } from '../src/errors.js';
import { ensureBuilt } from './helpers/cli.js';
import { useTempDir } from './helpers/temp-dir.js';

const MAIN = fileURLToPath(new URL('../dist/src/cli/main.js', import.meta.url));
const tmp = useTempDir('cli-endpoints');

describe('parseEndpoint', () => {
  it('takes plain paths, ipc:///abs/path and tcp://127.0.0.1:PORT', () => {
    expect(parseEndpoint('/run/x/tzip.sock')).toEqual({ kind: 'ipc', path: '/run/x/tzip.sock', endpoint: 'ipc:///run/x/tzip.sock' });
    expect(parseEndpoint('rel/t.sock')).toMatchObject({ kind: 'ipc', path: join(process.cwd(), 'rel/t.sock') });
    expect(parseEndpoint('ipc:///tmp/x.sock')).toEqual({ kind: 'ipc', path: '/tmp/x.sock', endpoint: 'ipc:///tmp/x.sock' });
    expect(parseEndpoint('IPC:///tmp/a//b/../x.sock')).toMatchObject({ path: '/tmp/a/x.sock' });
    expect(parseEndpoint('ipc:////tmp/x.sock')).toMatchObject({ path: '/tmp/x.sock' });
    expect(parseEndpoint('tcp://127.0.0.1:5555')).toEqual({ kind: 'tcp', port: 5555, endpoint: 'tcp://127.0.0.1:5555' });
    expect(parseEndpoint('tcp://127.0.0.1:00080')).toEqual({ kind: 'tcp', port: 80, endpoint: 'tcp://127.0.0.1:80' });
  });

  it('refuses other spellings, saying what is accepted', () => {
    const cases: [string, RegExp][] = [
      ['', /empty tzip endpoint: give a socket path, ipc:\/\/\/abs\/path or tcp:\/\/127\.0\.0\.1:PORT/],
      ['inproc://tzip', /unsupported endpoint scheme inproc:\/\//],
      ['udp://127.0.0.1:5', /unsupported endpoint scheme udp:\/\//],
      ['ipc://tmp/x.sock', /needs an absolute path, with three slashes: ipc:\/\/\/abs\/path/],
      ['ipc://', /needs an absolute path/],
      ['tcp://localhost:5555', /tcp:\/\/127\.0\.0\.1:PORT with PORT 1\.\.65535 \(it listens on loopback only\)/],
      ['tcp://0.0.0.0:5555', /loopback only/],
      ['tcp://127.0.0.1:0', /PORT 1\.\.65535/],
      ['tcp://127.0.0.1:65536', /PORT 1\.\.65535/],
      ['tcp://127.0.0.1', /PORT 1\.\.65535/],
      [`ipc:///${'x'.repeat(120)}.sock`, /at most 107/],
      [`/${'y'.repeat(120)}.sock`, /at most 107/],
    ];
    for (const [spelling, message] of cases) {
      let err: unknown;
      try {
        parseEndpoint(spelling);
      } catch (e) {
        err = e;
      }
      expect(err, spelling).toBeInstanceOf(TzipError);
      expect((err as TzipError).code).toBe('TZIP_USAGE');
      expect((err as TzipError).message, spelling).toMatch(message);
    }
  });

  it('TZIP_SOCKET in any spelling; the daemon\'s socket path refuses tcp:// and points to --tcp', () => {
    const uid = process.getuid?.() ?? 0;
    expect(defaultSocketPath({ TZIP_SOCKET: 'ipc:///x/y.sock' })).toBe('/x/y.sock');
    expect(defaultEndpoint({ TZIP_SOCKET: 'tcp://127.0.0.1:7000' })).toMatchObject({ kind: 'tcp', port: 7000 });
    // A tcp:// TZIP_SOCKET names no socket file: the default folder's socket is where that daemon's keys are.
    expect(defaultSocketPath({ TZIP_SOCKET: 'tcp://127.0.0.1:7000', XDG_RUNTIME_DIR: '/run/user/9' })).toBe('/run/user/9/tzip/tzip.sock');
    expect(resolveEndpoint(undefined, {})).toEqual({ kind: 'ipc', path: `/tmp/tzip-${uid}/tzip.sock`, endpoint: `ipc:///tmp/tzip-${uid}/tzip.sock` });
    expect(resolveEndpoint('ipc:///a/b.sock', { TZIP_SOCKET: '/x/y.sock' })).toMatchObject({ path: '/a/b.sock' });
    expect(resolveSocketPath('ipc:///a/b.sock', {})).toBe('/a/b.sock');
    expect(resolveSocketPath(undefined, { TZIP_SOCKET: 'ipc:///x/y.sock' })).toBe('/x/y.sock');
    expect(() => resolveSocketPath('tcp://127.0.0.1:5555', {})).toThrow(/--socket is tcp:\/\/127\.0\.0\.1:5555: .*`tzip serve --tcp 5555`/);
    expect(() => resolveSocketPath(undefined, { TZIP_SOCKET: 'tcp://127.0.0.1:5555' })).toThrow(/TZIP_SOCKET is tcp:\/\/127\.0\.0\.1:5555/);
    expect(curveDirFor({ TZIP_CURVE_DIR: '/k/curve', XDG_RUNTIME_DIR: '/run/user/9' })).toBe('/k/curve');
    expect(curveDirFor({ XDG_RUNTIME_DIR: '/run/user/9' })).toBe('/run/user/9/tzip/curve');
  });
});

interface Run {
  code: number;
  stdout: string;
  stderr: string;
}

/** Runs the compiled CLI with exactly `env` (plus PATH) in `cwd`. */
function tzip(args: readonly string[], cwd: string, env: NodeJS.ProcessEnv = {}): Promise<Run> {
  return new Promise((resolve) => {
    execFile(process.execPath, [MAIN, ...args], { cwd, env: { PATH: process.env.PATH, FORCE_COLOR: '0', ...env } }, (error, stdout, stderr) => {
      resolve({ code: error === null ? 0 : typeof error.code === 'number' ? error.code : -1, stdout, stderr });
    });
  });
}

describe('the CLI reaches the daemon in every spelling', () => {
  let daemon: Daemon;
  let xdg: string;
  let socket: string;
  let port: number;

  beforeAll(async () => {
    ensureBuilt();
    // The daemon's socket is the default one of XDG_RUNTIME_DIR=xdg, so its curve/ is where a client looks by default.
    xdg = join(tmp(), 'xdg');
    mkdirSync(xdg, { mode: 0o700 });
    socket = join(xdg, 'tzip', 'tzip.sock');
    daemon = await Daemon.start({ socketPath: socket, limits: defaultLimits(), log: () => undefined, tcpPort: 0 });
    port = Number(/:(\d+)$/.exec(daemon.tcpEndpoint as string)?.[1]);
    expect(port).toBeGreaterThan(0);
  });

  afterAll(async () => {
    await daemon?.stop('tests done');
  });

  async function expectJobs(args: string[], env: NodeJS.ProcessEnv, cwd = tmp()) {
    const r = await tzip(['--json', 'jobs', ...args], cwd, env);
    expect(r.code, `${args.join(' ')} ${JSON.stringify(env)}: ${r.stderr}`).toBe(0);
    const doc = JSON.parse(r.stdout);
    expect(doc.daemon.pid).toBe(process.pid);
    expect(doc.daemon.socket).toBe(socket);
  }

  it('--socket as a plain path, a relative path and ipc:///abs/path', async () => {
    await expectJobs(['--socket', socket], {});
    await expectJobs(['--socket', relative(tmp(), socket)], {});
    await expectJobs(['--socket', `ipc://${socket}`], {});
  });

  it('TZIP_SOCKET as a path or ipc:///abs/path, and the default socket of XDG_RUNTIME_DIR', async () => {
    await expectJobs([], { TZIP_SOCKET: socket });
    await expectJobs([], { TZIP_SOCKET: `ipc://${socket}` });
    await expectJobs([], { XDG_RUNTIME_DIR: xdg });
  });

  it('tcp://127.0.0.1:PORT over CURVE, with the keys next to the default socket or in TZIP_CURVE_DIR', async () => {
    await expectJobs(['--socket', `tcp://127.0.0.1:${port}`], { XDG_RUNTIME_DIR: xdg });
    await expectJobs([], { TZIP_SOCKET: `tcp://127.0.0.1:${port}`, XDG_RUNTIME_DIR: xdg });
    await expectJobs(['--socket', `tcp://127.0.0.1:${port}`], { TZIP_CURVE_DIR: join(xdg, 'tzip', 'curve'), XDG_RUNTIME_DIR: join(tmp(), 'elsewhere') });
    const r = await tzip(['jobs', '--socket', `tcp://127.0.0.1:${port}`], tmp(), { TZIP_CURVE_DIR: join(tmp(), 'no-keys') });
    expect(r.code).toBe(3);
    expect(r.stderr).toMatch(/cannot read the daemon's CURVE key .*tzip serve --tcp PORT/);
  });

  it('refuses bad spellings with exit code 1', async () => {
    for (const spelling of ['inproc://x', 'ipc://relative.sock', 'tcp://localhost:1']) {
      const r = await tzip(['jobs', '--socket', spelling], tmp());
      expect(r.code, r.stderr).toBe(1);
      expect(r.stderr).toMatch(/tcp:\/\/127\.0\.0\.1:PORT|ipc:\/\/\/abs\/path/);
    }
    const env = await tzip(['jobs'], tmp(), { TZIP_SOCKET: 'inproc://x' });
    expect(env.code).toBe(1);
  });
});

describe('tzip serve --socket', () => {
  it('listens on the path of ipc:///abs/path (not under the current folder)', async () => {
    const cwd = join(tmp(), 'serve-cwd');
    mkdirSync(cwd);
    const path = join(tmp(), 'serve', 'tzip.sock');
    const child = spawn(process.execPath, [MAIN, '--json', 'serve', '--socket', `ipc://${path}`], { cwd, env: { ...process.env, TZIP_SOCKET: '' }, stdio: ['ignore', 'pipe', 'pipe'] });
    try {
      const ready = await new Promise<Record<string, unknown>>((resolve, reject) => {
        let out = '';
        child.stdout.on('data', (b: Buffer) => {
          out += b.toString();
          const line = out.split('\n').find((l) => l.includes('"listening"'));
          if (line !== undefined) resolve(JSON.parse(line));
        });
        child.once('exit', (code) => reject(new Error(`tzip serve exited ${code} before listening`)));
      });
      expect(ready.socket).toBe(path);
      expect(ready.endpoint).toBe(`ipc://${path}`);
      expect(existsSync(path)).toBe(true);
      expect(existsSync(join(cwd, 'ipc:'))).toBe(false);
      const r = await tzip(['--json', 'jobs', '--socket', `ipc://${path}`], cwd);
      expect(r.code, r.stderr).toBe(0);
      expect(JSON.parse(r.stdout).daemon.socket).toBe(path);
    } finally {
      child.kill('SIGTERM');
      await new Promise((r) => child.once('exit', r));
    }
  });

  it('refuses tcp://, pointing to --tcp', async () => {
    const r = await tzip(['serve', '--socket', 'tcp://127.0.0.1:5555'], tmp());
    expect(r.code).toBe(1);
    expect(r.stderr).toMatch(/--socket is tcp:\/\/127\.0\.0\.1:5555: the daemon listens on an ipc socket .*`tzip serve --tcp 5555`/);
  });
});
