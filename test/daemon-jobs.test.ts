// Protocol version 3 against a daemon in this process over ipc:// (ZeroMQ DEALERs, /dev/shm files made here): jobs
// named in hello and by the `job` op, per-stream counters after real round trips (bytes compared), `set` switching a
// job's codec (and the daemon's) at the next request, version gating, the observer's events and the logger option.
// The GPU path's SM budget is checked against a stand-in for the addon's GPU functions, and, on a machine with a GPU,
// against the real GPU codec of a `tzip serve` child process that opens this process's CUDA IPC handles.
import { execFileSync } from 'node:child_process';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { useGpuApiForTests, type GpuApi } from '../src/daemon/gpu.js';
import { ENDED_JOB_KEEP_MS, JobRegistry, MAX_ENDED_JOBS } from '../src/daemon/jobs.js';
import { defaultLimits } from '../src/daemon/limits.js';
import { daemonUsesMps, sharesMps } from '../src/daemon/mps.js';
import { RateWindow } from '../src/daemon/rates.js';
import { Daemon, type RequestEvent } from '../src/daemon/server.js';
import { Session } from '../src/daemon/session.js';
import type { Logger } from '../src/logger.js';
import {
  addonAvailable, compress, cudaIpcGetMemHandle, decompress, gpu, gpuAlloc, gpuCopyFromDevice, gpuCopyToDevice, gpuDevices, gpuFree,
  maxCompressedSize, readHeader, type FrameHeader, type GpuCompressed, type GpuRunOptions,
} from '../src/native.js';
import { bf16Weights } from './helpers/bf16-weights.js';
import { startServe, type ServeChild } from './helpers/cli.js';
import { DaemonConn } from './helpers/daemon-conn.js';
import { bf16RoundTrip } from './helpers/shm-round-trip.js';
import { useTempDir } from './helpers/temp-dir.js';

const tmp = useTempDir('daemon-jobs');
const BF16 = { code: 4, bits: 16, lanes: 1 };
const CPU = { type: 1, id: 0 };

let daemon: Daemon;
const events: RequestEvent[] = [];
const lines: { level: string; msg: string; fields?: Record<string, unknown> }[] = [];
const logger: Logger = {
  debug: (msg, fields) => lines.push({ level: 'debug', msg, ...(fields ? { fields } : {}) }),
  info: (msg, fields) => lines.push({ level: 'info', msg, ...(fields ? { fields } : {}) }),
  warn: (msg, fields) => lines.push({ level: 'warn', msg, ...(fields ? { fields } : {}) }),
  error: (msg, fields) => lines.push({ level: 'error', msg, ...(fields ? { fields } : {}) }),
};

beforeAll(async () => {
  const limits = { ...defaultLimits(), leaseMs: 5000 };
  daemon = await Daemon.start({ socketPath: join(tmp(), 'd', 'tzip.sock'), limits, logger, observer: (e) => events.push(e) });
});

afterAll(async () => {
  await daemon.stop('tests done');
});

/** A connection that says hello with protocol versions 1-3 and `job` (if given). */
async function v3(name: string, job?: Record<string, unknown> | null): Promise<DaemonConn> {
  const c = new DaemonConn(daemon.endpoint, name);
  const h = await c.req({ op: 'hello', versions: [1, 2, 3], pid: c.pid, shm_prefix: c.prefix, name, ...(job !== undefined ? { job } : {}) });
  expect(h.ok, JSON.stringify(h)).toBe(true);
  expect(h.version).toBe(3);
  c.sid = h.sid;
  return c;
}

async function jobs(): Promise<Record<string, any>> {
  const c = new DaemonConn(daemon.endpoint);
  try {
    const r = await c.req({ op: 'jobs' });
    expect(r.ok, JSON.stringify(r)).toBe(true);
    return r;
  } finally {
    c.close();
  }
}

async function jobNamed(name: string): Promise<Record<string, any>> {
  const j = (await jobs()).jobs.find((x: { name: string }) => x.name === name);
  expect(j, `job ${name} listed`).toBeDefined();
  return j;
}

async function set(body: Record<string, unknown>): Promise<Record<string, any>> {
  const c = new DaemonConn(daemon.endpoint);
  try {
    return await c.req({ op: 'set', ...body });
  } finally {
    c.close();
  }
}

