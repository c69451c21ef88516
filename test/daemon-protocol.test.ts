// Unit tests of the daemon protocol's validation: message parsing (size cap, MessagePack, schemas, ops),
// DLPack -> frame layout rules, C-order stride checks, overlap checks, reply encoding.
import { describe, expect, it } from 'vitest';
import { Packr } from 'msgpackr';
import { frameLayout, isCompactCOrder } from '../src/daemon/dtype-map.js';
import { parseRequest } from '../src/daemon/parse-request.js';
import { checkOverlaps, type ResolvedRegion } from '../src/daemon/regions.js';
import { ReplyError, toWireError } from '../src/daemon/reply-error.js';
import { decodeMessage, encodeMessage } from '../src/daemon/wire.js';
import { TzipError } from '../src/errors.js';

const packr = new Packr({ useRecords: false });
const limits = { maxMessageBytes: 1 << 20 };
const SID = '0123456789abcdef0123456789abcdef';

function parse(value: unknown) {
  return parseRequest(packr.pack(value), limits);
}

/** PyTorch's shareable handle of a cudaMalloc'd allocation: [version 2]["c"] + 64 bytes. */
const CUDA_HANDLE = Buffer.concat([Buffer.from([2, 0x63]), Buffer.alloc(64, 7)]);

function cudaData(extra: Record<string, unknown> = {}) {
  return { kind: 'cuda_ipc', device_uuid: 'GPU-1', handle: CUDA_HANDLE, offset: 0, size: 12, ref_counter_handle: Buffer.from('/torch_1_2_3'), ref_counter_offset: 0, ...extra };
}

function gpuTensor(data: Record<string, unknown> = {}) {
  return { device: { type: 2, id: 0 }, dtype: { code: 4, bits: 16, lanes: 1 }, shape: [2, 3], byte_offset: 0, data: cudaData(data) };
}

function shmTensor(extra: Record<string, unknown> = {}) {
  return {
    device: { type: 1, id: 0 },
    dtype: { code: 4, bits: 16, lanes: 1 },
    shape: [2, 3],
    byte_offset: 0,
    data: { kind: 'shm', name: 'tzip-1-0123abcd-a1', offset: 0, size: 12 },
    ...extra,
  };
}

describe('parseRequest accepts every op', () => {
  const valid: Record<string, unknown>[] = [
    { id: 1, op: 'hello', versions: [1], pid: 123, shm_prefix: 'tzip-123-0123abcd-' },
    { id: 2, op: 'hello', versions: [1, 2], pid: 123, shm_prefix: 'tzip-123-0123456789abcdef-', name: 'trainer' },
    { id: 3, op: 'heartbeat', sid: SID },
    { id: 4, op: 'compress', sid: SID, tensors: [{ tensor: shmTensor(), out: { kind: 'shm', name: 'tzip-1-0123abcd-a1', offset: 64, size: 128 } }] },
    { id: 5, op: 'compress', sid: SID, codec: 'max', threads: 2, chunk_size: 4096, tensors: [] },
    { id: 6, op: 'decompress', sid: SID, verify: false, frames: [{ frame: { kind: 'shm', name: '/torch_1_2_3', offset: 64, size: 100 }, out: shmTensor({ strides: [3, 1] }) }] },
    { id: 7, op: 'release', sid: SID },
    { id: 8, op: 'release', sid: SID, names: ['tzip-1-0123abcd-a1'], end: true },
    { id: 9, op: 'stats' },
    { id: 10, op: 'stats', sid: SID },
    { id: 11, op: 'shutdown', sid: SID },
    {
      id: 12, op: 'compress', sid: SID, wait_event: Buffer.alloc(64, 1), tensors: [{
        tensor: gpuTensor(),
        out: cudaData({ offset: 64, size: 200 }),
      }],
    },
    { id: 13, op: 'decompress', sid: SID, wait_event: null, frames: [{ frame: cudaData({ ref_counter_handle: null }), out: gpuTensor({ device_index: 3 }) }] },
    // an expandable-segment handle is valid protocol (the daemon refuses it with an explanation)
    { id: 14, op: 'compress', sid: SID, tensors: [{ tensor: gpuTensor({ handle: Buffer.from([2, 0x65, 1, 2, 3]) }), out: cudaData() }] },
    { id: 15, op: 'release', sid: SID, handles: [CUDA_HANDLE] },
  ];
  for (const msg of valid) {
    it(`${String(msg.op)} #${String(msg.id)}`, () => {
      const parsed = parse(msg);
      expect(parsed.error).toBeUndefined();
      expect(parsed.id).toBe(msg.id);
      expect(parsed.request?.op).toBe(msg.op);
    });
  }
});

