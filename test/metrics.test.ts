// The Prometheus endpoint of `tzip serve --metrics PORT` (src/daemon/metrics.ts, docs/configuration.md "Metrics"): a
// real daemon process, real requests of a job (MiniLM's bf16 weights and gradients through shared memory, round trips
// compared byte for byte), scraped with fetch; the counters equal the bytes and requests sent, the histogram counts
// them, the gauges follow sessions, jobs and `set`. The series of a job the registry dropped go with it (a real
// JobRegistry with a short keep time and a real session table).
import { spawn, type ChildProcessByStdio } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import type { Readable } from 'node:stream';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { JobRegistry } from '../src/daemon/jobs.js';
import { defaultLimits } from '../src/daemon/limits.js';
import { DaemonMetrics } from '../src/daemon/metrics.js';
import { SessionTable } from '../src/daemon/session.js';
import { DaemonStats } from '../src/daemon/stats.js';
import { maxCompressedSize } from '../src/native.js';
import { openSafetensors } from '../src/safetensors.js';
import { ensureBuilt } from './helpers/cli.js';
import { DaemonConn, shmFile } from './helpers/daemon-conn.js';
import { useTempDir } from './helpers/temp-dir.js';

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const MAIN = join(ROOT, 'dist', 'src', 'cli', 'main.js');
const tmp = useTempDir('metrics');
const JOB = 'metrics-test';
const BF16 = { code: 4, bits: 16, lanes: 1 };
const CPU = { type: 1, id: 0 };

/** A scrape parsed: `name{a="x",b="y"}` (labels sorted) -> value; and the raw text. */
interface Scrape {
  text: string;
  contentType: string | null;
  get(name: string, labels?: Record<string, string>): number | undefined;
}

/** Parses Prometheus' text format (one sample per line; `# HELP`/`# TYPE` lines skipped). */
function parseScrape(text: string, contentType: string | null): Scrape {
  const samples = new Map<string, number>();
  for (const line of text.split('\n')) {
    if (line === '' || line.startsWith('#')) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$/.exec(line);
    if (m === null) throw new Error(`not a sample line: ${line}`);
    const labels = [...(m[2] ?? '').matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)].map((l) => `${l[1]}="${l[2]}"`).sort();
    samples.set(`${m[1]}{${labels.join(',')}}`, Number(m[3]));
  }
  return {
    text, contentType,
    get: (name, labels = {}) => samples.get(`${name}{${Object.entries(labels).map(([k, v]) => `${k}="${v}"`).sort().join(',')}}`),
  };
}

let daemon: ChildProcessByStdio<null, Readable, Readable>;
let ready: { endpoint: string; metrics: string; socket: string };
let stderr = '';

async function scrape(): Promise<Scrape> {
  const res = await fetch(ready.metrics);
  expect(res.status).toBe(200);
  return parseScrape(await res.text(), res.headers.get('content-type'));
}

beforeAll(async () => {
  ensureBuilt();
  const env: NodeJS.ProcessEnv = {};
  for (const [k, v] of Object.entries(process.env)) if (!k.startsWith('TZIP_')) env[k] = v;
  env.XDG_CONFIG_HOME = join(tmp(), 'no-config');
  const socket = join(tmp(), 'd', 'tzip.sock');
  daemon = spawn(process.execPath, [MAIN, 'serve', '--socket', socket, '--metrics', '0', '--sm-budget', '7', '--json'], { env, stdio: ['ignore', 'pipe', 'pipe'] });
  daemon.stderr.on('data', (d: Buffer) => { stderr += d.toString(); });
  ready = await new Promise((resolve, reject) => {
    let out = '';
    daemon.stdout.on('data', (d: Buffer) => {
      out += d.toString();
      if (out.includes('\n')) resolve(JSON.parse(out.split('\n')[0] as string));
    });
    daemon.on('exit', (code) => reject(new Error(`daemon exited ${code}: ${stderr}`)));
  });
});

afterAll(async () => {
  if (daemon.exitCode !== null) return;
  const exited = new Promise<number | null>((resolve) => daemon.on('exit', (code) => resolve(code)));
  daemon.kill('SIGTERM');
  // The metrics server is closed too: the process exits by itself, with 0.
  expect(await exited).toBe(0);
});

