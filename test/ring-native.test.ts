/**
 * The submission ring's native thread (docs/ring.md; cuda/src/addon/ring*.{h,cpp}) driven directly from TypeScript:
 * a client mapping of a real /dev/shm ring file packs SQEs and reaps CQEs (test/helpers/ring-native-client.ts), the
 * addon's ringOpen serves it from its own mapping, and the regions are real /dev/shm files mapped with mapShared.
 *
 * Round trips for every dtype are bit-exact: each frame equals the addon's plain compress() output for the same
 * bytes, dtype, shape and codec, and decompress through the ring gives the bytes back. Hostile clients (unregistered
 * ids, released generations, out-of-bounds and overflowing offsets, garbage, torn and concurrently rewritten SQEs,
 * indices outside the ring, a client that does not reap, close with work in flight) each get an error completion or
 * a broken ring, and every byte outside the ranges of the SQEs that succeeded is checked to be untouched. The GPU
 * suite (device regions, WAIT/SIGNAL on the ring's flag) is skipped without a GPU, with the reason in its name.
 */
import { spawnSync } from 'node:child_process';
import { readFileSync, rmSync, truncateSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import {
  addonAvailable,
  addonPath,
  compress,
  gpu,
  gpuAlloc,
  gpuCopyFromDevice,
  gpuCopyToDevice,
  gpuFree,
  mapShared,
  maxCompressedSize,
  ringBytes,
  ringOpen,
  type NativeRing,
  type RingCompletionStats,
  type RingOpenOptions,
} from '../src/native.js';
import { packageRoot } from '../src/package-root.js';
import { bf16Weights } from './helpers/bf16-weights.js';
import {
  CODEC,
  DTYPE,
  DTYPE_BYTES,
  FLAG,
  H,
  OP,
  RingClient,
  encodeSqe,
  type Cqe,
  type RegionRef,
  type Sqe,
} from './helpers/ring-native-client.js';

const ERRORS: Record<string, number> = Object.fromEntries(
  (JSON.parse(readFileSync(join(packageRoot(), 'src', 'errors.json'), 'utf8')) as { codes: { name: string; value: number }[] }).codes.map(
    (c) => [c.name, c.value],
  ),
);
const OK = 0;
const HANDLE = ERRORS.TZIP_HANDLE as number;
const INVALID = ERRORS.TZIP_INVALID_ARGUMENT as number;
const KNOWN_STATUS = new Set([0, ...Object.values(ERRORS)]);

const probe = addonAvailable() ? gpu() : { available: false, reason: 'the native addon is not built', devices: [] };
const hasGpu = probe.available;
if (!hasGpu) console.warn(`ring-native.test.ts: GPU tests skipped: ${probe.reason}`);

const TAG = `tzip-ringtest-${process.pid}`;
const files: string[] = [];
const rings: NativeRing[] = [];
let serial = 0;

afterAll(async () => {
  await Promise.all(rings.map((r) => r.close()));
  for (const f of files) rmSync(f, { force: true });
});

// ------------------------------------------------------------------------------------------------ helpers

/** A deterministic LCG. */
function lcg(seed: number): () => number {
  let s = seed >>> 0 || 1;
  return () => {
    s = (Math.imul(s, 1103515245) + 12345) >>> 0;
    return s >>> 8;
  };
}

/** `n` elements of `dtype` that look like real data of that kind (small weights, small integers, masks). */
function dataOf(dtype: string, n: number, seed = 1): Buffer {
  const r = lcg(seed);
  const size = DTYPE_BYTES[dtype] as number;
  const b = Buffer.alloc(n * size);
  const gauss = () => (r() + r() + r() + r() - 2 * 0xffffff) / 0xffffff;
  for (let i = 0; i < n; i++) {
    switch (dtype) {
      case 'BF16': return bf16Weights(n, seed);
      case 'F16': b.writeUInt16LE(((r() & 1) << 15) | ((10 + (r() % 4)) << 10) | (r() & 0x3ff), 2 * i); break;
      case 'F32': b.writeFloatLE(gauss() * 0.02, 4 * i); break;
      case 'F64': b.writeDoubleLE(gauss() * 0.02, 8 * i); break;
      case 'BOOL': b[i] = r() % 3 === 0 ? 1 : 0; break;
      case 'I16': b.writeInt16LE((r() % 200) - 100, 2 * i); break;
      case 'U16': b.writeUInt16LE(r() % 1000, 2 * i); break;
      case 'I32': b.writeInt32LE((r() % 20000) - 10000, 4 * i); break;
      case 'U32': b.writeUInt32LE(r() % 50000, 4 * i); break;
      case 'I64': b.writeBigInt64LE(BigInt((r() % 4000) - 2000), 8 * i); break;
      case 'U64': b.writeBigUInt64LE(BigInt(r() % 70000), 8 * i); break;
      default: b[i] = r() % 40; // U8, I8, F8_E4M3, F8_E5M2: skewed bytes
    }
  }
  return b;
}

const sleep = (ms: number) => new Promise<void>((res) => setTimeout(res, ms));

async function until(cond: () => boolean, what: string, ms = 10_000): Promise<void> {
  const end = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(1);
  }
}

interface TestRing {
  client: RingClient;
  ring: NativeRing;
  stats: RingCompletionStats[];
  broken: string[];
}

function openRing(entries = 64, extra: Partial<RingOpenOptions> = {}): TestRing {
  const path = `/dev/shm/${TAG}-ring-${serial++}`;
  files.push(path);
  const client = RingClient.create(path, entries);
  const stats: RingCompletionStats[] = [];
  const broken: string[] = [];
  const ring = ringOpen(mapShared(path, true), {
    entries, smBudget: 10, cpuThreads: 2, spinUs: 2000,
    onStats: (b) => stats.push(...b), onBroken: (w) => broken.push(w), ...extra,
  });
  rings.push(ring);
  return { client, ring, stats, broken };
}

interface Region {
  ref: { id: number; generation: number };
  /** The client's mapping of the region's file. */
  mem: Buffer;
  path: string;
}

/** A /dev/shm file of `bytes` bytes (filled with `fill`), registered to `ring` through the daemon's own mapping. */
function region(ring: NativeRing, bytes: number, fill = 0xa5, writable = true): Region {
  const path = `/dev/shm/${TAG}-region-${serial++}`;
  files.push(path);
  writeFileSync(path, Buffer.alloc(bytes, fill));
  const r = ring.addHost(mapShared(path, writable));
  expect(r.bytes).toBe(bytes);
  return { ref: { id: r.id, generation: r.generation }, mem: mapShared(path, true), path };
}

const at = (r: Region, offset: number | bigint, bytes: number | bigint): RegionRef => ({ ...r.ref, offset, bytes });

function compressSqe(userData: bigint, dtype: string, shape: number[], src: RegionRef, dst: RegionRef, codec = 'auto', extra: Partial<Sqe> = {}): Sqe {
  return { userData, op: OP.compress, codec: CODEC[codec], dtype: DTYPE[dtype], shape, src, dst, ...extra };
}

function decompressSqe(userData: bigint, src: RegionRef, dst: RegionRef, extra: Partial<Sqe> = {}): Sqe {
  return { userData, op: OP.decompress, flags: FLAG.verify, src, dst, ...extra };
}

function codeOf(f: () => unknown): string | undefined {
  try {
    f();
  } catch (err) {
    return (err as { code?: string }).code;
  }
  return undefined;
}

/** Bytes of `mem` in [from, to) that differ from `fill`. */
function touched(mem: Buffer, fill: number, from = 0, to = mem.length): number {
  let n = 0;
  for (let i = from; i < to; i++) if (mem[i] !== fill) n++;
  return n;
}

const ALL_DTYPES = Object.keys(DTYPE);

// ------------------------------------------------------------------------------------------------ round trips