describe('parseRequest refuses', () => {
  const cases: [string, unknown, string][] = [
    ['a non-map', [1, 2], 'TZIP_PROTOCOL'],
    ['a string', 'hello', 'TZIP_PROTOCOL'],
    ['nil', null, 'TZIP_PROTOCOL'],
    ['a missing op', { id: 1 }, 'TZIP_PROTOCOL'],
    ['an unknown op', { id: 1, op: 'rm -rf' }, 'TZIP_PROTOCOL'],
    ['a numeric op', { id: 1, op: 3 }, 'TZIP_PROTOCOL'],
    ['unknown fields', { id: 1, op: 'heartbeat', sid: SID, x: 1 }, 'TZIP_PROTOCOL'],
    ['a bad session id', { id: 1, op: 'heartbeat', sid: 'ABC' }, 'TZIP_PROTOCOL'],
    ['a prefix with a slash', { id: 1, op: 'hello', versions: [1], pid: 1, shm_prefix: 'tzip-1-0123abcd/' }, 'TZIP_PROTOCOL'],
    ['no versions', { id: 1, op: 'hello', versions: [], pid: 1, shm_prefix: 'tzip-1-0123abcd-' }, 'TZIP_PROTOCOL'],
    ['a negative dimension', { id: 1, op: 'compress', sid: SID, tensors: [{ tensor: shmTensor({ shape: [-1] }), out: { kind: 'shm', name: 'a', offset: 0, size: 1 } }] }, 'TZIP_PROTOCOL'],
    ['a fractional offset', { id: 1, op: 'compress', sid: SID, tensors: [{ tensor: shmTensor({ byte_offset: 0.5 }), out: { kind: 'shm', name: 'a', offset: 0, size: 1 } }] }, 'TZIP_PROTOCOL'],
    ['a path as shm name', { id: 1, op: 'compress', sid: SID, tensors: [{ tensor: shmTensor(), out: { kind: 'shm', name: '../x', offset: 0, size: 1 } }] }, 'TZIP_PROTOCOL'],
    ['"." as shm name', { id: 1, op: 'compress', sid: SID, tensors: [{ tensor: shmTensor(), out: { kind: 'shm', name: '..', offset: 0, size: 1 } }] }, 'TZIP_PROTOCOL'],
    ['an unknown handle kind', { id: 1, op: 'compress', sid: SID, tensors: [{ tensor: shmTensor(), out: { kind: 'rdma', name: 'a', offset: 0, size: 1 } }] }, 'TZIP_PROTOCOL'],
    ['zero bits', { id: 1, op: 'compress', sid: SID, tensors: [{ tensor: shmTensor({ dtype: { code: 2, bits: 0, lanes: 1 } }), out: { kind: 'shm', name: 'a', offset: 0, size: 1 } }] }, 'TZIP_PROTOCOL'],
    ['an unknown codec', { id: 1, op: 'compress', sid: SID, codec: 'zip', tensors: [] }, 'TZIP_PROTOCOL'],
    ['a chunk size out of range', { id: 1, op: 'compress', sid: SID, chunk_size: 100, tensors: [] }, 'TZIP_PROTOCOL'],
    ['65 dimensions', { id: 1, op: 'compress', sid: SID, tensors: [{ tensor: shmTensor({ shape: new Array(65).fill(1) }), out: { kind: 'shm', name: 'a', offset: 0, size: 1 } }] }, 'TZIP_PROTOCOL'],
    ['a bare 64-byte CUDA handle', { id: 1, op: 'compress', sid: SID, tensors: [{ tensor: gpuTensor({ handle: Buffer.alloc(64) }), out: cudaData() }] }, 'TZIP_PROTOCOL'],
    ['a kind "c" handle of 65 bytes', { id: 1, op: 'compress', sid: SID, tensors: [{ tensor: gpuTensor({ handle: CUDA_HANDLE.subarray(0, 65) }), out: cudaData() }] }, 'TZIP_PROTOCOL'],
    ['an unknown handle version', { id: 1, op: 'compress', sid: SID, tensors: [{ tensor: gpuTensor({ handle: Buffer.concat([Buffer.from([9]), CUDA_HANDLE.subarray(1)]) }), out: cudaData() }] }, 'TZIP_PROTOCOL'],
    ['an unknown shareable kind', { id: 1, op: 'compress', sid: SID, tensors: [{ tensor: gpuTensor({ handle: Buffer.concat([Buffer.from([2, 0x78]), Buffer.alloc(64)]) }), out: cudaData() }] }, 'TZIP_PROTOCOL'],
    ['a handle as a string', { id: 1, op: 'compress', sid: SID, tensors: [{ tensor: gpuTensor({ handle: 'x'.repeat(66) }), out: cudaData() }] }, 'TZIP_PROTOCOL'],
    ['PyTorch\'s per-share event fields', { id: 1, op: 'compress', sid: SID, tensors: [{ tensor: gpuTensor({ event_handle: null, event_sync_required: false }), out: cudaData() }] }, 'TZIP_PROTOCOL'],
    ['a wait_event of 63 bytes', { id: 1, op: 'compress', sid: SID, wait_event: Buffer.alloc(63), tensors: [] }, 'TZIP_PROTOCOL'],
    ['a ref counter that is a path', { id: 1, op: 'compress', sid: SID, tensors: [{ tensor: gpuTensor({ ref_counter_handle: Buffer.from('/../x') }), out: cudaData() }] }, 'TZIP_PROTOCOL'],
    ['a release of a bad handle', { id: 1, op: 'release', sid: SID, handles: [Buffer.alloc(3)] }, 'TZIP_PROTOCOL'],
  ];
  for (const [what, value, code] of cases) {
    it(what, () => {
      const parsed = parse(value);
      expect(parsed.request).toBeUndefined();
      expect(parsed.error?.code).toBe(code);
    });
  }

  it('bytes that are not MessagePack, and trailing bytes', () => {
    for (const bytes of [Buffer.from([0xc1]), Buffer.from([0x92, 0x01]), Buffer.from([0x81, 0xa1, 0x61]), Buffer.concat([packr.pack({ id: 1, op: 'stats' }), Buffer.from([1])])]) {
      const parsed = parseRequest(bytes, limits);
      expect(parsed.error?.code).toBe('TZIP_PROTOCOL');
    }
  });

  it('messages above the cap, before decoding them', () => {
    const parsed = parseRequest(Buffer.alloc(2000), { maxMessageBytes: 1000 });
    expect(parsed.error?.code).toBe('TZIP_TOO_LARGE');
  });

  it('integers beyond 2^53 (decoded as bigints)', () => {
    const bytes = Buffer.concat([Buffer.from([0x82, 0xa2, 0x69, 0x64, 0xcf]), Buffer.alloc(8, 0xff), Buffer.from([0xa2, 0x6f, 0x70, 0xa5]), Buffer.from('stats')]);
    expect(decodeMessage(bytes)).toEqual({ id: 2n ** 64n - 1n, op: 'stats' });
    const parsed = parseRequest(bytes, limits);
    expect(parsed.error?.code).toBe('TZIP_PROTOCOL');
    expect(parsed.id).toBeNull();
  });

  it('random bytes never throw', () => {
    let seed = 42;
    const rand = () => ((seed = (seed * 1103515245 + 12345) & 0x7fffffff) / 0x7fffffff);
    for (let i = 0; i < 2000; i++) {
      const bytes = Buffer.from(Array.from({ length: 1 + Math.floor(rand() * 64) }, () => Math.floor(rand() * 256)));
      const parsed = parseRequest(bytes, limits);
      expect(parsed.error !== undefined || parsed.request !== undefined).toBe(true);
    }
  });
});

