// `tzip jobs` and `tzip set` (the compiled CLI, as child processes) against a real daemon in this process: a session
// that said hello with a job is listed (JSON and table) with the bytes of its real round trips; `tzip set` switches
// the job's codec and the next compress writes frames of that codec (read from the frame's own header); the daemon's
// sm_budget; an unknown job, bad settings and an absent daemon are errors with their exit codes.
import { spawn } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defaultLimits } from '../src/daemon/limits.js';
import { Daemon } from '../src/daemon/server.js';
import { maxCompressedSize, readHeader } from '../src/native.js';
import { bf16Weights } from './helpers/bf16-weights.js';
import { ensureBuilt, runTzip } from './helpers/cli.js';
import { DaemonConn, shmFile } from './helpers/daemon-conn.js';
import { useTempDir } from './helpers/temp-dir.js';

const tmp = useTempDir('cli-jobs');
const MAIN = fileURLToPath(new URL('../dist/src/cli/main.js', import.meta.url));
const BF16 = { code: 4, bits: 16, lanes: 1 };
const CPU = { type: 1, id: 0 };

let daemon: Daemon;
let socket: string;
let conn: DaemonConn;

beforeAll(async () => {
  ensureBuilt();
  socket = join(tmp(), 'd', 'tzip.sock');
  daemon = await Daemon.start({ socketPath: socket, limits: { ...defaultLimits(), leaseMs: 30_000 }, log: () => undefined });
  conn = new DaemonConn(daemon.endpoint, 'rank0');
  const h = await conn.req({
    op: 'hello', versions: [1, 2, 3], pid: conn.pid, shm_prefix: conn.prefix, name: 'rank0',
    job: { name: 'train-cli', user: 'tester', rank: 0, world_size: 1, devices: ['cpu'], mps: null },
  });
  expect(h.ok, JSON.stringify(h)).toBe(true);
  conn.sid = h.sid;
});

afterAll(async () => {
  conn?.close();
  await daemon?.stop('tests done');
});

let seq = 0;
/** Compresses `data` (bf16) through the session as stream `stream`; returns the reply and the frame's bytes. */
async function compressOnce(data: Buffer, stream: string) {
  const tag = `t${seq++}`;
  const cap = maxCompressedSize(data.length, 1);
  const inName = `${conn.prefix}${tag}-in`;
  const outName = `${conn.prefix}${tag}-frame`;
  shmFile(inName, data.length, data);
  const framePath = shmFile(outName, cap);
  const r = await conn.call('compress', {
    stream, codec: 'auto',
    tensors: [{ tensor: { device: CPU, dtype: BF16, shape: [data.length / 2], byte_offset: 0, data: { kind: 'shm', name: inName, offset: 0, size: data.length } },
      out: { kind: 'shm', name: outName, offset: 0, size: cap } }],
  });
  expect(r.ok, JSON.stringify(r)).toBe(true);
  return { reply: r, frame: readFileSync(framePath).subarray(0, r.frames[0].bytes) };
}

async function jobsJson(): Promise<Record<string, any>> {
  const r = await runTzip(['--json', 'jobs', '--socket', socket], tmp());
  expect(r.code, r.stderr).toBe(0);
  return JSON.parse(r.stdout);
}

describe('tzip jobs', () => {
  it('lists a session that said hello with a job, with the bytes of its requests per stream', async () => {
    const before = (await jobsJson()).jobs.find((j: { name: string }) => j.name === 'train-cli');
    expect(before).toMatchObject({ name: 'train-cli', user: 'tester', state: 'running', sessions: 1, devices: ['cpu'] });
    expect(before.pids).toContain(process.pid);
    const data = bf16Weights(40_000, 7);
    const { reply } = await compressOnce(data, 'gradients');
    const doc = await jobsJson();
    expect(doc.daemon).toMatchObject({ pid: process.pid, socket });
    const job = doc.jobs.find((j: { name: string }) => j.name === 'train-cli');
    expect(job.streams.gradients.compress.requests).toBe(before.streams.gradients.compress.requests + 1);
    expect(job.streams.gradients.compress.bytes_in).toBe(before.streams.gradients.compress.bytes_in + data.length);
    expect(job.streams.gradients.compress.bytes_out).toBe(before.streams.gradients.compress.bytes_out + reply.frames[0].bytes);
  });

  it('prints a table with the daemon line and the job row', async () => {
    const r = await runTzip(['jobs', '--socket', socket], tmp());
    expect(r.code, r.stderr).toBe(0);
    expect(r.stdout).toContain(`tzip daemon pid ${process.pid}`);
    expect(r.stdout).toContain('codec rates, last 10 s');
    const row = r.stdout.split('\n').find((l) => l.includes('train-cli'));
    expect(row, r.stdout).toBeDefined();
    expect(row).toContain('tester');
    expect(row).toContain('attached');
  });

  it('says so, with exit code 3, when no daemon listens', async () => {
    const r = await runTzip(['jobs', '--socket', join(tmp(), 'nobody', 'tzip.sock')], tmp());
    expect(r.code).toBe(3);
    expect(r.stderr).toMatch(/no tzip daemon at .*nobody\/tzip\.sock.*tzip serve/);
    const j = await runTzip(['--json', 'jobs', '--socket', join(tmp(), 'nobody', 'tzip.sock')], tmp());
    expect(j.code).toBe(3);
    expect(JSON.parse(j.stdout).error.code).toBe('TZIP_IO');
  });

  it('says a killed daemon is gone (its socket and pid files left behind) instead of waiting out the timeout', async () => {
    const dead = join(tmp(), 'killed', 'tzip.sock');
    const child = spawn(process.execPath, [MAIN, '--json', 'serve', '--socket', dead], { stdio: ['ignore', 'pipe', 'ignore'] });
    await new Promise<void>((resolve, reject) => {
      child.stdout.on('data', (b: Buffer) => {
        if (b.toString().includes('"listening"')) resolve();
      });
      child.once('exit', (code) => reject(new Error(`tzip serve exited ${code}`)));
    });
    child.kill('SIGKILL');
    await new Promise((r) => child.once('exit', r));
    expect(existsSync(dead)).toBe(true);
    const r = await runTzip(['jobs', '--socket', dead], tmp());
    expect(r.code).toBe(3);
    expect(r.stderr).toMatch(new RegExp(`no tzip daemon at .*killed/tzip\\.sock: its daemon \\(pid ${child.pid}, since .*\\) is gone and left its socket file`));
  });
});

