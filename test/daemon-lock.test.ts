// The daemon lock and socket folder: one daemon per socket path (a second is refused, in-process and as a
// real `tzip serve` process), stale pid files of dead daemons are replaced, the folder is private (0700): created so,
// or refused when it existed open to others (its mode is never changed).
import { execFile, execFileSync, spawn } from 'node:child_process';
import { chmodSync, existsSync, lstatSync, mkdirSync, readFileSync, statSync, symlinkSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { beforeAll, describe, expect, it } from 'vitest';
import { defaultLimits } from '../src/daemon/limits.js';
import { DaemonLock, holderAlive, lockPathOf, processStartTime, readLockInfo } from '../src/daemon/lock.js';
import { defaultSocketPath, ensurePrivateDir, resolveSocketPath } from '../src/daemon/paths.js';
import { Daemon } from '../src/daemon/server.js';
import { TzipError } from '../src/errors.js';
import { ensureBuilt } from './helpers/cli.js';
import { useTempDir } from './helpers/temp-dir.js';

const MAIN = fileURLToPath(new URL('../dist/src/cli/main.js', import.meta.url));
const tmp = useTempDir('daemon-lock');

describe('socket paths', () => {
  it('follow --socket, TZIP_SOCKET, XDG_RUNTIME_DIR, then /tmp/tzip-$UID', () => {
    const uid = process.getuid?.() ?? 0;
    expect(defaultSocketPath({ TZIP_SOCKET: '/x/y.sock', XDG_RUNTIME_DIR: '/run/user/1' })).toBe('/x/y.sock');
    expect(defaultSocketPath({ XDG_RUNTIME_DIR: '/run/user/1' })).toBe('/run/user/1/tzip/tzip.sock');
    expect(defaultSocketPath({ XDG_RUNTIME_DIR: 'relative' })).toBe(`/tmp/tzip-${uid}/tzip.sock`);
    expect(defaultSocketPath({})).toBe(`/tmp/tzip-${uid}/tzip.sock`);
    expect(resolveSocketPath('/a/b.sock', { TZIP_SOCKET: '/x/y.sock' })).toBe('/a/b.sock');
    expect(() => resolveSocketPath(`/${'x'.repeat(120)}/s.sock`, {})).toThrow(/at most 107/);
  });

  it('live in a private folder: created 0700 (whatever the umask), refused when a symlink', () => {
    const dir = join(tmp(), 'fresh');
    ensurePrivateDir(join(dir, 'tzip.sock'));
    expect(statSync(dir).mode & 0o7777).toBe(0o700);
    // A umask that takes the owner's write bit: the folder made in this call is still 0700.
    const umask = process.umask(0o277);
    try {
      ensurePrivateDir(join(tmp(), 'umask', 'tzip.sock'));
    } finally {
      process.umask(umask);
    }
    expect(statSync(join(tmp(), 'umask')).mode & 0o7777).toBe(0o700);
    // An existing private folder is used as it is.
    const own = join(tmp(), 'own');
    mkdirSync(own, { mode: 0o700 });
    chmodSync(own, 0o500);
    ensurePrivateDir(join(own, 'tzip.sock'));
    expect(statSync(own).mode & 0o7777).toBe(0o500);
    chmodSync(own, 0o700);
    const link = join(tmp(), 'link');
    symlinkSync(dir, link);
    expect(() => ensurePrivateDir(join(link, 'tzip.sock'))).toThrow(TzipError);
  });

  it('never change the mode of an existing folder: one open to others (a /tmp, a shared cwd) is refused, saying why and what to do', () => {
    const uid = process.getuid?.() ?? 0;
    // A private stand-in for /tmp (1777), never the real one.
    const fakeTmp = join(tmp(), 'fake_tmp');
    mkdirSync(fakeTmp);
    chmodSync(fakeTmp, 0o1777);
    let err: unknown;
    try {
      ensurePrivateDir(join(fakeTmp, 'tzip.sock'));
    } catch (e) {
      err = e;
    }
    expect(err).toBeInstanceOf(TzipError);
    expect((err as TzipError).code).toBe('TZIP_IO');
    expect((err as TzipError).message).toContain(`${fakeTmp}: the socket folder has mode 1777, open to other users`);
    expect((err as TzipError).message).toContain(`e.g. ${join(fakeTmp, `tzip-${uid}`, 'tzip.sock')}`);
    expect((err as TzipError).message).not.toContain('chmod 700'); // never suggested for a folder others write in
    expect(statSync(fakeTmp).mode & 0o7777).toBe(0o1777);
    // The suggested folder works: created 0700, the shared one left as it was.
    ensurePrivateDir(join(fakeTmp, `tzip-${uid}`, 'tzip.sock'));
    expect(statSync(join(fakeTmp, `tzip-${uid}`)).mode & 0o7777).toBe(0o700);
    expect(statSync(fakeTmp).mode & 0o7777).toBe(0o1777);
    // A folder others may enter but not write to (a home, a 0755 project folder): refused, left 0755.
    const loose = join(tmp(), 'loose');
    mkdirSync(loose);
    chmodSync(loose, 0o755);
    expect(() => ensurePrivateDir(join(loose, 'tzip.sock'))).toThrow(/has mode 755, open to other users.*chmod 700/);
    expect(statSync(loose).mode & 0o7777).toBe(0o755);
  });
});

describe('DaemonLock', () => {
  it('refuses a second holder of the same path and frees the path on release', async () => {
    const sock = join(tmp(), 'one.sock');
    const first = await DaemonLock.acquire(sock);
    expect(readLockInfo(lockPathOf(sock))?.pid).toBe(process.pid);
    await expect(DaemonLock.acquire(sock)).rejects.toThrow(/another tzip daemon \(pid \d+/);
    const other = await DaemonLock.acquire(join(tmp(), 'two.sock'));
    other.release();
    first.release();
    expect(existsSync(lockPathOf(sock))).toBe(false);
    const again = await DaemonLock.acquire(sock);
    again.release();
  });

  it('replaces the pid file of a dead daemon (stale) and of a reused pid', async () => {
    const sock = join(tmp(), 'stale.sock');
    const dead = await new Promise<number>((resolve) => {
      const child = spawn(process.execPath, ['-e', '0']);
      child.on('exit', () => resolve(child.pid as number));
    });
    writeFileSync(lockPathOf(sock), JSON.stringify({ pid: dead, start: 1, socket: sock, since: 'then' }));
    const lock = await DaemonLock.acquire(sock);
    expect(lock.replacedStale?.pid).toBe(dead);
    lock.release();
    // our own parent's pid with a wrong start time: the pid was reused by another process
    writeFileSync(lockPathOf(sock), JSON.stringify({ pid: process.ppid, start: (processStartTime(process.ppid) ?? 0) + 1, socket: sock, since: 'then' }));
    expect(holderAlive(readLockInfo(lockPathOf(sock))!)).toBe(false);
    const lock2 = await DaemonLock.acquire(sock);
    expect(lock2.replacedStale?.pid).toBe(process.ppid);
    lock2.release();
  });

  it('refuses when the pid file names a live process with its start time (a daemon the mutex cannot see)', async () => {
    const sock = join(tmp(), 'live.sock');
    writeFileSync(lockPathOf(sock), JSON.stringify({ pid: process.ppid, start: processStartTime(process.ppid), socket: sock, since: 'now' }));
    await expect(DaemonLock.acquire(sock)).rejects.toThrow(new RegExp(`pid ${process.ppid}`));
  });
});

describe('Daemon.start on a path that is not a socket', () => {
  it('refuses a regular file, a folder, a symlink and a FIFO with TZIP_IO naming it, deleting nothing', async () => {
    const dir = join(tmp(), 'kinds');
    mkdirSync(dir, { mode: 0o700 });
    const file = join(dir, 'file.sock');
    writeFileSync(file, 'data');
    const folder = join(dir, 'folder.sock');
    mkdirSync(folder);
    const link = join(dir, 'link.sock');
    symlinkSync(file, link);
    const dangling = join(dir, 'dangling.sock');
    symlinkSync(join(dir, 'nowhere'), dangling);
    const fifo = join(dir, 'fifo.sock');
    execFileSync('mkfifo', [fifo]);
    for (const [path, kind] of [[file, 'a regular file'], [folder, 'a folder'], [link, 'a symlink'], [dangling, 'a symlink'], [fifo, 'a FIFO']] as const) {
      let err: unknown;
      try {
        const d = await Daemon.start({ socketPath: path, limits: defaultLimits(), log: () => undefined });
        await d.stop('should not have started');
      } catch (e) {
        err = e;
      }
      expect(err, path).toBeInstanceOf(TzipError);
      expect((err as TzipError).code).toBe('TZIP_IO');
      expect((err as TzipError).message).toContain(`${path}: the socket path exists and is ${kind}, not a Unix socket`);
      expect(lstatSync(path).isSocket()).toBe(false);
      expect(existsSync(lockPathOf(path))).toBe(false);
    }
    expect(readFileSync(file, 'utf8')).toBe('data');
    expect(lstatSync(folder).isDirectory()).toBe(true);
    expect(lstatSync(link).isSymbolicLink()).toBe(true);
    expect(lstatSync(fifo).isFIFO()).toBe(true);
  });
});

describe('tzip serve', () => {
  beforeAll(() => ensureBuilt());

  it('refuses a second daemon on a socket that is served, and serves again after the first stops', async () => {
    const sock = join(tmp(), 'srv', 'tzip.sock');
    const first = spawn(process.execPath, [MAIN, 'serve', '--socket', sock], { stdio: ['ignore', 'pipe', 'pipe'] });
    try {
      await new Promise<void>((resolve, reject) => {
        first.stdout.on('data', (d: Buffer) => { if (d.toString().includes('listening')) resolve(); });
        first.on('exit', (code) => reject(new Error(`daemon exited ${code}`)));
      });
      expect(statSync(sock).isSocket()).toBe(true);
      expect(statSync(sock).mode & 0o777).toBe(0o600);
      const second = await new Promise<{ code: number | null; stderr: string }>((resolve) => {
        execFile(process.execPath, [MAIN, 'serve', '--socket', sock], (error, _stdout, stderr) => {
          resolve({ code: error === null ? 0 : (error.code as number), stderr });
        });
      });
      expect(second.code).toBe(1);
      expect(second.stderr).toContain(`another tzip daemon (pid ${first.pid}`);
      expect(statSync(sock).isSocket()).toBe(true);
      expect(JSON.parse(readFileSync(lockPathOf(sock), 'utf8')).pid).toBe(first.pid);
    } finally {
      const exited = new Promise((resolve) => first.on('exit', resolve));
      first.kill('SIGTERM');
      await exited;
    }
    expect(existsSync(sock)).toBe(false);
    expect(existsSync(lockPathOf(sock))).toBe(false);
  });

  it('takes over after a daemon was killed (socket and pid file left behind)', async () => {
    const sock = join(tmp(), 'killed', 'tzip.sock');
    const start = () => {
      const child = spawn(process.execPath, [MAIN, 'serve', '--socket', sock], { stdio: ['ignore', 'pipe', 'pipe'] });
      let err = '';
      child.stderr.on('data', (d: Buffer) => { err += d.toString(); });
      const ready = new Promise<void>((resolve, reject) => {
        child.stdout.on('data', (d: Buffer) => { if (d.toString().includes('listening')) resolve(); });
        child.on('exit', (code) => reject(new Error(`daemon exited ${code}: ${err}`)));
      });
      return { child, ready, err: () => err };
    };
    const a = start();
    await a.ready;
    const aExit = new Promise((resolve) => a.child.on('exit', resolve));
    a.child.kill('SIGKILL');
    await aExit;
    expect(existsSync(sock)).toBe(true);
    expect(existsSync(lockPathOf(sock))).toBe(true);
    const b = start();
    try {
      await b.ready;
      expect(b.err()).toContain(`replaced the stale lock of pid ${a.child.pid}`);
    } finally {
      const bExit = new Promise((resolve) => b.child.on('exit', resolve));
      b.child.kill('SIGTERM');
      await bExit;
    }
  });

  it('refuses a socket in a folder open to others at once (exit 3), leaving the folder\'s mode as it was', async () => {
    const shared = join(tmp(), 'shared_tmp');
    mkdirSync(shared);
    chmodSync(shared, 0o1777);
    writeFileSync(join(shared, 'other_users_file'), 'theirs');
    const sock = join(shared, 'tzip.sock');
    const result = await new Promise<{ code: number | null; stderr: string }>((resolve) => {
      execFile(process.execPath, [MAIN, 'serve', '--socket', sock], { timeout: 20_000 },
        (error, _stdout, stderr) => resolve({ code: error === null ? 0 : (error.code as number), stderr }));
    });
    expect(result.code).toBe(3);
    expect(result.stderr).toContain(`${shared}: the socket folder has mode 1777, open to other users`);
    expect(statSync(shared).mode & 0o7777).toBe(0o1777);
    expect(existsSync(sock)).toBe(false);
    expect(existsSync(lockPathOf(sock))).toBe(false);
  });

  it('refuses a --socket path where something other than a socket is (exit 3, at once), leaving it as it was', async () => {
    const dir = join(tmp(), 'userfiles');
    mkdirSync(dir, { mode: 0o700 });
    const notes = join(dir, 'notes.txt');
    writeFileSync(notes, 'precious user data\n');
    const started = Date.now();
    const result = await new Promise<{ code: number | null; stderr: string }>((resolve) => {
      execFile(process.execPath, [MAIN, 'serve', '--socket', notes], { timeout: 20_000 },
        (error, _stdout, stderr) => resolve({ code: error === null ? 0 : (error.code as number), stderr }));
    });
    expect(result.code).toBe(3);
    expect(result.stderr).toContain(`${notes}: the socket path exists and is a regular file, not a Unix socket`);
    expect(Date.now() - started).toBeLessThan(15_000);
    expect(readFileSync(notes, 'utf8')).toBe('precious user data\n');
    expect(existsSync(lockPathOf(notes))).toBe(false);
  });

  it('honours TZIP_SOCKET and exits by itself after --idle-exit with no client', async () => {
    const sock = join(tmp(), 'idle', 'tzip.sock');
    const started = Date.now();
    const result = await new Promise<{ code: number | null; stdout: string; stderr: string }>((resolve) => {
      execFile(process.execPath, [MAIN, 'serve', '--idle-exit', '0.3', '--json'], { env: { ...process.env, TZIP_SOCKET: sock }, timeout: 20_000 },
        (error, stdout, stderr) => resolve({ code: error === null ? 0 : (error.code as number), stdout, stderr }));
    });
    expect(result.code).toBe(0);
    expect(JSON.parse(result.stdout.trim())).toMatchObject({ event: 'listening', socket: sock });
    expect(result.stderr).toContain('idle');
    expect(Date.now() - started).toBeGreaterThanOrEqual(300);
    expect(existsSync(sock)).toBe(false);
    expect(existsSync(lockPathOf(sock))).toBe(false);
  });
});