describe('jobs (protocol version 3)', () => {
  it('lists the job hello names, with every rank, and counts each stream of real round trips', async () => {
    const info = { name: 'train-a', user: 'alice', world_size: 2, devices: ['cpu'], mps: null };
    const r0 = await v3('rank0', { ...info, rank: 0 });
    const r1 = await v3('rank1', { ...info, rank: 1 });
    try {
      let j = await jobNamed('train-a');
      // The client says nothing of MPS (null); the daemon knows only where it sees a GPU (false or true there), and
      // shares_mps is false as soon as one side says false.
      const daemonMps = (await jobs()).daemon.mps as boolean | null;
      expect(j).toMatchObject({ user: 'alice', state: 'running', sessions: 2, ranks: [0, 1], world_size: 2, devices: ['cpu'], attached: true,
        mps: null, shares_mps: daemonMps === false ? false : null, settings: { codec: null, sm_budget: null } });
      expect(j.pids).toEqual([process.pid]);
      expect(Math.abs(j.attached_at_ms - Date.now())).toBeLessThan(60_000);
      expect(j.totals.bytes_in).toBe(0);

      const grads = bf16Weights(50_000, 3);
      const a = await bf16RoundTrip(r0, grads, 'g', { stream: 'gradients' });
      expect(a.back.equals(grads)).toBe(true);
      expect(a.compress.settings).toEqual({ codec: null, sm_budget: null });
      expect(a.decompress.settings).toEqual({ codec: null, sm_budget: null });
      const state = bf16Weights(20_000, 4);
      const b = await bf16RoundTrip(r1, state, 'o', { stream: 'optimizer' });
      expect(b.back.equals(state)).toBe(true);
      const plain = bf16Weights(1000, 5);
      await bf16RoundTrip(r1, plain, 'x'); // no stream: counted as "other"

      j = await jobNamed('train-a');
      const g = j.streams.gradients;
      expect(g.compress).toMatchObject({ requests: 1, items: 1, bytes_in: grads.length, bytes_out: a.compress.frames[0].bytes });
      expect(g.decompress).toMatchObject({ requests: 1, items: 1, bytes_in: a.compress.frames[0].bytes, bytes_out: grads.length });
      expect(g.compress.seconds).toBeGreaterThan(0);
      expect(g.errors).toBe(0);
      expect(j.streams.optimizer.compress.bytes_in).toBe(state.length);
      expect(j.streams.other.compress.bytes_in).toBe(plain.length);
      expect(j.streams.checkpoint.compress.requests).toBe(0);
      const original = grads.length + state.length + plain.length;
      const frames = a.compress.frames[0].bytes + b.compress.frames[0].bytes + (j.streams.other.compress.bytes_out as number);
      expect(j.totals.bytes_in).toBe(2 * original);
      expect(j.totals.bytes_out).toBe(2 * frames);
      expect(j.totals.ratio).toBeCloseTo(frames / original, 10);
      expect(j.totals.requests).toBe(6);
      expect(j.totals.gbps).toBeGreaterThan(0);

      // an error is counted under its stream
      const bad = await r0.call('decompress', { stream: 'checkpoint', frames: [{ frame: { kind: 'shm', name: `${r0.prefix}missing`, offset: 0, size: 64 },
        out: { device: CPU, dtype: BF16, shape: [32], byte_offset: 0, data: { kind: 'shm', name: `${r0.prefix}missing2`, offset: 0, size: 64 } } }] });
      expect(bad.ok).toBe(false);
      j = await jobNamed('train-a');
      expect(j.streams.checkpoint.errors).toBe(1);

      const d = (await jobs()).daemon;
      // The GPUs the daemon's process sees (none off a GPU host), and MPS known only where there is one.
      const gpus = probe.available ? gpuDevices().map((g) => expect.objectContaining({ uuid: g.uuid, name: g.name })) : [];
      expect(d).toMatchObject({ pid: process.pid, socket: daemon.socketPath, sm_budget: null, sm_budget_default: 10, codec: null,
        mps: probe.available ? expect.any(Boolean) : null, gpus });
      expect(d.rates.compress_gbps).toBeGreaterThan(0);
      expect(d.rates.decompress_gbps).toBeGreaterThan(0);
    } finally {
      r0.close();
      r1.close();
    }
  });

  it('set: a job codec applies at its next request (off: raw frames), the daemon codec to jobs without one; null clears', async () => {
    const c = await v3('steered', { name: 'train-b' });
    const other = await v3('bystander', { name: 'train-c' });
    try {
      const data = bf16Weights(40_000, 7);
      const before = await bf16RoundTrip(c, data, 'b0');
      expect(['fast', 'max']).toContain(before.compress.frames[0].codec);

      const s = await set({ job: 'train-b', codec: 'off' });
      expect(s).toMatchObject({ ok: true, job: 'train-b', settings: { codec: 'off', sm_budget: null }, overrides: { codec: 'off', sm_budget: null } });
      const off = await bf16RoundTrip(c, data, 'b1');
      expect(off.compress.frames[0].codec).toBe('raw');
      expect(readHeader(off.frame).codec).toBe('raw');
      expect(off.back.equals(data)).toBe(true);
      expect(off.compress.settings).toEqual({ codec: 'off', sm_budget: null });
      // the heartbeat tells the client too; the other job is untouched
      expect((await c.call('heartbeat')).settings).toEqual({ codec: 'off', sm_budget: null });
      const untouched = await bf16RoundTrip(other, data, 'c0');
      expect(['fast', 'max']).toContain(untouched.compress.frames[0].codec);

      // the daemon's codec: for every job without one of its own
      const d = await set({ codec: 'max', sm_budget: 20 });
      expect(d).toMatchObject({ ok: true, job: null, settings: { codec: 'max', sm_budget: 20 } });
      const viaDaemon = await bf16RoundTrip(other, data, 'c1');
      expect(viaDaemon.compress.frames[0].codec).toBe('max');
      expect(viaDaemon.compress.settings).toEqual({ codec: 'max', sm_budget: 20 });
      expect(viaDaemon.back.equals(data)).toBe(true);
      expect((await bf16RoundTrip(c, data, 'b2')).compress.frames[0].codec).toBe('raw');
      expect((await jobNamed('train-b')).settings).toEqual({ codec: 'off', sm_budget: 20 });

      // cleared: the job follows the daemon again, then the request's own codec
      expect((await set({ job: 'train-b', codec: null })).settings).toEqual({ codec: 'max', sm_budget: 20 });
      expect((await bf16RoundTrip(c, data, 'b3')).compress.frames[0].codec).toBe('max');
      expect((await set({ codec: null, sm_budget: null })).settings).toEqual({ codec: null, sm_budget: null });
      const back = await bf16RoundTrip(c, data, 'b4');
      expect(back.compress.frames[0].codec).toBe(before.compress.frames[0].codec);
      expect(back.frame.equals(before.frame)).toBe(true);

      // a query: no field changes nothing
      expect((await set({ job: 'train-b' })).settings).toEqual({ codec: null, sm_budget: null });
      const unknown = await set({ job: 'nope', codec: 'fast' });
      expect(unknown.error.code).toBe('TZIP_USAGE');
      expect(unknown.error.message).toContain('"train-b"');
      expect((await set({ codec: 'bytes' })).error.code).toBe('TZIP_PROTOCOL');
      expect((await set({ sm_budget: 2000 })).error.code).toBe('TZIP_PROTOCOL');
    } finally {
      c.close();
      other.close();
    }
  });

  it('the job op sets, moves, detaches and clears a session\'s job', async () => {
    const c = await v3('late-attacher');
    try {
      let j = await jobNamed('late-attacher'); // no job: listed under its hello name
      expect(j.attached).toBe(false);
      expect(j.attached_at_ms).toBeNull();
      const r = await c.call('job', { job: { name: 'train-d', rank: 3 }, attached: true });
      expect(r).toMatchObject({ ok: true, job: 'train-d', settings: { codec: null, sm_budget: null } });
      j = await jobNamed('train-d');
      expect(j).toMatchObject({ attached: true, rank: 3, sessions: 1 });
      // the name it left had no request: not listed as ended
      expect((await jobs()).jobs.map((x: { name: string }) => x.name)).not.toContain('late-attacher');
      await c.call('job', { job: { name: 'train-d', rank: 3 }, attached: false });
      j = await jobNamed('train-d');
      expect(j.attached).toBe(false);
      expect(j.attached_at_ms).toBeNull();
      expect((await c.call('job', { job: null, attached: false })).job).toBe('late-attacher');
      const names = (await jobs()).jobs.map((x: { name: string }) => x.name);
      expect(names).toContain('late-attacher');
      expect(names).not.toContain('train-d'); // left without a request or a setting
    } finally {
      c.close();
    }
  });

  it('a job outlives its sessions as "ended", with its counters and settings', async () => {
    const c = await v3('short', { name: 'train-e' });
    await bf16RoundTrip(c, bf16Weights(2000, 9), 'e');
    await set({ job: 'train-e', sm_budget: 4 });
    await c.call('release', { end: true });
    c.close();
    const j = await jobNamed('train-e');
    expect(j).toMatchObject({ state: 'ended', sessions: 0, attached: false, overrides: { codec: null, sm_budget: 4 } });
    expect(j.ended_at_ms).toBeGreaterThan(0);
    expect(j.streams.other.compress.requests).toBe(1);
    // a new session of the job finds it as it was left
    const again = await v3('again', { name: 'train-e' });
    try {
      expect((await again.call('heartbeat')).settings).toEqual({ codec: null, sm_budget: 4 });
      expect((await jobNamed('train-e')).state).toBe('running');
    } finally {
      again.close();
    }
  });

  it('keeps versions 1 and 2 as they were: no settings in replies, version 3 fields refused', async () => {
    const c = new DaemonConn(daemon.endpoint, 'old-client');
    try {
      const h = await c.hello();
      expect(h.version).toBe(1);
      expect(h.daemon.protocol_versions).toEqual([1, 2, 3, 4]);
      expect(h.settings).toBeUndefined();
      const data = bf16Weights(3000, 11);
      const rt = await bf16RoundTrip(c, data, 'v1');
      expect(rt.back.equals(data)).toBe(true);
      expect(rt.compress.settings).toBeUndefined();
      expect((await c.call('heartbeat')).settings).toBeUndefined();
      const tagged = await c.call('compress', { stream: 'gradients', tensors: [] });
      expect(tagged.error.code).toBe('TZIP_PROTOCOL');
      expect(tagged.error.message).toContain('version 3');
      expect((await c.call('compress', { sm_budget: 8, tensors: [] })).error.code).toBe('TZIP_PROTOCOL');
      expect((await c.call('job', { job: { name: 'x' }, attached: true })).error.code).toBe('TZIP_PROTOCOL');
      const h2 = await c.req({ op: 'hello', versions: [1, 2], pid: c.pid, shm_prefix: c.prefix, job: { name: 'x' } });
      expect(h2.error.code).toBe('TZIP_PROTOCOL');
      // a version 3 session: unknown stream and out-of-range budgets are schema errors
      const v = await v3('checker');
      try {
        expect((await v.call('compress', { stream: 'weights', tensors: [] })).error.code).toBe('TZIP_PROTOCOL');
        expect((await v.call('decompress', { sm_budget: -1, frames: [] })).error.code).toBe('TZIP_PROTOCOL');
        expect((await v.call('compress', { stream: 'checkpoint', sm_budget: 0, tensors: [] })).ok).toBe(true);
        const bad = await v.req({ op: 'hello', versions: [3], pid: v.pid, shm_prefix: v.prefix, job: { name: '' } });
        expect(bad.error.code).toBe('TZIP_PROTOCOL');
      } finally {
        v.close();
      }
    } finally {
      c.close();
    }
  });

  it('tells the observer every answered request and logs through the logger', async () => {
    events.length = 0;
    const c = await v3('observed', { name: 'train-f' });
    try {
      const data = bf16Weights(5000, 13);
      const rt = await bf16RoundTrip(c, data, 'f', { stream: 'sendrecv' });
      await c.raw(Buffer.from('not msgpack'));
      await jobs();
      const hello = events.find((e) => e.op === 'hello');
      expect(hello).toMatchObject({ job: 'train-f', stream: null, device: null, items: 0, error: null });
      expect(events.find((e) => e.op === 'compress')).toMatchObject({ job: 'train-f', stream: 'sendrecv', device: 'cpu', items: 1,
        bytesIn: data.length, bytesOut: rt.compress.frames[0].bytes, error: null });
      expect(events.find((e) => e.op === 'decompress')).toMatchObject({ device: 'cpu', bytesIn: rt.compress.frames[0].bytes, bytesOut: data.length });
      expect(events.find((e) => e.op === 'invalid')).toMatchObject({ job: null, error: 'TZIP_PROTOCOL' });
      expect(events.find((e) => e.op === 'jobs')).toMatchObject({ job: null, error: null });
      for (const e of events) expect(e.seconds).toBeGreaterThanOrEqual(0);
      // The start-up line about GPUs: which are served, or why none is.
      expect(lines.some((l) => l.level === 'info' && /^(no GPU served|GPUs served through CUDA IPC)/.test(l.msg))).toBe(true);
      expect(lines.some((l) => l.level === 'debug' && l.msg.includes('opened by pid') && l.fields?.job === 'train-f')).toBe(true);
      expect(lines.some((l) => l.level === 'info' && l.msg.startsWith('settings of job "train-b": codec=off'))).toBe(true);
    } finally {
      c.close();
    }
  });
});

