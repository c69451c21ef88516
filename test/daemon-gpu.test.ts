// The daemon's GPU path (CUDA IPC handles, interprocess events) against a stand-in for the addon's GPU functions:
// "device memory" is host memory behind fake pointers, IPC handles name fake allocations, the codec is the CPU
// codec. Checks what the daemon does around the codec: handle checks and caching, one open per allocation per
// daemon, events waited on and recorded, the codecs and frame headers the addon reports used and checked (a frame that
// disagrees with its handle or destination refused), release / session end closing everything (after requests in
// flight), hostile handles answered with errors. The real GPU runs in python-bridge/tests/test_client_cuda.py.
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { TzipError } from '../src/errors.js';
import { useGpuApiForTests, type GpuApi } from '../src/daemon/gpu.js';
import { ipcAllocations } from '../src/daemon/gpu-map.js';
import { defaultLimits } from '../src/daemon/limits.js';
import { Daemon } from '../src/daemon/server.js';
import { compress, decompress, maxCompressedSize, readHeader, type FrameHeader, type GpuCompressed, type GpuDevice } from '../src/native.js';
import { bf16Weights } from './helpers/bf16-weights.js';
import { DaemonConn } from './helpers/daemon-conn.js';
import { useTempDir } from './helpers/temp-dir.js';

const tmp = useTempDir('daemon-gpu');
const UUID = 'GPU-11111111-2222-3333-4444-555555555555';

/** A fake GPU: allocations of host memory behind fake addresses, and what the daemon did with them. */
class FakeGpu {
  private nextBase = 0x7000_0000_0000n;
  /** Client-side allocations by base. */
  readonly memory = new Map<bigint, Buffer>();
  /** Daemon-side mappings: mapped base -> client base. */
  readonly mapped = new Map<bigint, bigint>();
  opens = 0;
  closes = 0;
  readonly events = new Set<bigint>();
  private nextEvent = 1n;
  destroyed = 0;
  readonly waited: bigint[] = [];
  readonly recorded: bigint[] = [];
  /** When set, gpuCompress waits for it (a request held in flight). */
  hold: Promise<void> | null = null;
  /** When set, what gpuCompress reports is passed through it (an addon that reports something else). */
  alterCompressed: ((r: GpuCompressed[]) => GpuCompressed[]) | null = null;
  /** When set, what gpuDecompress reports is passed through it (headers that changed after the decode). */
  alterHeaders: ((h: FrameHeader[]) => FrameHeader[]) | null = null;
  /** gpuCompress / gpuDecompress calls, with their item counts. */
  readonly batches: { op: 'compress' | 'decompress'; items: number }[] = [];
  /** The codec of every item gpuCompress was given, in order. */
  readonly asked: string[] = [];

  alloc(bytes: Buffer | number): bigint {
    const base = this.nextBase;
    this.nextBase += 0x1_0000_0000n;
    this.memory.set(base, typeof bytes === 'number' ? Buffer.alloc(bytes) : Buffer.from(bytes));
    return base;
  }

  /** PyTorch's shareable handle of an allocation: [2]["c"] + 64 bytes (base, magic). */
  handle(base: bigint): Buffer {
    const h = Buffer.alloc(66);
    h[0] = 2;
    h[1] = 0x63;
    h.writeBigUInt64LE(base, 2);
    h.write('fake-ipc', 10, 'latin1');
    return h;
  }

  /** The bytes behind a daemon-side pointer. */
  private resolve(ptr: bigint, n: number): Buffer {
    for (const [mbase, base] of this.mapped) {
      const mem = this.memory.get(base) as Buffer;
      if (ptr >= mbase && ptr + BigInt(n) <= mbase + BigInt(mem.length)) {
        const off = Number(ptr - mbase);
        return mem.subarray(off, off + n);
      }
    }
    throw Object.assign(new Error(`pointer 0x${ptr.toString(16)} (+${n}) is not device memory of device 0`), { code: 'TZIP_INVALID_ARGUMENT' });
  }