describe('tzip set', () => {
  it('switches a job\'s codec: the next compress writes frames of that codec, default goes back', async () => {
    const data = bf16Weights(30_000, 11);
    const auto = await compressOnce(data, 'optimizer');
    expect(readHeader(auto.frame).codec).not.toBe('raw');

    const off = await runTzip(['--json', 'set', 'train-cli', 'codec=off', '--socket', socket], tmp());
    expect(off.code, off.stderr).toBe(0);
    expect(JSON.parse(off.stdout)).toEqual({ job: 'train-cli', settings: { codec: 'off', sm_budget: null } });
    const raw = await compressOnce(data, 'optimizer');
    expect(raw.reply.frames[0].codec).toBe('raw');
    expect(readHeader(raw.frame).codec).toBe('raw');
    expect(raw.reply.settings).toEqual({ codec: 'off', sm_budget: null });
    expect((await jobsJson()).jobs.find((j: { name: string }) => j.name === 'train-cli').settings.codec).toBe('off');

    const fast = await runTzip(['set', 'train-cli', 'codec=fast', '--socket', socket], tmp());
    expect(fast.code, fast.stderr).toBe(0);
    expect(fast.stdout).toContain('job "train-cli": codec fast');
    expect(readHeader((await compressOnce(data, 'optimizer')).frame).codec).toBe('fast');

    const back = await runTzip(['set', 'train-cli', 'codec=default', '--socket', socket], tmp());
    expect(back.code, back.stderr).toBe(0);
    expect(readHeader((await compressOnce(data, 'optimizer')).frame).codec).toBe(readHeader(auto.frame).codec);
  });

  it('sets the daemon\'s sm_budget (no job), shown by tzip jobs; default clears it', async () => {
    const r = await runTzip(['--json', 'set', 'sm_budget=4', '--socket', socket], tmp());
    expect(r.code, r.stderr).toBe(0);
    expect(JSON.parse(r.stdout)).toMatchObject({ job: null, settings: { sm_budget: 4 } });
    expect((await jobsJson()).daemon.sm_budget).toBe(4);
    const both = await runTzip(['--json', 'set', 'train-cli', 'sm_budget=0', 'codec=max', '--socket', socket], tmp());
    expect(both.code, both.stderr).toBe(0);
    expect(JSON.parse(both.stdout)).toEqual({ job: 'train-cli', settings: { codec: 'max', sm_budget: 0 } });
    const clear = await runTzip(['set', 'train-cli', 'sm_budget=default', 'codec=default', '--socket', socket], tmp());
    expect(clear.code, clear.stderr).toBe(0);
    expect((await runTzip(['set', 'sm_budget=default', '--socket', socket], tmp())).code).toBe(0);
    expect((await jobsJson()).daemon.sm_budget).toBe(null);
  });

  it('refuses an unknown job (listing the jobs) and bad settings with exit code 1', async () => {
    const r = await runTzip(['set', 'no-such-job', 'codec=max', '--socket', socket], tmp());
    expect(r.code).toBe(1);
    expect(r.stderr).toContain('no job named "no-such-job"');
    expect(r.stderr).toContain('"train-cli"');
    for (const [args, message] of [
      [['codec=zstd'], /codec 'zstd' is not one of fast, max, auto, off, default/],
      [['sm_budget=2000'], /sm_budget '2000' is not an integer from 0/],
      [['train-cli'], /nothing to set/],
      [['train-cli', 'threads=4'], /unknown setting 'threads'/],
      [['codec=max', 'codec=fast'], /codec is given twice/],
    ] as const) {
      const bad = await runTzip(['set', ...args, '--socket', socket], tmp());
      expect(bad.code, `${args.join(' ')}: ${bad.stderr}`).toBe(1);
      expect(bad.stderr).toMatch(message);
    }
  });
});