describe('an observer that throws', () => {
  it('is logged and changes no reply', async () => {
    const logged: string[] = [];
    const d = await Daemon.start({ socketPath: join(tmp(), 'o', 'tzip.sock'), limits: defaultLimits(), log: (line) => logged.push(line),
      observer: () => { throw new Error('observer bug'); } });
    const c = new DaemonConn(d.endpoint, 'o');
    try {
      expect((await c.hello()).ok).toBe(true);
      expect((await c.call('heartbeat')).ok).toBe(true);
      expect(logged.filter((l) => l.includes('the request observer failed: observer bug'))).toHaveLength(2);
      expect(logged.some((l) => l.startsWith('error: '))).toBe(true);
    } finally {
      c.close();
      await d.stop('test done');
    }
  });
});

describe('the registry and its parts', () => {
  const limits = defaultLimits();
  const session = (pid: number, name: string) => new Session(pid, `tzip-${pid}-0000abcd-`, name, 3, limits);

  it('drops an ended job after the keep time, never a live one', () => {
    const reg = new JobRegistry(1000);
    const a = session(11, 'a');
    a.setJob({ name: 'j' }, true, 0);
    reg.join(a, 0);
    reg.record(a, 'compress', undefined, { seconds: 0.1, items: 1, bytesIn: 10, bytesOut: 5, error: null });
    const b = session(12, '');
    reg.join(b, 0);
    expect(reg.all(0).map((j) => j.name).sort()).toEqual(['j', 'pid-12']);
    reg.leave(a, 100);
    expect(reg.get('j')?.endedAt).toBe(100);
    expect(reg.all(1100).map((j) => j.name).sort()).toEqual(['j', 'pid-12']);
    expect(reg.all(1101).map((j) => j.name)).toEqual(['pid-12']);
    expect(reg.all(10_000_000).map((j) => j.name)).toEqual(['pid-12']);
    expect(ENDED_JOB_KEEP_MS).toBe(60_000);
  });

  it('bounds the ended jobs it lists, and counts a request that outlived its session into the job it was in', () => {
    const reg = new JobRegistry();
    for (let i = 0; i <= MAX_ENDED_JOBS; i++) {
      const s = session(20, 'r');
      s.setJob({ name: `run-${i}` }, true, i);
      reg.join(s, i);
      reg.record(s, 'compress', 'gradients', { seconds: 0, items: 1, bytesIn: 2, bytesOut: 1, error: null });
      reg.leave(s, i);
      if (i === MAX_ENDED_JOBS) {
        reg.record(s, 'decompress', 'gradients', { seconds: 0, items: 1, bytesIn: 1, bytesOut: 2, error: null });
        expect(reg.get(`run-${i}`)?.streams.gradients.decompress.bytesOut).toBe(2);
      }
    }
    const names = reg.all(MAX_ENDED_JOBS).map((j) => j.name);
    expect(names).toHaveLength(MAX_ENDED_JOBS);
    expect(names).not.toContain('run-0'); // the first to end went first
    expect(names).toContain(`run-${MAX_ENDED_JOBS}`);
  });

  it('applies settings: the job\'s codec over every request, its budget over the request\'s, the daemon\'s as defaults', () => {
    const reg = new JobRegistry();
    const s = session(13, 'x');
    reg.join(s);
    expect(reg.apply(s, undefined)).toEqual({ codec: undefined, smBudget: undefined });
    expect(reg.apply(s, 7)).toEqual({ codec: undefined, smBudget: 7 });
    reg.set(undefined, { codec: 'fast', sm_budget: 16 });
    expect(reg.apply(s, undefined)).toEqual({ codec: 'fast', smBudget: 16 });
    expect(reg.apply(s, 0)).toEqual({ codec: 'fast', smBudget: 0 });
    reg.set('x', { codec: 'off', sm_budget: 2 });
    expect(reg.apply(s, 0)).toEqual({ codec: 'raw', smBudget: 2 });
    expect(() => reg.set('y', { codec: 'max' })).toThrow(/no job named "y"; the daemon lists "x"/);
  });

  it('rates over the last 10 s, MPS words', () => {
    const r = new RateWindow(10);
    r.add(5e9, 1_000_500);
    r.add(5e9, 1_009_000);
    expect(r.perSecond(1_009_999)).toBe(1e9);
    expect(r.perSecond(1_010_000)).toBe(0.5e9); // the first second left the window
    expect(r.perSecond(1_030_000)).toBe(0);
    expect(daemonUsesMps(false)).toBeNull();
    expect(daemonUsesMps(true, { CUDA_MPS_PIPE_DIRECTORY: join(tmp(), 'no-mps-here') })).toBe(false);
    expect(sharesMps(true, true)).toBe(true);
    expect(sharesMps(true, false)).toBe(false);
    expect(sharesMps(null, true)).toBeNull();
    expect(sharesMps(false, null)).toBe(false);
  });
});

