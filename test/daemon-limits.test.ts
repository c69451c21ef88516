// Per-session limits (docs/security.md, "Limits"): a daemon in this process with small limits, spoken to by ZeroMQ
// DEALERs over ipc:// with /dev/shm files made here. A session over a limit gets TZIP_LIMIT naming the limit, its value
// and the `tzip serve` flag; the daemon goes on serving it and other sessions; round trips stay bit-exact. The
// bookkeeping under the limits (mappings kept for requests in flight, bytes reserved, CUDA IPC allocations in use) is
// checked on the classes directly, where a request can be held in flight without timing.
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { useGpuApiForTests, type GpuApi } from '../src/daemon/gpu.js';
import { GpuSession, IpcAllocations } from '../src/daemon/gpu-map.js';
import { defaultLimits, SESSION_LIMITS } from '../src/daemon/limits.js';
import { ReplyError } from '../src/daemon/reply-error.js';
import { Daemon } from '../src/daemon/server.js';
import { Session } from '../src/daemon/session.js';
import { FileOwners, ShmMappings } from '../src/daemon/shm-map.js';
import { compress, maxCompressedSize } from '../src/native.js';
import { DaemonConn, shmFile } from './helpers/daemon-conn.js';
import { bf16RoundTrip } from './helpers/shm-round-trip.js';
import { bf16Weights } from './helpers/bf16-weights.js';
import { useTempDir } from './helpers/temp-dir.js';

const tmp = useTempDir('daemon-limits');
const MAX_REGIONS = 4;
const MAX_INFLIGHT_BYTES = 1 << 20;
let daemon: Daemon;



const BF16 = { code: 4, bits: 16, lanes: 1 };
const CPU = { type: 1, id: 0 };
const tensor = (name: string, elements: number, offset = 0) =>
  ({ device: CPU, dtype: BF16, shape: [elements], byte_offset: 0, data: { kind: 'shm', name, offset, size: elements * 2 } });
const region = (name: string, offset: number, size: number) => ({ kind: 'shm', name, offset, size });

/** Compresses `data` (bf16) of `c` and back: the bytes back (the frame's file kept its capacity). */
async function roundTrip(c: DaemonConn, data: Buffer, tag: string): Promise<Buffer> {
  const rt = await bf16RoundTrip(c, data, tag);
  expect(rt.frameFileBytes).toBe(maxCompressedSize(data.length, 1));
  return rt.back;
}

beforeAll(async () => {
  const limits = { ...defaultLimits(), leaseMs: 5000, maxRegionsPerSession: MAX_REGIONS, maxInflightBytesPerSession: MAX_INFLIGHT_BYTES };
  daemon = await Daemon.start({ socketPath: join(tmp(), 'd', 'tzip.sock'), limits, log: () => undefined });
});

afterAll(async () => {
  await daemon.stop('tests done');
});

function expectLimit(r: Record<string, any>, name: keyof typeof SESSION_LIMITS, value: number): void {
  expect(r.ok).toBe(false);
  expect(r.error.code).toBe('TZIP_LIMIT');
  expect(r.error.message).toContain(`${name} = ${value}`);
  expect(r.error.message).toContain(`tzip serve ${SESSION_LIMITS[name].flag} N`);
}