describe.skipIf(!addonAvailable())('ring round trips (CPU regions)', () => {
  it.each(ALL_DTYPES)('%s: the frame equals compress(), decompress gives the bytes back', async (dtype) => {
    const { client, ring } = openRing();
    const shape = [3, 1111];
    const data = dataOf(dtype, 3 * 1111, 3);
    const expected = await compress(data, { dtype, shape, codec: 'auto' });
    const cap = maxCompressedSize(data.length, 2);
    const src = region(ring, 64 + data.length);
    data.copy(src.mem, 64);
    const frames = region(ring, 100 + cap + 100);
    const [c] = await client.call([compressSqe(11n, dtype, shape, at(src, 64, data.length), at(frames, 100, cap))]);
    expect(c).toEqual({ userData: 11n, status: OK, codec: expected[7], reserved: [0, 0, 0], result: BigInt(expected.length), message: '' });
    expect(Buffer.compare(frames.mem.subarray(100, 100 + expected.length), expected)).toBe(0);
    expect(touched(frames.mem, 0xa5, 0, 100) + touched(frames.mem, 0xa5, 100 + cap)).toBe(0);
    const back = region(ring, data.length + 32);
    const [d] = await client.call([decompressSqe(12n, at(frames, 100, expected.length), at(back, 16, data.length))]);
    expect(d).toMatchObject({ userData: 12n, status: OK, result: BigInt(data.length), message: '' });
    expect(Buffer.compare(back.mem.subarray(16, 16 + data.length), data)).toBe(0);
    expect(touched(back.mem, 0xa5, 0, 16) + touched(back.mem, 0xa5, 16 + data.length)).toBe(0);
  });

  it.each(['BF16', 'F16', 'F32', 'I32'].flatMap((d) => ['raw', 'fast', 'max', 'bytes', 'auto'].map((c) => [d, c])))(
    '%s with codec %s: the same frame as compress()',
    async (dtype, codec) => {
      const { client, ring } = openRing();
      const data = dataOf(dtype as string, 40_000, 5); // several 64 KiB chunks: the codec's threads
      const expected = await compress(data, { dtype: dtype as string, shape: [40_000], codec: codec as 'auto' });
      const cap = maxCompressedSize(data.length, 1);
      const src = region(ring, data.length);
      data.copy(src.mem);
      const frames = region(ring, cap);
      const [c] = await client.call([compressSqe(1n, dtype as string, [40_000], at(src, 0, data.length), at(frames, 0, cap), codec)]);
      expect(c).toMatchObject({ status: OK, codec: expected[7], result: BigInt(expected.length) });
      expect(Buffer.compare(frames.mem.subarray(0, expected.length), expected)).toBe(0);
      const back = region(ring, data.length);
      const [d] = await client.call([decompressSqe(2n, at(frames, 0, expected.length), at(back, 0, data.length))]);
      expect(d?.status).toBe(OK);
      expect(Buffer.compare(back.mem, data)).toBe(0);
    },
  );

  it('empty tensors and 0-dimensional ones', async () => {
    const { client, ring } = openRing();
    const src = region(ring, 64);
    const frames = region(ring, 4096);
    const scalar = dataOf('F32', 1);
    scalar.copy(src.mem);
    for (const [u, shape, bytes] of [[1n, [0, 5], 0], [2n, [], 4]] as const) {
      const data = src.mem.subarray(0, bytes);
      const expected = await compress(Buffer.from(data), { dtype: 'F32', shape: [...shape], codec: 'auto' });
      const cap = maxCompressedSize(bytes, shape.length);
      const [c] = await client.call([compressSqe(u, 'F32', [...shape], at(src, 0, bytes), at(frames, 0, cap))]);
      expect(c).toMatchObject({ status: OK, result: BigInt(expected.length), codec: expected[7] });
      expect(Buffer.compare(frames.mem.subarray(0, expected.length), expected)).toBe(0);
    }
  });

  it('a batch of linked SQEs: one CQE each, in order, frames equal compress(); stats per stream tag', async () => {
    const { client, ring, stats } = openRing();
    const dtypes = ['BF16', 'F16', 'F32', 'U8', 'I64', 'BOOL', 'F64', 'I16'];
    const datas = dtypes.map((d, i) => dataOf(d, 3000 + 17 * i, 20 + i));
    const total = datas.reduce((s, d) => s + d.length, 0);
    const src = region(ring, total);
    const caps = datas.map((d) => maxCompressedSize(d.length, 1));
    const frames = region(ring, caps.reduce((s, c) => s + c, 0));
    const back = region(ring, total);
    let so = 0;
    let fo = 0;
    const srcAt: number[] = [];
    const frameAt: number[] = [];
    const sqes = datas.map((d, i) => {
      d.copy(src.mem, so);
      srcAt.push(so);
      frameAt.push(fo);
      const s = compressSqe(BigInt(100 + i), dtypes[i] as string, [d.length / (DTYPE_BYTES[dtypes[i] as string] as number)],
        at(src, so, d.length), at(frames, fo, caps[i] as number), 'auto', { flags: i < 7 ? FLAG.link : 0, stream: 1 });
      so += d.length;
      fo += caps[i] as number;
      return s;
    });
    const cqes = await client.call(sqes);
    expect(cqes.map((c) => c.userData)).toEqual(sqes.map((s) => s.userData));
    const expected = await Promise.all(datas.map((d, i) => compress(d, { dtype: dtypes[i] as string, shape: [d.length / (DTYPE_BYTES[dtypes[i] as string] as number)], codec: 'auto' })));
    cqes.forEach((c, i) => {
      expect(c).toMatchObject({ status: OK, result: BigInt(expected[i]!.length), codec: expected[i]![7] });
      expect(Buffer.compare(frames.mem.subarray(frameAt[i], frameAt[i]! + expected[i]!.length), expected[i]!)).toBe(0);
    });
    const dcqes = await client.call(datas.map((d, i) => decompressSqe(BigInt(200 + i), at(frames, frameAt[i]!, expected[i]!.length),
      at(back, srcAt[i]!, d.length), { flags: FLAG.verify | (i < 7 ? FLAG.link : 0), stream: 3 })));
    expect(dcqes.every((c) => c.status === OK)).toBe(true);
    expect(Buffer.compare(back.mem, src.mem)).toBe(0);
    await until(() => stats.filter((s) => s.op === 'decompress').reduce((n, s) => n + s.items, 0) >= 8, 'stats');
    const c = stats.filter((s) => s.op === 'compress' && s.stream === 1);
    expect(c.reduce((n, s) => n + s.items, 0)).toBe(8);
    expect(c.reduce((n, s) => n + s.inBytes, 0)).toBe(total);
    expect(c.reduce((n, s) => n + s.outBytes, 0)).toBe(expected.reduce((n, e) => n + e.length, 0));
    expect(c.every((s) => s.errors === 0 && !s.gpu && s.seconds >= 0)).toBe(true);
    const d = stats.filter((s) => s.op === 'decompress' && s.stream === 3);
    expect(d.reduce((n, s) => n + s.outBytes, 0)).toBe(total);
  });

  it('nop SQEs complete at once, with their user_data', async () => {
    const { client } = openRing(8);
    const cqes = await client.call([0n, 1n, 0xffffffffffffffffn].map((u) => ({ userData: u, op: OP.nop })));
    expect(cqes).toEqual([0n, 1n, 0xffffffffffffffffn].map((u) => ({ userData: u, status: OK, codec: 0, reserved: [0, 0, 0], result: 0n, message: '' })));
  });

  it('many submissions around the ring: indices wrap, every CQE comes back in order', async () => {
    const { client, ring } = openRing(8);
    const data = dataOf('BF16', 512, 9);
    const src = region(ring, data.length);
    data.copy(src.mem);
    const cap = maxCompressedSize(data.length, 1);
    const frames = region(ring, cap * 4);
    const expected = await compress(data, { dtype: 'BF16', shape: [512], codec: 'max' });
    for (let round = 0; round < 20; round++) {
      const sqes = [0, 1, 2, 3].map((k) => compressSqe(BigInt(round * 4 + k), 'BF16', [512], at(src, 0, data.length), at(frames, k * cap, cap), 'max'));
      const cqes = await client.call(sqes);
      expect(cqes.map((c) => [c.userData, c.status, c.result])).toEqual(sqes.map((s) => [s.userData, OK, BigInt(expected.length)]));
    }
    expect(client.word(H.sqHead)).toBe(80);
    expect(client.word(H.sqTail)).toBe(80);
    expect(client.word(H.cqHead)).toBe(80);
  });
});

// ------------------------------------------------------------------------------------------------ hostile clients