// The GPU path's SM budget reaches the addon: a stand-in GPU whose "device memory" is host memory and whose codec is
// the CPU codec records each call's options (daemon-gpu.test.ts has the full stand-in; this one does what these
// requests need).
describe('SM budget on the GPU path (stand-in GPU)', () => {
  const UUID = 'GPU-99999999-2222-3333-4444-555555555555';
  const memory = new Map<bigint, Buffer>();
  const calls: { op: string; opts: GpuRunOptions }[] = [];
  let next = 0x7000_0000_0000n;
  let nextEvent = 1n;
  let gpuDaemon: Daemon;
  const resolve = (ptr: bigint, n: number): Buffer => {
    for (const [base, mem] of memory) {
      if (ptr >= base && ptr + BigInt(n) <= base + BigInt(mem.length)) return mem.subarray(Number(ptr - base), Number(ptr - base) + n);
    }
    throw Object.assign(new Error('not device memory'), { code: 'TZIP_INVALID_ARGUMENT' });
  };
  const api: GpuApi = {
    gpuDevices: () => [{ ordinal: 0, uuid: UUID, name: 'Stand-in GPU', smCount: 132, totalMemory: 1 << 30, pciBusId: '', computeCapability: '9.0' }],
    cudaIpcOpenMemHandle: (h) => Buffer.from(h).readBigUInt64LE(0),
    cudaIpcCloseMemHandle: () => undefined,
    cudaIpcOpenEventHandle: () => nextEvent++,
    cudaEventCreateInterprocess: () => ({ event: nextEvent, handle: Buffer.alloc(64, Number(nextEvent++)) }),
    cudaEventDestroy: () => undefined,
    cudaMemGetInfo: () => ({ free: 1 << 29, total: 1 << 30 }),
    gpuCompress: async (items, opts) => {
      calls.push({ op: 'compress', opts });
      const out: GpuCompressed[] = [];
      for (const it of items) {
        const frame = await compress(resolve(it.data, Number(it.nbytes)), { dtype: it.dtype, shape: it.shape.map(Number), codec: it.codec });
        frame.copy(resolve(it.frame, Number(it.frameCapacity)));
        out.push({ frameBytes: BigInt(frame.length), codec: readHeader(frame).codec });
      }
      return out;
    },
    gpuDecompress: async (items, opts) => {
      calls.push({ op: 'decompress', opts });
      const headers: FrameHeader[] = [];
      for (const it of items) {
        const frame = resolve(it.frame, Number(it.frameBytes));
        await decompress(frame, { out: resolve(it.out, Number(it.outBytes)) });
        headers.push(readHeader(frame));
      }
      return headers;
    },
  };

  beforeAll(async () => {
    useGpuApiForTests(api);
    gpuDaemon = await Daemon.start({ socketPath: join(tmp(), 'g', 'tzip.sock'), limits: { ...defaultLimits(), leaseMs: 5000 }, log: () => undefined });
  });
  afterAll(async () => {
    await gpuDaemon.stop('tests done');
    useGpuApiForTests(undefined);
  });

  it('says at start-up whether it is an MPS client, and warns once per session whose client does not share its MPS server', async () => {
    const pipes = join(tmp(), 'mps');
    mkdirSync(pipes, { recursive: true });
    const saved = process.env.CUDA_MPS_PIPE_DIRECTORY;
    process.env.CUDA_MPS_PIPE_DIRECTORY = pipes;
    const seen: { level: string; msg: string }[] = [];
    const capture: Logger = {
      debug: () => undefined,
      info: (msg) => seen.push({ level: 'info', msg }),
      warn: (msg) => seen.push({ level: 'warn', msg }),
      error: (msg) => seen.push({ level: 'error', msg }),
    };
    const hello = async (d: Daemon, name: string, mps: boolean | null) => {
      const c = new DaemonConn(d.endpoint, name);
      const h = await c.req({ op: 'hello', versions: [3], pid: c.pid, shm_prefix: c.prefix, job: { name, mps } });
      c.sid = h.sid;
      return c;
    };
    const warnings = (name: string) => seen.filter((l) => l.level === 'warn' && l.msg.includes(`(job "${name}")`));
    try {
      // No MPS control daemon: the start-up line says so; an MPS client is warned once (hello, then a job op: one line),
      // a client that said nothing of MPS never.
      let d = await Daemon.start({ socketPath: join(tmp(), 'm1', 'tzip.sock'), limits: defaultLimits(), logger: capture });
      try {
        expect(seen.some((l) => l.level === 'info' && l.msg.startsWith(`MPS: no MPS control daemon in ${pipes}`))).toBe(true);
        const a = await hello(d, 'mps-client', true);
        expect((await a.call('job', { job: { name: 'mps-client', mps: true }, attached: true })).ok).toBe(true);
        const b = await hello(d, 'silent', null);
        a.close(); b.close();
        expect(warnings('mps-client')).toHaveLength(1);
        expect(warnings('mps-client')[0]!.msg).toMatch(/is an MPS client and this daemon is not/);
        expect(warnings('silent')).toHaveLength(0);
      } finally {
        await d.stop('test done');
      }
      // The control pipe there: the daemon is an MPS client; an MPS client is not warned, a client without MPS is.
      execFileSync('mkfifo', [join(pipes, 'control')]);
      seen.length = 0;
      d = await Daemon.start({ socketPath: join(tmp(), 'm2', 'tzip.sock'), limits: defaultLimits(), logger: capture });
      try {
        expect(seen.some((l) => l.level === 'info' && l.msg.startsWith('MPS: this daemon is an MPS client'))).toBe(true);
        const a = await hello(d, 'shared', true);
        const b = await hello(d, 'plain', false);
        a.close(); b.close();
        expect(warnings('shared')).toHaveLength(0);
        expect(warnings('plain')).toHaveLength(1);
        expect(warnings('plain')[0]!.msg).toMatch(/is not an MPS client and this daemon is:/);
      } finally {
        await d.stop('test done');
      }
    } finally {
      if (saved === undefined) delete process.env.CUDA_MPS_PIPE_DIRECTORY;
      else process.env.CUDA_MPS_PIPE_DIRECTORY = saved;
    }
  });

  it('passes the request\'s sm_budget, else the daemon\'s, and a job\'s over both; GPU memory once a request ran there', async () => {
    const c = new DaemonConn(gpuDaemon.endpoint, 'gpu-job');
    const h = await c.req({ op: 'hello', versions: [3], pid: c.pid, shm_prefix: c.prefix, job: { name: 'gpu-job', devices: [UUID], mps: true } });
    c.sid = h.sid;
    const ask = async (body: Record<string, unknown>) => {
      const q = new DaemonConn(gpuDaemon.endpoint);
      try {
        return await q.req(body);
      } finally {
        q.close();
      }
    };
    try {
      const before = await ask({ op: 'jobs' });
      expect(before.daemon.gpus).toEqual([{ uuid: UUID, name: 'Stand-in GPU', memory_used_bytes: null, memory_total_bytes: 1 << 30 }]);
      expect(typeof before.daemon.mps).toBe('boolean');
      expect(before.jobs[0]).toMatchObject({ name: 'gpu-job', mps: true, devices: [UUID] });

      const data = bf16Weights(10_000, 17);
      const base = next;
      next += 0x1_0000_0000n;
      memory.set(base, Buffer.alloc(1 << 20));
      data.copy(memory.get(base) as Buffer, 0);
      const handle = Buffer.alloc(66);
      handle[0] = 2;
      handle[1] = 0x63;
      handle.writeBigUInt64LE(base, 2);
      const ipc = (offset: number, size: number) => ({ kind: 'cuda_ipc', device_uuid: UUID, handle, offset, size, ref_counter_handle: Buffer.from(`/torch_${c.pid}_1_0`), ref_counter_offset: 0 });
      const gpuTensor = (offset: number) => ({ device: { type: 2, id: 0 }, dtype: BF16, shape: [10_000], byte_offset: 0, data: ipc(offset, data.length) });
      const cap = maxCompressedSize(data.length, 1);
      const roundTripGpu = async (extra: Record<string, unknown>) => {
        const r = await c.call('compress', { tensors: [{ tensor: gpuTensor(0), out: ipc(256 << 10, cap) }], ...extra });
        expect(r.ok, JSON.stringify(r)).toBe(true);
        const d = await c.call('decompress', { frames: [{ frame: ipc(256 << 10, r.frames[0].bytes), out: gpuTensor(512 << 10) }], ...extra });
        expect(d.ok, JSON.stringify(d)).toBe(true);
        expect((memory.get(base) as Buffer).subarray(512 << 10, (512 << 10) + data.length).equals(data)).toBe(true);
        return [calls.at(-2)?.opts.smBudget, calls.at(-1)?.opts.smBudget];
      };
      expect(await roundTripGpu({})).toEqual([undefined, undefined]); // the addon's default
      expect(await roundTripGpu({ sm_budget: 0, stream: 'gradients' })).toEqual([0, 0]);
      await ask({ op: 'set', sm_budget: 24 });
      expect(await roundTripGpu({})).toEqual([24, 24]);
      expect(await roundTripGpu({ sm_budget: 8 })).toEqual([8, 8]);
      await ask({ op: 'set', job: 'gpu-job', sm_budget: 33, codec: 'off' });
      expect(await roundTripGpu({ sm_budget: 8 })).toEqual([33, 33]);
      const r = await c.call('compress', { tensors: [{ tensor: gpuTensor(0), out: ipc(256 << 10, cap) }] });
      expect(r.frames[0].codec).toBe('raw');
      expect(r.settings).toEqual({ codec: 'off', sm_budget: 33 });

      const after = await ask({ op: 'jobs' });
      expect(after.daemon.gpus[0].memory_used_bytes).toBe(1 << 29);
      expect(after.daemon.sm_budget).toBe(24);
      const j = after.jobs[0];
      expect(j.streams.gradients.compress.requests).toBe(1);
      expect(j.streams.other.compress.requests).toBe(5);
      expect(j.shares_mps).toBe(after.daemon.mps);
    } finally {
      c.close();
    }
  });
});

