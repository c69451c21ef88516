/**
 * What the compress and decompress paths share, CPU and GPU alike (op-compress.ts, op-decompress.ts, op-gpu.ts): the
 * per-item results of a reply, the checks of a frame against its memory and destination, and the byte count of a
 * compress batch. A leaf: it imports no op module, so the three import it and only op-compress/op-decompress import
 * op-gpu (the choice between the CPU and the GPU path is theirs).
 */
import type { FrameHeader } from '../native.js';
import type { FrameLayout } from './dtype-map.js';
import { ReplyError } from './reply-error.js';
import type { RequestTally } from './tally.js';

/** One frame of the reply. */
export interface FrameResult {
  /** Length of the frame written at the start of the output region, bytes. */
  bytes: number;
  /** Codec the frame records ('auto' resolved). */
  codec: string;
  /** The frame's dtype and shape (docs/protocol.md, "Tensors and frames"). */
  dtype: string;
  shape: number[];
}

/** One tensor of the reply: what the frame said. */
export interface TensorResult {
  nbytes: number;
  dtype: string;
  shape: number[];
  codec: string;
}

function sameShape(a: readonly number[], b: readonly number[]): boolean {
  return a.length === b.length && a.every((d, i) => d === b[i]);
}

/**
 * Checks that frame `i`'s header gives the size of the memory its handle gives (bytes).
 * Shared by the CPU path and the GPU path (op-gpu.ts).
 * @throws ReplyError TZIP_INVALID_ARGUMENT naming the frame.
 */
export function checkFrameSize(i: number, header: FrameHeader, handleBytes: number): void {
  if (header.frameBytes !== handleBytes) {
    throw new ReplyError('TZIP_INVALID_ARGUMENT', `frame ${i}: the handle gives ${handleBytes} bytes, the frame is ${header.frameBytes}`, { index: i });
  }
}

/**
 * Checks frame `i`'s header against its destination's layout: dtype, shape and nbytes must be the
 * frame's (docs/protocol.md "Tensors and frames"). Shared by the CPU and GPU paths.
 * @throws ReplyError TZIP_INVALID_ARGUMENT naming the frame.
 */
export function checkFrameDestination(i: number, header: FrameHeader, out: FrameLayout): void {
  if (out.dtype !== header.dtype || !sameShape(out.shape, header.shape) || out.nbytes !== header.nbytes) {
    throw new ReplyError('TZIP_INVALID_ARGUMENT',
      `frame ${i} holds ${header.dtype} [${header.shape.join(', ')}] (${header.nbytes} bytes); the destination is ${out.dtype} [${out.shape.join(', ')}] (${out.nbytes} bytes)`,
      { index: i });
  }
}

/**
 * Adds a compress batch to the request's account and the daemon's counters: its tensors' bytes in, its frames' bytes
 * out. Shared by the CPU path and the GPU path.
 */
export function countCompressed(tally: RequestTally, plans: readonly { input: { layout: { nbytes: number } } }[], frames: readonly FrameResult[]): void {
  let inBytes = 0;
  let outBytes = 0;
  for (let i = 0; i < plans.length; i++) {
    inBytes += (plans[i] as (typeof plans)[number]).input.layout.nbytes;
    outBytes += (frames[i] as FrameResult).bytes;
  }
  tally.coded('compress', plans.length, inBytes, outBytes);
}
