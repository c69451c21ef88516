// The GPU codec and CUDA IPC through the addon (src/native.ts): GPU frames equal CPU frames byte for byte for every
// codec and dtype, on real tensors and edge cases; the codec gpuCompress reports per frame and the headers
// gpuDecompress returns equal what the CPU frames record; cross decoding; batches; views at odd offsets with guard
// bytes around them; frames shorter than the largest header at the very end of their allocations; corrupt frames
// rejected with the CPU decoder's codes and no write outside `out`; argument errors; CUDA IPC memory and events
// across processes. Without a GPU only the "no GPU" behaviour is checked; the GPU suite is
// skipped and its name says why.
import { execFile } from 'node:child_process';
import { createHash } from 'node:crypto';
import { existsSync, readdirSync } from 'node:fs';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { TZIP_ERROR_CODES, TzipError, toTzipError } from '../src/errors.js';
import {
  addonAvailable,
  addonPath,
  compress,
  cudaEventCreateInterprocess,
  cudaEventDestroy,
  cudaIpcCloseMemHandle,
  cudaIpcGetMemHandle,
  cudaIpcOpenEventHandle,
  cudaIpcOpenMemHandle,
  cudaMemGetInfo,
  decompress,
  gpu,
  gpuAlloc,
  gpuCompress,
  gpuCopyFromDevice,
  gpuCopyToDevice,
  gpuDecompress,
  gpuDevices,
  gpuFree,
  maxCompressedSize,
  readHeader,
  type Codec,
  type FrameHeader,
  type GpuCompressed,
  type GpuDecodeItem,
  type GpuEncodeItem,
} from '../src/native.js';
import { packageRoot } from '../src/package-root.js';
import { openSafetensors } from '../src/safetensors.js';

const probe = addonAvailable() ? gpu() : { available: false, reason: 'the native addon is not built', devices: [] };
const hasGpu = probe.available;
const skipNote = hasGpu ? '' : ` (skipped: no GPU: ${probe.reason})`;
if (!hasGpu) console.warn(`gpu-addon.test.ts: GPU tests skipped: ${probe.reason}`);

const DEV = 0;
const CHUNK = 65536;
const CODECS: Codec[] = ['raw', 'fast', 'max', 'bytes', 'auto'];
const SIZES: Record<string, number> = { BF16: 2, F16: 2, F32: 4, U8: 1, I32: 4, I64: 8 };
const DTYPES = ['BF16', 'F16', 'F32', 'U8', 'I32'];
const GUARD = 0xa5;

// ------------------------------------------------------------------------------------------------ helpers

/** Expects `f` (sync or async) to fail with a TzipError of `code`; returns it. */
async function expectCode(f: () => unknown, code: string, message?: RegExp): Promise<TzipError> {
  let caught: unknown;
  try {
    await f();
  } catch (err) {
    caught = err;
  }
  if (!(caught instanceof TzipError)) throw new Error(`expected a TzipError ${code}, got ${String(caught)}`);
  expect(caught.code).toBe(code);
  if (message !== undefined) expect(caught.message).toMatch(message);
  return caught;
}

/** Throws naming the first differing byte, so that a mismatch in megabytes reads well. */
function expectSameBytes(actual: Uint8Array, expected: Uint8Array, what: string): void {
  const a = Buffer.from(actual.buffer, actual.byteOffset, actual.byteLength);
  const b = Buffer.from(expected.buffer, expected.byteOffset, expected.byteLength);
  if (a.equals(b)) return;
  let i = 0;
  while (i < a.length && i < b.length && a[i] === b[i]) i++;
  throw new Error(`${what}: ${a.length} bytes vs ${b.length} expected, first difference at byte ${i}`);
}

/** Throws unless buf[begin, end) is all `value`. */
function expectFilled(buf: Uint8Array, begin: number, end: number, value: number, what: string): void {
  for (let i = begin; i < end; i++) {
    if (buf[i] !== value) throw new Error(`${what}: byte ${i} is 0x${buf[i]!.toString(16)}, the guard is 0x${value.toString(16)}`);
  }
}

/** Deterministic generator (mulberry32). */
function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function randomBytes(n: number, seed: number): Buffer {
  const r = rng(seed);
  const b = Buffer.alloc(n);
  for (let i = 0; i < n; i++) b[i] = (r() * 256) | 0;
  return b;
}

function f32ToF16Bits(x: number): number {
  const f = new Float32Array([x]);
  const u = new Uint32Array(f.buffer)[0]!;
  const sign = (u >>> 16) & 0x8000;
  const exp = ((u >>> 23) & 0xff) - 127 + 15;
  if (exp <= 0) return sign;
  if (exp >= 31) return sign | 0x7c00;
  return sign | (exp << 10) | ((u >>> 13) & 0x3ff);
}

/** Weight-like values (normal, sigma 0.02) in `dtype`: what real tensors look like to the codecs. */
function weightLike(dtype: string, count: number, seed: number): Buffer {
  const r = rng(seed);
  const out = Buffer.alloc(count * SIZES[dtype]!);
  const f = new Float32Array(1);
  const u = new Uint32Array(f.buffer);
  for (let i = 0; i < count; i++) {
    const g = Math.sqrt(-2 * Math.log(r() + 1e-12)) * Math.cos(2 * Math.PI * r()) * 0.02;
    f[0] = g;
    switch (dtype) {
      case 'F32': out.writeUInt32LE(u[0]!, 4 * i); break;
      case 'BF16': out.writeUInt16LE((u[0]! + 0x7fff + ((u[0]! >>> 16) & 1)) >>> 16, 2 * i); break;
      case 'F16': out.writeUInt16LE(f32ToF16Bits(g), 2 * i); break;
      case 'U8': out[i] = Math.max(0, Math.min(255, Math.round(128 + g * 2000))); break;
      default: out.writeInt32LE(Math.round(g * 5000), 4 * i);
    }
  }
  return out;
}

