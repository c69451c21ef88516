// `tzip top` (the compiled CLI) in a pseudo-terminal: a tmux session of 120x40 on a private tmux server runs it, and
// its screen (tmux capture-pane) is read while a real daemon in this process comes, serves a job, goes and comes back.
// The screen says the daemon is not reachable before it starts, then shows the job with its stream, says so again when
// the daemon stops (keeping the last figures), shows the daemon after its restart, and q quits with exit code 0.
import { execFileSync } from 'node:child_process';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defaultLimits } from '../src/daemon/limits.js';
import { Daemon } from '../src/daemon/server.js';
import { maxCompressedSize } from '../src/native.js';
import { bf16Weights } from './helpers/bf16-weights.js';
import { ensureBuilt } from './helpers/cli.js';
import { DaemonConn, shmFile } from './helpers/daemon-conn.js';
import { useTempDir } from './helpers/temp-dir.js';

const MAIN = fileURLToPath(new URL('../dist/src/cli/main.js', import.meta.url));
const tmp = useTempDir('cli-top');
const TMUX = `tzip-test-${process.pid}`;
const hasTmux = (() => {
  try {
    execFileSync('tmux', ['-V'], { stdio: 'ignore' });
    return true;
  } catch {
    return false;
  }
})();

function tmux(...args: string[]): string {
  return execFileSync('tmux', ['-L', TMUX, ...args], { encoding: 'utf8' });
}

function screen(): string {
  return tmux('capture-pane', '-p', '-t', 'top');
}

/** Waits until the screen satisfies `ok` (checked every 200 ms, up to `ms`); returns it. */
async function waitScreen(ok: (s: string) => boolean, what: string, ms = 20_000): Promise<string> {
  const end = Date.now() + ms;
  let s = '';
  while (Date.now() < end) {
    s = screen();
    if (ok(s)) return s;
    await new Promise((r) => setTimeout(r, 200));
  }
  throw new Error(`screen never showed ${what}; last screen:\n${s}`);
}

function limits() {
  return { ...defaultLimits(), leaseMs: 30_000 };
}

let socket: string;
let daemon: Daemon | undefined;

beforeAll(() => {
  if (!hasTmux) return;
  ensureBuilt();
  socket = join(tmp(), 'd', 'tzip.sock');
});

afterAll(async () => {
  if (hasTmux) {
    try {
      tmux('kill-server');
    } catch {
      // already gone
    }
  }
  await daemon?.stop('tests done');
});

describe.skipIf(!hasTmux)('tzip top in a terminal (tmux)', () => {
  it('shows a missing daemon, then the job it serves, the daemon going away and coming back; q quits', async () => {
    // The shell line keeps the pane open after top exits, to read its exit code.
    tmux('new-session', '-d', '-s', 'top', '-x', '120', '-y', '40',
      `env FORCE_COLOR=0 ${process.execPath} ${MAIN} top --socket ${socket}; echo "top exited $?"; sleep 600`);

    await waitScreen((s) => s.includes('daemon not reachable') && s.includes('no tzip daemon at'), 'the missing daemon');

    daemon = await Daemon.start({ socketPath: socket, limits: limits(), log: () => undefined });
    const conn = new DaemonConn(daemon.endpoint, 'rank0');
    try {
      const h = await conn.req({ op: 'hello', versions: [1, 2, 3], pid: conn.pid, shm_prefix: conn.prefix, name: 'rank0',
        job: { name: 'train-top', user: 'tester', devices: ['cpu'] } });
      expect(h.ok, JSON.stringify(h)).toBe(true);
      conn.sid = h.sid;
      const data = bf16Weights(50_000, 5);
      const cap = maxCompressedSize(data.length, 1);
      shmFile(`${conn.prefix}in`, data.length, data);
      shmFile(`${conn.prefix}out`, cap);
      const r = await conn.call('compress', { stream: 'gradients', tensors: [{
        tensor: { device: { type: 1, id: 0 }, dtype: { code: 4, bits: 16, lanes: 1 }, shape: [data.length / 2], byte_offset: 0,
          data: { kind: 'shm', name: `${conn.prefix}in`, offset: 0, size: data.length } },
        out: { kind: 'shm', name: `${conn.prefix}out`, offset: 0, size: cap } }] });
      expect(r.ok, JSON.stringify(r)).toBe(true);

      const s = await waitScreen((x) => /train-top\s+attached\s+tester/.test(x) && /^\s+gradients\s/m.test(x), 'the job and its stream');
      expect(s).toContain(`daemon pid ${process.pid}`);
      expect(s).toContain('codec rates (last 10 s)');
      expect(s).toMatch(/JOB\s+STATE\s+USER/);
      expect(s).not.toContain('daemon not reachable');
      // The job's row carries the original bytes of its compress request (100 kB of bf16).
      expect(s).toMatch(/train-top.*100\.00 kB/);
      for (const line of s.split('\n')) expect(line.length).toBeLessThanOrEqual(120);
    } finally {
      conn.close();
    }

    await daemon.stop('restart');
    daemon = undefined;
    const away = await waitScreen((x) => x.includes('daemon not reachable'), 'the daemon gone');
    expect(away).toContain('train-top'); // the last figures stay, as of the last answer

    daemon = await Daemon.start({ socketPath: socket, limits: limits(), log: () => undefined });
    await waitScreen((x) => !x.includes('daemon not reachable') && x.includes(`daemon pid ${process.pid}`) && x.includes('jobs 0'), 'the restarted daemon');

    tmux('send-keys', '-t', 'top', 'q');
    await waitScreen((x) => x.includes('top exited 0'), 'top exiting with code 0 after q');
  });
});