describe('frameLayout', () => {
  it('keeps dtypes with a safetensors twin', () => {
    expect(frameLayout({ code: 4, bits: 16, lanes: 1 }, [3, 4])).toMatchObject({ dtype: 'BF16', shape: [3, 4], nbytes: 24, opaque: false });
    expect(frameLayout({ code: 6, bits: 8, lanes: 1 }, [5])).toMatchObject({ dtype: 'BOOL', nbytes: 5 });
    expect(frameLayout({ code: 10, bits: 8, lanes: 1 }, [5])).toMatchObject({ dtype: 'F8_E4M3' });
    expect(frameLayout({ code: 12, bits: 8, lanes: 1 }, [5])).toMatchObject({ dtype: 'F8_E5M2' });
    expect(frameLayout({ code: 1, bits: 64, lanes: 1 }, [])).toMatchObject({ dtype: 'U64', shape: [], nbytes: 8 });
  });
  it('splits complex numbers into float pairs', () => {
    expect(frameLayout({ code: 5, bits: 64, lanes: 1 }, [3])).toMatchObject({ dtype: 'F32', shape: [3, 2], nbytes: 24 });
    expect(frameLayout({ code: 5, bits: 128, lanes: 1 }, [3])).toMatchObject({ dtype: 'F64', shape: [3, 2] });
    expect(frameLayout({ code: 5, bits: 32, lanes: 1 }, [3])).toMatchObject({ dtype: 'F16', shape: [3, 2] });
  });
  it('carries other types as bytes', () => {
    expect(frameLayout({ code: 14, bits: 8, lanes: 1 }, [4, 4])).toMatchObject({ dtype: 'U8', shape: [16], opaque: true });
    expect(frameLayout({ code: 2, bits: 32, lanes: 4 }, [2])).toMatchObject({ dtype: 'U8', shape: [32], opaque: true });
  });
  it('flattens more than 32 dimensions', () => {
    expect(frameLayout({ code: 2, bits: 32, lanes: 1 }, [...new Array(32).fill(1), 3]).shape).toEqual([3]);
    expect(frameLayout({ code: 5, bits: 64, lanes: 1 }, [...new Array(31).fill(1), 2, 3]).shape).toEqual([12]);
    expect(frameLayout({ code: 2, bits: 32, lanes: 1 }, new Array(32).fill(1)).shape).toHaveLength(32);
  });
  it('refuses sub-byte elements and sizes beyond 2^53', () => {
    expect(() => frameLayout({ code: 17, bits: 4, lanes: 1 }, [2])).toThrow(ReplyError);
    expect(() => frameLayout({ code: 2, bits: 32, lanes: 1 }, [2 ** 26, 2 ** 26])).toThrow(/beyond 2\^53/);
  });
});