/** NaN payloads, -0.0, infinities, subnormals and normals; for U8/I32 the bytes of such f32/bf16 values. */
function specials(dtype: string, count: number, seed: number): Buffer {
  const r = rng(seed);
  const bf16 = [0x7fc1, 0xffff, 0x7f81, 0xff80, 0x7f80, 0x8000, 0x0000, 0x0001, 0x807f, 0x3f80, 0xbf80, 0x0080];
  const f16 = [0x7e01, 0xfc01, 0x7fff, 0x7c00, 0xfc00, 0x8000, 0x0000, 0x0001, 0x83ff, 0x3c00, 0x0400];
  const f32 = [0x7fc00001, 0xffbadbad, 0x7f800001, 0x7f800000, 0xff800000, 0x80000000, 0, 1, 0x807fffff,
    0x3f800000, 0x00800000, 0x7fffffff];
  const w = SIZES[dtype]!;
  const out = Buffer.alloc(count * w);
  const pick = <T>(a: T[]): T => a[(r() * a.length) | 0]!;
  for (let i = 0; i < count; i++) {
    switch (dtype) {
      case 'BF16': out.writeUInt16LE(pick(bf16), 2 * i); break;
      case 'F16': out.writeUInt16LE(pick(f16), 2 * i); break;
      case 'U8': out[i] = (pick(f32) >>> (8 * (i % 4))) & 0xff; break;
      default: out.writeUInt32LE(pick(f32) >>> 0, 4 * i);
    }
  }
  return out;
}

interface Tensor {
  name: string;
  dtype: string;
  shape: number[];
  bytes: Buffer;
}

/** The edge cases of one dtype (sizes around the chunk size, empty, constant, random, special values). */
function edgeCases(dtype: string, seed: number): Tensor[] {
  const w = SIZES[dtype]!;
  const t = (name: string, shape: number[], bytes: Buffer): Tensor => ({ name: `${dtype} ${name}`, dtype, shape, bytes });
  const n = (bytes: number) => Math.floor(bytes / w);
  const elems = (count: number, s: number) => weightLike(dtype, count, s);
  const constant = Buffer.alloc(n(200_000) * w);
  for (let i = 0; i < constant.length; i += w) constant.writeUIntLE(dtype === 'U8' ? 7 : 0x3f80, i, Math.min(w, 2));
  return [
    t('empty [0]', [0], Buffer.alloc(0)),
    t('empty [3, 0, 2]', [3, 0, 2], Buffer.alloc(0)),
    t('one element', [1], elems(1, seed)),
    t('chunk - 1 element (chunk - 1 byte for U8)', [CHUNK / w - 1], elems(CHUNK / w - 1, seed + 1)),
    t('chunk + 1 element (chunk + 1 byte for U8)', [CHUNK / w + 1], elems(CHUNK / w + 1, seed + 2)),
    t('3 chunks + 17 elements', [3 * (CHUNK / w) + 17], elems(3 * (CHUNK / w) + 17, seed + 3)),
    t('all equal', [n(200_000) / 8, 8], constant),
    t('random bytes', [n(150_000)], randomBytes(n(150_000) * w, seed + 4)),
    t('NaN payloads, -0.0, inf, subnormals', [n(70_000)], specials(dtype, n(70_000), seed + 5)),
    t('weight-like [256, 300]', [256, 300], elems(256 * 300, seed + 6)),
  ];
}

/** Expects gpuCompress's report of item i to be `frame`'s size and the codec its header records. */
function expectReported(r: GpuCompressed | undefined, frame: Buffer, what: string): void {
  expect(r, what).toBeDefined();
  expect(typeof r!.frameBytes, what).toBe('bigint');
  expect({ frameBytes: Number(r!.frameBytes), codec: r!.codec }, what).toEqual({ frameBytes: frame.length, codec: readHeader(frame).codec });
}

/** Expects the headers gpuDecompress returned to be readHeader's of the same frames. */
function expectHeaders(headers: FrameHeader[], frames: Buffer[], what: string): void {
  expect(headers, what).toHaveLength(frames.length);
  frames.forEach((f, i) => expect(headers[i], `${what}: item ${i}`).toEqual(readHeader(f)));
}

/** Device memory freed at the end of the suite. */
const allocations: bigint[] = [];
function alloc(nbytes: number): bigint {
  const p = gpuAlloc(DEV, nbytes);
  allocations.push(p);
  return p;
}
function release(p: bigint): void {
  const i = allocations.indexOf(p);
  if (i >= 0) allocations.splice(i, 1);
  gpuFree(p, DEV);
}

/** Places buffers in one device allocation at misaligned offsets with `gap` guard bytes between and around them. */
class Arena {
  readonly offsets: number[] = [];
  readonly size: number;
  readonly base: bigint;

  constructor(lengths: number[], readonly gap = 32, fill?: Buffer[]) {
    let off = gap;
    lengths.forEach((len, i) => {
      off = Math.ceil(off / 16) * 16 + (i % 3 === 0 ? 0 : (i * 7) % 16);  // every third 16-byte aligned, others odd
      this.offsets.push(off);
      off += len + gap;
    });
    this.size = off + 16;
    this.base = alloc(this.size);
    const init = Buffer.alloc(this.size, GUARD);
    fill?.forEach((b, i) => b.copy(init, this.offsets[i]!));
    gpuCopyToDevice(this.base, init, DEV);
  }
  ptr(i: number): bigint {
    return this.base + BigInt(this.offsets[i]!);
  }
  download(): Buffer {
    return gpuCopyFromDevice(this.base, this.size, DEV);
  }
  /** Checks that everything outside the items' [offset, offset + lengths[i]) still holds the guard byte. */
  expectGuards(host: Buffer, lengths: number[], what: string): void {
    let prev = 0;
    lengths.forEach((len, i) => {
      expectFilled(host, prev, this.offsets[i]!, GUARD, `${what}: before item ${i}`);
      prev = this.offsets[i]! + len;
    });
    expectFilled(host, prev, this.size, GUARD, `${what}: after the last item`);
  }
  free(): void {
    release(this.base);
  }
}

/**
 * Compresses `tensors` on the GPU in one call and on the CPU; expects identical frames. Then decodes the CPU frames on
 * the GPU (one call, guard bytes around every output) and the GPU frames on the CPU. Returns the frames.
 */