/** Two bf16 weight tensors and one bf16 gradient tensor of MiniLM (a real trained model and its real gradients). */
async function minilm(): Promise<{ name: string; bytes: Buffer; shape: number[] }[]> {
  const picked: { name: string; bytes: Buffer; shape: number[] }[] = [];
  for (const [file, count] of [['minilm-weights-bf16.safetensors', 2], ['minilm-grads-bf16.safetensors', 1]] as const) {
    const f = await openSafetensors(join(ROOT, 'data', 'demo', file));
    const ts = f.header.tensors.filter((t) => t.dtype === 'BF16' && t.shape.length === 2 && t.end - t.begin === 384 * 384 * 2).slice(0, count);
    for (const t of ts) picked.push({ name: t.name, bytes: await f.read(t.begin, t.end), shape: t.shape });
    await f.close();
  }
  expect(picked).toHaveLength(3);
  return picked;
}

describe('tzip serve --metrics', () => {
  it('answers GET /metrics in Prometheus\' text format, 404 elsewhere, 405 to POST; the gauges before any client', async () => {
    expect(ready.metrics).toMatch(/^http:\/\/127\.0\.0\.1:\d+\/metrics$/);
    const s = await scrape();
    expect(s.contentType).toBe('text/plain; version=0.0.4; charset=utf-8');
    expect(s.text).toContain('# TYPE tzip_requests_total counter');
    expect(s.text).toContain('# TYPE tzip_request_duration_seconds histogram');
    expect(s.get('tzip_sessions')).toBe(0);
    expect(s.get('tzip_sm_budget')).toBe(7); // --sm-budget
    expect(s.get('tzip_mapped_bytes')).toBe(0);
    expect(s.get('tzip_jobs', { state: 'running' })).toBe(0);
    expect(s.get('process_resident_memory_bytes')).toBeGreaterThan(0);
    expect((await fetch(new URL('/other', ready.metrics))).status).toBe(404);
    expect((await fetch(ready.metrics, { method: 'POST', body: 'x' })).status).toBe(405);
    expect((await fetch(ready.metrics, { method: 'HEAD' })).status).toBe(200);
  });

  it('counts a job\'s requests, bytes and tensors per stream and direction, errors by code, durations by op and device', async () => {
    const tensors = await minilm();
    const c = new DaemonConn(ready.endpoint, JOB);
    try {
      const hello = await c.req({ op: 'hello', versions: [1, 2, 3], pid: process.pid, shm_prefix: c.prefix, name: 'vitest',
        job: { name: JOB, rank: 0, world_size: 1, devices: ['cpu'] } });
      expect(hello.version).toBe(3);
      c.sid = hello.sid;
      expect((await c.call('job', { job: { name: JOB, rank: 0, world_size: 1 }, attached: true })).ok).toBe(true);

      // One shm file: the three tensors, their frames, and room to decode them back.
      const caps = tensors.map((t) => maxCompressedSize(t.bytes.length, 2));
      const sizes = tensors.map((t) => t.bytes.length);
      const inOff = [0, sizes[0]!, sizes[0]! + sizes[1]!];
      const frameBase = 1 << 20;
      const frameOff = [frameBase, frameBase + caps[0]!, frameBase + caps[0]! + caps[1]!];
      const backBase = 2 << 20;
      const name = `${c.prefix}m`;
      const path = shmFile(name, 3 << 20, Buffer.concat(tensors.map((t) => t.bytes)));
      const item = (i: number) => ({
        tensor: { device: CPU, dtype: BF16, shape: tensors[i]!.shape, byte_offset: 0, data: { kind: 'shm', name, offset: inOff[i], size: sizes[i] } },
        out: { kind: 'shm', name, offset: frameOff[i], size: caps[i] },
      });
      const weights = await c.call('compress', { tensors: [item(0), item(1)], codec: 'auto', stream: 'checkpoint' });
      expect(weights.ok, JSON.stringify(weights.error)).toBe(true);
      const grads = await c.call('compress', { tensors: [item(2)], codec: 'auto', stream: 'gradients' });
      expect(grads.ok, JSON.stringify(grads.error)).toBe(true);
      const frames: number[] = [...weights.frames.map((f: { bytes: number }) => f.bytes), grads.frames[0].bytes];
      const back = await c.call('decompress', { stream: 'checkpoint', frames: [0, 1].map((i) => ({
        frame: { kind: 'shm', name, offset: frameOff[i], size: frames[i] },
        out: { device: CPU, dtype: BF16, shape: tensors[i]!.shape, byte_offset: 0, data: { kind: 'shm', name, offset: backBase + inOff[i]!, size: sizes[i] } },
      })) });
      expect(back.ok, JSON.stringify(back.error)).toBe(true);
      const file = readFileSync(path);
      for (const i of [0, 1]) expect(file.subarray(backBase + inOff[i]!, backBase + inOff[i]! + sizes[i]!).equals(tensors[i]!.bytes)).toBe(true);
      // A frame that is not one (its first bytes zeroed): an error reply, counted by its code, no bytes counted.
      const broken = Buffer.alloc(frames[2]!);
      shmFile(`${c.prefix}z`, frames[2]!, broken);
      const bad = await c.call('decompress', { stream: 'gradients', frames: [{
        frame: { kind: 'shm', name: `${c.prefix}z`, offset: 0, size: frames[2] },
        out: { device: CPU, dtype: BF16, shape: tensors[2]!.shape, byte_offset: 0, data: { kind: 'shm', name, offset: backBase + inOff[2]!, size: sizes[2] } },
      }] });
      expect(bad.ok).toBe(false);
      const code = bad.error.code as string;

      const s = await scrape();
      const flow = (stream: string, direction: string) => ({ job_name: JOB, stream, direction });
      expect(s.get('tzip_requests_total', { op: 'hello' })).toBe(1);
      expect(s.get('tzip_requests_total', { op: 'job' })).toBe(1);
      expect(s.get('tzip_requests_total', { op: 'compress' })).toBe(2);
      expect(s.get('tzip_requests_total', { op: 'decompress' })).toBe(2);
      expect(s.get('tzip_errors_total', { op: 'decompress', code })).toBe(1);
      expect(s.get('tzip_errors_total', { op: 'compress', code })).toBeUndefined();
      expect(s.get('tzip_bytes_in_total', flow('checkpoint', 'compress'))).toBe(sizes[0]! + sizes[1]!);
      expect(s.get('tzip_bytes_out_total', flow('checkpoint', 'compress'))).toBe(frames[0]! + frames[1]!);
      expect(s.get('tzip_tensors_total', flow('checkpoint', 'compress'))).toBe(2);
      expect(s.get('tzip_bytes_in_total', flow('gradients', 'compress'))).toBe(sizes[2]);
      expect(s.get('tzip_bytes_out_total', flow('gradients', 'compress'))).toBe(frames[2]);
      expect(s.get('tzip_bytes_in_total', flow('checkpoint', 'decompress'))).toBe(frames[0]! + frames[1]!);
      expect(s.get('tzip_bytes_out_total', flow('checkpoint', 'decompress'))).toBe(sizes[0]! + sizes[1]!);
      expect(s.get('tzip_tensors_total', flow('checkpoint', 'decompress'))).toBe(2);
      // The failed decompress counted nothing under its stream.
      expect(s.get('tzip_bytes_in_total', flow('gradients', 'decompress'))).toBeUndefined();
      // Real weights compress: fewer bytes out than in.
      expect(s.get('tzip_bytes_out_total', flow('checkpoint', 'compress'))!).toBeLessThan(sizes[0]! + sizes[1]!);
      // The histogram: every compress on the CPU, with a positive total time and all below +Inf.
      expect(s.get('tzip_request_duration_seconds_count', { op: 'compress', device: 'cpu' })).toBe(2);
      expect(s.get('tzip_request_duration_seconds_bucket', { op: 'compress', device: 'cpu', le: '+Inf' })).toBe(2);
      expect(s.get('tzip_request_duration_seconds_sum', { op: 'compress', device: 'cpu' })!).toBeGreaterThan(0);
      expect(s.get('tzip_request_duration_seconds_count', { op: 'hello', device: 'none' })).toBe(1);
      // Gauges of this moment: one session of one running, attached job; its shared memory still mapped.
      expect(s.get('tzip_sessions')).toBe(1);
      expect(s.get('tzip_sessions_opened_total')).toBe(1);
      expect(s.get('tzip_jobs', { state: 'running' })).toBe(1);
      expect(s.get('tzip_job_sessions', { job_name: JOB })).toBe(1);
      expect(s.get('tzip_job_attached', { job_name: JOB })).toBe(1);
      expect(s.get('tzip_mapped_bytes')!).toBeGreaterThanOrEqual(3 << 20);
      expect(s.get('tzip_mapped_files')!).toBeGreaterThanOrEqual(1);

      // `set` changes the SM budgets at run time: the gauges read them at the next scrape.
      expect((await c.req({ op: 'set', sm_budget: 3 })).ok).toBe(true);
      expect((await c.req({ op: 'set', job: JOB, sm_budget: 5 })).ok).toBe(true);
      const after = await scrape();
      expect(after.get('tzip_sm_budget')).toBe(3);
      expect(after.get('tzip_job_sm_budget', { job_name: JOB })).toBe(5);
      expect(after.get('tzip_requests_total', { op: 'set' })).toBe(2);
      // Cleared, the daemon's budget goes back to what it started with (--sm-budget 7), the job's to the daemon's.
      expect((await c.req({ op: 'set', sm_budget: null })).settings).toMatchObject({ sm_budget: 7 });
      expect((await c.req({ op: 'set', job: JOB, sm_budget: null })).settings).toMatchObject({ sm_budget: 7 });
      expect((await c.req({ op: 'set', sm_budget: 3 })).ok).toBe(true);

      // The session ends (goodbye): the gauges follow, the job is listed as ended, its counters stay.
      expect((await c.call('release', { end: true })).ok).toBe(true);
      const ended = await scrape();
      expect(ended.get('tzip_sessions')).toBe(0);
      expect(ended.get('tzip_sessions_ended_total', { reason: 'goodbye' })).toBe(1);
      expect(ended.get('tzip_jobs', { state: 'ended' })).toBe(1);
      expect(ended.get('tzip_job_sessions', { job_name: JOB })).toBe(0);
      expect(ended.get('tzip_job_attached', { job_name: JOB })).toBe(0);
      expect(ended.get('tzip_mapped_bytes')).toBe(0);
      expect(ended.get('tzip_bytes_in_total', flow('checkpoint', 'compress'))).toBe(sizes[0]! + sizes[1]!);
    } finally {
      c.close();
    }
  });
});

