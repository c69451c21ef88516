// The daemon in this process, spoken to by a ZeroMQ DEALER over ipc:// with /dev/shm files made here:
// hello, compress/decompress round trips (bytes compared), error replies that leave it serving,
// release and disconnect ending sessions, shutdown.
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defaultLimits } from '../src/daemon/limits.js';
import { Daemon } from '../src/daemon/server.js';
import { maxCompressedSize } from '../src/native.js';
import { DaemonConn, shmFile } from './helpers/daemon-conn.js';
import { bf16Weights } from './helpers/bf16-weights.js';
import { useTempDir } from './helpers/temp-dir.js';

const tmp = useTempDir('daemon-server');

let daemon: Daemon;


beforeAll(async () => {
  const limits = { ...defaultLimits(), leaseMs: 5000 };
  daemon = await Daemon.start({ socketPath: join(tmp(), 'd', 'tzip.sock'), limits, log: () => undefined });
});

afterAll(async () => {
  await daemon.stop('tests done');
});


describe('daemon in-process', () => {
  it('compresses and decompresses a batch through shared memory', async () => {
    const c = new DaemonConn(daemon.endpoint);
    try {
      const hello = await c.hello();
      expect(hello.ok).toBe(true);
      expect(hello.version).toBe(1);
      expect(hello.daemon.gpu).toBe(false);
      const a = bf16Weights(100_000);
      const b = Buffer.from(Array.from({ length: 1000 }, (_, i) => i % 7));
      const capA = maxCompressedSize(a.length, 1);
      const capB = maxCompressedSize(b.length, 2);
      const name = `${c.prefix}batch`;
      const inBytes = Buffer.concat([a, Buffer.alloc(256 - (a.length % 256)), b]);
      const offB = a.length + 256 - (a.length % 256);
      const outBase = 1 << 20;
      const path = shmFile(name, 4 << 20, inBytes);
      const tensors = [
        { tensor: { device: { type: 1, id: 0 }, dtype: { code: 4, bits: 16, lanes: 1 }, shape: [100_000], byte_offset: 0, data: { kind: 'shm', name, offset: 0, size: a.length } },
          out: { kind: 'shm', name, offset: outBase, size: capA } },
        { tensor: { device: { type: 1, id: 0 }, dtype: { code: 1, bits: 8, lanes: 1 }, shape: [10, 100], byte_offset: offB, data: { kind: 'shm', name, offset: 0, size: offB + b.length } },
          out: { kind: 'shm', name, offset: outBase + capA + 64, size: capB } },
      ];
      const r = await c.call('compress', { tensors, codec: 'auto' });
      expect(r.ok).toBe(true);
      expect(r.frames).toHaveLength(2);
      expect(r.frames[0].bytes).toBeLessThan(a.length * 0.85);
      expect(r.frames[0].dtype).toBe('BF16');
      expect(r.frames[1].shape).toEqual([10, 100]);
      const backBase = 3 << 20;
      const d = await c.call('decompress', { frames: [
        { frame: { kind: 'shm', name, offset: outBase, size: r.frames[0].bytes },
          out: { device: { type: 1, id: 0 }, dtype: { code: 4, bits: 16, lanes: 1 }, shape: [100_000], byte_offset: 0, data: { kind: 'shm', name, offset: backBase, size: a.length } } },
        { frame: { kind: 'shm', name, offset: outBase + capA + 64, size: r.frames[1].bytes },
          out: { device: { type: 1, id: 0 }, dtype: { code: 1, bits: 8, lanes: 1 }, shape: [10, 100], strides: [100, 1], byte_offset: 0, data: { kind: 'shm', name, offset: backBase + a.length, size: b.length } } },
      ] });
      expect(d.ok).toBe(true);
      expect(d.tensors.map((t: { nbytes: number }) => t.nbytes)).toEqual([a.length, b.length]);
      const file = readFileSync(path);
      expect(file.subarray(backBase, backBase + a.length).equals(a)).toBe(true);
      expect(file.subarray(backBase + a.length, backBase + a.length + b.length).equals(b)).toBe(true);
      // the same decompress through a handle table (protocol version 2): one shm entry, regions named by reference
      const back2 = backBase + (512 << 10);
      const ref = (offset: number, size: number) => ({ kind: 'ref', index: 0, offset, size });
      const viaTable = { handles: [{ kind: 'shm', name, offset: outBase, size: 3 << 20 }], frames: [
        { frame: ref(0, r.frames[0].bytes),
          out: { device: { type: 1, id: 0 }, dtype: { code: 4, bits: 16, lanes: 1 }, shape: [100_000], byte_offset: 0, data: ref(back2 - outBase, a.length) } },
      ] };
      // not in this version-1 session
      const v1 = await c.call('decompress', viaTable);
      expect(v1.error.code).toBe('TZIP_PROTOCOL');
      expect(v1.error.message).toContain('version 2');
      // the same process says hello again with version 2 (its session is replaced)
      const h2 = await c.req({ op: 'hello', versions: [1, 2], pid: process.pid, shm_prefix: c.prefix, name: 'vitest' });
      expect(h2.version).toBe(2);
      c.sid = h2.sid;
      const d2 = await c.call('decompress', viaTable);
      expect(d2.ok).toBe(true);
      expect(readFileSync(path).subarray(back2, back2 + a.length).equals(a)).toBe(true);
      const st = await c.call('stats', {});
      expect(st.session.mapped.files).toBe(1);
      const rel = await c.call('release', { names: [name] });
      expect(rel.released).toBe(1);
    } finally {
      c.close();
    }
  });

  it('answers garbage with errors and keeps serving', async () => {
    const c = new DaemonConn(daemon.endpoint);
    try {
      await c.hello();
      expect((await c.raw(Buffer.from('not msgpack at all'))).error.code).toBe('TZIP_PROTOCOL');
      expect((await c.raw(Buffer.alloc(2 << 20))).error.code).toBe('TZIP_TOO_LARGE');
      expect((await c.req({ op: 'launch' })).error.code).toBe('TZIP_PROTOCOL');
      const nope = await c.call('compress', { tensors: [{ tensor: { device: { type: 1, id: 0 }, dtype: { code: 2, bits: 32, lanes: 1 }, shape: [4], byte_offset: 0, data: { kind: 'shm', name: 'tzip-1-00000000-x', offset: 0, size: 16 } }, out: { kind: 'shm', name: `${c.prefix}o`, offset: 0, size: 100 } }] });
      expect(nope.error.code).toBe('TZIP_HANDLE');
      expect(nope.error.index).toBe(0);
      expect((await c.call('heartbeat')).ok).toBe(true);
    } finally {
      c.close();
    }
  });

  it('ends sessions on goodbye and on disconnect', async () => {
    const before = (await statsOf()).sessions_ended;
    const a = new DaemonConn(daemon.endpoint);
    await a.hello();
    const bye = await a.call('release', { end: true });
    expect(bye.ok).toBe(true);
    expect((await a.call('heartbeat')).error.code).toBe('TZIP_SESSION');
    a.close();
    const b = new DaemonConn(daemon.endpoint);
    await b.hello();
    b.close();
    for (let i = 0; i < 100; i++) {
      const s = await statsOf();
      if ((s.sessions_ended.disconnect ?? 0) > (before.disconnect ?? 0)) break;
      await new Promise((r) => setTimeout(r, 20));
    }
    const after = await statsOf();
    expect(after.sessions_ended.goodbye).toBe((before.goodbye ?? 0) + 1);
    expect(after.sessions_ended.disconnect).toBeGreaterThan(before.disconnect ?? 0);
  });
});

async function statsOf(): Promise<Record<string, any>> {
  const c = new DaemonConn(daemon.endpoint);
  try {
    return await c.req({ op: 'stats' });
  } finally {
    c.close();
  }
}