async function checkAgainstCpu(tensors: Tensor[], codec: Codec, chunkSize = CHUNK, smBudget?: number): Promise<Buffer[]> {
  const input = new Arena(tensors.map((t) => t.bytes.length), 32, tensors.map((t) => t.bytes));
  const caps = tensors.map((t) => maxCompressedSize(t.bytes.length, t.shape.length, chunkSize));
  const frames = new Arena(caps);
  const items: GpuEncodeItem[] = tensors.map((t, i) => ({
    data: t.bytes.length ? input.ptr(i) : 0n, nbytes: t.bytes.length, dtype: t.dtype, codec, shape: t.shape,
    frame: frames.ptr(i), frameCapacity: caps[i]!,
  }));
  const written = await gpuCompress(items, { device: DEV, chunkSize, smBudget });
  expect(written).toHaveLength(tensors.length);
  const host = frames.download();
  frames.expectGuards(host, caps, `${codec} frame arena`);
  const cpu = await Promise.all(tensors.map((t) => compress(t.bytes, { dtype: t.dtype, shape: t.shape, codec, chunkSize })));
  const gpuFrames = tensors.map((t, i) => {
    expectReported(written[i], cpu[i]!, `${codec} ${t.name}: size and codec reported`);
    const f = host.subarray(frames.offsets[i]!, frames.offsets[i]! + Number(written[i]!.frameBytes));
    expectSameBytes(f, cpu[i]!, `${codec} ${t.name}: GPU frame vs CPU frame`);
    return Buffer.from(f);
  });
  // GPU decodes the CPU frames, packed at odd offsets; outputs in an arena of guard bytes.
  const frameArena = new Arena(cpu.map((f) => f.length), 0, cpu);
  const outs = new Arena(tensors.map((t) => t.bytes.length));
  const dec: GpuDecodeItem[] = tensors.map((t, i) => ({
    frame: frameArena.ptr(i), frameBytes: cpu[i]!.length, out: t.bytes.length ? outs.ptr(i) : 0n, outBytes: t.bytes.length,
  }));
  expectHeaders(await gpuDecompress(dec, { device: DEV, smBudget }), cpu, `${codec}: headers of the decoded frames`);
  const back = outs.download();
  outs.expectGuards(back, tensors.map((t) => t.bytes.length), `${codec} decode arena`);
  tensors.forEach((t, i) =>
    expectSameBytes(back.subarray(outs.offsets[i]!, outs.offsets[i]! + t.bytes.length), t.bytes, `${codec} ${t.name}: GPU decode`));
  // CPU decodes the GPU frames.
  for (const [i, t] of tensors.entries()) expectSameBytes(await decompress(gpuFrames[i]!), t.bytes, `${codec} ${t.name}: CPU decode`);
  for (const a of [input, frames, frameArena, outs]) a.free();
  return gpuFrames;
}

/** Real tensors: data/demo (npm run demo) or $TZIP_GPU_REAL_DATA; up to `budget` bytes of whole tensors per file. */
async function realTensors(budget = 4 << 20): Promise<Tensor[]> {
  const dir = process.env.TZIP_GPU_REAL_DATA ?? join(packageRoot(), 'data', 'demo');
  if (!existsSync(dir)) return [];
  const out: Tensor[] = [];
  for (const name of readdirSync(dir).filter((n) => n.endsWith('.safetensors')).sort()) {
    const file = await openSafetensors(join(dir, name));
    try {
      let total = 0;
      for (const t of file.header.tensors) {
        const n = t.end - t.begin;
        if (total + n > budget) continue;
        total += n;
        out.push({ name: `${name}:${t.name}`, dtype: t.codecDtype, shape: t.codecShape, bytes: await file.read(t.begin, t.end) });
      }
    } finally {
      await file.close();
    }
  }
  return out;
}

/** The CPU decoder's verdict on `frame`: its error code, or '' and the bytes. */
async function cpuVerdict(frame: Buffer): Promise<{ code: string; bytes?: Buffer }> {
  try {
    return { code: '', bytes: await decompress(frame, { threads: 1 }) };
  } catch (err) {
    return { code: toTzipError(err).code };
  }
}

// ------------------------------------------------------------------------------------------------ no GPU

describe('errors', () => {
  it('TZIP_CUDA is an error code and itemErrors survive the mapping into TzipError', () => {
    expect(TZIP_ERROR_CODES).toContain('TZIP_CUDA');
    const raw = Object.assign(new Error('gpuDecompress: item 1 of 2: TZIP_CORRUPT: corrupt frame'), {
      code: 'TZIP_CORRUPT', itemErrors: ['', 'TZIP_CORRUPT'],
    });
    const e = toTzipError(raw);
    expect(e.code).toBe('TZIP_CORRUPT');
    expect(e.itemErrors).toEqual(['', 'TZIP_CORRUPT']);
    expect(e.withContext({ file: 'x' }).itemErrors).toEqual(['', 'TZIP_CORRUPT']);
  });
});

describe.skipIf(hasGpu || !addonAvailable())('without a GPU', () => {
  it(`gpuDevices() is [] and every GPU function fails with TZIP_UNSUPPORTED naming why (${probe.reason})`, async () => {
    expect(gpuDevices()).toEqual([]);
    const why = new RegExp(probe.reason.replace(/[.*+?^${}()|[\]\\]/g, '\\$&'));
    const h = Buffer.alloc(64);
    await expectCode(() => gpuCompress([], { device: 0 }), 'TZIP_UNSUPPORTED', why);
    await expectCode(() => gpuDecompress([], { device: 0 }), 'TZIP_UNSUPPORTED', why);
    await expectCode(() => cudaIpcGetMemHandle(1n, 0), 'TZIP_UNSUPPORTED', why);
    await expectCode(() => cudaIpcOpenMemHandle(h, 0), 'TZIP_UNSUPPORTED', why);
    await expectCode(() => cudaIpcCloseMemHandle(1n, 0), 'TZIP_UNSUPPORTED', why);
    await expectCode(() => cudaIpcOpenEventHandle(h, 0), 'TZIP_UNSUPPORTED', why);
    await expectCode(() => cudaEventCreateInterprocess(0), 'TZIP_UNSUPPORTED', why);
    await expectCode(() => cudaEventDestroy(1n, 0), 'TZIP_UNSUPPORTED', why);
    await expectCode(() => cudaMemGetInfo(0), 'TZIP_UNSUPPORTED', why);
    await expectCode(() => gpuAlloc(0, 16), 'TZIP_UNSUPPORTED', why);
    await expectCode(() => gpuFree(1n, 0), 'TZIP_UNSUPPORTED', why);
    await expectCode(() => gpuCopyToDevice(1n, h, 0), 'TZIP_UNSUPPORTED', why);
    await expectCode(() => gpuCopyFromDevice(1n, 16, 0), 'TZIP_UNSUPPORTED', why);
  });
});