describe.skipIf(!addonAvailable())('hostile SQEs get an error CQE and touch nothing', () => {
  it('unregistered ids, released generations and regions used after release: TZIP_HANDLE', async () => {
    const { client, ring } = openRing();
    const data = dataOf('F16', 1000);
    const a = region(ring, data.length);
    data.copy(a.mem);
    const cap = maxCompressedSize(data.length, 1);
    const frames = region(ring, cap);
    const sqe = (u: bigint, src: RegionRef) => compressSqe(u, 'F16', [1000], src, at(frames, 0, cap));
    const c1 = await client.call([
      sqe(1n, { id: 999, generation: 1, offset: 0, bytes: data.length }),
      sqe(2n, { id: 0, generation: 0, offset: 0, bytes: data.length }),
      sqe(3n, { id: a.ref.id, generation: a.ref.generation + 5, offset: 0, bytes: data.length }),
      sqe(4n, at(a, 0, data.length)),
    ]);
    expect(c1.map((c) => c.status)).toEqual([HANDLE, HANDLE, HANDLE, OK]);
    expect(c1[0]!.message).toBe('region 999 is not registered');
    expect(c1[2]!.message).toMatch(/region \d+ has no generation/);
    frames.mem.fill(0xa5);
    await ring.remove([a.ref.id]);
    const [gone] = await client.call([sqe(5n, at(a, 0, data.length))]);
    expect(gone).toMatchObject({ status: HANDLE, message: `region ${a.ref.id} is not registered` });
    // The id comes back with the next generation: the old one stays refused.
    const b = region(ring, data.length);
    data.copy(b.mem);
    expect(b.ref).toEqual({ id: a.ref.id, generation: a.ref.generation + 1 });
    const [old, fresh] = await client.call([sqe(6n, at(a, 0, data.length)), sqe(7n, at(b, 0, data.length))]);
    expect(old).toMatchObject({ status: HANDLE, message: `region ${a.ref.id} generation ${a.ref.generation} was released` });
    expect(fresh?.status).toBe(OK);
    // A region being removed is refused at once, also as a destination.
    const removal = ring.remove([b.ref.id]);
    const [late] = await client.call([{ ...sqe(8n, at(frames, 0, 16)), dst: at(b, 0, cap) }]);
    expect(late?.status).toBe(HANDLE);
    await removal;
    await expect(ring.remove([b.ref.id])).rejects.toMatchObject({ code: 'TZIP_INVALID_ARGUMENT' });
    await expect(ring.remove([12345])).rejects.toMatchObject({ code: 'TZIP_INVALID_ARGUMENT' });
  });

  it('out-of-bounds and overflowing offsets, bad fields: TZIP_INVALID_ARGUMENT, nothing written', async () => {
    const { client, ring } = openRing();
    const data = dataOf('BF16', 2048);
    const cap = maxCompressedSize(data.length, 1);
    const src = region(ring, data.length + cap + 64);
    data.copy(src.mem);
    const srcBefore = Buffer.from(src.mem);
    const frames = region(ring, cap);
    const good = compressSqe(0n, 'BF16', [2048], at(src, 0, data.length), at(frames, 0, cap));
    const U64 = 0xffffffffffffffffn;
    const cases: [string, Partial<Sqe>, number][] = [
      ['src offset past the end', { src: at(src, data.length + cap + 65, 0) }, INVALID],
      ['src bytes past the end', { src: at(src, cap + 66, data.length) }, INVALID],
      ['src offset + bytes wrapping 2^64', { src: at(src, U64 - 7n, 16) }, INVALID],
      ['dst offset + bytes wrapping 2^64', { dst: at(frames, 16, U64) }, INVALID],
      ['dst below the frame bound', { dst: at(frames, 0, cap - 1) }, INVALID],
      ['shape product wrapping 2^64', { shape: [2 ** 62, 8] }, INVALID],
      ['shape times dtype size not the src bytes', { shape: [2047] }, INVALID],
      ['ndim 7', { ndim: 7 }, INVALID],
      ['a shape entry past ndim', { ndim: 1, shape: [2048, 5] }, INVALID],
      ['unknown dtype', { dtype: 99 }, INVALID],
      ['unknown codec', { codec: 9 }, INVALID],
      ['unknown op', { op: 7 }, INVALID],
      ['unknown flag', { flags: 0x40 }, INVALID],
      ['reserved byte', { reserved: 1 }, INVALID],
      ['unknown stream tag', { stream: 5 }, INVALID],
      ['src and dst overlapping', { dst: at(src, 8, cap) }, INVALID],
      ['WAIT on a ring without a GPU flag', { flags: FLAG.wait }, INVALID],
      ['SIGNAL on a ring without a GPU flag', { flags: FLAG.signal }, INVALID],
      ['a src of another generation', { src: { ...src.ref, generation: 0, offset: 0, bytes: data.length } }, HANDLE],
    ];
    const cqes = await client.call(cases.map(([, patch], i) => ({ ...good, userData: BigInt(i), ...patch })));
    cqes.forEach((c, i) => {
      expect([cases[i]![0], c.status, c.result]).toEqual([cases[i]![0], cases[i]![2], 0n]);
      expect(c.message.length).toBeGreaterThan(0);
      expect(c.message.length).toBeLessThanOrEqual(40);
    });
    expect(cqes.find((c) => c.userData === BigInt(cases.length - 4))?.message).toBe('src and dst overlap');
    expect(touched(frames.mem, 0xa5)).toBe(0);
    expect(Buffer.compare(src.mem, srcBefore)).toBe(0);
  });

  it('batch rules: one failing SQE fails its whole batch and nothing of it runs', async () => {
    const { client, ring } = openRing(8);
    const data = dataOf('F32', 1024);
    const src = region(ring, data.length);
    data.copy(src.mem);
    const cap = maxCompressedSize(data.length, 1);
    const frames = region(ring, 4 * cap);
    const sq = (u: bigint, k: number, extra: Partial<Sqe> = {}) => compressSqe(u, 'F32', [1024], at(src, 0, data.length), at(frames, k * cap, cap), 'fast', extra);
    const check = async (batch: Sqe[], bad: number, status: number, message: RegExp) => {
      frames.mem.fill(0xa5);
      const cqes = await client.call(batch);
      expect(cqes.map((c) => c.status)).toEqual(batch.map(() => status));
      expect(cqes[bad]!.message).toMatch(message);
      cqes.forEach((c, i) => i !== bad && expect(c.message).toBe(`SQE ${bad} of the batch failed`));
      expect(touched(frames.mem, 0xa5)).toBe(0);
    };
    await check([sq(1n, 0, { flags: FLAG.link }), sq(2n, 1, { flags: FLAG.link, src: at(src, 0, data.length + 4) }), sq(3n, 2)], 1, INVALID, /src range past region/);
    await check([sq(1n, 0, { flags: FLAG.link }), sq(2n, 1, { flags: FLAG.link }), sq(3n, 0)], 2, INVALID, /dst of SQE 2 overlaps SQE 0/);
    await check([sq(1n, 0, { flags: FLAG.link }), { userData: 2n, op: OP.nop }], 1, INVALID, /mixes ops/);
    await check([sq(1n, 0, { flags: FLAG.link }), sq(2n, 1, { flags: FLAG.link, dst: { id: 77, generation: 1, offset: 0, bytes: cap } }), sq(3n, 2)], 1, HANDLE, /region 77/);
    // A chain longer than the ring (8 entries): all of it fails, up to and including its first SQE without LINK.
    frames.mem.fill(0xa5);
    const chain = Array.from({ length: 8 }, (_, i) => sq(BigInt(10 + i), i % 4, { flags: FLAG.link }));
    const long = await client.call(chain);
    expect(long.every((c) => c.status === INVALID)).toBe(true);
    expect(long[7]!.message).toBe('batch longer than 8 SQEs');
    const rest = await client.call([sq(18n, 0, { flags: FLAG.link }), sq(19n, 1)]);
    expect(rest.map((c) => [c.userData, c.status])).toEqual([[18n, INVALID], [19n, INVALID]]);
    expect(touched(frames.mem, 0xa5)).toBe(0);
    // The ring serves the next batch as usual.
    const after = await client.call([sq(20n, 0, { flags: FLAG.link }), sq(21n, 1)]);
    expect(after.map((c) => c.status)).toEqual([OK, OK]);
  });

  it('a batch whose last SQE is not published yet is waited for', async () => {
    const { client, ring } = openRing(8);
    const data = dataOf('BF16', 256);
    const src = region(ring, data.length);
    data.copy(src.mem);
    const cap = maxCompressedSize(data.length, 1);
    const frames = region(ring, 2 * cap);
    client.submit([compressSqe(1n, 'BF16', [256], at(src, 0, data.length), at(frames, 0, cap), 'fast', { flags: FLAG.link })]);
    await until(() => client.word(H.sqTail) === 1, 'the first SQE copied');
    await sleep(30);
    expect(client.ready()).toBe(0); // waiting for the rest of its batch
    client.submit([compressSqe(2n, 'BF16', [256], at(src, 0, data.length), at(frames, cap, cap), 'fast')]);
    const cqes = await client.reap(2);
    expect(cqes.map((c) => [c.userData, c.status])).toEqual([[1n, OK], [2n, OK]]);
  });

  it('a read-only mapping serves as src, never as dst', async () => {
    const { client, ring } = openRing();
    const data = dataOf('U8', 5000);
    const ro = region(ring, 70_000, 0x11, false);
    data.copy(ro.mem);
    const rw = region(ring, 70_000);
    const cap = maxCompressedSize(data.length, 1);
    const [asDst, asSrc] = await client.call([
      compressSqe(1n, 'U8', [5000], at(rw, 0, data.length), at(ro, 0, cap)),
      compressSqe(2n, 'U8', [5000], at(ro, 0, data.length), at(rw, 0, cap)),
    ]);
    expect(asDst).toMatchObject({ status: INVALID, message: `dst region ${ro.ref.id} is read-only` });
    expect(asSrc?.status).toBe(OK);
    expect(touched(ro.mem, 0x11, data.length)).toBe(0);
  });

  it('a region whose file shrank under its mapping: TZIP_HANDLE, and for every later SQE naming it', async () => {
    const { client, ring } = openRing();
    const n = 64 * 1024;
    const src = region(ring, 2 * n, 0x3c);
    const cap = maxCompressedSize(2 * n, 1);
    const frames = region(ring, cap);
    truncateSync(src.path, 4096);
    const sqe = (u: bigint) => compressSqe(u, 'BF16', [n], at(src, 0, 2 * n), at(frames, 0, cap), 'bytes');
    const [c] = await client.call([sqe(1n)]);
    expect(c).toMatchObject({ status: HANDLE, message: `region ${src.ref.id}: its file shrank`, result: 0n });
    const [again] = await client.call([sqe(2n)]);
    expect(again).toMatchObject({ status: HANDLE, message: `region ${src.ref.id}: its file shrank` });
    expect(ring.state).toBe('serving');
  });

  it('garbage SQEs: a CQE each with a known status; nothing outside the SQEs that succeeded is written', async () => {
    const { client, ring } = openRing(64);
    const data = dataOf('BF16', 4096, 31);
    const regions = [region(ring, 4 * data.length), region(ring, 4 * data.length)];
    data.copy(regions[0]!.mem);
    const original = regions.map((r) => Buffer.from(r.mem));
    const allowed = regions.map((r) => new Uint8Array(r.mem.length));
    const cap = maxCompressedSize(data.length, 1);
    const base = encodeSqe(compressSqe(0n, 'BF16', [4096], at(regions[0]!, 0, data.length), at(regions[1]!, 0, cap)));
    const rnd = lcg(77);
    for (let round = 0; round < 25; round++) {
      const sqes: Buffer[] = [];
      for (let k = 0; k < 16; k++) {
        const b = Buffer.from(base);
        if (k % 4 === 0) {
          for (let i = 0; i < 128; i++) b[i] = rnd() & 0xff; // pure garbage
        } else {
          for (let f = 0; f < 1 + (rnd() % 3); f++) {
            const i = 8 + (rnd() % 120);
            b[i] = (b[i] as number) ^ (1 << (rnd() % 8)); // a valid SQE, bits flipped
          }
        }
        b.writeBigUInt64LE(BigInt(round * 16 + k), 0);
        if (k === 15) b[9] = (b[9] as number) & ~FLAG.link; // every submission ends its last chain
        sqes.push(b);
      }
      const cqes = await client.call(sqes);
      cqes.forEach((c, k) => {
        expect(c.userData).toBe(BigInt(round * 16 + k));
        expect(KNOWN_STATUS.has(c.status)).toBe(true);
        expect(c.reserved).toEqual([0, 0, 0]);
        const s = sqes[k] as Buffer;
        if (c.status !== OK || s[8] === OP.nop) return;
        const id = s.readUInt32LE(40);
        const ri = regions.findIndex((r) => r.ref.id === id);
        expect(ri).toBeGreaterThanOrEqual(0);
        const off = Number(s.readBigUInt64LE(48));
        allowed[ri]!.fill(1, off, off + Number(s.readBigUInt64LE(56)));
      });
    }
    regions.forEach((r, ri) => {
      for (let i = 0; i < r.mem.length; i++) if (!allowed[ri]![i] && r.mem[i] !== original[ri]![i]) throw new Error(`region ${ri} byte ${i} written`);
    });
  });

  it('torn writes: an SQE published before its second half (the shape) is written', async () => {
    const { client, ring } = openRing(8);
    const data = dataOf('F16', 4096, 5);
    const src = region(ring, data.length);
    data.copy(src.mem);
    const cap = maxCompressedSize(data.length, 2);
    const frames = region(ring, cap);
    const expected = await compress(data, { dtype: 'F16', shape: [64, 64], codec: 'fast' });
    const full = encodeSqe(compressSqe(0n, 'F16', [64, 64], at(src, 0, data.length), at(frames, 0, cap), 'fast'));
    const statuses = new Set<number>();
    for (let i = 0; i < 40; i++) {
      full.writeBigUInt64LE(BigInt(i), 0);
      const head = client.word(H.sqHead);
      const off = client.sqeOffset(head);
      // The second half (shape, wait and signal values) still holds 0xff bytes when the SQE is published: a copy taken
      // before it is fully written has a shape that overflows or entries past ndim that are not 0.
      client.mem.fill(0xff, off + 64, off + 128);
      full.copy(client.mem, off, 0, 64);
      client.publish(1);
      // Two SQEs in three are completed only after the thread has copied them torn (it stores sq_tail after its copy),
      // the third at once: a fixed sleep here let a loaded machine (a compile beside the tests) copy every SQE whole.
      if (i % 3) await until(() => client.word(H.sqTail) === ((head + 1) >>> 0), `SQE ${i} copied`);
      full.copy(client.mem, off + 64, 64, 128);
      const [c] = await client.reap(1);
      expect(c?.userData).toBe(BigInt(i));
      expect([OK, INVALID]).toContain(c?.status);
      statuses.add(c!.status);
      if (c!.status === OK) expect(Buffer.compare(frames.mem.subarray(0, expected.length), expected)).toBe(0);
    }
    expect(statuses.has(INVALID)).toBe(true);
    expect(touched(frames.mem, 0xa5, expected.length)).toBe(0);
    expect(Buffer.compare(src.mem, data)).toBe(0);
  });

  it('an SQE rewritten while the thread reads it (a writer loop flipping its bytes): known statuses, nothing outside written', async () => {
    const { client, ring } = openRing(8, { spinUs: 20_000 });
    const bystander = openRing(8);
    const other = region(bystander.ring, 70_000, 0x5a);
    const data = dataOf('BF16', 4096, 8);
    const src = region(ring, data.length);
    data.copy(src.mem);
    const cap = maxCompressedSize(data.length, 1);
    const frames = region(ring, cap);
    const rnd = lcg(5);
    const statuses = new Set<number>();
    const round = async (i: number, keepDst: boolean) => {
      const full = encodeSqe(compressSqe(BigInt(i), 'BF16', [4096], at(src, 0, data.length), at(frames, 0, cap), 'fast'));
      const off = client.sqeOffset(client.word(H.sqHead));
      full.copy(client.mem, off);
      client.publish(1);
      // Flip bytes 8-127 (user_data stays; so does LINK, so that every copy ends its batch) until the CQE is there
      // and at least 2 ms have passed.
      const stop = Date.now() + 2;
      const deadline = Date.now() + 5000;
      while (Date.now() < stop || client.ready() === 0) {
        if (Date.now() > deadline) throw new Error(`no CQE for SQE ${i}: ring ${ring.state}, sq ${client.word(H.sqHead)}/${client.word(H.sqTail)}, cq ${client.word(H.cqHead)}/${client.word(H.cqTail)}, slot ${client.mem.subarray(off, off + 128).toString('hex')}`);
        let b = 8 + (rnd() % 120);
        if (keepDst && b >= 40 && b < 64) b += 24;
        const bit = b === 9 ? 1 + (rnd() % 7) : rnd() % 8;
        client.mem[off + b] = (client.mem[off + b] as number) ^ (1 << bit);
      }
      const [c] = await client.reap(1);
      expect(c?.userData).toBe(BigInt(i));
      expect(KNOWN_STATUS.has(c!.status)).toBe(true);
      statuses.add(c!.status);
    };
    // The dst fields stay: whatever the thread copied, a success wrote only inside the frames region, never the src.
    for (let i = 0; i < 80; i++) await round(i, true);
    expect(Buffer.compare(src.mem, data)).toBe(0);
    // Any byte flips, the dst fields too: only this ring's regions may be named; another ring's region stays as it was.
    for (let i = 80; i < 160; i++) await round(i, false);
    expect(touched(other.mem, 0x5a)).toBe(0);
    expect(statuses.has(INVALID) || statuses.has(HANDLE)).toBe(true);
    // The ring keeps serving.
    data.copy(src.mem);
    const [after] = await client.call([compressSqe(999n, 'BF16', [4096], at(src, 0, data.length), at(frames, 0, cap), 'fast')]);
    expect(after?.status).toBe(OK);
    expect(ring.state).toBe('serving');
  });
});