  api(): GpuApi {
    const devices: GpuDevice[] = [{ ordinal: 0, uuid: UUID, name: 'Fake GPU', smCount: 10, totalMemory: 1 << 30, pciBusId: '', computeCapability: '9.0' }];
    return {
      gpuDevices: () => devices,
      cudaIpcOpenMemHandle: (h, device) => {
        expect(device).toBe(0);
        expect(h.byteLength).toBe(64);
        const base = Buffer.from(h).readBigUInt64LE(0);
        if (Buffer.from(h).toString('latin1', 8, 16) !== 'fake-ipc' || !this.memory.has(base)) {
          throw new TzipError('TZIP_CUDA' as never, 'cudaIpcOpenMemHandle: cudaErrorInvalidValue: invalid argument');
        }
        for (const b of this.mapped.values()) if (b === base) throw new TzipError('TZIP_CUDA' as never, 'opened twice in one process');
        this.opens++;
        const mbase = base + 0x1000_0000_0000n;
        this.mapped.set(mbase, base);
        return mbase;
      },
      cudaIpcCloseMemHandle: (mbase) => {
        expect(this.mapped.delete(mbase)).toBe(true);
        this.closes++;
      },
      cudaIpcOpenEventHandle: (h) => {
        if (h.byteLength !== 64 || h[0] !== 0xee) throw new TzipError('TZIP_CUDA' as never, 'cudaIpcOpenEventHandle: cudaErrorInvalidResourceHandle');
        const e = this.nextEvent++;
        this.events.add(e);
        return e;
      },
      cudaEventCreateInterprocess: () => {
        const e = this.nextEvent++;
        this.events.add(e);
        return { event: e, handle: Buffer.alloc(64, Number(e)) };
      },
      cudaEventDestroy: (e) => {
        expect(this.events.delete(e)).toBe(true);
        this.destroyed++;
      },
      // As the addon: per item the frame's size and the codec it records; per decoded frame its header.
      gpuCompress: async (items, opts) => {
        this.batches.push({ op: 'compress', items: items.length });
        if (opts.waitEvent !== undefined) this.waited.push(opts.waitEvent);
        if (this.hold !== null) await this.hold;
        const written: GpuCompressed[] = [];
        for (const it of items) {
          this.asked.push(it.codec ?? '(none: the addon\'s auto)');
          const input = this.resolve(it.data, Number(it.nbytes));
          const frame = await compress(input, { dtype: it.dtype, shape: it.shape.map(Number), codec: it.codec, chunkSize: opts.chunkSize });
          frame.copy(this.resolve(it.frame, Number(it.frameCapacity)));
          written.push({ frameBytes: BigInt(frame.length), codec: readHeader(frame).codec });
        }
        if (opts.recordEvent !== undefined) this.recorded.push(opts.recordEvent);
        return this.alterCompressed !== null ? this.alterCompressed(written) : written;
      },
      gpuDecompress: async (items, opts) => {
        this.batches.push({ op: 'decompress', items: items.length });
        if (opts.waitEvent !== undefined) this.waited.push(opts.waitEvent);
        const headers: FrameHeader[] = [];
        for (const it of items) {
          const frame = this.resolve(it.frame, Number(it.frameBytes));
          await decompress(frame, { out: this.resolve(it.out, Number(it.outBytes)), verify: opts.verify });
          headers.push(readHeader(frame));
        }
        if (opts.recordEvent !== undefined) this.recorded.push(opts.recordEvent);
        return this.alterHeaders !== null ? this.alterHeaders(headers) : headers;
      },
    };
  }
}


let gpu: FakeGpu;
let daemon: Daemon;

beforeAll(async () => {
  gpu = new FakeGpu();
  useGpuApiForTests(gpu.api());
  const limits = { ...defaultLimits(), leaseMs: 5000 };
  daemon = await Daemon.start({ socketPath: join(tmp(), 'd', 'tzip.sock'), limits, log: () => undefined });
});

afterAll(async () => {
  await daemon.stop('tests done');
  useGpuApiForTests(undefined);
});


const EVENT = Buffer.alloc(64, 0xee);

function ipc(c: DaemonConn, base: bigint, offset: number, size: number, extra: Record<string, unknown> = {}) {
  return { kind: 'cuda_ipc', device_uuid: UUID.toLowerCase().slice(4), device_index: 3, handle: gpu.handle(base), offset, size,
    ref_counter_handle: Buffer.from(`/torch_${c.pid}_42_0`), ref_counter_offset: 7, ...extra };
}