describe('per-session limits over the socket', () => {
  it('hello tells the limits', async () => {
    const c = new DaemonConn(daemon.endpoint, 'limits');
    try {
      const h = await c.hello();
      expect(h.limits.max_regions).toBe(MAX_REGIONS);
      expect(h.limits.max_inflight_bytes).toBe(MAX_INFLIGHT_BYTES);
      expect(h.limits.max_ipc_handles).toBe(defaultLimits().maxIpcHandlesPerSession);
    } finally {
      c.close();
    }
  });

  it('a request naming more files than --max-regions gets TZIP_LIMIT; the session and others go on', async () => {
    const a = new DaemonConn(daemon.endpoint, 'limits');
    const b = new DaemonConn(daemon.endpoint, 'limits');
    try {
      await a.hello();
      await b.hello();
      // 3 tensors, each in its own file, frames into a 4th and 5th file: 5 files > 4.
      const data = bf16Weights(2048);
      const cap = maxCompressedSize(data.length, 1);
      const tensors = [0, 1, 2].map((i) => {
        shmFile(`${a.prefix}r${i}`, data.length, data);
        return { tensor: tensor(`${a.prefix}r${i}`, 2048), out: region(`${a.prefix}${i < 2 ? 'o0' : 'o1'}`, (i % 2) * cap, cap) };
      });
      shmFile(`${a.prefix}o0`, 2 * cap);
      shmFile(`${a.prefix}o1`, 2 * cap);
      expectLimit(await a.call('compress', { tensors }), 'maxRegionsPerSession', MAX_REGIONS);
      // Nothing stays mapped beyond the limit, and the same session is served at once (4 files: within it).
      let st = await a.req({ op: 'stats', sid: a.sid });
      expect(st.session.mapped.files).toBeLessThanOrEqual(MAX_REGIONS);
      const ok = await a.call('compress', { tensors: tensors.slice(0, 2) });
      expect(ok.ok, JSON.stringify(ok)).toBe(true);
      // Requests one after the other may name any number of files: idle mappings make room.
      for (let i = 0; i < 3; i++) expect((await roundTrip(a, bf16Weights(1000, 10 + i), `seq${i}`)).equals(bf16Weights(1000, 10 + i))).toBe(true);
      st = await a.req({ op: 'stats', sid: a.sid });
      expect(st.session.mapped.files).toBeLessThanOrEqual(MAX_REGIONS);
      // Another session has its own count.
      expect((await roundTrip(b, data, 'other')).equals(data)).toBe(true);
    } finally {
      a.close();
      b.close();
    }
  });

  it('a request above --max-inflight-bytes gets TZIP_LIMIT; smaller ones and other sessions are served', async () => {
    const a = new DaemonConn(daemon.endpoint, 'limits');
    const b = new DaemonConn(daemon.endpoint, 'limits');
    try {
      await a.hello();
      await b.hello();
      const elements = MAX_INFLIGHT_BYTES / 2 + 1; // one element more than the limit's bytes
      const name = `${a.prefix}big`;
      const cap = maxCompressedSize(elements * 2, 1);
      shmFile(name, elements * 2 + cap);
      const r = await a.call('compress', { tensors: [{ tensor: tensor(name, elements), out: region(name, elements * 2, cap) }] });
      expectLimit(r, 'maxInflightBytesPerSession', MAX_INFLIGHT_BYTES);
      expect(r.error.message).toContain(`${elements * 2} bytes`);
      // A decompress is counted by its destination's bytes: a frame (made here by the codec) of that tensor.
      const big = bf16Weights(elements);
      const frame = await compress(big, { dtype: 'BF16', shape: [elements], codec: 'fast' });
      const frameName = `${a.prefix}big-frame`;
      shmFile(frameName, frame.length, frame);
      const d = await a.call('decompress', { frames: [{ frame: region(frameName, 0, frame.length), out: tensor(name, elements) }] });
      expectLimit(d, 'maxInflightBytesPerSession', MAX_INFLIGHT_BYTES);
      // Within the limit, the same session is served, bit-exact.
      const data = bf16Weights(MAX_INFLIGHT_BYTES / 4);
      expect((await roundTrip(a, data, 'half')).equals(data)).toBe(true);
      const st = await a.req({ op: 'stats', sid: a.sid });
      expect(st.session.inflight_bytes).toBe(0);
      expect((await roundTrip(b, data, 'b-half')).equals(data)).toBe(true);
    } finally {
      a.close();
      b.close();
    }
  });
});