// ------------------------------------------------------------------------------------------------ broken rings, CQ full, close

describe.skipIf(!addonAvailable())('indices, a client that does not reap, close', () => {
  it('sq_head more than `entries` past sq_tail: broken (state 2, onBroken), other rings keep working', async () => {
    const victim = openRing(8);
    const other = openRing(8);
    victim.client.setWord(H.sqHead, 9);
    await until(() => victim.ring.state === 'broken', 'broken state');
    expect(victim.client.state).toBe(2);
    await until(() => victim.broken.length === 1, 'onBroken');
    expect(victim.broken[0]).toMatch(/sq_head 9 is more than 8 SQEs past sq_tail 0/);
    expect(victim.client.ready()).toBe(0);
    expect(codeOf(() => victim.ring.addHost(Buffer.alloc(16)))).toBe('TZIP_INVALID_ARGUMENT');
    const [c] = await other.client.call([{ userData: 5n, op: OP.nop }]);
    expect(c?.status).toBe(OK);
    await victim.ring.close();
    expect(victim.ring.state).toBe('broken');
    expect(victim.client.state).toBe(2);
  });

  it('a ring file shrunk under its mapping: broken, the process lives', async () => {
    const victim = openRing(8);
    const other = openRing(8);
    await victim.client.call([{ userData: 1n, op: OP.nop }]);
    truncateSync(victim.client.path, 0);
    await until(() => victim.ring.state === 'broken', 'broken state');
    await until(() => victim.broken.length === 1, 'onBroken');
    expect(victim.broken[0]).toBe('the ring file shrank under its mapping');
    const [c] = await other.client.call([{ userData: 2n, op: OP.nop }]);
    expect(c?.status).toBe(OK);
  });

  it('cq_tail outside its range: broken', async () => {
    const { client, ring, broken } = openRing(8);
    await client.call([{ userData: 1n, op: OP.nop }]);
    client.setWord(H.cqTail, 100);
    client.submit([{ userData: 2n, op: OP.nop }]);
    await until(() => ring.state === 'broken', 'broken state');
    await until(() => broken.length === 1, 'onBroken');
    expect(broken[0]).toMatch(/cq_tail 100/);
    expect(client.word(H.cqHead)).toBe(1);
  });

  it('sq_head moved backwards past sq_tail (wrapping): broken', async () => {
    const { client, ring } = openRing(16);
    await client.call([{ userData: 1n, op: OP.nop }, { userData: 2n, op: OP.nop }]);
    client.setWord(H.sqHead, 0);
    await until(() => ring.state === 'broken', 'broken state');
  });

  it('a client that does not reap stalls only its own ring; its CQEs come in order once it reaps', async () => {
    const a = openRing(8);
    const b = openRing(8);
    const nops = (from: number) => Array.from({ length: 8 }, (_, i) => ({ userData: BigInt(from + i), op: OP.nop }));
    a.client.submit(nops(0));
    await until(() => a.client.ready() === 8, 'a full CQ');
    a.client.submit(nops(8));
    // The thread copies the 9th SQE, runs it and waits for room for its CQE (one batch at a time).
    await until(() => a.client.word(H.sqTail) === 9, 'the 9th SQE copied');
    await sleep(30);
    expect(a.client.word(H.sqTail)).toBe(9);
    expect(a.client.word(H.cqHead)).toBe(8); // nothing overwritten
    expect(a.ring.state).toBe('serving');
    const [bc] = await b.client.call([{ userData: 42n, op: OP.nop }]);
    expect(bc?.userData).toBe(42n);
    const first = await a.client.reap(8);
    const second = await a.client.reap(8);
    expect([...first, ...second].map((c) => c.userData)).toEqual([...Array(16).keys()].map(BigInt));
  });

  it('close while the CQ is full resolves; the header says closed', async () => {
    const { client, ring } = openRing(8);
    client.submit(Array.from({ length: 8 }, (_, i) => ({ userData: BigInt(i), op: OP.nop })));
    await until(() => client.ready() === 8, 'a full CQ');
    client.submit([{ userData: 8n, op: OP.nop }]);
    await until(() => client.word(H.sqTail) === 9, 'the 9th SQE copied');
    await ring.close();
    expect(ring.state).toBe('closed');
    expect(client.state).toBe(1);
    expect(client.ready()).toBe(8);
  });

  it('close with a batch in flight: the batch finishes and completes, then the thread stops', async () => {
    const { client, ring } = openRing(8);
    const n = 4 << 20;
    const data = dataOf('BF16', n, 12);
    const src = region(ring, data.length);
    data.copy(src.mem);
    const cap = maxCompressedSize(data.length, 1);
    const frames = region(ring, cap);
    client.submit([compressSqe(1n, 'BF16', [n], at(src, 0, data.length), at(frames, 0, cap), 'max')]);
    await until(() => client.word(H.sqTail) === 1, 'the SQE taken');
    const closing = ring.close();
    expect(ring.state).toBe('closed');
    await closing;
    const [c] = await client.reap(1, 1000);
    expect(c?.status).toBe(OK);
    const expected = await compress(data, { dtype: 'BF16', shape: [n], codec: 'max' });
    expect(c?.result).toBe(BigInt(expected.length));
    expect(Buffer.compare(frames.mem.subarray(0, expected.length), expected)).toBe(0);
    expect(client.state).toBe(1);
    // SQEs after the close are not served; the ring's methods say it is closed.
    client.submit([{ userData: 2n, op: OP.nop }]);
    await sleep(30);
    expect(client.ready()).toBe(0);
    expect(codeOf(() => ring.addHost(Buffer.alloc(8)))).toBe('TZIP_INVALID_ARGUMENT');
    await ring.remove([src.ref.id]);
    await ring.close();
  });

  it('remove() of regions in use resolves after their batch, which completes normally', async () => {
    const { client, ring } = openRing(8);
    const n = 2 << 20;
    const data = dataOf('BF16', n, 13);
    const src = region(ring, data.length);
    data.copy(src.mem);
    const cap = maxCompressedSize(data.length, 1);
    const frames = region(ring, cap);
    const expected = await compress(data, { dtype: 'BF16', shape: [n], codec: 'max' });
    client.submit([compressSqe(1n, 'BF16', [n], at(src, 0, data.length), at(frames, 0, cap), 'max')]);
    await until(() => client.word(H.sqTail) === 1, 'the SQE taken');
    await ring.remove([src.ref.id, frames.ref.id]);
    // By now the batch has finished with both regions: the whole frame is there.
    expect(Buffer.compare(frames.mem.subarray(0, expected.length), expected)).toBe(0);
    const [c] = await client.reap(1);
    expect(c).toMatchObject({ status: OK, result: BigInt(expected.length) });
    const [after] = await client.call([compressSqe(2n, 'BF16', [n], at(src, 0, data.length), at(frames, 0, cap), 'max')]);
    expect(after?.status).toBe(HANDLE);
  });
});