describe('isCompactCOrder', () => {
  it('accepts absent and C-order strides, any stride on size-1 dims, anything when empty', () => {
    expect(isCompactCOrder([2, 3], undefined)).toBe(true);
    expect(isCompactCOrder([2, 3], null)).toBe(true);
    expect(isCompactCOrder([2, 3], [3, 1])).toBe(true);
    expect(isCompactCOrder([2, 1, 3], [3, 99, 1])).toBe(true);
    expect(isCompactCOrder([2, 0, 3], [7, 7, 7])).toBe(true);
  });
  it('refuses transposed, strided and mis-ranked strides', () => {
    expect(isCompactCOrder([2, 3], [1, 2])).toBe(false);
    expect(isCompactCOrder([2, 3], [6, 2])).toBe(false);
    expect(isCompactCOrder([2, 3], [3])).toBe(false);
  });
});

describe('checkOverlaps', () => {
  const region = (name: string, start: number, length: number, writable: boolean, index: number): ResolvedRegion =>
    ({ bytes: Buffer.alloc(length), name, start, writable, what: `r${index}`, index });
  it('allows reads that overlap, and disjoint writes', () => {
    expect(() => checkOverlaps([region('a', 0, 100, false, 0), region('a', 50, 100, false, 1), region('a', 200, 10, true, 2), region('b', 0, 100, true, 3)])).not.toThrow();
  });
  it('refuses a write overlapping anything in the same file', () => {
    expect(() => checkOverlaps([region('a', 0, 100, false, 0), region('a', 99, 10, true, 1)])).toThrow(/r1 overlaps r0/);
    expect(() => checkOverlaps([region('a', 0, 1000, false, 0), region('a', 10, 10, true, 1), region('a', 500, 10, false, 2)])).toThrow(ReplyError);
    expect(() => checkOverlaps([region('a', 0, 100, true, 0), region('a', 10, 5, false, 1)])).toThrow(ReplyError);
  });
});

describe('replies', () => {
  it('encode large integers as integers, not floats', () => {
    const bytes = encodeMessage({ id: 1, ok: true, n: 2 ** 40, m: -(2 ** 40), small: 7, f: 0.5, missing: undefined });
    // 2^40 as a 64-bit integer (0xd3 int64 or 0xcf uint64), never as a float64 (0xcb)
    expect(bytes.includes(Buffer.from([0xd3, 0, 0, 1, 0, 0, 0, 0, 0])) || bytes.includes(Buffer.from([0xcf, 0, 0, 1, 0, 0, 0, 0, 0]))).toBe(true);
    expect(decodeMessage(bytes)).toEqual({ id: 1, ok: true, n: 2 ** 40, m: -(2 ** 40), small: 7, f: 0.5 });
  });
  it('map errors to wire errors with their codes', () => {
    expect(toWireError(new ReplyError('TZIP_HANDLE', 'x', { index: 3, need: 10 }))).toEqual({ code: 'TZIP_HANDLE', message: 'x', index: 3, need: 10 });
    expect(toWireError(new TzipError('TZIP_CORRUPT', 'bad'), 2)).toEqual({ code: 'TZIP_CORRUPT', message: 'bad', index: 2 });
    expect(toWireError(Object.assign(new Error('addon'), { code: 'TZIP_CHECKSUM' })).code).toBe('TZIP_CHECKSUM');
    expect(toWireError(new TypeError('oops')).code).toBe('TZIP_INTERNAL');
  });
});
