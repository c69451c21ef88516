// The container's XXH32 (src/container.ts): the JavaScript implementation that hashes headers and indexes up to 1 MiB
// gives xxhash-wasm's digest for every length and alignment, and xxh32() gives it on both sides of the 1 MiB switch.
import fc from 'fast-check';
import xxhash from 'xxhash-wasm';
import { describe, expect, it } from 'vitest';
import { xxh32, xxh32Small } from '../src/container.js';

describe('xxh32', () => {
  it('matches the reference digests of the XXH32 specification', () => {
    expect(xxh32Small(new Uint8Array(0))).toBe(0x02cc5d05);
    expect(xxh32Small(Buffer.from('a'))).toBe(0x550d7456);
    expect(xxh32Small(Buffer.from('abc'))).toBe(0x32d153ff);
  });

  it('equals xxhash-wasm for every length up to 300 bytes and any byte offset', async () => {
    const wasm = await xxhash();
    fc.assert(fc.property(fc.uint8Array({ maxLength: 300 }), fc.integer({ min: 0, max: 7 }), (bytes, offset) => {
      const shifted = new Uint8Array(bytes.byteLength + offset);
      shifted.set(bytes, offset);
      const view = shifted.subarray(offset);
      expect(xxh32Small(view)).toBe(wasm.h32Raw(view, 0) >>> 0);
    }), { numRuns: 2000 });
  });

  it('xxh32() equals xxhash-wasm below, at and above 1 MiB', async () => {
    const wasm = await xxhash();
    for (const n of [65536, (1 << 20) - 1, 1 << 20, (1 << 20) + 7, 3_000_001]) {
      const bytes = new Uint8Array(n);
      for (let i = 0; i < n; i++) bytes[i] = (i * 2654435761) >>> 24;
      expect(await xxh32(bytes)).toBe(wasm.h32Raw(bytes, 0) >>> 0);
    }
  });
});