describe.skipIf(!addonAvailable())('ringOpen arguments', () => {
  const make = (entries: number, patch: (b: Buffer) => void = () => {}, bytes = ringBytes(entries)): string => {
    const path = `/dev/shm/${TAG}-open-${serial++}`;
    files.push(path);
    const b = Buffer.alloc(bytes);
    b.write('TZRING01', 0, 'latin1');
    b.writeUInt32LE(entries, 8);
    patch(b);
    writeFileSync(path, b);
    return path;
  };
  const opts = (entries: number, extra: Partial<RingOpenOptions> = {}): RingOpenOptions => ({
    entries, smBudget: 10, cpuThreads: 1, spinUs: 0, onStats: () => {}, onBroken: () => {}, ...extra,
  });
  it.each([
    ['a file of the wrong size', () => ringOpen(mapShared(make(8, undefined, ringBytes(8) - 64), true), opts(8))],
    ['a bigger file', () => ringOpen(mapShared(make(8, undefined, ringBytes(16)), true), opts(8))],
    ['a bad magic', () => ringOpen(mapShared(make(8, (b) => b.write('TZRING00', 0, 'latin1')), true), opts(8))],
    ['header entries other than opts.entries', () => ringOpen(mapShared(make(8, (b) => b.writeUInt32LE(16, 8)), true), opts(8))],
    ['entries not a power of two', () => ringOpen(mapShared(make(12), true), opts(12))],
    ['entries above 4096', () => ringOpen(mapShared(make(8192), true), opts(8192))],
    ['a read-only mapping', () => ringOpen(mapShared(make(8), false), opts(8))],
    ['cpuThreads 0', () => ringOpen(mapShared(make(8), true), opts(8, { cpuThreads: 0 }))],
    ['no onStats', () => ringOpen(mapShared(make(8), true), opts(8, { onStats: undefined as never }))],
  ])('refuses %s (TZIP_INVALID_ARGUMENT)', (_what, f) => {
    expect(codeOf(f)).toBe('TZIP_INVALID_ARGUMENT');
  });

  it.skipIf(hasGpu)('a device without a GPU: TZIP_UNSUPPORTED', () => {
    expect(codeOf(() => ringOpen(mapShared(make(8), true), opts(8, { device: 0 })))).toBe('TZIP_UNSUPPORTED');
  });

  it('an onStats that throws is an uncaught exception of the process, which the ring survives', () => {
    const script = `
      const a = require(process.argv[1]);
      const fs = require('node:fs');
      const p = process.argv[2] + '-throws';
      const b = Buffer.alloc(${ringBytes(8)});
      b.write('TZRING01', 0, 'latin1');
      b.writeUInt32LE(8, 8);
      fs.writeFileSync(p, b);
      const view = a.mapShared(p, true);
      let seen = 0;
      process.on('uncaughtException', (e) => { seen++; });
      const ring = a.ringOpen(a.mapShared(p, true), { entries: 8, smBudget: 10, cpuThreads: 1, spinUs: 0,
        onStats() { throw new Error('stats handler bug'); }, onBroken() {} });
      const r = ring.addHost(a.mapShared(p, true));
      // A compress SQE naming a range too small: an error CQE that counts in stats.
      const q = Buffer.alloc(128);
      q[8] = 1; q[11] = 1; q[12] = 1;
      q.writeUInt32LE(r.id, 16); q.writeUInt32LE(r.generation, 20); q.writeBigUInt64LE(1n, 32); q.writeBigUInt64LE(1n, 64);
      q.writeUInt32LE(r.id, 40); q.writeUInt32LE(r.generation, 44); q.writeBigUInt64LE(8n, 48); q.writeBigUInt64LE(8n, 56);
      q.copy(view, 4096);
      view.writeUInt32LE(1, 64);
      const t0 = Date.now();
      (function poll() {
        if ((seen > 0 && view.readUInt32LE(256) === 1) || Date.now() - t0 > 10000) {
          ring.close().then(() => { console.log(JSON.stringify({ seen, cqes: view.readUInt32LE(256), state: ring.state })); fs.rmSync(p); });
        } else setTimeout(poll, 5);
      })();
    `;
    // Node's policy for exceptions of N-API callbacks decides where it goes: with this flag, to uncaughtException;
    // without it, a DEP0168 warning. Either way the process and the ring go on.
    const r = spawnSync(process.execPath, ['--force-node-api-uncaught-exceptions-policy=true', '-e', script, addonPath(), `/dev/shm/${TAG}-child`],
      { encoding: 'utf8', timeout: 30_000 });
    expect(r.signal, r.stderr).toBeNull();
    expect(r.status, r.stderr).toBe(0);
    expect(JSON.parse(r.stdout.trim())).toEqual({ seen: 1, cqes: 1, state: 'closed' });
  });

  it('a ring dropped without close() stops its thread; a process may exit with a ring still open', () => {
    const script = `
      const a = require(process.argv[1]);
      const fs = require('node:fs');
      const make = (p) => {
        const b = Buffer.alloc(${ringBytes(8)});
        b.write('TZRING01', 0, 'latin1');
        b.writeUInt32LE(8, 8);
        fs.writeFileSync(p, b);
        return a.mapShared(p, true);
      };
      const o = { entries: 8, smBudget: 10, cpuThreads: 1, spinUs: 0, onStats() {}, onBroken() {} };
      const dropped = process.argv[2] + '-dropped', open = process.argv[2] + '-open';
      const view = make(dropped);
      (() => { a.ringOpen(a.mapShared(dropped, true), o); })();
      a.ringOpen(make(open), o);
      const t0 = Date.now();
      (function poll() {
        global.gc();
        if (view.readUInt32LE(260) === 1 || Date.now() - t0 > 10000) {
          console.log(view.readUInt32LE(260));
          fs.rmSync(dropped);
          fs.rmSync(open);
        } else setTimeout(poll, 5);
      })();
    `;
    const r = spawnSync(process.execPath, ['--expose-gc', '-e', script, addonPath(), `/dev/shm/${TAG}-child`], { encoding: 'utf8', timeout: 30_000 });
    expect(r.signal, r.stderr).toBeNull();
    expect(r.status, r.stderr).toBe(0);
    expect(r.stdout.trim()).toBe('1');
  });
});

// ------------------------------------------------------------------------------------------------ settings, bytes in flight

