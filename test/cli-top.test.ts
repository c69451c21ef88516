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
import { jobsText, type JobsReport } from '../src/cli/jobs.js';
import { topLines } from '../src/cli/top.js';
import { bf16Weights } from './helpers/bf16-weights.js';
import { ensureBuilt, runTzip } from './helpers/cli.js';
import { DaemonConn, shmFile } from './helpers/daemon-conn.js';
import { useTempDir } from './helpers/temp-dir.js';

const MAIN = fileURLToPath(new URL('../dist/src/cli/main.js', import.meta.url));
const tmp = useTempDir('cli-top');
const hasTmux = (() => {
  try {
    execFileSync('tmux', ['-V'], { stdio: 'ignore' });
    return true;
  } catch {
    return false;
  }
})();

/** Runs tmux on this file's own server (its socket in the temp folder, removed with it). */
function tmux(...args: string[]): string {
  return execFileSync('tmux', ['-S', join(tmp(), 'tmux.sock'), ...args], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
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

/** A daemon at `path` with one client that said hello as job `job` (user tester) while `body` runs; both go after. */
async function withJobDaemon(path: string, job: string, body: () => Promise<void>): Promise<void> {
  const d = await Daemon.start({ socketPath: path, limits: limits(), log: () => undefined });
  const conn = new DaemonConn(d.endpoint, 'rank0');
  try {
    const h = await conn.req({ op: 'hello', versions: [1, 2, 3], pid: conn.pid, shm_prefix: conn.prefix, name: 'rank0', job: { name: job, user: 'tester' } });
    expect(h.ok, JSON.stringify(h)).toBe(true);
    await body();
  } finally {
    conn.close();
    await d.stop('test done');
  }
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

// What the screen and the table say about a daemon with GPUs (this machine has none for the tmux test to show): the
// lines of a `jobs` reply as an H200 daemon writes it (docs/protocol.md, "jobs").
describe('the screen\'s lines (topLines) and the jobs table for a GPU daemon', () => {
  const direction = (requests: number, bytesIn: number, bytesOut: number, seconds: number) => ({ requests, items: requests, bytes_in: bytesIn, bytes_out: bytesOut, seconds });
  const idle = { compress: direction(0, 0, 0, 0), decompress: direction(0, 0, 0, 0), errors: 0 };
  const report: JobsReport = {
    daemon: {
      pid: 4242, version: '0.1.0', socket: '/run/user/1000/tzip/tzip.sock', uptime_ms: 3_723_000, sm_budget: 16, sm_budget_default: 10,
      codec: null, mps: true,
      gpus: [{ uuid: 'GPU-8f3c1a2b-0000-1111-2222-333344445555', name: 'NVIDIA H200', index: 0, memory_used_bytes: 75e9, memory_total_bytes: 150e9 },
        { uuid: 'GPU-99999999-0000-1111-2222-333344445555', name: 'NVIDIA H200', index: 1, memory_used_bytes: null, memory_total_bytes: 150e9 }],
      rates: { compress_gbps: 123.4, decompress_gbps: 0.25 },
    },
    jobs: [{
      name: 'llama-70b-pretrain', user: 'alice', state: 'running', pids: [101, 102, 103, 104], sessions: 4,
      devices: ['GPU-8f3c1a2b-0000-1111-2222-333344445555'], attached: true, attached_at_ms: Date.now() - 60_000, mps: true, shares_mps: true,
      settings: { codec: 'fast', sm_budget: 16 }, overrides: { codec: 'fast', sm_budget: null },
      streams: { gradients: { compress: direction(10, 4e9, 2.6e9, 0.04), decompress: direction(10, 2.6e9, 4e9, 0.03), errors: 1 }, optimizer: idle, checkpoint: idle, sendrecv: idle, other: idle },
    }, {
      name: 'eval', user: 'bob', state: 'ended', pids: [7], sessions: 0, devices: ['cpu'], attached: false, attached_at_ms: null, mps: false, shares_mps: false,
      settings: { codec: null, sm_budget: 16 }, streams: { gradients: idle, optimizer: idle, checkpoint: idle, sendrecv: idle, other: idle },
    }],
  };

  it('show the daemon\'s settings, each GPU\'s memory, the rates, each job and its streams within the width', () => {
    const view = { where: report.daemon.socket, report, error: null, lastOkAt: Date.now(), intervalMs: 1000 };
    for (const width of [80, 120, 200]) {
      const lines = topLines(view, width, Date.now()).map((l) => l.text);
      for (const l of lines) expect(l.length, l).toBeLessThanOrEqual(width);
      const text = lines.join('\n');
      expect(text).toContain('daemon pid 4242  tzip 0.1.0  up 1 h 02 m  jobs 2 (1 attached)');
      expect(text).toContain('SM budget 16');
      expect(text).toContain('MPS client: yes');
      expect(text).toMatch(/^GPU 0 NVIDIA H200 mem\[\|{15} {15}\] 75.00 GB \/ 150.00 GB/m);
      expect(text).toMatch(/^GPU 1 NVIDIA H200 mem\[ {30}\] memory \?/m);
      expect(text).toContain('compress 123.4 GB/s  decompress 250 MB/s');
      if (width >= 120) {
        expect(text).toMatch(/^JOB\s+STATE\s+USER\s+PIDS\s+DEVICES\s+MPS CODEC\s+SMS\s+REQS\s+ERR\s+ORIGINAL\s+CODED\s+RATIO\s+GB\/s/m);
        expect(text).toMatch(/^llama-70b\S*\s+attached alice\s+101 102 1~\s+GPU-8f3c1a2b\s+yes fast\s+16\s+20\s+1\s+8.00 GB\s+5.20 GB 0.6500\s+114.3/m);
        expect(text).toMatch(/^ {2}gradients\s+20\s+1\s+8.00 GB\s+5.20 GB 0.6500/m);
        expect(text).toMatch(/^eval\s+ended\s+bob/m);
      } else {
        // Narrow: devices, pids, user and MPS make room; the figures stay.
        expect(text).toMatch(/^JOB\s+STATE\s+CODEC\s+SMS\s+REQS\s+ERR\s+ORIGINAL\s+CODED\s+RATIO\s+GB\/s/m);
        expect(text).toMatch(/^llama-70b-p~\s+attached fast\s+16\s+20\s+1\s+8.00 GB\s+5.20 GB 0.6500\s+114.3/m);
        expect(text).toMatch(/^ {2}gradients\s+20\s+1\s+8.00 GB\s+5.20 GB 0.6500\s+114.3/m);
      }
      expect(text).not.toMatch(/^ {2}optimizer/m);
    }
  });

  it('say when the daemon is away, keeping the last answer', () => {
    const lines = topLines({ where: '/x.sock', report, error: 'no tzip daemon at /x.sock', lastOkAt: Date.now() - 5000, intervalMs: 1000 }, 120, Date.now());
    expect(lines[1]).toMatchObject({ text: 'daemon not reachable: no tzip daemon at /x.sock', color: 'red' });
    expect(lines[2]?.text).toMatch(/^retrying every 1 s; below: as of \d\d:\d\d:\d\d$/);
    expect(lines.some((l) => l.text.startsWith('llama-70b') && l.dim === true)).toBe(true);
  });

  it('tzip jobs prints the same figures as a table', () => {
    const text = jobsText(report);
    expect(text).toContain('tzip daemon pid 4242 (tzip 0.1.0), up 1 h 02 m, socket /run/user/1000/tzip/tzip.sock');
    expect(text).toContain('settings: codec per request, SM budget 16; MPS client: yes');
    expect(text).toContain('GPU 0 NVIDIA H200 (GPU-8f3c1a2b-0000-1111-2222-333344445555): memory 75.00 GB / 150.00 GB');
    expect(text).toContain('GPU 1 NVIDIA H200 (GPU-99999999-0000-1111-2222-333344445555): memory ?');
    expect(text).toContain('codec rates, last 10 s: compress 123.4 GB/s, decompress 250 MB/s');
    const row = text.split('\n').find((l) => l.includes('llama-70b-pretrain')) as string;
    expect(row.split('│').map((c) => c.trim()).filter((c) => c !== '')).toEqual(
      ['llama-70b-pretrain', 'attached', 'alice', '101 102 103 +1', 'GPU-8f3c1a2b', 'yes', 'fast', '16', '20', '1', '8.00 GB', '5.20 GB', '0.6500', '114.3']);
  });
});

describe('tzip top with stdout not a terminal', () => {
  it('prints one screen as text, as top -b -n 1 does, and exits 3 when no daemon answers', async () => {
    ensureBuilt();
    const path = join(tmp(), 'batch', 'tzip.sock');
    await withJobDaemon(path, 'batch-job', async () => {
      const r = await runTzip(['top', '--socket', path], tmp());
      expect(r.code, r.stderr).toBe(0);
      expect(r.stdout).toContain(`daemon pid ${process.pid}`);
      expect(r.stdout).toMatch(/^batch-job\s+attached tester/m);
      expect(r.stdout).not.toContain('\x1b['); // plain text: no alternate screen, no colours
      expect(r.stdout).not.toContain('q quit');
    });
    const gone = await runTzip(['top', '--socket', path], tmp());
    expect(gone.code).toBe(3);
    expect(gone.stdout).toContain('daemon not reachable: no tzip daemon at');
    expect(gone.stderr).toContain('no tzip daemon at');
  });

  it('--json prints one snapshot, the document `tzip jobs --json` prints, and exits (on a terminal too); 3 with a JSON error when no daemon answers', async () => {
    ensureBuilt();
    const path = join(tmp(), 'json', 'tzip.sock');
    await withJobDaemon(path, 'json-job', async () => {
      const [top, jobs] = [await runTzip(['top', '--json', '--socket', path], tmp()), await runTzip(['jobs', '--json', '--socket', path], tmp())];
      expect(top.code, top.stderr).toBe(0);
      const doc = JSON.parse(top.stdout) as JobsReport;
      expect(doc.daemon.pid).toBe(process.pid);
      expect(doc.jobs.map((j) => j.name)).toEqual(['json-job']);
      const same = JSON.parse(jobs.stdout) as JobsReport;
      expect(Object.keys(doc).sort()).toEqual(Object.keys(same).sort());
      expect(Object.keys(doc.daemon).sort()).toEqual(Object.keys(same.daemon).sort());
      expect(Object.keys(doc.jobs[0] as object).sort()).toEqual(Object.keys(same.jobs[0] as object).sort());
      if (hasTmux) {
        // On a terminal: still one JSON document and exit 0, no live screen.
        tmux('new-session', '-d', '-s', 'topjson', '-x', '200', '-y', '50',
          `env FORCE_COLOR=0 ${process.execPath} ${MAIN} top --json --socket ${path}; echo "top exited $?"; sleep 600`);
        try {
          const end = Date.now() + 20_000;
          let pane = '';
          while (Date.now() < end && !pane.includes('top exited')) {
            await new Promise((r) => setTimeout(r, 200));
            pane = tmux('capture-pane', '-p', '-J', '-t', 'topjson', '-S', '-1000');
          }
          expect(pane).toContain('top exited 0');
          expect(pane).toContain('"json-job"');
          expect(pane).not.toContain('q quit');
        } finally {
          tmux('kill-session', '-t', 'topjson');
        }
      }
    });
    const gone = await runTzip(['top', '--json', '--socket', path], tmp());
    expect(gone.code).toBe(3);
    expect((JSON.parse(gone.stdout) as { error: { code: string; message: string } }).error.message).toContain('no tzip daemon at');
  });
});