describe('what the limits count', () => {
  it('mappings in use by a request in flight are kept; idle ones make room', () => {
    const owners = new FileOwners();
    const m = new ShmMappings({ maxBytes: 1 << 30, maxCached: 2, maxRegions: 2 }, () => 'session-1', owners);
    const prefix = `tzip-${process.pid}-${Math.floor(Math.random() * 2 ** 32).toString(16).padStart(8, '0')}-`;
    for (const x of ['a', 'b', 'c']) shmFile(`${prefix}${x}`, 4096);
    m.map(`${prefix}a`, false, 1001);
    m.map(`${prefix}b`, false, 1002);
    let err: unknown;
    try {
      m.map(`${prefix}c`, false, 1003);
    } catch (e) {
      err = e;
    }
    expect(err).toBeInstanceOf(ReplyError);
    expect((err as ReplyError).code).toBe('TZIP_LIMIT');
    expect(m.count).toBe(2);
    m.endRequest(1001); // request 1001 is done: its file may go
    m.map(`${prefix}c`, false, 1003);
    expect(m.count).toBe(2);
    expect(m.idOf(`${prefix}a`)).toBeUndefined();
    expect(m.idOf(`${prefix}b`)).toBeDefined();
    m.endRequest(1002);
    m.endRequest(1003);
    m.drop();
    expect(owners.size).toBe(0);
  });

  it('a request may use more mappings than are kept idle after it, up to the limit', () => {
    const owners = new FileOwners();
    const m = new ShmMappings({ maxBytes: 1 << 30, maxCached: 1, maxRegions: 3 }, () => 'session-2', owners);
    const prefix = `tzip-${process.pid}-${Math.floor(Math.random() * 2 ** 32).toString(16).padStart(8, '0')}-`;
    for (const x of ['a', 'b', 'c', 'd']) shmFile(`${prefix}${x}`, 4096);
    for (const x of ['a', 'b', 'c']) m.map(`${prefix}${x}`, false, 2001);
    expect(m.count).toBe(3);
    expect(() => m.map(`${prefix}d`, false, 2001)).toThrow(/maxRegionsPerSession = 3/);
    m.endRequest(2001);
    expect(m.count).toBe(1); // the most recently used stays
    expect(m.idOf(`${prefix}c`)).toBeDefined();
    m.drop();
    expect(owners.size).toBe(0);
  });

  it('bytes reserved by requests in flight add up, and are given back', () => {
    const s = new Session(process.pid, `tzip-${process.pid}-0123456789-`, 'bytes', 1, { ...defaultLimits(), maxInflightBytesPerSession: 1000 });
    const first = s.reserveBytes(600);
    expect(() => s.reserveBytes(600)).toThrow(/maxInflightBytesPerSession = 1000/);
    const second = s.reserveBytes(400);
    expect(s.inflightBytes).toBe(1000);
    first();
    first(); // idempotent
    expect(s.inflightBytes).toBe(400);
    second();
    expect(s.reserveBytes(1000)).toBeTypeOf('function');
  });

  it('CUDA IPC allocations: at --max-ipc-handles, idle ones are closed to make room; in-use ones are a TZIP_LIMIT before CUDA opens more', () => {
    // A stand-in for the CUDA driver's IPC calls (this machine has no GPU; the real GPU: test_security_gpu.py).
    const opened = new Set<bigint>();
    let opens = 0;
    const fake = {
      gpuDevices: () => [],
      cudaIpcOpenMemHandle: (h: Uint8Array) => {
        opens++;
        const base = Buffer.from(h).readBigUInt64LE(0);
        opened.add(base);
        return base;
      },
      cudaIpcCloseMemHandle: (base: bigint) => {
        opened.delete(base);
      },
    } as unknown as GpuApi;
    useGpuApiForTests(fake);
    try {
      const handle = (n: number) => {
        const h = Buffer.alloc(66);
        h[0] = 2;
        h[1] = 0x63;
        h.writeBigUInt64LE(BigInt(n) << 32n, 2);
        return h;
      };
      const g = new GpuSession('sid-1', { maxAllocations: 2, maxEvents: 4 }, new IpcAllocations());
      const req1 = new Set<string>();
      g.track(req1);
      for (const n of [1, 2]) req1.add(g.allocation(handle(n), 0).key);
      expect(() => g.allocation(handle(3), 0)).toThrow(/maxIpcHandlesPerSession = 2.*--max-ipc-handles/);
      expect(opens).toBe(2); // refused before CUDA opened a third
      g.untrack(req1);
      const req2 = new Set<string>();
      g.track(req2);
      req2.add(g.allocation(handle(3), 0).key);
      expect(g.allocations).toBe(2);
      expect(opened.size).toBe(2); // the least recently used idle allocation was closed
      expect(opened.has(1n << 32n)).toBe(false);
      g.untrack(req2);
      g.close();
      expect(opened.size).toBe(0);
    } finally {
      useGpuApiForTests(undefined);
    }
  });
});
