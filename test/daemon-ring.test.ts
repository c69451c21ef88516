// Protocol version 4, the submission ring (docs/ring.md), against a daemon in this process over ipc:// (ZeroMQ
// DEALERs, /dev/shm files made here): a TypeScript client says hello, creates its ring file under its shm prefix,
// registers shared-memory regions, writes SQEs into the ring file and reads CQEs. Round trips of every dtype are
// bit-exact and their frames equal the plain addon's `compress` output; 8 clients at once; a client that disappears
// mid-submission (socket closed, process killed with a half-published batch) has its ring and regions freed while the
// others go on; hostile control requests and hostile ring contents get their errors and the daemon keeps serving. The
// CUDA regions run against a `tzip serve` child process on a machine with a GPU (CUDA IPC handles cannot be opened by
// the process that made them).
import { spawn } from 'node:child_process';
import { existsSync, linkSync, rmSync, symlinkSync, truncateSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defaultLimits } from '../src/daemon/limits.js';
import { MAX_RINGS_PER_SESSION, ringOpener } from '../src/daemon/ring-ops.js';
import { Daemon, type RequestEvent } from '../src/daemon/server.js';
import {
  addonAvailable, compress, cudaIpcGetMemHandle, gpu, gpuAlloc, gpuCopyFromDevice, gpuCopyToDevice, gpuFree, mapShared, maxCompressedSize,
  ringBytes,
} from '../src/native.js';
import { bf16Weights } from './helpers/bf16-weights.js';
import { ensureBuilt, startServe, type ServeChild } from './helpers/cli.js';
import { DaemonConn, shmFile } from './helpers/daemon-conn.js';
import { CODEC, DTYPE, DTYPE_BYTES, FLAG, H, OP, RingClient, encodeSqe, type Cqe, type Sqe } from './helpers/ring-native-client.js';
import { bf16RoundTrip } from './helpers/shm-round-trip.js';
import { useTempDir } from './helpers/temp-dir.js';

const tmp = useTempDir('daemon-ring');
const MAX_REGIONS = 24;
const TZIP_HANDLE = 44;
const TZIP_INVALID_ARGUMENT = 1;
const hasRing = addonAvailable() && ringOpener() !== null;
const NO_RING = hasRing ? '' : ' (skipped: the native addon has no ringOpen: build it with the ring, cuda/src/addon/ring*.cpp)';

let daemon: Daemon;
/** The request observer's events (what the metrics count). */
const events: RequestEvent[] = [];

/** SQE stream tags (docs/ring.md). */
const STREAM = { other: 0, gradients: 1, optimizer: 2, checkpoint: 3, sendrecv: 4 } as const;
/** Every dtype of the format, in code order, with its element size. */
const DTYPES: readonly { name: string; code: number; size: number }[] = Object.entries(DTYPE)
  .sort((a, b) => a[1] - b[1]).map(([name, code]) => ({ name, code, size: DTYPE_BYTES[name] as number }));

/** /dev/shm/`name` of `size` bytes made (removed after the file) and mapped shared, as a client maps its memory. */
function sharedFile(name: string, size: number): Buffer {
  shmFile(name, size);
  return mapShared(`/dev/shm/${name}`, true);
}

/** A client's ring file: the ring client of test/helpers and the file's /dev/shm name. */
interface RingFile {
  rc: RingClient;
  name: string;
}

const ringFiles: RingClient[] = [];
afterAll(() => {
  for (const r of ringFiles.splice(0)) r.remove();
});

/** Makes the ring file /dev/shm/`name` of `entries` entries (removed after the file). */
function ringFile(name: string, entries: number): RingFile {
  const rc = RingClient.create(`/dev/shm/${name}`, entries);
  ringFiles.push(rc);
  return { rc, name };
}

/** A file that is no ring file of `entries` entries: `bytes` long, the magic and entries words as given. */
function badRingFile(name: string, entries: number, opts: { magic?: string; headerEntries?: number; bytes?: number }): string {
  const head = Buffer.alloc(16);
  head.write(opts.magic ?? 'TZRING01', 0, 'latin1');
  head.writeUInt32LE(opts.headerEntries ?? entries, 8);
  shmFile(name, opts.bytes ?? ringBytes(entries), head);
  return name;
}

/** A CQE as the tests read it (its result as a number). */
type Done = Omit<Cqe, 'result'> & { result: number };

/** Waits for `n` CQEs of `r` and reaps them. */
async function reap(r: RingFile, n: number, timeoutMs?: number): Promise<Done[]> {
  return (await r.rc.reap(n, timeoutMs)).map((q) => ({ ...q, result: Number(q.result) }));
}

/** An SQE whose regions are all given (what the tests build). */
type FullSqe = Sqe & { src: { id: number; generation: number; offset: number; bytes: number }; dst: { id: number; generation: number; offset: number; bytes: number } };

/** Writes `sqes` into the ring's next slots without publishing them (sq_head unchanged). */
function writeUnpublished(r: RingFile, sqes: readonly Sqe[]): void {
  const head = r.rc.word(H.sqHead);
  sqes.forEach((q, i) => encodeSqe(q).copy(r.rc.mem, r.rc.sqeOffset(head + i)));
}

beforeAll(async () => {
  const limits = { ...defaultLimits(), leaseMs: 5000, maxRegionsPerSession: MAX_REGIONS };
  daemon = await Daemon.start({ socketPath: join(tmp(), 'd', 'tzip.sock'), limits, log: () => undefined, observer: (e) => events.push(e) });
});

afterAll(async () => {
  await daemon?.stop('tests done');
});

/** A connection that says hello with protocol versions 1-4. */
async function v4(name: string): Promise<DaemonConn> {
  const c = new DaemonConn(daemon.endpoint, name);
  const h = await c.req({ op: 'hello', versions: [1, 2, 3, 4], pid: c.pid, shm_prefix: c.prefix, name });
  expect(h.ok, JSON.stringify(h)).toBe(true);
  expect(h.version).toBe(4);
  c.sid = h.sid;
  return c;
}

async function stats(sid?: string): Promise<Record<string, any>> {
  const c = new DaemonConn(daemon.endpoint);
  try {
    const r = await c.req({ op: 'stats', ...(sid !== undefined ? { sid } : {}) });
    expect(r.ok, JSON.stringify(r)).toBe(true);
    return r;
  } finally {
    c.close();
  }
}