// ------------------------------------------------------------------------------------------------ on a GPU

describe.skipIf(!hasGpu)(`GPU codec and CUDA IPC through the addon${skipNote}`, () => {
  afterAll(() => {
    for (const p of [...allocations]) release(p);
  });

  it('lists devices with nvidia-smi UUIDs and memory', async () => {
    const devs = gpuDevices();
    expect(devs.length).toBeGreaterThanOrEqual(1);
    devs.forEach((d, i) => {
      expect(d.ordinal).toBe(i);
      expect(d.uuid).toMatch(/^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/);
      expect(d.uuid).toBe(probe.devices[i]!.uuid);
      expect(d.smCount).toBeGreaterThan(0);
      expect(d.totalMemory).toBeGreaterThan(0);
      expect(d.pciBusId).toMatch(/^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-9a-fA-F]$/);
    });
    const smi = await new Promise<string>((resolve) =>
      execFile('nvidia-smi', ['-L'], (err, stdout) => resolve(err ? '' : stdout)));
    if (smi !== '') for (const d of devs) expect(smi).toContain(`UUID: ${d.uuid})`);
    const mem = cudaMemGetInfo(DEV);
    expect(mem.free).toBeGreaterThan(0);
    expect(mem.free).toBeLessThanOrEqual(mem.total);
    expect(mem.total).toBeLessThanOrEqual(devs[DEV]!.totalMemory);
    expect(mem.total).toBeGreaterThan(0.9 * devs[DEV]!.totalMemory);
  });

  for (const codec of CODECS) {
    it(`${codec}: GPU frames equal CPU frames for BF16/F16/F32/U8/I32 edge cases, one batch; cross decoding`, async () => {
      const tensors = DTYPES.flatMap((d, k) => edgeCases(d, 1000 * k + 17));
      await checkAgainstCpu(tensors, codec);
    });
  }

  it('chunk sizes 4096 and 65280, SM budgets 1, 0 (all) and -1 give the CPU frames too', async () => {
    const tensors = DTYPES.flatMap((d, k) => edgeCases(d, 77 + k).slice(2, 8));
    for (const codec of ['max', 'auto', 'bytes'] as Codec[]) await checkAgainstCpu(tensors, codec, 4096, 1);
    await checkAgainstCpu(tensors, 'fast', 65280, 0);
    await checkAgainstCpu(tensors, 'max', CHUNK, -1);
  });

  it('real tensors (data/demo or $TZIP_GPU_REAL_DATA): GPU frames equal CPU frames for every codec', async (ctx) => {
    const tensors = await realTensors();
    if (tensors.length === 0) {
      console.warn('gpu-addon.test.ts: no real tensors (run npm run demo or set TZIP_GPU_REAL_DATA): skipped');
      ctx.skip();
      return;
    }
    const dtypes = new Set(tensors.map((t) => t.dtype));
    console.log(`real tensors: ${tensors.length} (${[...dtypes].join(', ')}), ${tensors.reduce((s, t) => s + t.bytes.length, 0)} bytes`);
    for (const codec of CODECS) await checkAgainstCpu(tensors, codec);
  });

  it('a batch of 600 small tensors of mixed dtypes and codecs in one call each way', async () => {
    const r = rng(4242);
    const all = ['BF16', 'F16', 'F32', 'U8', 'I32', 'I64'];
    const tensors: Tensor[] = [];
    const codecs: Codec[] = [];
    for (let i = 0; i < 600; i++) {
      const dtype = all[(r() * all.length) | 0]!;
      const count = r() < 0.1 ? 0 : (r() * 3000) | 0;
      tensors.push({ name: `#${i}`, dtype, shape: [count], bytes: r() < 0.3 ? randomBytes(count * SIZES[dtype]!, i) : weightLike(dtype === 'I64' ? 'U8' : dtype, dtype === 'I64' ? count * 8 : count, i) });
      codecs.push(CODECS[(r() * CODECS.length) | 0]!);
    }
    const input = new Arena(tensors.map((t) => t.bytes.length), 16, tensors.map((t) => t.bytes));
    const caps = tensors.map((t) => maxCompressedSize(t.bytes.length, 1));
    const frames = new Arena(caps, 0);
    const written = await gpuCompress(tensors.map((t, i) => ({
      data: input.ptr(i), nbytes: t.bytes.length, dtype: t.dtype, codec: codecs[i], shape: t.shape, frame: frames.ptr(i), frameCapacity: caps[i]!,
    })), { device: DEV });
    const host = frames.download();
    const cpuFrames: Buffer[] = [];
    for (const [i, t] of tensors.entries()) {
      const cpu = await compress(t.bytes, { dtype: t.dtype, shape: t.shape, codec: codecs[i] });
      cpuFrames.push(cpu);
      expectReported(written[i], cpu, `item ${i} (${t.dtype} ${codecs[i]})`);
      expectSameBytes(host.subarray(frames.offsets[i]!, frames.offsets[i]! + Number(written[i]!.frameBytes)), cpu, `item ${i} (${t.dtype} ${codecs[i]})`);
    }
    // Both codecs `auto` can pick show up in the batch, so the codecs reported per item are not all one value.
    expect(new Set(written.filter((_, i) => codecs[i] === 'auto' && ['BF16', 'F16', 'F32'].includes(tensors[i]!.dtype) && tensors[i]!.bytes.length > 0).map((w) => w.codec)))
      .toEqual(new Set(['fast', 'max']));
    const outs = new Arena(tensors.map((t) => t.bytes.length), 8);
    const headers = await gpuDecompress(tensors.map((t, i) => ({
      frame: frames.ptr(i), frameBytes: written[i]!.frameBytes, out: outs.ptr(i), outBytes: t.bytes.length,
    })), { device: DEV });
    expectHeaders(headers, cpuFrames, 'batch of 600: headers');
    const back = outs.download();
    outs.expectGuards(back, tensors.map((t) => t.bytes.length), 'batch decode');
    tensors.forEach((t, i) => expectSameBytes(back.subarray(outs.offsets[i]!, outs.offsets[i]! + t.bytes.length), t.bytes, `item ${i}`));
    for (const a of [input, frames, outs]) a.free();
  });

  it('a view at byte offset 6 of an allocation: encode from it, decode into it, nothing around it changes', async () => {
    const t = weightLike('BF16', 50_001, 6);
    const cap = maxCompressedSize(t.length, 1);
    const src = alloc(t.length + 64);
    const dst = alloc(t.length + 64);
    const fr = alloc(cap + 64);
    for (const [p, n] of [[src, t.length], [dst, t.length], [fr, cap]] as [bigint, number][]) gpuCopyToDevice(p, Buffer.alloc(n + 64, GUARD), DEV);
    gpuCopyToDevice(src + 6n, t, DEV);
    const [w] = await gpuCompress([{ data: src + 6n, nbytes: t.length, dtype: 'BF16', codec: 'max', shape: [50_001], frame: fr + 6n, frameCapacity: cap }], { device: DEV });
    expect(w!.codec).toBe('max');
    const size = w!.frameBytes;
    const frHost = gpuCopyFromDevice(fr, cap + 64, DEV);
    expectFilled(frHost, 0, 6, GUARD, 'before the frame');
    expectFilled(frHost, 6 + cap, cap + 64, GUARD, 'after the frame capacity');
    expectSameBytes(frHost.subarray(6, 6 + Number(size)), await compress(t, { dtype: 'BF16', shape: [50_001], codec: 'max' }), 'frame');
    const [h] = await gpuDecompress([{ frame: fr + 6n, frameBytes: size, out: dst + 6n, outBytes: t.length }], { device: DEV });
    expect(h).toEqual(readHeader(frHost.subarray(6, 6 + Number(size))));
    const out = gpuCopyFromDevice(dst, t.length + 64, DEV);
    expectFilled(out, 0, 6, GUARD, 'before the view');
    expectFilled(out, 6 + t.length, t.length + 64, GUARD, 'after the view');
    expectSameBytes(out.subarray(6, 6 + t.length), t, 'decoded view');
    const srcHost = gpuCopyFromDevice(src, t.length + 64, DEV);
    expectFilled(srcHost, 0, 6, GUARD, 'input: before');
    expectFilled(srcHost, 6 + t.length, t.length + 64, GUARD, 'input: after');
    for (const p of [src, dst, fr]) release(p);
  });

  it('headers of frames shorter than the largest header, each at the very end of its own allocation (0 to 32 dims)', async () => {
    const ones = (k: number) => Array.from({ length: k }, () => 1);
    const tensors: Tensor[] = [
      { name: 'bf16 scalar (ndim 0)', dtype: 'BF16', shape: [], bytes: Buffer.from([0x80, 0x3f]) },
      { name: 'u8 [0]', dtype: 'U8', shape: [0], bytes: Buffer.alloc(0) },
      { name: 'f32 32 dims, empty', dtype: 'F32', shape: [...ones(31), 0], bytes: Buffer.alloc(0) },
      { name: 'bf16 32 dims', dtype: 'BF16', shape: [...ones(31), 5], bytes: weightLike('BF16', 5, 21) },
      { name: 'i32 [2, 3]', dtype: 'I32', shape: [2, 3], bytes: weightLike('I32', 6, 22) },
      { name: 'f16 5 dims', dtype: 'F16', shape: [1, 2, 1, 2, 3], bytes: weightLike('F16', 12, 23) },
    ];
    const cpu = await Promise.all(tensors.map((t) => compress(t.bytes, { dtype: t.dtype, shape: t.shape, codec: 'auto' })));
    expect(cpu.some((f) => f.length < 304)).toBe(true);
    const framePtrs = cpu.map((f) => {
      const p = alloc(f.length);  // nothing after the frame but the end of its allocation
      gpuCopyToDevice(p, f, DEV);
      return p;
    });
    const outs = tensors.map((t) => (t.bytes.length ? alloc(t.bytes.length) : 0n));
    const headers = await gpuDecompress(tensors.map((t, i) => ({ frame: framePtrs[i]!, frameBytes: cpu[i]!.length, out: outs[i]!, outBytes: t.bytes.length })), { device: DEV });
    expectHeaders(headers, cpu, 'short frames');
    tensors.forEach((t, i) => {
      expect(headers[i]!.shape).toEqual(t.shape);
      if (t.bytes.length) expectSameBytes(gpuCopyFromDevice(outs[i]!, t.bytes.length, DEV), t.bytes, t.name);
    });
    // The same frames cut short, each again at the end of its own allocation: the CPU decoder's codes, per item.
    const cut = cpu.flatMap((f, k) => [47, 48, 64, 303].filter((n) => n < f.length).map((n) => ({ frame: f.subarray(0, n), nbytes: tensors[k]!.bytes.length })));
    const cutPtrs = cut.map((c) => {
      const p = alloc(c.frame.length);
      gpuCopyToDevice(p, c.frame, DEV);
      return p;
    });
    const verdicts = await Promise.all(cut.map((c) => cpuVerdict(c.frame)));
    expect(verdicts.every((v) => v.code !== '')).toBe(true);
    const cutOuts = cut.map((c) => (c.nbytes ? alloc(c.nbytes) : 0n));
    const err = await expectCode(() => gpuDecompress(cut.map((c, i) => ({ frame: cutPtrs[i]!, frameBytes: c.frame.length, out: cutOuts[i]!, outBytes: c.nbytes })), { device: DEV }),
      verdicts[0]!.code);
    expect(err.itemErrors).toEqual(verdicts.map((v) => v.code));
    for (const p of [...framePtrs, ...outs, ...cutPtrs, ...cutOuts]) if (p !== 0n) release(p);
  });

  it('corrupt and truncated frames: the CPU decoder\'s error codes per item, no write outside `out`', async () => {
    const bases: Tensor[] = [
      { name: 'bf16 max', dtype: 'BF16', shape: [40_000], bytes: weightLike('BF16', 40_000, 1) },
      { name: 'f32 fast', dtype: 'F32', shape: [20_000], bytes: weightLike('F32', 20_000, 2) },
      { name: 'f16 auto', dtype: 'F16', shape: [100, 300], bytes: weightLike('F16', 30_000, 3) },
      { name: 'u8 bytes', dtype: 'U8', shape: [30_000], bytes: weightLike('U8', 30_000, 4) },
      { name: 'i32 specials', dtype: 'I32', shape: [9_000], bytes: specials('I32', 9_000, 5) },
      { name: 'bf16 raw', dtype: 'BF16', shape: [9_000], bytes: weightLike('BF16', 9_000, 6) },
    ];
    const codecs: Codec[] = ['max', 'fast', 'auto', 'bytes', 'bytes', 'raw'];
    // Small chunks: many chunks, so flips land in tables and payloads of several chunks.
    const frames = await Promise.all(bases.map((t, i) => compress(t.bytes, { dtype: t.dtype, shape: t.shape, codec: codecs[i], chunkSize: 4096 })));
    const r = rng(99);
    const cases: { base: number; frame: Buffer; what: string }[] = [];
    frames.forEach((f, b) => {
      const h = readHeader(f);
      const flipAt = (pos: number, x = 0xff) => {
        const m = Buffer.from(f);
        m[pos] = m[pos]! ^ x;
        cases.push({ base: b, frame: m, what: `${bases[b]!.name}: byte ${pos} ^ 0x${x.toString(16)}` });
      };
      for (const pos of [0, 4, 6, 8, 12, 16, 24, 32, 40, 44, 47, 48, h.headerBytes - 16, h.headerBytes - 4, h.headerBytes, h.headerBytes + 1, f.length - 1]) {
        if (pos >= 0 && pos < f.length) flipAt(pos);
      }
      for (let k = 0; k < 40; k++) flipAt((r() * f.length) | 0, 1 + ((r() * 255) | 0));
      for (const len of [0, 10, 47, 48, h.headerBytes - 1, h.headerBytes, f.length >> 1, f.length - 1]) {
        if (len >= 0 && len < f.length) cases.push({ base: b, frame: f.subarray(0, len), what: `${bases[b]!.name}: first ${len} bytes` });
      }
      cases.push({ base: b, frame: Buffer.concat([f, Buffer.from([0])]), what: `${bases[b]!.name}: one trailing byte` });
      cases.push({ base: b, frame: f, what: `${bases[b]!.name}: intact` });
    });
    const verdicts = await Promise.all(cases.map((c) => cpuVerdict(c.frame)));
    expect(verdicts.filter((v) => v.code !== '').length).toBeGreaterThan(cases.length / 2);
    const lens = cases.map((c) => bases[c.base]!.bytes.length);
    const frameArena = new Arena(cases.map((c) => c.frame.length), 16, cases.map((c) => c.frame));
    const outs = new Arena(lens, 64);
    const items = cases.map((c, i) => ({ frame: frameArena.ptr(i), frameBytes: c.frame.length, out: outs.ptr(i), outBytes: lens[i]! }));
    const err = await expectCode(() => gpuDecompress(items, { device: DEV }), verdicts.find((v) => v.code !== '')!.code);
    expect(err.itemErrors).toHaveLength(cases.length);
    const mismatches = cases.flatMap((c, i) => err.itemErrors![i] === verdicts[i]!.code ? [] : [`${c.what}: GPU '${err.itemErrors![i]}', CPU '${verdicts[i]!.code}'`]);
    expect(mismatches).toEqual([]);
    const first = verdicts.findIndex((v) => v.code !== '');
    expect(err.message).toMatch(new RegExp(`item ${first} of ${cases.length}`));
    const back = outs.download();
    outs.expectGuards(back, lens, 'corrupt-frame outputs');
    verdicts.forEach((v, i) => {
      if (v.code === '') expectSameBytes(back.subarray(outs.offsets[i]!, outs.offsets[i]! + lens[i]!), v.bytes!, cases[i]!.what);
    });
    // One failing frame alone: the same code, naming item 0.
    const bad = verdicts.findIndex((v) => v.code === 'TZIP_CHECKSUM');
    if (bad >= 0) {
      const one = await expectCode(() => gpuDecompress([items[bad]!], { device: DEV }), 'TZIP_CHECKSUM', /item 0 of 1/);
      expect(one.itemErrors).toEqual(['TZIP_CHECKSUM']);
    }
    frameArena.free();
    outs.free();
  });

  it('verify: false decodes good frames; events: recordEvent then waitEvent; concurrent calls', async () => {
    const tensors = DTYPES.map((d, k) => ({ name: d, dtype: d, shape: [33_333], bytes: weightLike(d, 33_333, 50 + k) }));
    const ev = cudaEventCreateInterprocess(DEV);
    expect(ev.handle).toHaveLength(64);
    expect(typeof ev.event).toBe('bigint');
    const input = new Arena(tensors.map((t) => t.bytes.length), 16, tensors.map((t) => t.bytes));
    const caps = tensors.map((t) => maxCompressedSize(t.bytes.length, 1));
    const frames = new Arena(caps);
    const outs = new Arena(tensors.map((t) => t.bytes.length));
    const enc = tensors.map((t, i) => ({ data: input.ptr(i), nbytes: t.bytes.length, dtype: t.dtype, codec: 'max' as Codec, shape: t.shape, frame: frames.ptr(i), frameCapacity: caps[i]! }));
    const written = await gpuCompress(enc, { device: DEV, recordEvent: ev.event });
    expect(written.map((w) => w.codec)).toEqual(['max', 'max', 'max', 'bytes', 'bytes']);  // max on U8/I32 is bytes
    const headers = await gpuDecompress(tensors.map((t, i) => ({ frame: frames.ptr(i), frameBytes: written[i]!.frameBytes, out: outs.ptr(i), outBytes: t.bytes.length })),
      { device: DEV, waitEvent: ev.event, verify: false });
    headers.forEach((h, i) => expect(h).toMatchObject({ dtype: tensors[i]!.dtype, shape: tensors[i]!.shape, nbytes: tensors[i]!.bytes.length, codec: written[i]!.codec, frameBytes: Number(written[i]!.frameBytes) }));
    const back = outs.download();
    tensors.forEach((t, i) => expectSameBytes(back.subarray(outs.offsets[i]!, outs.offsets[i]! + t.bytes.length), t.bytes, `${t.name} verify:false`));
    // Eight calls in flight at once, each its own batch.
    const results = await Promise.all(enc.map((e) => gpuCompress([e], { device: DEV, smBudget: 4 })).concat(enc.map((e) => gpuCompress([e], { device: DEV }))));
    results.forEach((s, k) => expect(s[0]).toEqual(written[k % enc.length]));
    expect(await gpuCompress([], { device: DEV, waitEvent: ev.event, recordEvent: ev.event })).toEqual([]);
    cudaEventDestroy(ev.event, DEV);
    for (const a of [input, frames, outs]) a.free();
  });

  it('more than 2^31 bytes in one tensor (64-bit sizes)', async () => {
    const rows = Math.ceil(2 ** 31 / (4 * 4099)) + 1;
    const n = rows * 4099 * 4;  // F32 [rows, 4099]: just over 2^31 bytes, not a whole number of chunks
    const block = weightLike('F32', 1 << 22, 31);  // 16 MiB of real-looking values, repeated
    const input = Buffer.alloc(n, block);
    const cap = maxCompressedSize(n, 2);
    const src = alloc(n);
    const fr = alloc(cap);
    gpuCopyToDevice(src, input, DEV);
    const shape = [rows, 4099];
    const [w] = await gpuCompress([{ data: src, nbytes: BigInt(n), dtype: 'F32', codec: 'fast', shape, frame: fr, frameCapacity: BigInt(cap) }], { device: DEV, smBudget: 0 });
    expect(w!.codec).toBe('fast');
    const size = w!.frameBytes;
    const frame = gpuCopyFromDevice(fr, size, DEV);
    const h = readHeader(frame);
    expect(h.nbytes).toBe(n);
    expect(h.frameBytes).toBe(Number(size));
    expectSameBytes(frame, await compress(input, { dtype: 'F32', shape, codec: 'fast' }), 'frame of > 2 GiB');
    release(src);
    const out = alloc(n);
    const [back] = await gpuDecompress([{ frame: fr, frameBytes: size, out, outBytes: BigInt(n) }], { device: DEV, smBudget: 0 });
    expect(back).toEqual(h);
    expectSameBytes(gpuCopyFromDevice(out, n, DEV), input, 'decoded > 2 GiB');
    release(out);
    release(fr);
  }, 180_000);

  it('bad arguments: TZIP_INVALID_ARGUMENT, and the next call still works', async () => {
    const t = weightLike('BF16', 4096, 8);
    const cap = maxCompressedSize(t.length, 1);
    const src = alloc(t.length);
    const fr = alloc(cap);
    const out = alloc(t.length);
    gpuCopyToDevice(src, t, DEV);
    const item: GpuEncodeItem = { data: src, nbytes: t.length, dtype: 'BF16', codec: 'max', shape: [4096], frame: fr, frameCapacity: cap };
    const enc = (patch: Partial<GpuEncodeItem>, opts: object = {}) => () => gpuCompress([{ ...item, ...patch }], { device: DEV, ...opts });
    const INV = 'TZIP_INVALID_ARGUMENT';
    await expectCode(enc({}, { device: 99 }), INV, /device 99/);
    await expectCode(enc({}, { device: -1 }), INV);
    await expectCode(() => gpuCompress([item], {} as never), INV, /device/);
    await expectCode(enc({ data: 0n }), INV, /null/);
    await expectCode(enc({ frame: 0n }), INV, /null/);
    await expectCode(enc({ frameCapacity: cap - 1 }), INV, /frameCapacity/);
    await expectCode(enc({ data: 0x1000n }), INV, /not device memory|unregistered|not memory CUDA knows/);
    await expectCode(enc({ nbytes: 2 ** 40, shape: [2 ** 39], frameCapacity: 2 ** 41 }), INV, /last byte/);
    await expectCode(enc({ dtype: 'X9' }), INV, /dtype/);
    await expectCode(enc({ shape: [4095] }), INV, /shape/);
    await expectCode(enc({ codec: 'zip' as Codec }), INV, /codec/);
    await expectCode(enc({}, { chunkSize: 1000 }), INV, /chunkSize/);
    await expectCode(enc({}, { smBudget: 1.5 }), INV, /smBudget/);
    await expectCode(enc({}, { waitEvent: 0n }), INV, /waitEvent/);
    await expectCode(() => gpuCompress('x' as never, { device: DEV }), INV);
    const devs = gpuDevices();
    if (devs.length > 1) {
      const other = gpuAlloc(1, t.length);
      await expectCode(enc({ data: other }), INV, /device 1/);
      gpuFree(other, 1);
    }
    const [w] = await gpuCompress([item], { device: DEV });
    const size = w!.frameBytes;
    const dec = (patch: Partial<GpuDecodeItem>) => () => gpuDecompress([{ frame: fr, frameBytes: size, out, outBytes: t.length, ...patch }], { device: DEV });
    await expectCode(dec({ frame: 0n }), INV, /null/);
    await expectCode(dec({ out: 0n }), INV, /null/);
    await expectCode(dec({ out: 0x1000n }), INV);
    const e = await expectCode(dec({ outBytes: t.length - 2 }), INV, /item 0 of 1/);
    expect(e.itemErrors).toEqual([INV]);
    await expectCode(() => gpuCopyFromDevice(0x1000n, 16, DEV), INV);
    await expectCode(() => cudaIpcOpenMemHandle(Buffer.alloc(10), DEV), INV, /64 bytes/);
    await expectCode(() => cudaIpcOpenEventHandle(Buffer.alloc(65), DEV), INV, /64 bytes/);
    await expectCode(() => cudaIpcOpenMemHandle(Buffer.alloc(64), DEV), 'TZIP_CUDA', /cudaError\w+/);
    await expectCode(() => gpuAlloc(DEV, 2 ** 52), 'TZIP_CUDA', /cudaErrorMemoryAllocation/);
    await gpuDecompress([{ frame: fr, frameBytes: size, out, outBytes: t.length }], { device: DEV });
    expectSameBytes(gpuCopyFromDevice(out, t.length, DEV), t, 'after the errors');
    for (const p of [src, fr, out]) release(p);
  });

  it('CUDA IPC: a child process opens our memory and event, reads, compresses and decodes into our memory', async () => {
    const t = weightLike('BF16', 300_000, 12);
    const cpuFrame = await compress(t, { dtype: 'BF16', shape: [300_000], codec: 'max' });
    const src = alloc(t.length + 100);
    gpuCopyToDevice(src + 100n, t, DEV);
    const fr = alloc(cpuFrame.length + 8);
    gpuCopyToDevice(fr + 8n, cpuFrame, DEV);
    const dst = alloc(t.length + 64);
    gpuCopyToDevice(dst, Buffer.alloc(t.length + 64, GUARD), DEV);
    const ev = cudaEventCreateInterprocess(DEV);
    const cfg = {
      device: DEV, n: t.length, frameBytes: cpuFrame.length,
      src: cudaIpcGetMemHandle(src, DEV).toString('hex'), fr: cudaIpcGetMemHandle(fr, DEV).toString('hex'),
      dst: cudaIpcGetMemHandle(dst, DEV).toString('hex'), ev: ev.handle.toString('hex'),
    };
    const child = `
      const a = require(process.argv[1]);
      const c = JSON.parse(process.argv[2]);
      const sha = (b) => require('node:crypto').createHash('sha256').update(b).digest('hex');
      (async () => {
        const h = (x) => Buffer.from(x, 'hex');
        const src = a.cudaIpcOpenMemHandle(h(c.src), c.device), fr = a.cudaIpcOpenMemHandle(h(c.fr), c.device);
        const dst = a.cudaIpcOpenMemHandle(h(c.dst), c.device), ev = a.cudaIpcOpenEventHandle(h(c.ev), c.device);
        const read = sha(a.gpuCopyFromDevice(src + 100n, c.n, c.device));
        const cap = a.maxCompressedSize(c.n, 1);
        const mine = a.gpuAlloc(c.device, cap);
        const [w] = await a.gpuCompress([{ data: src + 100n, nbytes: c.n, dtype: 'BF16', codec: 'max', shape: [c.n / 2], frame: mine, frameCapacity: cap }],
          { device: c.device, recordEvent: ev });
        const frame = sha(a.gpuCopyFromDevice(mine, w.frameBytes, c.device));
        const [hd] = await a.gpuDecompress([{ frame: fr + 8n, frameBytes: c.frameBytes, out: dst + 32n, outBytes: c.n }], { device: c.device, waitEvent: ev });
        if (w.codec !== 'max' || hd.frameBytes !== c.frameBytes || hd.nbytes !== c.n) throw new Error('unexpected results ' + JSON.stringify({ codec: w.codec, hd }));
        a.gpuFree(mine, c.device);
        for (const p of [src, fr, dst]) a.cudaIpcCloseMemHandle(p, c.device);
        a.cudaEventDestroy(ev, c.device);
        process.stdout.write(JSON.stringify({ read, frame }));
      })().catch((e) => { process.stderr.write(e.code + ': ' + e.message); process.exit(1); });`;
    const result = await new Promise<string>((resolve, reject) =>
      execFile(process.execPath, ['-e', child, addonPath(), JSON.stringify(cfg)], { timeout: 60_000 }, (err, stdout, stderr) =>
        err ? reject(new Error(`child failed: ${err.message} ${stderr}`)) : resolve(stdout)));
    const sha = (b: Uint8Array) => createHash('sha256').update(b).digest('hex');
    expect(JSON.parse(result)).toEqual({ read: sha(t), frame: sha(cpuFrame) });
    const back = gpuCopyFromDevice(dst, t.length + 64, DEV);
    expectFilled(back, 0, 32, GUARD, 'before the child\'s output');
    expectFilled(back, 32 + t.length, t.length + 64, GUARD, 'after the child\'s output');
    expectSameBytes(back.subarray(32, 32 + t.length), t, 'decoded by the child into our memory');
    cudaEventDestroy(ev.event, DEV);
    for (const p of [src, fr, dst]) release(p);
  });

  it('memory stays flat over 300 calls', async () => {
    const t = weightLike('BF16', 10_000, 13);
    const cap = maxCompressedSize(t.length, 1);
    const src = alloc(t.length);
    const fr = alloc(cap);
    const out = alloc(t.length);
    gpuCopyToDevice(src, t, DEV);
    const run = async () => {
      const [w] = await gpuCompress([{ data: src, nbytes: t.length, dtype: 'BF16', codec: 'auto', shape: [10_000], frame: fr, frameCapacity: cap }], { device: DEV });
      await gpuDecompress([{ frame: fr, frameBytes: w!.frameBytes, out, outBytes: t.length }], { device: DEV });
    };
    for (let i = 0; i < 20; i++) await run();
    const before = cudaMemGetInfo(DEV).free;
    for (let i = 0; i < 300; i++) await run();
    expect(before - cudaMemGetInfo(DEV).free).toBeLessThan(64 << 20);
    for (const p of [src, fr, out]) release(p);
  });
});

beforeAll(() => {
  if (hasGpu) console.log(`gpu-addon.test.ts: ${gpuDevices().map((d) => `${d.ordinal}: ${d.name} ${d.uuid}`).join('; ')}`);
});
