// One bf16 tensor through a daemon and back over /dev/shm: compress from one file into a second (its capacity the
// codec's bound), decompress into a third; the replies, the frame and the bytes back.
import { readFileSync } from 'node:fs';
import { expect } from 'vitest';
import { maxCompressedSize } from '../../src/native.js';
import { type DaemonConn, shmFile } from './daemon-conn.js';

const BF16 = { code: 4, bits: 16, lanes: 1 };
const CPU = { type: 1, id: 0 };

/** What {@link bf16RoundTrip} saw. */
export interface RoundTrip {
  compress: Record<string, any>;
  decompress: Record<string, any>;
  /** The frame's bytes. */
  frame: Buffer;
  /** Bytes of the frame's file (its capacity: the daemon must not grow it). */
  frameFileBytes: number;
  /** The tensor's bytes back. */
  back: Buffer;
}

/**
 * Compresses `data` (bf16 elements) of session `c` with codec auto and back, `extra` fields on both requests (a
 * stream, an SM budget); the files are named `<prefix><tag>-in|frame|back`. Expects both replies ok.
 */
export async function bf16RoundTrip(c: DaemonConn, data: Buffer, tag: string, extra: Record<string, unknown> = {}): Promise<RoundTrip> {
  const n = data.length / 2;
  const cap = maxCompressedSize(data.length, 1);
  const [inName, outName, backName] = ['in', 'frame', 'back'].map((s) => `${c.prefix}${tag}-${s}`) as [string, string, string];
  shmFile(inName, data.length, data);
  const framePath = shmFile(outName, cap);
  const backPath = shmFile(backName, data.length);
  const tensor = (name: string) => ({ device: CPU, dtype: BF16, shape: [n], byte_offset: 0, data: { kind: 'shm', name, offset: 0, size: data.length } });
  const r = await c.call('compress', { tensors: [{ tensor: tensor(inName), out: { kind: 'shm', name: outName, offset: 0, size: cap } }], codec: 'auto', ...extra });
  expect(r.ok, JSON.stringify(r)).toBe(true);
  const file = readFileSync(framePath);
  const d = await c.call('decompress', { frames: [{ frame: { kind: 'shm', name: outName, offset: 0, size: r.frames[0].bytes }, out: tensor(backName) }], ...extra });
  expect(d.ok, JSON.stringify(d)).toBe(true);
  return { compress: r, decompress: d, frame: file.subarray(0, r.frames[0].bytes), frameFileBytes: file.length, back: readFileSync(backPath) };
}