/** Polls `stats` until `pred` holds (the ring's counters and closes arrive asynchronously). */
async function statsUntil(pred: (s: Record<string, any>) => boolean, what: string, sid?: string, timeoutMs = 10_000): Promise<Record<string, any>> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const s = await stats(sid);
    if (pred(s)) return s;
    if (Date.now() > deadline) throw new Error(`${what}: not within ${timeoutMs} ms; stats ${JSON.stringify({ rings: s.rings, session: s.session, mapped: s.mapped })}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

function expectError(r: Record<string, any>, code: string, text?: string): void {
  expect(r.ok, JSON.stringify(r)).toBe(false);
  expect(r.error.code, JSON.stringify(r.error)).toBe(code);
  if (text !== undefined) expect(r.error.message).toContain(text);
}

/** A ring of `c`: its file (entries, named `<prefix>ring-<tag>`) made and opened. */
async function openRing(c: DaemonConn, tag: string, entries = 64, extra: Record<string, unknown> = {}): Promise<{ file: RingFile; id: number }> {
  const file = ringFile(`${c.prefix}ring-${tag}`, entries);
  const r = await c.call('ring_open', { name: file.name, entries, ...extra });
  expect(r.ok, JSON.stringify(r)).toBe(true);
  expect(typeof r.ring).toBe('number');
  return { file, id: r.ring };
}

interface Region { id: number; generation: number; bytes: number }

/** Registers the shm files `names` (made already) to ring `ring`; expects success. */
async function register(c: DaemonConn, ring: number, names: string[]): Promise<Region[]> {
  const r = await c.call('ring_register', { ring, regions: names.map((name) => ({ kind: 'shm', name })) });
  expect(r.ok, JSON.stringify(r)).toBe(true);
  expect(r.regions).toHaveLength(names.length);
  return r.regions as Region[];
}

/** Test data of `n` elements of dtype `d` (BOOL: 0/1 bytes; others: a fixed LCG's bytes, floats weight-like). */
function dataOf(d: (typeof DTYPES)[number], n: number, seed: number): Buffer {
  if (d.name === 'BF16') return bf16Weights(n, seed);
  const out = Buffer.alloc(n * d.size);
  let s = seed;
  for (let i = 0; i < out.length; i++) {
    s = (s * 1103515245 + 12345) & 0x7fffffff;
    out[i] = d.name === 'BOOL' ? (s >> 16) & 1 : (s >> 16) & (i % d.size === d.size - 1 ? 0x3f : 0xff);
  }
  return out;
}

const align = (n: number) => Math.ceil(n / 64) * 64;

/** What one client sends through its ring: tensors laid out in one source file, frames and results in two more. */
interface Workload {
  items: { dtype: (typeof DTYPES)[number]; shape: number[]; data: Buffer; srcAt: number; frameAt: number; cap: number }[];
  srcName: string;
  frameName: string;
  backName: string;
  frames: Buffer;
  back: Buffer;
}

function workload(c: DaemonConn, tag: string, dtypes: readonly (typeof DTYPES)[number][], n: number, seed: number): Workload {
  let src = 0;
  let frame = 0;
  const items = dtypes.map((dtype, i) => {
    const shape = i % 2 === 0 ? [n] : [n / 4, 4];
    const data = dataOf(dtype, n, seed + i);
    const cap = maxCompressedSize(data.length, shape.length);
    const item = { dtype, shape, data, srcAt: src, frameAt: frame, cap };
    src += align(data.length);
    frame += align(cap);
    return item;
  });
  const srcName = `${c.prefix}${tag}-src`;
  const srcBuf = sharedFile(srcName, src);
  for (const it of items) it.data.copy(srcBuf, it.srcAt);
  const frameName = `${c.prefix}${tag}-frames`;
  const backName = `${c.prefix}${tag}-back`;
  return { items, srcName, frameName, backName, frames: sharedFile(frameName, frame), back: sharedFile(backName, src) };
}

/** The SQEs of a compress batch of `w` (linked), from region `src` into `frames`. */
function compressSqes(w: Workload, src: Region, frames: Region, opts: { codec?: number; stream?: number; userBase?: bigint } = {}): FullSqe[] {
  return w.items.map((it, i) => ({
    userData: (opts.userBase ?? 0n) + BigInt(i),
    op: OP.compress,
    flags: i < w.items.length - 1 ? FLAG.link : 0,
    codec: opts.codec ?? CODEC.auto,
    dtype: it.dtype.code,
    shape: it.shape,
    stream: opts.stream ?? STREAM.other,
    src: { id: src.id, generation: src.generation, offset: it.srcAt, bytes: it.data.length },
    dst: { id: frames.id, generation: frames.generation, offset: it.frameAt, bytes: it.cap },
  }));
}

/** The SQEs decoding the frames of `cqes` back into `back`. */
function decompressSqes(w: Workload, frames: Region, back: Region, cqes: readonly Done[], opts: { stream?: number; userBase?: bigint } = {}): Sqe[] {
  return w.items.map((it, i) => ({
    userData: (opts.userBase ?? 0n) + BigInt(i),
    op: OP.decompress,
    flags: (i < w.items.length - 1 ? FLAG.link : 0) | FLAG.verify,
    stream: opts.stream ?? STREAM.other,
    src: { id: frames.id, generation: frames.generation, offset: it.frameAt, bytes: (cqes[i] as Done).result },
    dst: { id: back.id, generation: back.generation, offset: it.srcAt, bytes: it.data.length },
  }));
}

/** CQEs sorted by user_data. */
const byUser = (cqes: Done[]) => [...cqes].sort((a, b) => (a.userData < b.userData ? -1 : a.userData > b.userData ? 1 : 0));

/**
 * Compresses and decompresses `w` through `ring` (regions src, frames, back) and checks every frame against the
 * plain addon's compress of the same tensor (codec auto) and every tensor back, byte for byte.
 */
async function ringRoundTrip(ring: RingFile, w: Workload, [src, frames, back]: Region[], opts: { compressStream?: number; decompressStream?: number } = {}): Promise<Done[]> {
  ring.rc.submit(compressSqes(w, src as Region, frames as Region, { stream: opts.compressStream ?? STREAM.other }));
  const cc = byUser(await reap(ring, w.items.length));
  for (let i = 0; i < w.items.length; i++) {
    const it = w.items[i] as Workload['items'][number];
    const cqe = cc[i] as Done;
    expect(cqe.status, `${it.dtype.name}: ${cqe.message}`).toBe(0);
    expect(cqe.userData).toBe(BigInt(i));
    const want = await compress(it.data, { dtype: it.dtype.name, shape: it.shape, codec: 'auto' });
    expect(cqe.result, it.dtype.name).toBe(want.length);
    expect(w.frames.subarray(it.frameAt, it.frameAt + cqe.result).equals(want), `${it.dtype.name}: the ring's frame is the addon's`).toBe(true);
  }
  w.back.fill(0xa5);
  ring.rc.submit(decompressSqes(w, frames as Region, back as Region, cc, { stream: opts.decompressStream ?? STREAM.other }));
  const dc = byUser(await reap(ring, w.items.length));
  for (let i = 0; i < w.items.length; i++) {
    const it = w.items[i] as Workload['items'][number];
    expect((dc[i] as Done).status, `${it.dtype.name}: ${(dc[i] as Done).message}`).toBe(0);
    expect((dc[i] as Done).result).toBe(it.data.length);
    expect(w.back.subarray(it.srcAt, it.srcAt + it.data.length).equals(it.data), `${it.dtype.name} back bit-exact`).toBe(true);
  }
  return cc;
}

/** A client with one ring and the three regions of a workload registered. */
async function ringClient(name: string, dtypes: readonly (typeof DTYPES)[number][] = DTYPES, n = 4096, seed = 7) {
  const c = await v4(name);
  const { file, id } = await openRing(c, 'main');
  const w = workload(c, 'w', dtypes, n, seed);
  const regions = await register(c, id, [w.srcName, w.frameName, w.backName]);
  return { c, file, id, w, regions };
}

describe('protocol version 4: hello and version gating', () => {
  it('hello of a version 4 session offers the ring (when the addon has it), a version 3 session gets none', async () => {
    const c = await v4('hello-v4');
    const v3 = new DaemonConn(daemon.endpoint, 'hello-v3');
    try {
      const h = await c.req({ op: 'hello', versions: [1, 2, 3, 4], pid: c.pid, shm_prefix: c.prefix, name: 'again' });
      expect(h.daemon.protocol_versions).toEqual([1, 2, 3, 4]);
      if (hasRing) expect(h.ring).toEqual({ entries_max: 4096, sqe_bytes: 128, cqe_bytes: 64, max_batch: 1024, max_regions: MAX_REGIONS });
      else expect(h.ring).toBeUndefined();
      const h3 = await v3.req({ op: 'hello', versions: [1, 2, 3], pid: v3.pid, shm_prefix: v3.prefix });
      expect(h3.version).toBe(3);
      expect(h3.ring).toBeUndefined();
      v3.sid = h3.sid;
      const file = ringFile(`${v3.prefix}ring-0`, 8);
      expectError(await v3.call('ring_open', { name: file.name, entries: 8 }), 'TZIP_PROTOCOL', 'protocol version 4');
      expectError(await v3.call('ring_close', { ring: 1 }), 'TZIP_PROTOCOL', 'protocol version 4');
      // and the version 3 session is served as before
      const rt = await bf16RoundTrip(v3, bf16Weights(1000, 3), 'v3');
      expect(rt.back.equals(bf16Weights(1000, 3))).toBe(true);
    } finally {
      c.close();
      v3.close();
    }
  });

  it.skipIf(hasRing)('a daemon whose addon has no ring answers the ring ops TZIP_UNSUPPORTED', async () => {
    const c = await v4('no-ring');
    try {
      const file = ringFile(`${c.prefix}ring-0`, 8);
      expectError(await c.call('ring_open', { name: file.name, entries: 8 }), 'TZIP_UNSUPPORTED');
    } finally {
      c.close();
    }
  });
});

describe.skipIf(!hasRing)(`the ring over the daemon${NO_RING}`, () => {
  it('round trips every dtype bit-exact, frames equal to the plain addon compress, counted in the job per stream and direction', async () => {
    const before = await stats();
    const { c, file, w, regions } = await ringClient('ring-dtypes');
    try {
      const cc = await ringRoundTrip(file, w, regions, { compressStream: STREAM.gradients, decompressStream: STREAM.checkpoint });
      const inBytes = w.items.reduce((n, it) => n + it.data.length, 0);
      const frameBytes = cc.reduce((n, q) => n + q.result, 0);
      // The thread hands its completions over in batches (at most 10 ms apart): poll for them.
      const s = await statsUntil((x) => x.rings.sqes - before.rings.sqes >= 2 * w.items.length, 'ring completions counted', c.sid);
      expect(s.rings.sqe_errors - before.rings.sqe_errors).toBe(0);
      expect(s.compress.items - before.compress.items).toBeGreaterThanOrEqual(w.items.length);
      expect(s.session.rings).toEqual({ open: 1, regions: 3 });
      const q = new DaemonConn(daemon.endpoint);
      try {
        const j = (await q.req({ op: 'jobs' })).jobs.find((x: { name: string }) => x.name === 'ring-dtypes');
        expect(j.streams.gradients.compress).toMatchObject({ items: w.items.length, bytes_in: inBytes, bytes_out: frameBytes });
        expect(j.streams.gradients.compress.requests).toBeGreaterThanOrEqual(1);
        expect(j.streams.checkpoint.decompress).toMatchObject({ items: w.items.length, bytes_in: frameBytes, bytes_out: inBytes });
        expect(j.streams.other.compress.items).toBe(0);
        expect(j.totals.errors).toBe(0);
        // and the observer (the metrics' feed) saw them as compress/decompress events of the job's streams
        const mine = events.filter((e) => e.job === 'ring-dtypes');
        const sum = (op: string, stream: string, f: (e: RequestEvent) => number) => mine.filter((e) => e.op === op && e.stream === stream).reduce((n, e) => n + f(e), 0);
        expect(sum('compress', 'gradients', (e) => e.items)).toBe(w.items.length);
        expect(sum('compress', 'gradients', (e) => e.bytesIn)).toBe(inBytes);
        expect(sum('decompress', 'checkpoint', (e) => e.bytesOut)).toBe(inBytes);
        expect(mine.filter((e) => e.op === 'compress').every((e) => e.device === 'cpu' && e.error === null)).toBe(true);
      } finally {
        q.close();
      }
    } finally {
      c.close();
    }
  });

  it('serves every codec of a bf16 tensor as the addon writes it, one SQE per batch', async () => {
    const { c, file, w, regions } = await ringClient('ring-codecs', [DTYPES[8] as (typeof DTYPES)[number]], 8192, 11);
    try {
      const [src, frames] = regions as [Region, Region, Region];
      const it = w.items[0] as Workload['items'][number];
      for (const [codec, value] of Object.entries(CODEC)) {
        file.rc.submit(compressSqes(w, src, frames, { codec: value, userBase: 100n }));
        const [cqe] = await reap(file, 1);
        expect(cqe?.status, cqe?.message).toBe(0);
        const want = await compress(it.data, { dtype: 'BF16', shape: it.shape, codec: codec as 'auto' });
        expect(w.frames.subarray(it.frameAt, it.frameAt + (cqe as Done).result).equals(want), codec).toBe(true);
      }
    } finally {
      c.close();
    }
  });

  it('serves 8 clients at once, each bit-exact', async () => {
    const clients = await Promise.all(Array.from({ length: 8 }, (_, i) => ringClient(`ring-many-${i}`, DTYPES.slice(i % 5, i % 5 + 6), 2048, 100 + i)));
    try {
      await Promise.all(clients.map(async ({ file, w, regions }) => {
        for (let round = 0; round < 3; round++) await ringRoundTrip(file, w, regions);
      }));
    } finally {
      for (const k of clients) k.c.close();
    }
  });

  it('a client whose socket closes with a half-published batch: its ring and regions are freed, others go on', async () => {
    const other = await ringClient('ring-bystander', DTYPES.slice(7, 12), 4096, 5);
    const gone = await ringClient('ring-gone', DTYPES.slice(0, 3), 1024, 9);
    try {
      const s0 = await stats(gone.c.sid);
      expect(s0.session.rings).toEqual({ open: 1, regions: 3 });
      const openBefore = s0.rings.open;
      const regionsBefore = s0.rings.regions;
      // Two SQEs of one batch written, only the first published: the thread waits for the client to finish it.
      const sqes = compressSqes(gone.w, gone.regions[0] as Region, gone.regions[1] as Region);
      writeUnpublished(gone.file, sqes);
      gone.file.rc.publish(1);
      await new Promise((r) => setTimeout(r, 50));
      expect(gone.file.rc.word(H.cqHead)).toBe(0);
      gone.c.close();
      const s1 = await statsUntil((s) => s.rings.open === openBefore - 1 && s.session === undefined, 'the gone client\'s ring closed', gone.c.sid);
      expect(s1.rings.regions).toBe(regionsBefore - 3);
      expect(gone.file.rc.state).toBe(1); // closed by the daemon
      await ringRoundTrip(other.file, other.w, other.regions);
    } finally {
      other.c.close();
      gone.c.close();
    }
  });

  it('a client process killed with a half-published batch: its ring, regions and files are freed, others go on', async () => {
    ensureBuilt();
    const other = await ringClient('ring-survivor', DTYPES.slice(9, 12), 4096, 13);
    const script = fileURLToPath(new URL('./helpers/ring-child.mjs', import.meta.url));
    const child = spawn(process.execPath, [script, daemon.endpoint], { cwd: fileURLToPath(new URL('..', import.meta.url)), stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    let err = '';
    child.stderr?.on('data', (b: Buffer) => { err += b.toString(); });
    try {
      const line = await new Promise<string>((resolve, reject) => {
        child.stdout?.on('data', (b: Buffer) => {
          out += b.toString();
          if (out.includes('\n')) resolve(out.split('\n')[0] as string);
        });
        child.once('exit', (code) => reject(new Error(`the child exited (${code}) before it was ready: ${err}`)));
      });
      const info = JSON.parse(line) as { sid: string; prefix: string; ring: number };
      const s0 = await stats(info.sid);
      expect(s0.session.rings).toEqual({ open: 1, regions: 2 });
      const openBefore = s0.rings.open;
      child.kill('SIGKILL');
      const s1 = await statsUntil((s) => s.session === undefined && s.rings.open === openBefore - 1, 'the killed client\'s ring closed', info.sid);
      expect(s1.rings.regions).toBe(s0.rings.regions - 2);
      // Its files go with its session (the process is gone: shm-cleanup.ts).
      const deadline = Date.now() + 10_000;
      while (existsSync(`/dev/shm/${info.prefix}ring-0`) && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
      expect(existsSync(`/dev/shm/${info.prefix}ring-0`)).toBe(false);
      await ringRoundTrip(other.file, other.w, other.regions);
    } finally {
      if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
      other.c.close();
    }
  });

  it('closes the rings of a session that ends by goodbye or is replaced, and ring_close closes one', async () => {
    const c = await v4('ring-ends');
    try {
      const a = await openRing(c, 'a', 8);
      const b = await openRing(c, 'b', 16);
      const x = sharedFile(`${c.prefix}x`, 4096);
      expect(x.length).toBe(4096);
      await register(c, a.id, [`${c.prefix}x`]);
      let s = await stats(c.sid);
      expect(s.session.rings).toEqual({ open: 2, regions: 1 });
      expect(s.session.mapped.files).toBe(3);
      expect(await c.call('ring_close', { ring: b.id })).toMatchObject({ ok: true });
      expect(b.file.rc.state).toBe(1);
      s = await stats(c.sid);
      expect(s.session.rings).toEqual({ open: 1, regions: 1 });
      expect(s.session.mapped.files).toBe(2);
      expectError(await c.call('ring_close', { ring: b.id }), 'TZIP_HANDLE', `ring ${b.id}`);
      expectError(await c.call('ring_register', { ring: b.id, regions: [{ kind: 'shm', name: `${c.prefix}x` }] }), 'TZIP_HANDLE');
      // A hello of the same process with the same prefix replaces the session: its ring is closed.
      const open = s.rings.open;
      const h = await c.req({ op: 'hello', versions: [4], pid: c.pid, shm_prefix: c.prefix });
      expect(h.ok).toBe(true);
      const oldSid = c.sid;
      c.sid = h.sid;
      await statsUntil((t) => t.rings.open === open - 1 && t.session === undefined, 'the replaced session\'s ring closed', oldSid);
      expect(a.file.rc.state).toBe(1);
      // goodbye
      const d = await openRing(c, 'd', 8);
      const open2 = (await stats()).rings.open;
      expect(await c.call('release', { end: true })).toMatchObject({ ok: true });
      await statsUntil((t) => t.rings.open === open2 - 1, 'the ring of a session that said goodbye closed');
      expect(d.file.rc.state).toBe(1);
    } finally {
      c.close();
    }
  });

  it('ring_release answers after the regions\' last batch; SQEs naming them later fail TZIP_HANDLE, even once the id is reused', async () => {
    const { c, file, id, w, regions } = await ringClient('ring-release', DTYPES.slice(8, 9), 4096, 17);
    try {
      await ringRoundTrip(file, w, regions);
      const [src, frames] = regions as [Region, Region, Region];
      expect(await c.call('ring_release', { ring: id, regions: [src.id] })).toMatchObject({ ok: true });
      file.rc.submit(compressSqes(w, src, frames));
      const [after] = await reap(file, 1);
      expect(after?.status).toBe(TZIP_HANDLE);
      expectError(await c.call('ring_release', { ring: id, regions: [src.id] }), 'TZIP_HANDLE', `region ${src.id}`);
      // registered again: maybe the same id, a new generation; the old (id, generation) still fails
      const [again] = await register(c, id, [w.srcName]);
      expect(again?.id === src.id ? again.generation !== src.generation : true).toBe(true);
      file.rc.submit(compressSqes(w, src, frames));
      expect((await reap(file, 1))[0]?.status).toBe(TZIP_HANDLE);
      await ringRoundTrip(file, w, [again as Region, frames, regions[2] as Region]);
      expect((await stats(c.sid)).session.rings.regions).toBe(3);
    } finally {
      c.close();
    }
  });
});

describe.skipIf(!hasRing)(`hostile control requests${NO_RING}`, () => {
  it('refuses ring files that are not the session\'s, symlinks, wrong sizes, bad magic and wrong entries', async () => {
    const c = await v4('hostile-open');
    const o = await v4('hostile-other');
    try {
      // another session's file
      const theirs = ringFile(`${o.prefix}ring-0`, 8);
      expectError(await c.call('ring_open', { name: theirs.name, entries: 8 }), 'TZIP_HANDLE', 'shm_prefix');
      // a symlink under the session's prefix to a ring file of another session
      const link = `${c.prefix}ring-link`;
      symlinkSync(`/dev/shm/${theirs.name}`, `/dev/shm/${link}`);
      try {
        expectError(await c.call('ring_open', { name: link, entries: 8 }), 'TZIP_HANDLE', 'symlink');
      } finally {
        rmSync(`/dev/shm/${link}`, { force: true });
      }
      // missing
      expectError(await c.call('ring_open', { name: `${c.prefix}ring-none`, entries: 8 }), 'TZIP_HANDLE', 'does not exist');
      // wrong size, bad magic, header entries not ring_open's
      const small = { name: badRingFile(`${c.prefix}ring-small`, 8, { bytes: ringBytes(8) - 64 }) };
      expectError(await c.call('ring_open', { name: small.name, entries: 8 }), 'TZIP_INVALID_ARGUMENT', `${ringBytes(8)} bytes`);
      const big = { name: badRingFile(`${c.prefix}ring-big`, 8, { bytes: ringBytes(16) }) };
      expectError(await c.call('ring_open', { name: big.name, entries: 8 }), 'TZIP_INVALID_ARGUMENT');
      const magic = { name: badRingFile(`${c.prefix}ring-magic`, 8, { magic: 'TZRING00' }) };
      expectError(await c.call('ring_open', { name: magic.name, entries: 8 }), 'TZIP_INVALID_ARGUMENT', 'magic');
      const entries = { name: badRingFile(`${c.prefix}ring-entries`, 8, { headerEntries: 16 }) };
      expectError(await c.call('ring_open', { name: entries.name, entries: 8 }), 'TZIP_INVALID_ARGUMENT', 'entries');
      // entries that are no ring's: checked by the schema
      for (const e of [0, 4, 12, 8192, -8, 8.5]) {
        expectError(await c.call('ring_open', { name: entries.name, entries: e }), 'TZIP_PROTOCOL', 'entries');
      }
      // a file already held: the ring file of a ring open now cannot be a second ring, nor a region
      const ok = await openRing(c, 'ok', 8);
      expectError(await c.call('ring_open', { name: ok.file.name, entries: 8 }), 'TZIP_INVALID_ARGUMENT', 'already');
      expectError(await c.call('ring_register', { ring: ok.id, regions: [{ kind: 'shm', name: ok.file.name }] }), 'TZIP_INVALID_ARGUMENT', 'ring file');
      // unknown fields (a `flag` of an earlier draft of docs/ring.md among them: the flags are in the header)
      expectError(await c.call('ring_open', { name: entries.name, entries: 16, flag: { offset: 0 } }), 'TZIP_PROTOCOL');
      expectError(await c.call('ring_open', { name: ok.file.name, entries: 8, extra: 1 }), 'TZIP_PROTOCOL');
      // nothing of the refusals stays mapped
      expect((await stats(c.sid)).session).toMatchObject({ rings: { open: 1, regions: 0 }, mapped: { files: 1 } });
    } finally {
      c.close();
      o.close();
    }
  });

  it(`refuses a ring past ${MAX_RINGS_PER_SESSION} per session (TZIP_LIMIT), and regions past max_regions`, async () => {
    const c = await v4('hostile-limits');
    try {
      const rings = [];
      for (let i = 0; i < MAX_RINGS_PER_SESSION; i++) rings.push(await openRing(c, `r${i}`, 8));
      const ninth = ringFile(`${c.prefix}ring-9`, 8);
      expectError(await c.call('ring_open', { name: ninth.name, entries: 8 }), 'TZIP_LIMIT', `${MAX_RINGS_PER_SESSION}`);
      expect(await c.call('ring_close', { ring: (rings[7] as { id: number }).id })).toMatchObject({ ok: true });
      const again = await c.call('ring_open', { name: ninth.name, entries: 8 });
      expect(again.ok, JSON.stringify(again)).toBe(true);
      expect(again.ring).toBeGreaterThan((rings[7] as { id: number }).id); // ids are never reused
      // 8 ring files held; regions up to max_regions in all
      const names = Array.from({ length: MAX_REGIONS - MAX_RINGS_PER_SESSION + 1 }, (_, i) => `${c.prefix}reg-${i}`);
      for (const n of names) shmFile(n, 4096);
      const first = rings[0] as { id: number };
      await register(c, first.id, names.slice(0, -1));
      const r = await c.call('ring_register', { ring: first.id, regions: [{ kind: 'shm', name: names[names.length - 1] }] });
      expectError(r, 'TZIP_LIMIT', `maxRegionsPerSession = ${MAX_REGIONS}`);
      // A ZeroMQ request of the session is still served, with what the rings leave (nothing: the newest mapping stays)
      const s = await stats(c.sid);
      expect(s.session.mapped.files).toBe(MAX_REGIONS);
    } finally {
      c.close();
    }
  });

  it('unknown ring ids, unknown or twice-named regions, foreign region files: TZIP_HANDLE and nothing registered or released', async () => {
    const c = await v4('hostile-ids');
    const o = await v4('hostile-ids-other');
    try {
      const { id } = await openRing(c, 'a', 8);
      for (const ring of [id + 1000, 0]) {
        expectError(await c.call('ring_register', { ring, regions: [{ kind: 'shm', name: `${c.prefix}a` }] }), 'TZIP_HANDLE', `ring ${ring}`);
        expectError(await c.call('ring_release', { ring, regions: [1] }), 'TZIP_HANDLE', `ring ${ring}`);
        expectError(await c.call('ring_close', { ring }), 'TZIP_HANDLE', `ring ${ring}`);
      }
      shmFile(`${c.prefix}a`, 4096);
      shmFile(`${c.prefix}b`, 8192);
      shmFile(`${o.prefix}theirs`, 4096);
      const [a] = await register(c, id, [`${c.prefix}a`]);
      expectError(await c.call('ring_release', { ring: id, regions: [(a as Region).id + 77] }), 'TZIP_HANDLE');
      expectError(await c.call('ring_release', { ring: id, regions: [(a as Region).id, (a as Region).id + 77] }), 'TZIP_HANDLE');
      expectError(await c.call('ring_release', { ring: id, regions: [(a as Region).id, (a as Region).id] }), 'TZIP_INVALID_ARGUMENT');
      expect((await stats(c.sid)).session.rings.regions).toBe(1); // nothing released by the refusals
      // all or nothing: a good file, another session's, a missing one
      const before = await stats(c.sid);
      for (const bad of [`${o.prefix}theirs`, `${c.prefix}missing`]) {
        const r = await c.call('ring_register', { ring: id, regions: [{ kind: 'shm', name: `${c.prefix}b` }, { kind: 'shm', name: bad }] });
        expectError(r, 'TZIP_HANDLE');
        expect(r.error.index).toBe(1);
      }
      const after = await stats(c.sid);
      expect(after.session.rings).toEqual(before.session.rings);
      expect(after.session.mapped).toEqual(before.session.mapped);
      // Registering a file twice (two regions, one mapping) and releasing both
      const twice = await register(c, id, [`${c.prefix}b`, `${c.prefix}b`]);
      expect((await stats(c.sid)).session.mapped.files).toBe(after.session.mapped.files + 1);
      expect(await c.call('ring_release', { ring: id, regions: twice.map((r) => r.id) })).toMatchObject({ ok: true });
      expect((await stats(c.sid)).session.mapped.files).toBe(after.session.mapped.files);
    } finally {
      c.close();
      o.close();
    }
  });

  const gpuProbe = addonAvailable() ? gpu() : { available: false, reason: 'the native addon is not built', devices: [] };
  it.skipIf(gpuProbe.available)(`cuda regions and a GPU ring on a daemon without GPU: TZIP_NO_DEVICE${gpuProbe.available ? ' (skipped: this machine has a GPU)' : ''}`, async () => {
    const c = await v4('hostile-nogpu');
    try {
      const handle = Buffer.concat([Buffer.from([2, 0x63]), Buffer.alloc(64, 7)]);
      const gpuRing = ringFile(`${c.prefix}ring-gpu`, 8);
      expectError(await c.call('ring_open', { name: gpuRing.name, entries: 8, device: { type: 2, id: 0 } }), 'TZIP_NO_DEVICE');
      const { id } = await openRing(c, 'cpu', 8);
      const r = await c.call('ring_register', { ring: id, regions: [{ kind: 'cuda', device: { type: 2, id: 0 }, handle, offset: 0, bytes: 1024 }] });
      expectError(r, 'TZIP_NO_DEVICE');
      expect((await stats(c.sid)).session.rings.regions).toBe(0);
    } finally {
      c.close();
    }
  });
});

describe.skipIf(!hasRing)(`ring memory and the ZeroMQ path${NO_RING}`, () => {
  it('a file a ring holds serves ZeroMQ requests too; another session cannot reach it through a hard link', async () => {
    const { c, file, w, regions } = await ringClient('ring-shared-file', DTYPES.slice(8, 9), 4096, 53);
    const o = await v4('ring-shared-other');
    try {
      const it0 = w.items[0] as Workload['items'][number];
      // The ZeroMQ path maps the ring's source file itself and compresses the same tensor into the same frame.
      const cap = maxCompressedSize(it0.data.length, 1);
      shmFile(`${c.prefix}zmq-frame`, cap);
      const r = await c.call('compress', { tensors: [{
        tensor: { device: { type: 1, id: 0 }, dtype: { code: 4, bits: 16, lanes: 1 }, shape: it0.shape, byte_offset: 0,
          data: { kind: 'shm', name: w.srcName, offset: it0.srcAt, size: it0.data.length } },
        out: { kind: 'shm', name: `${c.prefix}zmq-frame`, offset: 0, size: cap } }] });
      expect(r.ok, JSON.stringify(r)).toBe(true);
      const cc = await ringRoundTrip(file, w, regions);
      expect(r.frames[0].bytes).toBe((cc[0] as Done).result);
      // A hard link of the ring's file under the other session's prefix is that file: refused to it, by either path.
      const link = `${o.prefix}linked`;
      linkSync(`/dev/shm/${w.srcName}`, `/dev/shm/${link}`);
      try {
        const { id } = await openRing(o, 'o', 8);
        expectError(await o.call('ring_register', { ring: id, regions: [{ kind: 'shm', name: link }] }), 'TZIP_HANDLE', 'another session');
        shmFile(`${o.prefix}frame`, cap);
        const z = await o.call('compress', { tensors: [{
          tensor: { device: { type: 1, id: 0 }, dtype: { code: 4, bits: 16, lanes: 1 }, shape: it0.shape, byte_offset: 0,
            data: { kind: 'shm', name: link, offset: it0.srcAt, size: it0.data.length } },
          out: { kind: 'shm', name: `${o.prefix}frame`, offset: 0, size: cap } }] });
        expectError(z, 'TZIP_HANDLE', 'another session');
      } finally {
        rmSync(`/dev/shm/${link}`, { force: true });
      }
    } finally {
      c.close();
      o.close();
    }
  });

  it('a region file the client shrinks fails its SQEs TZIP_HANDLE; a ring file it shrinks breaks that ring only', async () => {
    const { c, file, w, regions } = await ringClient('ring-shrink', DTYPES.slice(8, 9), 4096, 59);
    const other = await ringClient('ring-shrink-other', DTYPES.slice(11, 12), 2048, 61);
    try {
      const [src, frames] = regions as [Region, Region, Region];
      truncateSync(`/dev/shm/${w.srcName}`, 0);
      file.rc.submit(compressSqes(w, src, frames));
      const [cqe] = await reap(file, 1);
      expect(cqe?.status, cqe?.message).toBe(TZIP_HANDLE);
      const broken0 = (await stats()).rings.broken;
      truncateSync(`/dev/shm/${file.name}`, 0);
      await statsUntil((x) => x.rings.broken === broken0 + 1, 'the ring whose file shrank is broken');
      await ringRoundTrip(other.file, other.w, other.regions);
      expectError(await c.call('heartbeat'), 'TZIP_PROTOCOL', 'ring broken');
      expect((await c.call('heartbeat')).ok).toBe(true);
    } finally {
      c.close();
      other.c.close();
    }
  });
});

describe.skipIf(!hasRing)(`rings when sessions lapse and the daemon stops${NO_RING}`, () => {
  it('closes the ring of a session whose lease lapsed, and every ring at shutdown', async () => {
    const own = await Daemon.start({ socketPath: join(tmp(), 'lease', 'tzip.sock'), limits: { ...defaultLimits(), leaseMs: 1000 }, log: () => undefined });
    let stopped = false;
    const c = new DaemonConn(own.endpoint, 'lapsing');
    const d = new DaemonConn(own.endpoint, 'staying');
    try {
      for (const k of [c, d]) {
        const h = await k.req({ op: 'hello', versions: [4], pid: k.pid, shm_prefix: k.prefix });
        expect(h.ok, JSON.stringify(h)).toBe(true);
        k.sid = h.sid;
      }
      const lapsing = ringFile(`${c.prefix}ring-l`, 8);
      expect((await c.call('ring_open', { name: lapsing.name, entries: 8 })).ok).toBe(true);
      const staying = ringFile(`${d.prefix}ring-s`, 8);
      expect((await d.call('ring_open', { name: staying.name, entries: 8 })).ok).toBe(true);
      // c says nothing more: its lease lapses, its ring is closed; d heartbeats
      const deadline = Date.now() + 10_000;
      while (lapsing.rc.state !== 1 && Date.now() < deadline) {
        expect((await d.call('heartbeat')).ok).toBe(true);
        await new Promise((r) => setTimeout(r, 50));
      }
      expect(lapsing.rc.state).toBe(1);
      expect(staying.rc.state).toBe(0);
      expect(own.stats.sessionsEnded.lease).toBe(1);
      await own.stop('test shutdown');
      stopped = true;
      expect(staying.rc.state).toBe(1);
      expect(own.sessions.ringCounters.open).toBe(0);
    } finally {
      c.close();
      d.close();
      if (!stopped) await own.stop('test done');
    }
  });
});

describe.skipIf(!hasRing)(`hostile ring contents through the daemon${NO_RING}`, () => {
  it('SQEs naming unregistered regions, other generations or bytes out of bounds get error CQEs; the ring serves on', async () => {
    const { c, file, w, regions } = await ringClient('hostile-sqes', DTYPES.slice(11, 12), 4096, 23);
    const errors0 = (await stats()).rings.sqe_errors;
    try {
      const [src, frames] = regions as [Region, Region, Region];
      const it0 = w.items[0] as Workload['items'][number];
      const base = compressSqes(w, src, frames)[0] as FullSqe;
      const bad: [string, Sqe, number][] = [
        ['unregistered src id', { ...base, userData: 1n, src: { ...base.src, id: 999 } }, TZIP_HANDLE],
        ['src of another generation', { ...base, userData: 2n, src: { ...base.src, generation: src.generation + 1 } }, TZIP_HANDLE],
        ['dst past the region', { ...base, userData: 3n, dst: { ...base.dst, offset: w.frames.length - 8 } }, TZIP_INVALID_ARGUMENT],
        ['src offset overflowing', { ...base, userData: 4n, src: { ...base.src, offset: 2 ** 53 } }, TZIP_INVALID_ARGUMENT],
        ['unknown op', { ...base, userData: 5n, op: 9 }, TZIP_INVALID_ARGUMENT],
        ['a reserved byte set', { ...base, userData: 6n, reserved: 1 }, TZIP_INVALID_ARGUMENT],
        ['shape and bytes disagree', { ...base, userData: 7n, shape: [it0.data.length / 4 + 1] }, TZIP_INVALID_ARGUMENT],
      ];
      for (const [what, sqe, status] of bad) {
        file.rc.submit([sqe]);
        const [cqe] = await reap(file, 1);
        expect(cqe?.userData, what).toBe(sqe.userData);
        expect(cqe?.status, `${what}: ${cqe?.message}`).toBe(status);
        expect(cqe?.message.length, what).toBeGreaterThan(0);
      }
      // garbage SQEs (a fixed LCG's bytes, LINK cleared so each is a batch of its own): an error CQE each
      let s = 99;
      for (let k = 0; k < 16; k++) {
        const at = 4096 + (file.rc.word(H.sqHead) & (file.rc.entries - 1)) * 128;
        for (let i = 0; i < 128; i++) {
          s = (s * 1103515245 + 12345) & 0x7fffffff;
          file.rc.mem[at + i] = s >> 16;
        }
        file.rc.mem[at + 9] = (file.rc.mem[at + 9] as number) & ~FLAG.link;
        file.rc.mem.writeBigUInt64LE(BigInt(1000 + k), at);
        file.rc.publish(1);
        const [cqe] = await reap(file, 1);
        expect(cqe?.userData).toBe(BigInt(1000 + k));
        expect(cqe?.status, `garbage SQE ${k}`).not.toBe(0);
      }
      expect(file.rc.state).toBe(0);
      await ringRoundTrip(file, w, regions);
      // Counted per direction: the compress SQEs among them (an unknown op is neither direction's).
      const compressErrors = bad.filter(([, q]) => q.op === OP.compress).length;
      await statsUntil((x) => x.rings.sqe_errors - errors0 >= compressErrors, 'error CQEs counted');
    } finally {
      c.close();
    }
  });

  it('a ring whose indices point outside it is broken: counted, the next control request says so once, its ZeroMQ path and other clients go on', async () => {
    const victim = await ringClient('hostile-broken', DTYPES.slice(8, 10), 2048, 29);
    const other = await ringClient('hostile-bystander', DTYPES.slice(5, 8), 2048, 31);
    try {
      const broken0 = (await stats()).rings.broken;
      // sq_head more than `entries` ahead of sq_tail
      victim.file.rc.setWord(H.sqHead, victim.file.rc.word(H.sqTail) + victim.file.rc.entries + 5);
      const deadline = Date.now() + 10_000;
      while (victim.file.rc.state !== 2 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 5));
      expect(victim.file.rc.state).toBe(2);
      await statsUntil((s) => s.rings.broken === broken0 + 1, 'the broken ring counted');
      // ring_close/ring_release/release are not swallowed; heartbeat is answered TZIP_PROTOCOL "ring broken" once
      const hb = await victim.c.call('heartbeat');
      expectError(hb, 'TZIP_PROTOCOL', 'ring broken');
      expect(hb.error.message).toContain(`ring ${victim.id}`);
      expect((await victim.c.call('heartbeat')).ok).toBe(true);
      expectError(await victim.c.call('ring_register', { ring: victim.id, regions: [{ kind: 'shm', name: victim.w.srcName }] }), 'TZIP_PROTOCOL', 'broken');
      // the session's ZeroMQ requests and another client's ring go on
      const data = bf16Weights(3000, 37);
      expect((await bf16RoundTrip(victim.c, data, 'zmq')).back.equals(data)).toBe(true);
      await ringRoundTrip(other.file, other.w, other.regions);
      // a new ring of the same session serves
      const { file, id } = await openRing(victim.c, 'fresh', 16);
      const regions = await register(victim.c, id, [victim.w.srcName, victim.w.frameName, victim.w.backName]);
      await ringRoundTrip(file, victim.w, regions);
      expect(await victim.c.call('ring_close', { ring: victim.id })).toMatchObject({ ok: true });
    } finally {
      victim.c.close();
      other.c.close();
    }
  });

  it('a cq_tail ahead of cq_head breaks the ring at its next completion; a client that stops reaping stalls only its own ring', async () => {
    const a = await ringClient('hostile-cq', DTYPES.slice(1, 2), 1024, 41);
    const b = await ringClient('hostile-cq-other', DTYPES.slice(2, 3), 1024, 43);
    try {
      const nop = (u: bigint): Sqe => ({ userData: u, op: OP.nop, src: { id: 0, generation: 0, offset: 0, bytes: 0 }, dst: { id: 0, generation: 0, offset: 0, bytes: 0 } });
      // b stops reaping: its CQ fills (64 entries), its SQEs wait; nothing else is affected
      for (let i = 0; i < 64; i++) b.file.rc.submit([nop(BigInt(i))]);
      const until = Date.now() + 10_000;
      while (b.file.rc.word(H.cqHead) < 64 && Date.now() < until) await new Promise((r) => setTimeout(r, 5));
      for (let i = 0; i < 8; i++) b.file.rc.submit([nop(BigInt(100 + i))]);
      await new Promise((r) => setTimeout(r, 100));
      expect(b.file.rc.word(H.cqHead)).toBe(64);
      expect(b.file.rc.state).toBe(0);
      // a's cq_tail jumps ahead of cq_head: broken at its next CQE
      a.file.rc.setWord(H.cqTail, a.file.rc.word(H.cqHead) + 1000);
      a.file.rc.submit([nop(1n)]);
      const deadline = Date.now() + 10_000;
      while (a.file.rc.state !== 2 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 5));
      expect(a.file.rc.state).toBe(2);
      // b reaps: its waiting SQEs complete
      const got = await reap(b.file, 72);
      expect(got.map((q) => q.status).every((s) => s === 0)).toBe(true);
      await ringRoundTrip(b.file, b.w, b.regions);
    } finally {
      a.c.close();
      b.c.close();
    }
  });
});

// ---- the job's settings and the per-session limits, applied by the ring thread -----------------------------------

/** One BF16 compress SQE of `n` elements from `src` at 0 into `frames` at 0, with `codec` and `smBudget`. */
function bf16Sqe(userData: bigint, src: Region, frames: Region, n: number, codec: number, smBudget = 0): FullSqe {
  return {
    userData, op: OP.compress, codec, dtype: DTYPE.BF16 as number, shape: [n], smBudget,
    src: { id: src.id, generation: src.generation, offset: 0, bytes: 2 * n },
    dst: { id: frames.id, generation: frames.generation, offset: 0, bytes: maxCompressedSize(2 * n, 1) },
  };
}

/** A `set` request from a connection of its own (as `tzip set` is); expects success. */
async function setOp(endpoint: string, body: Record<string, unknown>): Promise<Record<string, any>> {
  const q = new DaemonConn(endpoint);
  try {
    const r = await q.req({ op: 'set', ...body });
    expect(r.ok, JSON.stringify(r)).toBe(true);
    return r;
  } finally {
    q.close();
  }
}

describe.skipIf(!hasRing)(`job settings and limits on the ring${NO_RING}`, () => {
  it('after `set JOB codec=...` the very next SQE gets the job\'s codec (the frame\'s codec byte), with no heartbeat in between; also after the daemon\'s `set` and a `job` op', async () => {
    const n = 4096;
    const data = bf16Weights(n, 21);
    const c = await v4('ring-settings-job');
    const other = await v4('ring-settings-other');
    try {
      const { file, id } = await openRing(c, 'settings');
      sharedFile(`${c.prefix}settings-src`, data.length).set(data);
      const framesBuf = sharedFile(`${c.prefix}settings-frames`, maxCompressedSize(data.length, 1));
      const [src, frames] = await register(c, id, [`${c.prefix}settings-src`, `${c.prefix}settings-frames`]) as [Region, Region];
      const next = async (u: bigint): Promise<Done> => {
        file.rc.submit([bf16Sqe(u, src, frames, n, CODEC.fast as number)]);
        const [q] = await reap(file, 1);
        expect(q?.status, q?.message).toBe(0);
        return q as Done;
      };
      const expectFrame = async (q: Done, codec: 'raw' | 'fast' | 'max' | 'bytes') => {
        expect(q.codec, codec).toBe(CODEC[codec]);
        const frame = framesBuf.subarray(0, q.result);
        expect(frame[7], `${codec}: the frame's codec byte`).toBe(CODEC[codec]);
        expect(frame.equals(await compress(data, { dtype: 'BF16', shape: [n], codec })), `${codec}: the frame is the addon's`).toBe(true);
      };
      await expectFrame(await next(1n), 'fast');
      const endpoint = daemon.endpoint;
      // The job's "off": raw frames from the next SQE on (the set's reply came before it; nothing else was said).
      await setOp(endpoint, { job: 'ring-settings-job', codec: 'off' });
      await expectFrame(await next(2n), 'raw');
      await setOp(endpoint, { job: 'ring-settings-job', codec: 'max' });
      await expectFrame(await next(3n), 'max');
      // The job's codec cleared: the daemon's applies (none: the SQE's own), then the daemon's own setting.
      await setOp(endpoint, { job: 'ring-settings-job', codec: null });
      await expectFrame(await next(4n), 'fast');
      await setOp(endpoint, { codec: 'max' });
      try {
        await expectFrame(await next(5n), 'max');
      } finally {
        await setOp(endpoint, { codec: null });
      }
      await expectFrame(await next(6n), 'fast');
      // The session moves into a job of other settings: its ring follows at once.
      await setOp(endpoint, { job: 'ring-settings-other', codec: 'off' });
      const moved = await c.call('job', { job: { name: 'ring-settings-other' }, attached: true });
      expect(moved.ok, JSON.stringify(moved)).toBe(true);
      await expectFrame(await next(7n), 'raw');
      // A ring opened now starts with the job's settings.
      const second = await openRing(c, 'settings-2');
      const [src2, frames2] = await register(c, second.id, [`${c.prefix}settings-src`, `${c.prefix}settings-frames`]) as [Region, Region];
      second.file.rc.submit([bf16Sqe(8n, src2, frames2, n, CODEC.fast as number)]);
      const [q8] = await reap(second.file, 1);
      expect(q8?.status, q8?.message).toBe(0);
      await expectFrame(q8 as Done, 'raw');
    } finally {
      c.close();
      other.close();
    }
  });

  it('the ring thread applies the job\'s sm_budget over the SQE\'s at the next SQE, and ring_open\'s for SQEs that give none (TZIP_TRACE of a tzip serve child)', async () => {
    const socket = join(tmp(), 'trace', 'tzip.sock');
    const serve = await startServe(socket, { env: { TZIP_TRACE: '1' } });
    const endpoint = `ipc://${socket}`;
    const c = new DaemonConn(endpoint, 'ring-sm');
    try {
      const h = await c.req({ op: 'hello', versions: [1, 2, 3, 4], pid: c.pid, shm_prefix: c.prefix, name: 'ring-sm' });
      expect(h.ok, JSON.stringify(h)).toBe(true);
      c.sid = h.sid;
      const { file, id } = await openRing(c, 'sm', 64, { sm_budget: 12 });
      const n = 1024;
      sharedFile(`${c.prefix}sm-src`, 2 * n).set(bf16Weights(n, 4));
      sharedFile(`${c.prefix}sm-frames`, maxCompressedSize(2 * n, 1));
      const [src, frames] = await register(c, id, [`${c.prefix}sm-src`, `${c.prefix}sm-frames`]) as [Region, Region];
      const budgets: number[] = [];
      // The budget the thread gave the batch of one SQE of sm_budget `sm` (its trace line, written after the CQE).
      const budgetOf = async (u: bigint, sm: number): Promise<number> => {
        file.rc.submit([bf16Sqe(u, src, frames, n, CODEC.fast as number, sm)]);
        const [q] = await reap(file, 1);
        expect(q?.status, q?.message).toBe(0);
        const line = /tzip ring trace: op 1, 1 SQEs, CPU, codec \d+, SM budget (\d+):/g;
        const deadline = Date.now() + 10_000;
        for (;;) {
          const seen = [...serve.stderr().matchAll(line)].map((m) => Number(m[1]));
          if (seen.length > budgets.length) {
            budgets.push(seen[budgets.length] as number);
            return budgets[budgets.length - 1] as number;
          }
          if (Date.now() > deadline) throw new Error(`no trace line for SQE ${u}: ${serve.stderr()}`);
          await new Promise((r) => setTimeout(r, 5));
        }
      };
      expect(await budgetOf(1n, 0)).toBe(12);
      expect(await budgetOf(2n, 5)).toBe(5);
      await setOp(endpoint, { job: 'ring-sm', sm_budget: 37 });
      expect(await budgetOf(3n, 5)).toBe(37);
      expect(await budgetOf(4n, 0)).toBe(37);
      // 0 (all SMs) and budgets beyond an SQE's byte are a job's too.
      await setOp(endpoint, { job: 'ring-sm', sm_budget: 0 });
      expect(await budgetOf(40n, 5)).toBe(0);
      await setOp(endpoint, { job: 'ring-sm', sm_budget: 300 });
      expect(await budgetOf(41n, 5)).toBe(300);
      await setOp(endpoint, { job: 'ring-sm', sm_budget: null });
      expect(await budgetOf(5n, 5)).toBe(5);
      // The daemon's budget is the default of requests that name none: ring_open named 12.
      await setOp(endpoint, { sm_budget: 20 });
      expect(await budgetOf(6n, 0)).toBe(12);
    } finally {
      c.close();
      await serve.stop();
    }
  }, 60_000);

  it('a ring batch above --max-inflight-bytes completes TZIP_LIMIT (nothing written) and the ring serves on; ZeroMQ requests and ring batches reserve in one word', async () => {
    const n = 4096;
    const limit = 3 * 2 * n;
    const d2 = await Daemon.start({ socketPath: join(tmp(), 'lim', 'tzip.sock'), limits: { ...defaultLimits(), maxInflightBytesPerSession: limit }, log: () => undefined });
    const c = new DaemonConn(d2.endpoint, 'ring-limit');
    try {
      const h = await c.req({ op: 'hello', versions: [1, 2, 3, 4], pid: c.pid, shm_prefix: c.prefix, name: 'ring-limit' });
      expect(h.ok, JSON.stringify(h)).toBe(true);
      c.sid = h.sid;
      const { file, id } = await openRing(c, 'limit');
      const data = bf16Weights(n, 30);
      sharedFile(`${c.prefix}lim-src`, data.length).set(data);
      const cap = maxCompressedSize(data.length, 1);
      const framesBuf = sharedFile(`${c.prefix}lim-frames`, 4 * cap);
      const [src, frames] = await register(c, id, [`${c.prefix}lim-src`, `${c.prefix}lim-frames`]) as [Region, Region];
      const batch = (k: number, base: bigint): FullSqe[] => Array.from({ length: k }, (_, i) => ({
        ...bf16Sqe(base + BigInt(i), src, frames, n, CODEC.fast as number),
        flags: i < k - 1 ? FLAG.link : 0,
        dst: { id: frames.id, generation: frames.generation, offset: i * cap, bytes: cap },
      }));
      framesBuf.fill(0x77);
      file.rc.submit(batch(4, 10n));
      const over = await reap(file, 4);
      expect(over.map((q) => q.status)).toEqual([46, 46, 46, 46]);
      expect(over[0]?.message).toBe('bytes in flight over the session\'s limit');
      expect(framesBuf.every((b) => b === 0x77), 'nothing written').toBe(true);
      file.rc.submit(batch(3, 20n));
      const fits = await reap(file, 3);
      expect(fits.map((q) => q.status)).toEqual([0, 0, 0]);
      const want = await compress(data, { dtype: 'BF16', shape: [n], codec: 'fast' });
      for (let i = 0; i < 3; i++) expect(framesBuf.subarray(i * cap, i * cap + (fits[i] as Done).result).equals(want)).toBe(true);
      // The session's stats say nothing is held after the batches.
      const st = await c.req({ op: 'stats', sid: c.sid });
      expect(st.session.inflight_bytes).toBe(0);
    } finally {
      c.close();
      await d2.stop('test done');
    }
    // The word the ring threads reserve in is the session's own counter (session.ts): one side's bytes count for the other.
    const { Session } = await import('../src/daemon/session.js');
    const s = new Session(process.pid, 'tzip-x-', 'x', 4, { ...defaultLimits(), maxInflightBytesPerSession: 1000 });
    const word = new BigInt64Array(s.inflightShared.buffer, s.inflightShared.byteOffset, 1);
    const give = s.reserveBytes(600);
    expect(Atomics.load(word, 0)).toBe(600n);
    Atomics.add(word, 0, 300n); // a ring batch of 300 bytes, as the thread reserves
    expect(s.inflightBytes).toBe(900);
    expect(() => s.reserveBytes(101)).toThrow(/maxInflightBytesPerSession/);
    give();
    Atomics.sub(word, 0, 300n);
    expect(s.inflightBytes).toBe(0);
  });
});