describe.skipIf(!addonAvailable())('setSettings (the job settings) and the bytes in flight', () => {
  const LIMIT = ERRORS.TZIP_LIMIT as number;

  /** One BF16 compress SQE of `data` (shape [n]) from `src` at 0 into `dst` at 0, with `codec` and `smBudget`. */
  const bf16Sqe = (userData: bigint, src: Region, dst: Region, n: number, codec: string, smBudget = 0): Sqe =>
    compressSqe(userData, 'BF16', [n], at(src, 0, 2 * n), at(dst, 0, maxCompressedSize(2 * n, 1)), codec, { smBudget });

  it('the next SQE after setSettings gets its codec (raw frames for a job\'s "off"); null gives each SQE its own', async () => {
    const { client, ring } = openRing(64, { codec: 'bytes' });
    const n = 4096;
    const data = bf16Weights(n, 5);
    const src = region(ring, data.length);
    data.copy(src.mem);
    const dst = region(ring, maxCompressedSize(data.length, 1));
    const want = async (codec: 'raw' | 'fast' | 'max' | 'bytes') => compress(data, { dtype: 'BF16', shape: [n], codec });
    const frameOf = (c: Cqe) => Buffer.from(dst.mem.subarray(0, Number(c.result)));
    // ringOpen's codec applies from the first SQE on.
    let [c] = await client.call([bf16Sqe(1n, src, dst, n, 'fast')]);
    expect(c).toMatchObject({ status: OK, codec: CODEC.bytes });
    expect(frameOf(c as Cqe).equals(await want('bytes'))).toBe(true);
    for (const [codec, expected] of [['raw', 'raw'], ['max', 'max'], [null, 'fast'], ['auto', null]] as const) {
      ring.setSettings({ smBudget: 10, codec, smBudgetOverride: null });
      [c] = await client.call([bf16Sqe(2n, src, dst, n, 'fast')]);
      expect(c?.status, `codec ${codec}: ${c?.message}`).toBe(OK);
      if (expected === null) {
        // auto on bf16 weights: the data picks fast or max; the frame says which, and decodes to the bytes.
        expect([CODEC.fast, CODEC.max]).toContain(c?.codec);
        expect(frameOf(c as Cqe)[7]).toBe(c?.codec);
        continue;
      }
      expect(c?.codec, `codec ${codec}`).toBe(CODEC[expected]);
      const frame = frameOf(c as Cqe);
      expect(frame[7]).toBe(CODEC[expected]);
      expect(frame.equals(await want(expected)), `codec ${codec}`).toBe(true);
    }
    // Decompress SQEs are not touched by a codec setting: the raw frame written above decodes as it is.
    ring.setSettings({ smBudget: 10, codec: 'max', smBudgetOverride: null });
    [c] = await client.call([bf16Sqe(3n, src, dst, n, 'raw')]);
    expect(c).toMatchObject({ status: OK, codec: CODEC.max });
    const out = region(ring, data.length, 0);
    const [d] = await client.call([decompressSqe(4n, at(dst, 0, c?.result as bigint), at(out, 0, data.length))]);
    expect(d?.status, d?.message).toBe(OK);
    expect(out.mem.equals(data)).toBe(true);
  });

  it('a raw override fills the frame bound exactly and writes nothing past the SQE\'s dst; below the bound the CQE is an error whatever the codec', async () => {
    const { client, ring } = openRing(64, { codec: 'raw' });
    // Bytes that do not shrink: the raw frame is the largest a codec writes.
    const n = 3 * 65536 + 77;
    const data = Buffer.alloc(n);
    const r = lcg(99);
    for (let i = 0; i < n; i++) data[i] = r() & 0xff;
    const bound = maxCompressedSize(n, 1);
    const src = region(ring, n);
    data.copy(src.mem);
    const GUARD = 4096;
    const dst = region(ring, bound + GUARD, 0x5c);
    let [c] = await client.call([compressSqe(1n, 'U8', [n], at(src, 0, n), at(dst, 0, bound), 'fast')]);
    expect(c).toMatchObject({ status: OK, codec: CODEC.raw, result: BigInt(bound) });
    expect(Buffer.from(dst.mem.subarray(0, bound)).equals(await compress(data, { dtype: 'U8', shape: [n], codec: 'raw' }))).toBe(true);
    expect(touched(dst.mem, 0x5c, bound)).toBe(0);
    // One byte short of the bound: refused before anything runs, with the override as without it.
    for (const codec of ['raw', null] as const) {
      ring.setSettings({ smBudget: 10, codec, smBudgetOverride: null });
      dst.mem.fill(0x5c);
      [c] = await client.call([compressSqe(2n, 'U8', [n], at(src, 0, n), at(dst, 0, bound - 1), 'fast')]);
      expect(c).toMatchObject({ status: INVALID, message: `dst bytes below the frame bound ${bound}` });
      expect(touched(dst.mem, 0x5c)).toBe(0);
    }
  });

  it('refuses settings it cannot apply (TZIP_INVALID_ARGUMENT) and keeps the ones it had', async () => {
    const { client, ring } = openRing(64, { codec: 'raw' });
    for (const bad of [
      { smBudget: 10, codec: 'zstd', smBudgetOverride: null },
      { smBudget: 10, codec: null, smBudgetOverride: -1 },
      { smBudget: 10, codec: null, smBudgetOverride: 1.5 },
      { codec: null, smBudgetOverride: null },
    ]) {
      expect(codeOf(() => ring.setSettings(bad as never)), JSON.stringify(bad)).toBe('TZIP_INVALID_ARGUMENT');
    }
    expect(codeOf(() => openRing(8, { codec: 'zstd' as never }))).toBe('TZIP_INVALID_ARGUMENT');
    const n = 1024;
    const src = region(ring, 2 * n);
    bf16Weights(n, 2).copy(src.mem);
    const dst = region(ring, maxCompressedSize(2 * n, 1));
    const [c] = await client.call([bf16Sqe(1n, src, dst, n, 'fast')]);
    expect(c).toMatchObject({ status: OK, codec: CODEC.raw });
  });

  it('the SM budget: the override wins over the SQE\'s, an SQE that gives 0 takes the default (TZIP_TRACE of a child process)', () => {
    // A CPU batch does not use its SM budget; the thread's trace line says the one it was given.
    const script = `
      const a = require(process.argv[1]);
      const fs = require('node:fs');
      const base = process.argv[2];
      const ringPath = base + '-trace-ring', regPath = base + '-trace-region';
      const b = Buffer.alloc(${ringBytes(8)});
      b.write('TZRING01', 0, 'latin1');
      b.writeUInt32LE(8, 8);
      fs.writeFileSync(ringPath, b);
      fs.writeFileSync(regPath, Buffer.alloc(8192, 7));
      const view = a.mapShared(ringPath, true);
      const ring = a.ringOpen(a.mapShared(ringPath, true), { entries: 8, smBudget: 12, cpuThreads: 1, spinUs: 100000,
        onStats() {}, onBroken() {} });
      const r = ring.addHost(a.mapShared(regPath, true));
      let head = 0;
      // A 16-byte U8 compress SQE from offset 0 into offset 4096, with sm_budget \`sm\`; waits for its CQE.
      const one = (sm) => {
        const q = Buffer.alloc(128);
        q[8] = 1; q[10] = 1; q[11] = 1; q[12] = 1; q[13] = sm;
        q.writeUInt32LE(r.id, 16); q.writeUInt32LE(r.generation, 20); q.writeBigUInt64LE(16n, 32); q.writeBigUInt64LE(16n, 64);
        q.writeUInt32LE(r.id, 40); q.writeUInt32LE(r.generation, 44); q.writeBigUInt64LE(4096n, 48); q.writeBigUInt64LE(4096n, 56);
        q.copy(view, 4096 + (head % 8) * 128);
        view.writeUInt32LE(++head, 64);
        const t0 = Date.now();
        while (view.readUInt32LE(256) < head) if (Date.now() - t0 > 10000) throw new Error('no CQE');
        view.writeUInt32LE(head, 320);
      };
      one(0); one(5);
      ring.setSettings({ smBudget: 20, codec: null, smBudgetOverride: 37 });
      one(0); one(5);
      ring.setSettings({ smBudget: 20, codec: null, smBudgetOverride: null });
      one(0); one(5);
      // A job's budget beyond an SQE's byte, and 0 (all SMs), are overrides too.
      ring.setSettings({ smBudget: 20, codec: null, smBudgetOverride: 300 });
      one(5);
      ring.setSettings({ smBudget: 20, codec: null, smBudgetOverride: 0 });
      one(5);
      ring.close().then(() => { fs.rmSync(ringPath); fs.rmSync(regPath); });
    `;
    const r = spawnSync(process.execPath, ['-e', script, addonPath(), `/dev/shm/${TAG}-child`],
      { encoding: 'utf8', timeout: 30_000, env: { ...process.env, TZIP_TRACE: '1' } });
    expect(r.status, r.stderr).toBe(0);
    const budgets = [...r.stderr.matchAll(/tzip ring trace: op 1, 1 SQEs, CPU, codec 1, SM budget (\d+):/g)].map((m) => Number(m[1]));
    expect(budgets, r.stderr).toEqual([12, 5, 37, 37, 20, 5, 300, 0]);
  });

  it('a batch counts its bytes in the session\'s word while it runs; one that would pass the limit fails TZIP_LIMIT, nothing written', async () => {
    const word = new BigInt64Array(new SharedArrayBuffer(8));
    const n = 2048;
    const { client, ring } = openRing(64, { inflightBytes: new Uint8Array(word.buffer), maxInflightBytes: 3 * 2 * n });
    const data = bf16Weights(n, 8);
    const src = region(ring, data.length);
    data.copy(src.mem);
    const cap = maxCompressedSize(data.length, 1);
    const dst = region(ring, 3 * cap, 0x33);
    const sqe = (u: bigint, k: number, link = false): Sqe =>
      compressSqe(u, 'BF16', [n], at(src, 0, data.length), at(dst, k * cap, cap), 'fast', { flags: link ? FLAG.link : 0 });
    // Three tensors in one batch: exactly the limit.
    let cqes = await client.call([sqe(1n, 0, true), sqe(2n, 1, true), sqe(3n, 2)]);
    expect(cqes.map((c) => c.status)).toEqual([OK, OK, OK]);
    expect(Atomics.load(word, 0)).toBe(0n);
    // A ZeroMQ request of the session holds one byte (as session.ts reserves): the same batch is over the limit.
    Atomics.store(word, 0, 1n);
    dst.mem.fill(0x33);
    cqes = await client.call([sqe(4n, 0, true), sqe(5n, 1, true), sqe(6n, 2)]);
    expect(cqes.map((c) => c.status)).toEqual([LIMIT, LIMIT, LIMIT]);
    expect(cqes[0]?.message).toBe('bytes in flight over the session\'s limit');
    expect(cqes[1]?.message).toBe('SQE 0 of the batch failed');
    expect(touched(dst.mem, 0x33)).toBe(0);
    expect(Atomics.load(word, 0)).toBe(1n);
    // Decompress counts the destinations' bytes: a frame of the first batch decoded into 2n bytes fits under the 1 held.
    const frame = await compress(data, { dtype: 'BF16', shape: [n], codec: 'fast' });
    frame.copy(dst.mem);
    const out = region(ring, data.length, 0);
    const [d] = await client.call([decompressSqe(7n, at(dst, 0, frame.length), at(out, 0, data.length))]);
    expect(d?.status, d?.message).toBe(OK);
    expect(out.mem.equals(data)).toBe(true);
    expect(Atomics.load(word, 0)).toBe(1n);
    expect(codeOf(() => openRing(8, { inflightBytes: new Uint8Array(4) , maxInflightBytes: 1 }))).toBe('TZIP_INVALID_ARGUMENT');
    expect(codeOf(() => openRing(8, { inflightBytes: new Uint8Array(word.buffer) }))).toBe('TZIP_INVALID_ARGUMENT');
  });
});

// ------------------------------------------------------------------------------------------------ GPU