describe('DaemonMetrics', () => {
  it('drops the series of a job once the registry no longer lists it', async () => {
    const limits = defaultLimits();
    const sessions = new SessionTable(limits, () => undefined);
    const jobs = new JobRegistry(50); // ended jobs listed for 50 ms
    const metrics = new DaemonMetrics();
    metrics.attach({ stats: new DaemonStats(), sessions, jobs });
    const a = sessions.open(process.pid, `tzip-${process.pid}-0000000a-`, 'a', 3, 'ra');
    const b = sessions.open(process.pid, `tzip-${process.pid}-0000000b-`, 'b', 3, 'rb');
    jobs.join(a);
    jobs.join(b);
    for (const job of ['a', 'b']) {
      jobs.record(job === 'a' ? a : b, 'compress', 'gradients', { seconds: 0.001, items: 1, bytesIn: 100, bytesOut: 60, error: null });
      metrics.observe({ op: 'compress', job, stream: 'gradients', device: 'cpu', seconds: 0.001, items: 1, bytesIn: 100, bytesOut: 60, error: null });
    }
    const series = (text: string, job: string) => text.split('\n').filter((l) => l.includes(`job_name="${job}"`) && l.startsWith('tzip_bytes_'));
    const before = await metrics.text();
    expect(series(before, 'a')).toHaveLength(2);
    expect(series(before, 'b')).toHaveLength(2);
    jobs.leave(a);
    // Ended but still listed: its series stay.
    expect(series(await metrics.text(), 'a')).toHaveLength(2);
    await new Promise((r) => setTimeout(r, 80));
    const after = await metrics.text();
    expect(series(after, 'a')).toEqual([]);
    expect(series(after, 'b')).toEqual(['tzip_bytes_in_total{job_name="b",stream="gradients",direction="compress"} 100',
      'tzip_bytes_out_total{job_name="b",stream="gradients",direction="compress"} 60']);
    sessions.endAll('shutdown');
  });
});