// ---- CUDA regions: a `tzip serve` child process opens this process's CUDA IPC handles -----------------------------

const probe = addonAvailable() ? gpu() : { available: false, reason: 'the native addon is not built', devices: [] };

describe.skipIf(!probe.available || !hasRing)(`the ring with CUDA regions on a real GPU${probe.available ? NO_RING : ` (skipped: no GPU: ${probe.reason})`}`, () => {
  let serve: ServeChild | undefined;
  let socket = '';
  beforeAll(async () => {
    socket = join(tmp(), 'gpu', 'tzip.sock');
    serve = await startServe(socket);
  }, 30_000);
  afterAll(async () => {
    await serve?.stop();
  });

  it('compresses bf16/f16/f32 from device memory into frames equal to the CPU codec\'s, and back bit-exact; WAIT/SIGNAL on the header\'s produced and done words', async () => {
    const shareable = (ptr: bigint) => Buffer.concat([Buffer.from([2, 0x63]), cudaIpcGetMemHandle(ptr, 0)]);
    const c = new DaemonConn(`ipc://${socket}`, 'ring-gpu');
    const tensors = [DTYPES[8], DTYPES[7], DTYPES[11]] as (typeof DTYPES)[number][];
    const n = 1 << 16;
    const datas = tensors.map((d, i) => dataOf(d, n, 50 + i));
    const caps = datas.map((d) => maxCompressedSize(d.length, 1));
    const offsets: number[] = [];
    let total = 0;
    for (const d of datas) {
      offsets.push(total);
      total += align(d.length);
    }
    const frameOffsets: number[] = [];
    let frameTotal = 0;
    for (const cap of caps) {
      frameOffsets.push(frameTotal);
      frameTotal += align(cap);
    }
    const src = gpuAlloc(0, total);
    const frames = gpuAlloc(0, frameTotal);
    const back = gpuAlloc(0, total);
    try {
      datas.forEach((d, i) => gpuCopyToDevice(src + BigInt(offsets[i] as number), d, 0));
      const h = await c.req({ op: 'hello', versions: [1, 2, 3, 4], pid: c.pid, shm_prefix: c.prefix, name: 'ring-gpu' });
      expect(h.ok, JSON.stringify(h)).toBe(true);
      expect(h.ring).toBeDefined();
      c.sid = h.sid;
      const dev = { type: 2, id: (h.daemon.gpus[0] as { index: number }).index };
      const file = ringFile(`${c.prefix}ring-gpu`, 64);
      const o = await c.call('ring_open', { name: file.name, entries: 64, device: dev });
      expect(o.ok, JSON.stringify(o)).toBe(true);
      const reg = await c.call('ring_register', { ring: o.ring, regions: [
        { kind: 'cuda', device: dev, handle: shareable(src), offset: 0, bytes: total },
        { kind: 'cuda', device: dev, handle: shareable(frames), offset: 0, bytes: frameTotal },
        { kind: 'cuda', device: dev, handle: shareable(back), offset: 0, bytes: total },
      ] });
      expect(reg.ok, JSON.stringify(reg)).toBe(true);
      const [rs, rf, rb] = reg.regions as [Region, Region, Region];
      // The header's produced word (offset 448) reaches 1, as the client's stream's cuStreamWriteValue64 would write it.
      file.rc.mem.writeBigUInt64LE(1n, 448);
      file.rc.submit(tensors.map((d, i) => ({
        userData: BigInt(i), op: OP.compress, flags: (i === 0 ? FLAG.wait : 0) | (i < tensors.length - 1 ? FLAG.link : FLAG.signal),
        codec: CODEC.max, dtype: d.code, shape: [n], waitValue: i === 0 ? 1n : 0n, signalValue: i === tensors.length - 1 ? 7n : 0n,
        src: { id: rs.id, generation: rs.generation, offset: offsets[i] as number, bytes: (datas[i] as Buffer).length },
        dst: { id: rf.id, generation: rf.generation, offset: frameOffsets[i] as number, bytes: caps[i] as number },
      })));
      const cc = byUser(await reap(file, tensors.length, 60_000));
      for (let i = 0; i < tensors.length; i++) {
        const cqe = cc[i] as Done;
        expect(cqe.status, cqe.message).toBe(0);
        const want = await compress(datas[i] as Buffer, { dtype: (tensors[i] as { name: string }).name, shape: [n], codec: 'max' });
        expect(gpuCopyFromDevice(frames + BigInt(frameOffsets[i] as number), cqe.result, 0).equals(want), (tensors[i] as { name: string }).name).toBe(true);
      }
      // done (offset 512) becomes the batch's signal_value once its CQEs are written (docs/ring.md: CQEs first)
      const until = Date.now() + 10_000;
      while (file.rc.mem.readBigUInt64LE(512) !== 7n && Date.now() < until) await new Promise((r) => setTimeout(r, 1));
      expect(file.rc.mem.readBigUInt64LE(512)).toBe(7n);
      // A batch waiting for produced >= 2 does not start while produced is 1, and does once it is 2.
      file.rc.submit(tensors.map((_, i) => ({
        userData: BigInt(10 + i), op: OP.decompress,
        flags: FLAG.verify | (i === 0 ? FLAG.wait : 0) | (i < tensors.length - 1 ? FLAG.link : 0), waitValue: i === 0 ? 2n : 0n,
        src: { id: rf.id, generation: rf.generation, offset: frameOffsets[i] as number, bytes: (cc[i] as Done).result },
        dst: { id: rb.id, generation: rb.generation, offset: offsets[i] as number, bytes: (datas[i] as Buffer).length },
      })));
      await new Promise((r) => setTimeout(r, 200));
      expect(file.rc.ready()).toBe(0);
      file.rc.mem.writeBigUInt64LE(2n, 448);
      const dc = await reap(file, tensors.length, 60_000);
      expect(dc.every((q) => q.status === 0), JSON.stringify(dc, (_k, v) => (typeof v === 'bigint' ? v.toString() : v))).toBe(true);
      datas.forEach((d, i) => expect(gpuCopyFromDevice(back + BigInt(offsets[i] as number), d.length, 0).equals(d)).toBe(true));
      // a handle CUDA cannot open, a GPU the daemon does not have, an expandable segment: refused, nothing registered
      const bogus = Buffer.concat([Buffer.from([2, 0x63]), Buffer.alloc(64, 0x5a)]);
      expectError(await c.call('ring_register', { ring: o.ring, regions: [{ kind: 'cuda', device: dev, handle: bogus, offset: 0, bytes: 16 }] }), 'TZIP_HANDLE');
      expectError(await c.call('ring_register', { ring: o.ring, regions: [{ kind: 'cuda', device: { type: 2, id: 999 }, handle: shareable(src), offset: 0, bytes: 16 }] }), 'TZIP_NO_DEVICE');
      expectError(await c.call('ring_register', { ring: o.ring, regions: [{ kind: 'cuda', device: dev, handle: Buffer.from([2, 0x65, 1, 2, 3]), offset: 0, bytes: 16 }] }), 'TZIP_UNSUPPORTED');
      expect((await c.call('stats', {})).session.rings).toEqual({ open: 1, regions: 3 });
      // a cuda region of the ring on a CPU-only ring is refused
      const cpu = ringFile(`${c.prefix}ring-cpu`, 8);
      const oc = await c.call('ring_open', { name: cpu.name, entries: 8 });
      expectError(await c.call('ring_register', { ring: oc.ring, regions: [{ kind: 'cuda', device: dev, handle: shareable(src), offset: 0, bytes: 16 }] }), 'TZIP_INVALID_ARGUMENT', 'CPU batches only');
      expect(await c.call('ring_release', { ring: o.ring, regions: [rf.id] })).toMatchObject({ ok: true });
      // The session ends while a batch waits for a produced value that never comes: the ring still closes.
      file.rc.submit([{
        userData: 99n, op: OP.compress, flags: FLAG.wait, waitValue: 100n, codec: CODEC.fast, dtype: DTYPE.BF16 as number, shape: [n],
        src: { id: rs.id, generation: rs.generation, offset: 0, bytes: (datas[0] as Buffer).length },
        dst: { id: rb.id, generation: rb.generation, offset: 0, bytes: total },
      }]);
      await new Promise((r) => setTimeout(r, 100));
      expect(await c.call('release', { end: true })).toMatchObject({ ok: true });
      // The daemon closes its CUDA IPC mappings once the rings are closed: only then is the memory freed here.
      const deadline = Date.now() + 10_000;
      for (;;) {
        const st = await c.req({ op: 'stats' });
        if (st.gpu.allocations === 0 && st.rings.open === 0) break;
        expect(Date.now() < deadline, `the daemon let go of the allocations: ${JSON.stringify(st.gpu)}`).toBe(true);
        await new Promise((r) => setTimeout(r, 20));
      }
    } finally {
      c.close();
      gpuFree(src, 0);
      gpuFree(frames, 0);
      gpuFree(back, 0);
    }
  }, 120_000);
});