describe.skipIf(!hasGpu)(`GPU rings: device regions, WAIT/SIGNAL on the header's produced/done words${hasGpu ? '' : ` (skipped: no GPU: ${probe.reason})`}`, () => {
  const DEV = 0;
  const allocs: bigint[] = [];
  afterAll(() => {
    for (const p of allocs) gpuFree(p, DEV);
  });
  const alloc = (bytes: number, content?: Buffer): bigint => {
    const p = gpuAlloc(DEV, bytes);
    allocs.push(p);
    gpuCopyToDevice(p, content ?? Buffer.alloc(bytes, 0xa5), DEV);
    return p;
  };
  // The client's stream writes `produced` with cuStreamWriteValue64 into its registered mapping of the header page;
  // here the client's CPU writes it, which is the same store as far as the ring thread (a CPU poll) can tell.
  const PRODUCED = 448;
  const DONE = 512;
  const produce = (c: RingClient, v: bigint) => c.mem.writeBigUInt64LE(v, PRODUCED);
  const done = (c: RingClient) => c.mem.readBigUInt64LE(DONE);

  function gpuRing(entries = 64) {
    const r = openRing(entries, { device: DEV, spinUs: 2000 });
    const dev = (ptr: bigint, bytes: number) => {
      const x = r.ring.addDevice(ptr, bytes, DEV);
      expect(x.bytes).toBe(bytes);
      return { id: x.id, generation: x.generation };
    };
    return { ...r, dev };
  }

  it.each(ALL_DTYPES.flatMap((d) => ['auto', 'fast', 'max', 'raw'].map((c) => [d, c])))('%s with codec %s: GPU frames equal compress(), and decode back', async (dtype, codec) => {
    const { client, dev, stats } = gpuRing();
    const shape = [7, 3001];
    const data = dataOf(dtype as string, 7 * 3001, 4);
    const expected = await compress(data, { dtype: dtype as string, shape, codec: codec as 'auto' });
    const cap = maxCompressedSize(data.length, 2);
    const srcP = alloc(data.length + 64);
    gpuCopyToDevice(srcP + 64n, data, DEV);
    const frameP = alloc(cap);
    const backP = alloc(data.length);
    const src = dev(srcP, data.length + 64);
    const frames = dev(frameP, cap);
    const back = dev(backP, data.length);
    const [c] = await client.call([compressSqe(1n, dtype as string, shape, { ...src, offset: 64, bytes: data.length }, { ...frames, offset: 0, bytes: cap }, codec as string)]);
    expect(c).toEqual({ userData: 1n, status: OK, codec: expected[7], reserved: [0, 0, 0], result: BigInt(expected.length), message: '' });
    expect(Buffer.compare(gpuCopyFromDevice(frameP, expected.length, DEV), expected)).toBe(0);
    const [d] = await client.call([decompressSqe(2n, { ...frames, offset: 0, bytes: expected.length }, { ...back, offset: 0, bytes: data.length })]);
    expect(d).toMatchObject({ status: OK, result: BigInt(data.length) });
    expect(Buffer.compare(gpuCopyFromDevice(backP, data.length, DEV), data)).toBe(0);
    await until(() => stats.some((s) => s.gpu && s.op === 'decompress'), 'GPU stats');
  });

  it('a batch of 16 linked GPU SQEs: every frame equals compress(), a corrupt frame fails alone', async () => {
    const { client, dev } = gpuRing();
    const dtypes = Array.from({ length: 16 }, (_, i) => ['BF16', 'F16', 'F32', 'U8'][i % 4] as string);
    const datas = dtypes.map((d, i) => dataOf(d, 1000 + 333 * i, 40 + i));
    const caps = datas.map((d) => maxCompressedSize(d.length, 1));
    const total = datas.reduce((s, d) => s + d.length, 0);
    const capTotal = caps.reduce((s, c) => s + c, 0);
    const srcP = alloc(total);
    const frameP = alloc(capTotal);
    const backP = alloc(total);
    const src = dev(srcP, total);
    const frames = dev(frameP, capTotal);
    const back = dev(backP, total);
    const sAt: number[] = [];
    const fAt: number[] = [];
    let so = 0;
    let fo = 0;
    for (const [i, d] of datas.entries()) {
      gpuCopyToDevice(srcP + BigInt(so), d, DEV);
      sAt.push(so);
      fAt.push(fo);
      so += d.length;
      fo += caps[i] as number;
    }
    const elems = (i: number) => datas[i]!.length / (DTYPE_BYTES[dtypes[i] as string] as number);
    const cqes = await client.call(datas.map((d, i) => compressSqe(BigInt(i), dtypes[i] as string, [elems(i)], { ...src, offset: sAt[i], bytes: d.length },
      { ...frames, offset: fAt[i], bytes: caps[i] as number }, 'auto', { flags: i < 15 ? FLAG.link : 0 })));
    const expected = await Promise.all(datas.map((d, i) => compress(d, { dtype: dtypes[i] as string, shape: [elems(i)], codec: 'auto' })));
    cqes.forEach((c, i) => {
      expect(c).toMatchObject({ userData: BigInt(i), status: OK, codec: expected[i]![7], result: BigInt(expected[i]!.length) });
      expect(Buffer.compare(gpuCopyFromDevice(frameP + BigInt(fAt[i]!), expected[i]!.length, DEV), expected[i]!)).toBe(0);
    });
    // Frame 5's last payload byte flipped: it alone fails (the decoder's own check), the others decode.
    const bad = Buffer.from(expected[5]!);
    bad[bad.length - 1] = (bad[bad.length - 1] as number) ^ 0xff;
    gpuCopyToDevice(frameP + BigInt(fAt[5]!), bad, DEV);
    const dcqes = await client.call(datas.map((d, i) => decompressSqe(BigInt(100 + i), { ...frames, offset: fAt[i], bytes: expected[i]!.length },
      { ...back, offset: sAt[i], bytes: d.length }, { flags: FLAG.verify | (i < 15 ? FLAG.link : 0) })));
    dcqes.forEach((c, i) => expect([i, c.status === OK]).toEqual([i, i !== 5]));
    expect(KNOWN_STATUS.has(dcqes[5]!.status)).toBe(true);
    for (const [i, d] of datas.entries()) if (i !== 5) expect(Buffer.compare(gpuCopyFromDevice(backP + BigInt(sAt[i]!), d.length, DEV), d)).toBe(0);
  });

  it('WAIT holds a batch until `produced` reaches its value; SIGNAL sets `done` after its CQE', async () => {
    const { client, dev } = gpuRing();
    const data = dataOf('BF16', 50_000, 2);
    const cap = maxCompressedSize(data.length, 1);
    const src = dev(alloc(data.length, data), data.length);
    const frameP = alloc(cap);
    const frames = dev(frameP, cap);
    const expected = await compress(data, { dtype: 'BF16', shape: [50_000], codec: 'fast' });
    for (let v = 1n; v <= 5n; v++) {
      client.submit([compressSqe(v, 'BF16', [50_000], { ...src, offset: 0, bytes: data.length }, { ...frames, offset: 0, bytes: cap }, 'fast',
        { flags: FLAG.wait | FLAG.signal, waitValue: v, signalValue: 100n + v })]);
      await sleep(40);
      expect(client.ready()).toBe(0); // produced is v - 1
      expect(done(client)).toBe(v === 1n ? 0n : 99n + v);
      produce(client, v);
      const [c] = await client.reap(1);
      expect(c).toMatchObject({ userData: v, status: OK, result: BigInt(expected.length) });
      await until(() => done(client) === 100n + v, 'done');
    }
    expect(Buffer.compare(gpuCopyFromDevice(frameP, expected.length, DEV), expected)).toBe(0);
  });

  it('a failed batch and a nop batch still SIGNAL; WAIT/SIGNAL on a CPU batch or mid-batch are refused', async () => {
    const { client, ring, dev } = gpuRing();
    const r = dev(alloc(4096), 4096);
    const [failed] = await client.call([compressSqe(1n, 'U8', [16], { id: 999, generation: 1, offset: 0, bytes: 16 }, { ...r, offset: 0, bytes: 4096 }, 'raw', { flags: FLAG.signal, signalValue: 7n })]);
    expect(failed?.status).toBe(HANDLE);
    await until(() => done(client) === 7n, 'done after a failed batch');
    const [nop] = await client.call([{ userData: 2n, op: OP.nop, flags: FLAG.signal, signalValue: 8n }]);
    expect(nop?.status).toBe(OK);
    await until(() => done(client) === 8n, 'done after a nop');
    const [lower] = await client.call([{ userData: 3n, op: OP.nop, flags: FLAG.signal, signalValue: 2n }]);
    expect(lower?.status).toBe(OK);
    await sleep(20);
    expect(done(client)).toBe(8n); // never lowered
    const host = region(ring, 8192);
    const cpu = await client.call([
      compressSqe(3n, 'U8', [16], at(host, 0, 16), at(host, 4096, 4096), 'raw', { flags: FLAG.wait, waitValue: 0n }),
      { userData: 4n, op: OP.nop, flags: FLAG.link }, { userData: 5n, op: OP.nop, flags: FLAG.wait },
      compressSqe(6n, 'U8', [16], at(host, 0, 16), { ...r, offset: 0, bytes: 4096 }, 'raw'),
    ]);
    expect(cpu.map((c) => c.status)).toEqual([INVALID, INVALID, INVALID, INVALID]);
    expect(cpu[0]!.message).toBe('WAIT/SIGNAL on a CPU batch');
    expect(cpu[2]!.message).toBe('WAIT on SQE 1, not the first');
    expect(cpu[3]!.message).toBe('src and dst are on different devices');
    // CPU batches still run on a GPU ring.
    const [plain] = await client.call([compressSqe(7n, 'U8', [16], at(host, 0, 16), at(host, 4096, 4096), 'raw')]);
    expect(plain?.status).toBe(OK);
  });

  it('close while a batch waits on `produced`: it completes TZIP_SESSION and the thread stops', async () => {
    const { client, ring, dev } = gpuRing();
    const r = dev(alloc(8192), 8192);
    client.submit([compressSqe(1n, 'U8', [100], { ...r, offset: 0, bytes: 100 }, { ...r, offset: 4096, bytes: 4096 }, 'raw', { flags: FLAG.wait | FLAG.signal, waitValue: 50n, signalValue: 51n })]);
    await until(() => client.word(H.sqTail) === 1, 'the SQE taken');
    await sleep(20);
    expect(client.ready()).toBe(0);
    await ring.close();
    const [c] = await client.reap(1, 1000);
    expect(c).toMatchObject({ status: ERRORS.TZIP_SESSION, message: 'ring closed before the inputs were ready' });
    expect(client.mem.readBigUInt64LE(PRODUCED)).toBe(0n);
    expect(client.state).toBe(1);
  });

  it('addDevice refuses host memory and ranges past their allocation', () => {
    const { ring } = gpuRing();
    const p = alloc(4096);
    expect(codeOf(() => ring.addDevice(p, 4097, DEV))).toBe('TZIP_INVALID_ARGUMENT');
    expect(codeOf(() => ring.addDevice(4096n, 16, DEV))).toBe('TZIP_INVALID_ARGUMENT');
  });

  it('setSettings on a GPU ring: the next device batch gets the codec; a raw frame fills the bound exactly and nothing past dst is written', async () => {
    const { client, ring, dev } = gpuRing();
    const n = 50_000;
    const data = dataOf('BF16', n, 9);
    const cap = maxCompressedSize(data.length, 1);
    const GUARD = 4096;
    const src = dev(alloc(data.length, data), data.length);
    const frameP = alloc(cap + GUARD);
    const frames = dev(frameP, cap + GUARD);
    const one = async (u: bigint, codec: string) => {
      gpuCopyToDevice(frameP, Buffer.alloc(cap + GUARD, 0x5c), DEV);
      const [c] = await client.call([compressSqe(u, 'BF16', [n], { ...src, offset: 0, bytes: data.length }, { ...frames, offset: 0, bytes: cap }, codec)]);
      expect(c?.status, c?.message).toBe(OK);
      const mem = gpuCopyFromDevice(frameP, cap + GUARD, DEV);
      expect(touched(mem, 0x5c, cap), 'nothing past the SQE\'s dst').toBe(0);
      return { c: c as Cqe, frame: mem.subarray(0, Number((c as Cqe).result)) };
    };
    for (const [codec, expected] of [['raw', 'raw'], ['max', 'max'], [null, 'fast']] as const) {
      ring.setSettings({ smBudget: 10, codec, smBudgetOverride: null });
      const { c, frame } = await one(1n, 'fast');
      expect(c.codec, `codec ${codec}`).toBe(CODEC[expected]);
      expect(frame[7]).toBe(CODEC[expected]);
      expect(frame.equals(await compress(data, { dtype: 'BF16', shape: [n], codec: expected })), `codec ${codec}`).toBe(true);
    }
    // auto set over an SQE's raw: the device picks fast or max, as compress() does on the same bytes.
    ring.setSettings({ smBudget: 10, codec: 'auto', smBudgetOverride: null });
    const { c, frame } = await one(2n, 'raw');
    const auto = await compress(data, { dtype: 'BF16', shape: [n], codec: 'auto' });
    expect(c.codec).toBe(auto[7]);
    expect(frame.equals(auto)).toBe(true);
    // Incompressible bytes with raw set: the frame is exactly the bound.
    const bytes = Buffer.alloc(3 * 65536 + 77);
    const r = lcg(5);
    for (let i = 0; i < bytes.length; i++) bytes[i] = r() & 0xff;
    const bound = maxCompressedSize(bytes.length, 1);
    const bsrc = dev(alloc(bytes.length, bytes), bytes.length);
    const bdstP = alloc(bound + GUARD, Buffer.alloc(bound + GUARD, 0x5c));
    const bdst = dev(bdstP, bound + GUARD);
    ring.setSettings({ smBudget: 10, codec: 'raw', smBudgetOverride: null });
    const [q] = await client.call([compressSqe(3n, 'U8', [bytes.length], { ...bsrc, offset: 0, bytes: bytes.length }, { ...bdst, offset: 0, bytes: bound }, 'fast')]);
    expect(q).toMatchObject({ status: OK, codec: CODEC.raw, result: BigInt(bound) });
    const mem = gpuCopyFromDevice(bdstP, bound + GUARD, DEV);
    expect(mem.subarray(0, bound).equals(await compress(bytes, { dtype: 'U8', shape: [bytes.length], codec: 'raw' }))).toBe(true);
    expect(touched(mem, 0x5c, bound)).toBe(0);
  });

  it('a GPU batch holds its bytes in the session\'s word while it waits for `produced`; one over the limit fails TZIP_LIMIT, writes nothing and still SIGNALs', async () => {
    const word = new BigInt64Array(new SharedArrayBuffer(8));
    const n = 50_000;
    const data = dataOf('BF16', n, 3);
    const r = openRing(64, { device: DEV, spinUs: 2000, inflightBytes: new Uint8Array(word.buffer), maxInflightBytes: data.length });
    const dev = (ptr: bigint, bytes: number) => {
      const x = r.ring.addDevice(ptr, bytes, DEV);
      return { id: x.id, generation: x.generation };
    };
    const cap = maxCompressedSize(data.length, 1);
    const src = dev(alloc(data.length, data), data.length);
    const frameP = alloc(cap, Buffer.alloc(cap, 0x5c));
    const frames = dev(frameP, cap);
    const sqe = (u: bigint, v: bigint) => compressSqe(u, 'BF16', [n], { ...src, offset: 0, bytes: data.length }, { ...frames, offset: 0, bytes: cap }, 'fast',
      { flags: FLAG.wait | FLAG.signal, waitValue: v, signalValue: 100n + v });
    r.client.submit([sqe(1n, 1n)]);
    await until(() => Atomics.load(word, 0) === BigInt(data.length), 'the batch\'s bytes held');
    await sleep(40);
    expect(r.client.ready()).toBe(0);
    expect(Atomics.load(word, 0)).toBe(BigInt(data.length));
    produce(r.client, 1n);
    const [c] = await r.client.reap(1);
    expect(c?.status, c?.message).toBe(OK);
    expect(Atomics.load(word, 0)).toBe(0n);
    // `done` is stored after the CQEs are written.
    await until(() => done(r.client) === 101n, '`done` after the batch');
    // One byte held elsewhere (a ZeroMQ request of the session): the same batch no longer fits.
    Atomics.store(word, 0, 1n);
    gpuCopyToDevice(frameP, Buffer.alloc(cap, 0x5c), DEV);
    produce(r.client, 2n);
    const [d] = await r.client.call([sqe(2n, 2n)]);
    expect(d).toMatchObject({ status: ERRORS.TZIP_LIMIT, message: 'bytes in flight over the session\'s limit' });
    expect(touched(gpuCopyFromDevice(frameP, cap, DEV), 0x5c)).toBe(0);
    await until(() => done(r.client) === 102n, '`done` after the failed batch');
    expect(Atomics.load(word, 0)).toBe(1n);
  });

  it('the SM budget of a GPU batch: the override wins over the SQE\'s, an SQE that gives 0 takes the default (TZIP_TRACE of a child process)', () => {
    const script = `
      const a = require(process.argv[1]);
      const fs = require('node:fs');
      const ringPath = process.argv[2] + '-gputrace-ring';
      const b = Buffer.alloc(${ringBytes(8)});
      b.write('TZRING01', 0, 'latin1');
      b.writeUInt32LE(8, 8);
      fs.writeFileSync(ringPath, b);
      const view = a.mapShared(ringPath, true);
      const ring = a.ringOpen(a.mapShared(ringPath, true), { entries: 8, device: 0, smBudget: 12, cpuThreads: 1, spinUs: 100000,
        onStats() {}, onBroken() {} });
      const p = a.gpuAlloc(0, 8192);
      a.gpuCopyToDevice(p, Buffer.alloc(8192, 7), 0);
      const r = ring.addDevice(p, 8192, 0);
      let head = 0;
      const one = (sm) => {
        const q = Buffer.alloc(128);
        q[8] = 1; q[10] = 1; q[11] = 8; q[12] = 1; q[13] = sm;
        q.writeUInt32LE(r.id, 16); q.writeUInt32LE(r.generation, 20); q.writeBigUInt64LE(2048n, 32); q.writeBigUInt64LE(1024n, 64);
        q.writeUInt32LE(r.id, 40); q.writeUInt32LE(r.generation, 44); q.writeBigUInt64LE(4096n, 48); q.writeBigUInt64LE(4096n, 56);
        q.copy(view, 4096 + (head % 8) * 128);
        view.writeUInt32LE(++head, 64);
        const t0 = Date.now();
        while (view.readUInt32LE(256) < head) if (Date.now() - t0 > 20000) throw new Error('no CQE');
        const status = view.readInt32LE(4096 + 8 * 128 + ((head - 1) % 8) * 64 + 8);
        if (status !== 0) throw new Error('CQE status ' + status);
        view.writeUInt32LE(head, 320);
      };
      one(0); one(5);
      ring.setSettings({ smBudget: 20, codec: null, smBudgetOverride: 37 });
      one(0); one(5);
      ring.setSettings({ smBudget: 20, codec: null, smBudgetOverride: null });
      one(0); one(5);
      ring.close().then(() => { a.gpuFree(p, 0); fs.rmSync(ringPath); });
    `;
    const r = spawnSync(process.execPath, ['-e', script, addonPath(), `/dev/shm/${TAG}-child`],
      { encoding: 'utf8', timeout: 60_000, env: { ...process.env, TZIP_TRACE: '1' } });
    expect(r.status, r.stderr).toBe(0);
    const budgets = [...r.stderr.matchAll(/tzip ring trace: op 1, 1 SQEs, GPU, codec 1, SM budget (\d+):/g)].map((m) => Number(m[1]));
    expect(budgets, r.stderr).toEqual([12, 5, 37, 37, 20, 5]);
  });
});