const probe = addonAvailable() ? gpu() : { available: false, reason: 'the native addon is not built', devices: [] };

// The real GPU: this process is the client (its device memory shared by CUDA IPC handles, as PyTorch shares a
// cudaMalloc'd storage: [version 2]["c"] + cudaIpcMemHandle_t), the daemon a `tzip serve` child process.
describe.skipIf(!probe.available)(`SM budget and codec settings on a real GPU${probe.available ? '' : ` (skipped: no GPU: ${probe.reason})`}`, () => {
  let serve: ServeChild | undefined;
  let socket = '';
  beforeAll(async () => {
    socket = join(tmp(), 'real', 'tzip.sock');
    serve = await startServe(socket);
  }, 30_000);
  afterAll(async () => {
    await serve?.stop();
  });

  it('compresses with sm_budget 0, 1 and the default into the CPU codec\'s bytes; codec off writes the raw frame; jobs shows GPU memory', async () => {
    const dev = gpuDevices()[0] as { uuid: string; smCount: number };
    const data = bf16Weights(1 << 20, 21);
    const cap = maxCompressedSize(data.length, 1);
    const src = gpuAlloc(0, data.length);
    const frame = gpuAlloc(0, cap);
    const back = gpuAlloc(0, data.length);
    const c = new DaemonConn(`ipc://${socket}`, 'gpu-real');
    try {
      gpuCopyToDevice(src, data, 0);
      const shareable = (ptr: bigint) => Buffer.concat([Buffer.from([2, 0x63]), cudaIpcGetMemHandle(ptr, 0)]);
      const ipc = (ptr: bigint, size: number) => ({ kind: 'cuda_ipc', device_uuid: dev.uuid, handle: shareable(ptr), offset: 0, size });
      const tensor = (ptr: bigint) => ({ device: { type: 2, id: 0 }, dtype: BF16, shape: [1 << 20], byte_offset: 0, data: ipc(ptr, data.length) });
      const h = await c.req({ op: 'hello', versions: [1, 2, 3], pid: c.pid, shm_prefix: c.prefix, job: { name: 'gpu-real', devices: [dev.uuid] } });
      expect(h.ok, JSON.stringify(h)).toBe(true);
      c.sid = h.sid;
      for (const codec of ['fast', 'max'] as const) {
        const want = await compress(data, { dtype: 'BF16', shape: [1 << 20], codec });
        for (const smBudget of [0, 1, dev.smCount, undefined]) {
          const r = await c.call('compress', { codec, stream: 'checkpoint', ...(smBudget !== undefined ? { sm_budget: smBudget } : {}),
            tensors: [{ tensor: tensor(src), out: ipc(frame, cap) }] });
          expect(r.ok, JSON.stringify(r)).toBe(true);
          expect(gpuCopyFromDevice(frame, r.frames[0].bytes, 0).equals(want), `${codec} sm_budget ${smBudget}`).toBe(true);
          const d = await c.call('decompress', { stream: 'checkpoint', ...(smBudget !== undefined ? { sm_budget: smBudget } : {}),
            frames: [{ frame: ipc(frame, r.frames[0].bytes), out: tensor(back) }] });
          expect(d.ok, JSON.stringify(d)).toBe(true);
          expect(gpuCopyFromDevice(back, data.length, 0).equals(data)).toBe(true);
        }
      }
      const q = new DaemonConn(`ipc://${socket}`);
      try {
        expect((await q.req({ op: 'set', job: 'gpu-real', codec: 'off', sm_budget: 2 })).ok).toBe(true);
        const r = await c.call('compress', { codec: 'max', tensors: [{ tensor: tensor(src), out: ipc(frame, cap) }] });
        expect(r.frames[0].codec).toBe('raw');
        expect(r.settings).toEqual({ codec: 'off', sm_budget: 2 });
        const raw = await compress(data, { dtype: 'BF16', shape: [1 << 20], codec: 'raw' });
        expect(gpuCopyFromDevice(frame, r.frames[0].bytes, 0).equals(raw)).toBe(true);
        const j = await q.req({ op: 'jobs' });
        const g = j.daemon.gpus.find((x: { uuid: string }) => x.uuid === dev.uuid);
        expect(g.memory_used_bytes).toBeGreaterThan(0);
        expect(g.memory_used_bytes).toBeLessThanOrEqual(g.memory_total_bytes);
        expect(typeof j.daemon.mps).toBe('boolean');
        const job = j.jobs.find((x: { name: string }) => x.name === 'gpu-real');
        expect(job.streams.checkpoint.compress).toMatchObject({ requests: 8, bytes_in: 8 * data.length });
        expect(job.streams.checkpoint.decompress.bytes_out).toBe(8 * data.length);
        expect(j.daemon.rates.compress_gbps).toBeGreaterThan(0);
      } finally {
        q.close();
      }
    } finally {
      c.close();
      gpuFree(src, 0);
      gpuFree(frame, 0);
      gpuFree(back, 0);
    }
  }, 120_000);
});