function bf16(data: Record<string, unknown>, shape: number[], byteOffset = 0) {
  return { device: { type: 2, id: 3 }, dtype: { code: 4, bits: 16, lanes: 1 }, shape, byte_offset: byteOffset, data };
}

async function settle(what: () => boolean): Promise<void> {
  for (let i = 0; i < 200 && !what(); i++) await new Promise((r) => setTimeout(r, 10));
}

describe('GPU requests (fake GPU)', () => {
  it('says hello with its GPUs', async () => {
    const c = new DaemonConn(daemon.endpoint);
    try {
      const h = await c.hello();
      expect(h.daemon.gpu).toBe(true);
      expect(h.daemon.handle_kinds).toEqual(['shm', 'cuda_ipc']);
      expect(h.daemon.gpus).toEqual([{ uuid: UUID, name: 'Fake GPU', index: 0 }]);
    } finally {
      c.close();
    }
  });

  it('compresses views at storage offsets and decompresses them, events both ways, bytes as the CPU codec', async () => {
    const c = new DaemonConn(daemon.endpoint);
    try {
      await c.hello();
      const a = bf16Weights(100_000);
      const storageOffset = 4096; // the storage starts 4096 bytes into the allocation
      const base = gpu.alloc(8 << 20);
      const mem = gpu.memory.get(base) as Buffer;
      a.copy(mem, storageOffset + 6); // a view 3 elements into its storage
      const cap = maxCompressedSize(a.length, 1);
      const outOff = 1 << 20;
      const opensBefore = gpu.opens;
      const r = await c.call('compress', {
        wait_event: EVENT,
        tensors: [
          { tensor: bf16(ipc(c, base, storageOffset, a.length + 6 + 100), [100_000], 6), out: ipc(c, base, outOff, cap), codec: 'auto' },
          { tensor: bf16(ipc(c, base, storageOffset, a.length + 6 + 100), [100_000], 6), out: ipc(c, base, outOff + cap + 64, cap), codec: 'raw' },
        ],
      });
      expect(r.ok).toBe(true);
      expect(gpu.opens).toBe(opensBefore + 1); // one allocation, opened once
      expect(Buffer.isBuffer(r.event_handle) && r.event_handle.length).toBe(64);
      const want = await compress(a, { dtype: 'BF16', shape: [100_000] });
      expect(r.frames[0].bytes).toBe(want.length);
      expect(mem.subarray(outOff, outOff + want.length).equals(want)).toBe(true);
      expect(['fast', 'max']).toContain(r.frames[0].codec); // auto on bf16: as the addon reports it
      expect(r.frames[0].codec).toBe(readHeader(want).codec);
      expect(r.frames[1].codec).toBe('raw');
      expect(gpu.waited.length).toBeGreaterThan(0);
      expect(gpu.recorded.length).toBeGreaterThan(0);

      const back = 4 << 20;
      const d = await c.call('decompress', {
        wait_event: EVENT,
        frames: [{ frame: ipc(c, base, outOff, r.frames[0].bytes), out: bf16(ipc(c, base, back, a.length), [100_000]) }],
      });
      expect(d.ok).toBe(true);
      expect(d.tensors[0]).toMatchObject({ nbytes: a.length, dtype: 'BF16', shape: [100_000] });
      expect(mem.subarray(back, back + a.length).equals(a)).toBe(true);
      expect(gpu.opens).toBe(opensBefore + 1); // cached

      // the frame against a destination of another shape: refused after the decode (the destination is scratch)
      const wrong = await c.call('decompress', { frames: [{ frame: ipc(c, base, outOff, r.frames[0].bytes), out: bf16(ipc(c, base, back, a.length), [1000, 100]) }] });
      expect(wrong.error.code).toBe('TZIP_INVALID_ARGUMENT');
      const st = await c.call('stats');
      expect(st.gpu.allocations).toBeGreaterThanOrEqual(1);
      expect(st.session.gpu.allocations).toBe(1);
      const rel = await c.call('release', { handles: [gpu.handle(base)] });
      expect(rel.released).toBe(1);
      expect(gpu.mapped.size).toBe(0);
    } finally {
      c.close();
    }
  });

  it('takes a handle table (protocol version 2): references expand to the regions they name, checked as full handles', async () => {
    const c = new DaemonConn(daemon.endpoint);
    try {
      const hello = await c.req({ op: 'hello', versions: [1, 2], pid: c.pid, shm_prefix: c.prefix });
      expect(hello.version).toBe(2);
      c.sid = hello.sid;
      const a = bf16Weights(3000, 5);
      const base = gpu.alloc(1 << 20);
      const mem = gpu.memory.get(base) as Buffer;
      const storage = 8192; // the storage the table's entry describes starts here in the allocation
      a.copy(mem, storage + 64);
      const cap = maxCompressedSize(a.length, 1);
      const ref = (offset: number, size: number, index = 0) => ({ kind: 'ref', index, offset, size });
      const handles = [ipc(c, base, storage, 200_000)];
      const r = await c.call('compress', { handles, tensors: [
        { tensor: bf16(ref(64, a.length), [3000]), out: ref(16384, cap) },
        { tensor: bf16(ref(0, a.length + 64), [3000], 64), out: ref(32768, cap), codec: 'raw' },
      ] });
      expect(r.ok).toBe(true);
      const want = await compress(a, { dtype: 'BF16', shape: [3000], codec: 'fast' }); // a GPU request's default codec
      expect(mem.subarray(storage + 16384, storage + 16384 + r.frames[0].bytes).equals(want)).toBe(true);
      const d = await c.call('decompress', { handles, frames: [{ frame: ref(16384, r.frames[0].bytes), out: bf16(ref(65536, a.length), [3000]) }] });
      expect(d.ok).toBe(true);
      expect(mem.subarray(storage + 65536, storage + 65536 + a.length).equals(a)).toBe(true);
      // the same request with full handles writes the same bytes
      const full = await c.call('compress', { tensors: [{ tensor: bf16(ipc(c, base, storage + 64, a.length), [3000]), out: ipc(c, base, storage + 98304, cap) }] });
      expect(full.frames[0].bytes).toBe(r.frames[0].bytes);
      expect(mem.subarray(storage + 98304, storage + 98304 + full.frames[0].bytes).equals(want)).toBe(true);

      const code = async (op: string, body: Record<string, unknown>) => {
        const e = await c.call(op, body);
        expect(e.ok).toBe(false);
        return e.error as { code: string; message: string; index?: number };
      };
      const one = (tensor: unknown, out: unknown, table: unknown = handles) => ({ handles: table, tensors: [{ tensor: bf16(ipc(c, base, storage, 8), [4]), out: ref(16384, cap) }, { tensor, out }] });
      let e = await code('compress', one(bf16(ref(0, 8, 1), [4]), ref(16384 + cap, cap)));
      expect([e.code, e.index]).toEqual(['TZIP_PROTOCOL', 1]);
      expect(e.message).toContain('handles[1]');
      e = await code('compress', { tensors: [{ tensor: bf16(ref(0, 8), [4]), out: ipc(c, base, 16384, cap) }] });
      expect([e.code, e.index]).toEqual(['TZIP_PROTOCOL', 0]);
      expect(e.message).toContain('no "handles"');
      e = await code('compress', one(bf16(ref(199_999, 8), [4]), ref(16384 + cap, cap)));
      expect([e.code, e.index]).toEqual(['TZIP_HANDLE', 1]);
      expect(e.message).toContain('beyond its 200000 bytes');
      e = await code('compress', one(bf16(ref(0, 8), [4]), ref(Number.MAX_SAFE_INTEGER, 2)));
      expect([e.code, e.index]).toEqual(['TZIP_HANDLE', 1]);
      // an entry's checks are the full handle's: another process's ref counter
      e = await code('compress', one(bf16(ref(0, 8, 1), [4]), ref(16384 + cap, cap), [...handles, ipc(c, base, 0, 1000, { ref_counter_handle: Buffer.from('/torch_1_42_0') })]));
      expect([e.code, e.index]).toEqual(['TZIP_HANDLE', 1]);
      expect(e.message).toContain('another process');
      // a table entry is a full handle, never a reference; a reference has exactly its four fields
      e = await code('compress', one(bf16(ref(0, 8), [4]), ref(16384 + cap, cap), [ref(0, 8)]));
      expect(e.code).toBe('TZIP_PROTOCOL');
      e = await code('compress', one(bf16({ ...ref(0, 8), name: 'x' }, [4]), ref(16384 + cap, cap)));
      expect(e.code).toBe('TZIP_PROTOCOL');
      e = await code('decompress', { handles, frames: [{ frame: ref(16384, r.frames[0].bytes, 7), out: bf16(ref(65536, a.length), [3000]) }] });
      expect([e.code, e.index]).toEqual(['TZIP_PROTOCOL', 0]);
      // a region whose end in the allocation lies beyond 2^53
      const far = [ipc(c, base, Number.MAX_SAFE_INTEGER - 1, Number.MAX_SAFE_INTEGER - 1)];
      e = await code('compress', { handles: far, tensors: [{ tensor: bf16(ref(0, 8), [4]), out: ipc(c, base, 16384, cap) }] });
      expect([e.code, e.index]).toEqual(['TZIP_TOO_LARGE', 0]);
      // a session of protocol version 1 sends no handle tables
      const old = new DaemonConn(daemon.endpoint);
      try {
        await old.hello();
        const v1 = await old.call('compress', { handles: [ipc(old, base, storage, 200_000)], tensors: [{ tensor: bf16(ref(64, a.length), [3000]), out: ref(16384, cap) }] });
        expect(v1.error.code).toBe('TZIP_PROTOCOL');
        expect(v1.error.message).toContain('version 2');
      } finally {
        old.close();
      }
      expect((await c.call('heartbeat')).ok).toBe(true);
    } finally {
      c.close();
    }
  });

  it('a tensor whose request names no codec is coded fast on the GPU; a named codec is kept', async () => {
    const c = new DaemonConn(daemon.endpoint);
    try {
      await c.hello();
      const base = gpu.alloc(4 << 20);
      const w = bf16Weights(50_000, 11);
      w.copy(gpu.memory.get(base) as Buffer, 0);
      const cap = maxCompressedSize(w.length, 1);
      const tensor = (i: number, codec?: string) => ({
        tensor: bf16(ipc(c, base, 0, w.length), [50_000]), out: ipc(c, base, (1 << 20) + i * (1 << 19), cap), ...(codec !== undefined ? { codec } : {}),
      });
      const cases: { body: Record<string, unknown>; asked: string[] }[] = [
        { body: { tensors: [tensor(0), tensor(1, 'max')] }, asked: ['fast', 'max'] },
        { body: { codec: 'auto', tensors: [tensor(0), tensor(1, 'raw')] }, asked: ['auto', 'raw'] },
      ];
      for (const { body, asked } of cases) {
        const before = gpu.asked.length;
        const r = await c.call('compress', body);
        expect(r.ok).toBe(true);
        expect(gpu.asked.slice(before)).toEqual(asked);
        const want = await Promise.all(asked.map((codec) => compress(w, { dtype: 'BF16', shape: [50_000], codec: codec as 'auto' })));
        asked.forEach((_, i) => {
          expect(r.frames[i].codec).toBe(readHeader(want[i]!).codec);
          expect(r.frames[i].bytes).toBe(want[i]!.length);
        });
      }
    } finally {
      c.close();
    }
  });

  it('one addon call per request; the codecs and headers the addon reports are used and checked', async () => {
    const c = new DaemonConn(daemon.endpoint);
    try {
      await c.hello();
      const base = gpu.alloc(8 << 20);
      const mem = gpu.memory.get(base) as Buffer;
      const w = bf16Weights(50_000, 7);
      const noise = randomBytes(40_000); // bf16 bit patterns of random bytes: auto picks what the data says
      const ints = Buffer.alloc(4 * 3000);
      for (let i = 0; i < 3000; i++) ints.writeInt32LE((i * 7919) % 1000 - 500, 4 * i);
      w.copy(mem, 0);
      noise.copy(mem, 200_000);
      ints.copy(mem, 400_000);
      const i32 = (data: Record<string, unknown>, shape: number[]) => ({ device: { type: 2, id: 3 }, dtype: { code: 0, bits: 32, lanes: 1 }, shape, byte_offset: 0, data });
      const items = [
        { tensor: bf16(ipc(c, base, 0, w.length), [250, 200]), codec: 'auto', dtype: 'BF16', shape: [250, 200], bytes: w },
        { tensor: bf16(ipc(c, base, 200_000, noise.length), [20_000]), codec: 'auto', dtype: 'BF16', shape: [20_000], bytes: noise },
        { tensor: bf16(ipc(c, base, 0, w.length), [50_000]), codec: 'fast', dtype: 'BF16', shape: [50_000], bytes: w },
        { tensor: i32(ipc(c, base, 400_000, ints.length), [3000]), codec: 'auto', dtype: 'I32', shape: [3000], bytes: ints },
      ];
      const outAt = (i: number) => (1 << 20) + i * (1 << 19);
      const body = () => ({
        tensors: items.map((it, i) => ({ tensor: it.tensor, out: ipc(c, base, outAt(i), maxCompressedSize(it.bytes.length, it.shape.length)), codec: it.codec })),
      });
      const batchesBefore = gpu.batches.length;
      const r = await c.call('compress', body());
      expect(r.ok).toBe(true);
      expect(gpu.batches.slice(batchesBefore)).toEqual([{ op: 'compress', items: 4 }]);
      const want = await Promise.all(items.map((it) => compress(it.bytes, { dtype: it.dtype, shape: it.shape, codec: it.codec as 'auto' | 'fast' })));
      items.forEach((_, i) => {
        expect(r.frames[i].bytes).toBe(want[i]!.length);
        expect(r.frames[i].codec).toBe(readHeader(want[i]!).codec);
      });
      expect(r.frames[2].codec).toBe('fast');
      expect(r.frames[3].codec).toBe('bytes');

      const backAt = (i: number) => (4 << 20) + i * (1 << 19);
      const dest = (i: number) => {
        const it = items[i]!;
        return it.dtype === 'I32' ? i32(ipc(c, base, backAt(i), it.bytes.length), it.shape) : bf16(ipc(c, base, backAt(i), it.bytes.length), it.shape);
      };
      const frames = () => items.map((_, i) => ({ frame: ipc(c, base, outAt(i), r.frames[i].bytes), out: dest(i) }));
      const d = await c.call('decompress', { frames: frames() });
      expect(d.ok).toBe(true);
      expect(gpu.batches.slice(-1)).toEqual([{ op: 'decompress', items: 4 }]);
      items.forEach((it, i) => {
        expect(d.tensors[i]).toMatchObject({ nbytes: it.bytes.length, dtype: it.dtype, shape: it.shape, codec: r.frames[i].codec });
        expect(mem.subarray(backAt(i), backAt(i) + it.bytes.length).equals(it.bytes)).toBe(true);
      });

      const fails = async (op: string, msg: Record<string, unknown>) => {
        const e = await c.call(op, msg);
        expect(e.ok).toBe(false);
        return e.error as { code: string; message: string; index?: number };
      };
      try {
        // The addon reports a codec the asked codec cannot resolve to: an internal error, not a wrong reply.
        gpu.alterCompressed = (x) => x.map((y, i) => (i === 2 ? { ...y, codec: 'max' } : y));
        let e = await fails('compress', body());
        expect(e).toMatchObject({ code: 'TZIP_INTERNAL', index: 2 });
        gpu.alterCompressed = (x) => x.map((y, i) => (i === 0 ? { ...y, codec: 'raw' } : y));
        e = await fails('compress', body());
        expect(e).toMatchObject({ code: 'TZIP_INTERNAL', index: 0 });
        gpu.alterCompressed = (x) => x.slice(1);
        expect((await fails('compress', body())).code).toBe('TZIP_INTERNAL');
        gpu.alterCompressed = null;
        // Headers read back after the decode that disagree with the handle or the destination.
        gpu.alterHeaders = (h) => h.map((y, i) => (i === 1 ? { ...y, frameBytes: y.frameBytes + 16 } : y));
        e = await fails('decompress', { frames: frames() });
        expect(e).toMatchObject({ code: 'TZIP_INVALID_ARGUMENT', index: 1 });
        expect(e.message).toContain('the handle gives');
        gpu.alterHeaders = (h) => h.map((y, i) => (i === 3 ? { ...y, shape: [1000, 3] } : y));
        e = await fails('decompress', { frames: frames() });
        expect(e).toMatchObject({ code: 'TZIP_INVALID_ARGUMENT', index: 3 });
        expect(e.message).toContain('frame 3 holds I32 [1000, 3]');
        gpu.alterHeaders = (h) => h.map((y, i) => (i === 0 ? { ...y, dtype: 'F16' } : y));
        e = await fails('decompress', { frames: frames() });
        expect(e).toMatchObject({ code: 'TZIP_INVALID_ARGUMENT', index: 0 });
        gpu.alterHeaders = (h) => h.slice(0, 2);
        expect((await fails('decompress', { frames: frames() })).code).toBe('TZIP_INTERNAL');
      } finally {
        gpu.alterCompressed = null;
        gpu.alterHeaders = null;
      }
      expect((await c.call('decompress', { frames: frames() })).ok).toBe(true);
      expect((await c.call('release', { end: true })).ok).toBe(true);
    } finally {
      c.close();
    }
  });

  it('refuses bad handles with errors and keeps serving', async () => {
    const c = new DaemonConn(daemon.endpoint);
    try {
      await c.hello();
      const base = gpu.alloc(1 << 20);
      const t = bf16(ipc(c, base, 0, 2000), [1000]);
      const out = (off: number, size: number) => ipc(c, base, off, size);
      const code = async (body: Record<string, unknown>, op = 'compress') => {
        const r = await c.call(op, body);
        expect(r.ok).toBe(false);
        return r.error as { code: string; message: string; index?: number; need?: number };
      };
      // a handle CUDA cannot open (random bytes)
      const random = { ...ipc(c, base, 0, 2000), handle: Buffer.concat([Buffer.from([2, 0x63]), randomBytes(64)]) };
      let e = await code({ tensors: [{ tensor: bf16(random, [1000]), out: out(8192, 4096) }] });
      expect(e.code).toBe('TZIP_HANDLE');
      expect(e.message).toContain('cudaErrorInvalidValue');
      // another process's share (its ref counter names its pid)
      e = await code({ tensors: [{ tensor: bf16({ ...ipc(c, base, 0, 2000), ref_counter_handle: Buffer.from('/torch_1_42_0') }, [1000]), out: out(8192, 4096) }] });
      expect(e.code).toBe('TZIP_HANDLE');
      expect(e.message).toContain('another process');
      // an expandable segment
      e = await code({ tensors: [{ tensor: bf16({ ...ipc(c, base, 0, 2000), handle: Buffer.from([2, 0x65, 1, 2, 3, 4]) }, [1000]), out: out(8192, 4096) }] });
      expect(e.code).toBe('TZIP_UNSUPPORTED');
      expect(e.message).toContain("expandable_segments");
      // a GPU the daemon does not see
      e = await code({ tensors: [{ tensor: bf16({ ...ipc(c, base, 0, 2000), device_uuid: 'GPU-99999999-0000-0000-0000-000000000000' }, [1000]), out: out(8192, 4096) }] });
      expect(e.code).toBe('TZIP_NO_DEVICE');
      // a tensor beyond its storage, an output below the bound, overlapping regions, an event CUDA cannot open
      e = await code({ tensors: [{ tensor: bf16(ipc(c, base, 0, 1000), [1000]), out: out(8192, 4096) }] });
      expect(e.code).toBe('TZIP_HANDLE');
      e = await code({ tensors: [{ tensor: t, out: out(8192, 100) }] });
      expect(e.code).toBe('TZIP_HANDLE');
      expect(e.need).toBe(maxCompressedSize(2000, 1));
      e = await code({ tensors: [{ tensor: t, out: out(1000, 4096) }] });
      expect(e.message).toContain('overlaps');
      e = await code({ wait_event: Buffer.alloc(64, 1), tensors: [{ tensor: t, out: out(8192, 4096) }] });
      expect(e.code).toBe('TZIP_HANDLE');
      expect(e.message).toContain('wait_event');
      // the same allocation handle again later in a batch is checked again when its ref counter or GPU differs
      // (the daemon reuses the answer for a handle equal to the previous one only with both equal)
      const two = (second: Record<string, unknown>) => ({ tensors: [
        { tensor: t, out: out(8192, 4096) },
        { tensor: bf16({ ...ipc(c, base, 16384, 2000), ...second }, [1000]), out: out(24576, 4096) }] });
      e = await code(two({ ref_counter_handle: Buffer.from('/torch_1_42_0') }));
      expect([e.code, e.index]).toEqual(['TZIP_HANDLE', 1]);
      expect(e.message).toContain('another process');
      e = await code(two({ device_uuid: 'GPU-99999999-0000-0000-0000-000000000000' }));
      expect([e.code, e.index]).toEqual(['TZIP_NO_DEVICE', 1]);
      expect((await c.call('compress', two({}))).ok).toBe(true);
      // a frame that is not a frame
      e = await code({ frames: [{ frame: out(8192, 300), out: bf16(ipc(c, base, 65536, 2000), [1000]) }] }, 'decompress');
      expect(['TZIP_CORRUPT', 'TZIP_TRUNCATED', 'TZIP_INVALID_ARGUMENT']).toContain(e.code);
      expect((await c.call('heartbeat')).ok).toBe(true);
      const ok = await c.call('compress', { tensors: [{ tensor: t, out: out(8192, 4096) }] });
      expect(ok.ok).toBe(true);
    } finally {
      c.close();
    }
  });

  it('opens an allocation once for two sessions of a process, closes it when both let go', async () => {
    const a = new DaemonConn(daemon.endpoint);
    const b = new DaemonConn(daemon.endpoint);
    try {
      await a.hello();
      await b.hello();
      const base = gpu.alloc(1 << 20);
      const job = (c: DaemonConn) => c.call('compress', { tensors: [{ tensor: bf16(ipc(c, base, 0, 2000), [1000]), out: ipc(c, base, 4096, 8192) }] });
      const opens = gpu.opens;
      expect((await job(a)).ok).toBe(true);
      expect((await job(b)).ok).toBe(true);
      expect(gpu.opens).toBe(opens + 1);
      expect((await a.call('release', { end: true })).ok).toBe(true);
      expect([...gpu.mapped.values()]).toContain(base); // b still holds it
      expect((await b.call('release', { end: true })).ok).toBe(true);
      expect([...gpu.mapped.values()]).not.toContain(base);
    } finally {
      a.close();
      b.close();
    }
  });

  it('closes a session\'s handles and events only after its request in flight, when it disconnects', async () => {
    const c = new DaemonConn(daemon.endpoint);
    const base = gpu.alloc(1 << 20);
    await c.hello();
    let release!: () => void;
    gpu.hold = new Promise<void>((r) => { release = r; });
    const eventsBefore = gpu.events.size;
    const waitedBefore = gpu.waited.length;
    const pending = c.call('compress', { wait_event: EVENT, tensors: [{ tensor: bf16(ipc(c, base, 0, 2000), [1000]), out: ipc(c, base, 4096, 8192) }] });
    pending.catch(() => undefined);
    await settle(() => gpu.waited.length > waitedBefore);
    expect(gpu.waited.length).toBeGreaterThan(waitedBefore); // the request is in the (held) codec call
    c.close(); // the client goes away mid-request
    await new Promise((r) => setTimeout(r, 100));
    expect([...gpu.mapped.values()]).toContain(base); // still in use by the request
    release();
    gpu.hold = null;
    await settle(() => ![...gpu.mapped.values()].includes(base));
    expect([...gpu.mapped.values()]).not.toContain(base);
    await settle(() => gpu.events.size <= eventsBefore);
    expect(gpu.events.size).toBeLessThanOrEqual(eventsBefore); // its events destroyed
    // and the daemon serves the next client
    const d = new DaemonConn(daemon.endpoint);
    try {
      await d.hello();
      const r = await d.call('compress', { tensors: [{ tensor: bf16(ipc(d, base, 0, 2000), [1000]), out: ipc(d, base, 4096, 8192) }] });
      expect(r.ok).toBe(true);
    } finally {
      d.close();
    }
    expect(ipcAllocations.closeErrors).toBe(0);
  });
});
