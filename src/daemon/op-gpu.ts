/**
 * `compress` and `decompress` of tensors in a client's GPU memory (CUDA IPC handles).
 *
 * One request, one GPU, one addon batch: every handle is checked and opened first (cached per
 * session), then the addon's stream waits on the client's interprocess event (`wait_event`, recorded
 * by the client after it wrote the inputs), runs the whole batch, and records the session's own
 * interprocess event, whose handle goes back in the reply (`event_handle`) for the client's stream
 * to wait on. The addon resolves once the work has finished, so nothing is written into the
 * client's memory after the reply.
 *
 * What the reply needs of the frames comes back from the addon with the batch's results, in the
 * one device-to-host copy of the call: the codec each frame records (an `auto` float frame's is
 * chosen on the device) and, for a decompress, every frame's header (checked against its
 * destination after the decode, as the destination is scratch until the reply says otherwise).
 */
import type { Codec, FrameCodec, FrameHeader, GpuCompressed } from '../native.js';
import { maxCompressedSize } from '../native.js';
import { gpuApi, gpuReplyError, noteGpuUsed, type GpuApi, type GpuRunOptions } from './gpu.js';
import { expectGpu, GpuRequest } from './gpu-regions.js';
import type { DaemonLimits } from './limits.js';
import { checkFrameDestination, checkFrameSize, countCompressed, type FrameResult, type TensorResult } from './op-results.js';
import { checkOverlaps, type Extent } from './regions.js';
import { ReplyError } from './reply-error.js';
import type { CompressRequest, DecompressRequest } from './schema.js';
import type { AppliedSettings } from './jobs.js';
import type { Session } from './session.js';
import type { RequestTally } from './tally.js';

/**
 * The codec of a GPU compress request that names none (no `codec` on the tensor or the request): `fast`, the codec
 * that comes nearest to a network link's pace on the GPU. `auto` must stay a pure function of the data (the CPU and the
 * GPU write the same bytes), so it cannot weigh speed, and on bf16 weights it picks `max`, which encodes at 2.3 GB/s on
 * 10 H200 SMs against `fast`'s 81 GB/s for 6% more bytes (docs/benchmarks.md, "GPU encoder at memory speed"). The
 * Python client applies the same rule (python-bridge/tzip/_codec_choice.py); CPU requests keep `auto`.
 */
export const GPU_DEFAULT_CODEC: Codec = 'fast';

/** Frame dtypes whose `fast`/`max` codecs split the float (others are coded as `bytes`). */
const SPLIT_FLOATS: ReadonlySet<string> = new Set(['BF16', 'F16', 'F32']);

/**
 * The codec a frame records for the codec asked (as the codec resolves it: docs/format.md), or
 * null when only the frame can tell (`auto` on a float tensor picks `fast` or `max` by the data).
 */
export function recordedCodec(asked: Codec, dtype: string, nbytes: number): FrameCodec | null {
  const split = SPLIT_FLOATS.has(dtype);
  if (asked === 'auto') return !split ? 'bytes' : nbytes === 0 ? 'fast' : null;
  if ((asked === 'fast' || asked === 'max') && !split) return 'bytes';
  return asked;
}

function api(): GpuApi {
  const a = gpuApi();
  if (a === null) throw new ReplyError('TZIP_NO_DEVICE', 'this build of the tzip daemon has no GPU support in its native addon');
  return a;
}

/** Run options without undefined fields (the addon reads what is there). */
function runOptions(device: number, extra: { smBudget: number | undefined; chunkSize?: number | undefined; verify?: boolean | undefined; waitEvent?: bigint | undefined; recordEvent: bigint }): GpuRunOptions {
  const opts: GpuRunOptions = { device, recordEvent: extra.recordEvent };
  if (extra.smBudget !== undefined) opts.smBudget = extra.smBudget;
  if (extra.chunkSize !== undefined) opts.chunkSize = extra.chunkSize;
  if (extra.verify !== undefined) opts.verify = extra.verify;
  if (extra.waitEvent !== undefined) opts.waitEvent = extra.waitEvent;
  return opts;
}

/** The error of a failed addon batch, at the first failing item when the addon says which. */
function batchError(err: unknown, noun: 'tensor' | 'frame'): ReplyError {
  const items = (err as { itemErrors?: unknown } | null)?.itemErrors;
  let index: number | undefined;
  if (Array.isArray(items)) {
    const i = items.findIndex((e) => typeof e === 'string' && e !== '');
    if (i >= 0) index = i;
  }
  return gpuReplyError(err, index !== undefined ? `${noun} ${index}` : `GPU ${noun === 'tensor' ? 'compress' : 'decompress'}`, index);
}

/** What one GPU batch runs with: the addon, the device, the client's event to wait on, the session's own event. */
interface GpuRun {
  gpu: GpuApi;
  device: number;
  waitEvent: bigint | undefined;
  own: { event: bigint; handle: Buffer };
}

/**
 * Runs `body` for a request whose handles `r` has opened: checks that none of the batch's regions
 * overlap, keeps the request's allocations marked in use until `body` settles, and opens the
 * client's `wait_event` and the session's own event on the request's device.
 * @throws ReplyError TZIP_INVALID_ARGUMENT (overlapping regions), TZIP_NO_DEVICE (no GPU support),
 *   TZIP_HANDLE (an event handle CUDA cannot open); and whatever `body` throws.
 */
async function runGpuBatch<T>(r: GpuRequest, extents: Extent[], waitEventHandle: Uint8Array | null | undefined,
  body: (run: GpuRun) => Promise<T>): Promise<T> {
  checkOverlaps(extents);
  const device = r.device as number;
  const gpu = api();
  noteGpuUsed(device);
  const keys = [...r.keys];
  r.state.begin(keys);
  try {
    const waitEvent = waitEventHandle !== undefined && waitEventHandle !== null ? r.state.clientEvent(waitEventHandle, device) : undefined;
    return await body({ gpu, device, waitEvent, own: r.state.ownEvent(device) });
  } finally {
    r.state.end(keys);
  }
}

/**
 * Handles a validated compress request whose tensors are in GPU memory: frames written into the
 * clients' output handles, their sizes (bytes) and codecs in the reply.
 * @throws ReplyError TZIP_HANDLE (a handle that is not the session's or that CUDA cannot open),
 *   TZIP_NO_DEVICE (no GPU, or not this one by UUID), TZIP_INVALID_ARGUMENT (CPU and GPU memory
 *   or two GPUs in one request; an output smaller than the frame bound), TZIP_UNSUPPORTED
 *   (expandable segments), TZIP_TOO_LARGE, TZIP_CUDA, TZIP_INTERNAL; TZIP_CORRUPT (with the tensor's
 *   index) when the frame read back records a codec the encoder cannot have written: the output's
 *   memory was changed during the call.
 */
export async function handleGpuCompress(req: CompressRequest, session: Session, tally: RequestTally, settings: AppliedSettings): Promise<{ frames: FrameResult[]; event_handle: Buffer }> {
  req.tensors.forEach((item, i) => {
    expectGpu(item.tensor, `tensor ${i}`, i);
    expectGpu(item.out, `output of tensor ${i}`, i);
  });
  const r = new GpuRequest(session);
  let unreserve: (() => void) | undefined;
  try {
    const plans = req.tensors.map((item, i) => {
      const input = r.tensor(item.tensor, false, `tensor ${i}`, i);
      const out = r.handle(item.out, true, `output of tensor ${i}`, i);
      const need = maxCompressedSize(input.layout.nbytes, input.layout.shape.length, req.chunk_size);
      if (out.size < need) {
        throw new ReplyError('TZIP_HANDLE', `output of tensor ${i}: region of ${out.size} bytes is smaller than maxCompressedSize ${need}`, { index: i, need });
      }
      return { input, out, codec: settings.codec ?? ((item.codec ?? req.codec ?? GPU_DEFAULT_CODEC) as Codec), need };
    });
    const extents: Extent[] = [];
    for (const p of plans) extents.push(p.input.extent, p.out.extent);
    unreserve = session.reserveBytes(plans.reduce((n, p) => n + p.input.layout.nbytes, 0));
    return await runGpuBatch(r, extents, req.wait_event, async ({ gpu, device, waitEvent, own }) => {
      let written: GpuCompressed[];
      try {
        written = await gpu.gpuCompress(plans.map((p) => ({
          data: p.input.ptr,
          nbytes: p.input.layout.nbytes,
          dtype: p.input.layout.dtype,
          codec: p.codec,
          shape: p.input.layout.shape,
          frame: p.out.ptr,
          frameCapacity: p.out.size,
        })), runOptions(device, { smBudget: settings.smBudget, chunkSize: req.chunk_size, waitEvent, recordEvent: own.event }));
      } catch (err) {
        throw batchError(err, 'tensor');
      }
      if (written.length !== plans.length) {
        throw new ReplyError('TZIP_INTERNAL', `the GPU codec reported ${written.length} frames for ${plans.length} tensors`);
      }
      const frames = plans.map((p, i): FrameResult => {
        const w = written[i] as GpuCompressed;
        const bytes = Number(w.frameBytes);
        if (!Number.isSafeInteger(bytes) || bytes <= 0 || bytes > p.need) {
          throw new ReplyError('TZIP_INTERNAL', `tensor ${i}: the GPU codec reported a frame of ${String(w.frameBytes)} bytes (at most ${p.need} expected)`, { index: i });
        }
        // The codec the frame records must be what the codec asked resolves to (only `auto` on a float tensor is the
        // device's choice, between fast and max).
        const expected = recordedCodec(p.codec, p.input.layout.dtype, p.input.layout.nbytes);
        const ok = expected !== null ? w.codec === expected : w.codec === 'fast' || w.codec === 'max';
        if (!ok) {
          throw new ReplyError('TZIP_INTERNAL', `tensor ${i}: the GPU codec reported codec '${String(w.codec)}' for codec '${p.codec}' on ${p.input.layout.dtype}`, { index: i });
        }
        return { bytes, codec: w.codec, dtype: p.input.layout.dtype, shape: p.input.layout.shape };
      });
      countCompressed(tally, plans, frames);
      return { frames, event_handle: own.handle };
    });
  } finally {
    unreserve?.();
    r.finish();
  }
}

/**
 * Handles a validated decompress request whose frames and destinations are in GPU memory: each
 * frame decoded into its destination handle, checked against the destination's dtype and shape.
 * @throws ReplyError TZIP_HANDLE, TZIP_NO_DEVICE, TZIP_INVALID_ARGUMENT (frame and destination
 *   disagree), TZIP_CORRUPT / TZIP_TRUNCATED / TZIP_CHECKSUM / TZIP_UNSUPPORTED (the frame, with
 *   its index), TZIP_TOO_LARGE, TZIP_CUDA, TZIP_INTERNAL.
 */
export async function handleGpuDecompress(req: DecompressRequest, session: Session, tally: RequestTally, settings: AppliedSettings): Promise<{ tensors: TensorResult[]; event_handle: Buffer }> {
  req.frames.forEach((item, i) => {
    expectGpu(item.frame, `frame ${i}`, i);
    expectGpu(item.out, `destination of frame ${i}`, i);
  });
  const r = new GpuRequest(session);
  let unreserve: (() => void) | undefined;
  try {
    const plans = req.frames.map((item, i) => {
      const frame = r.handle(item.frame, false, `frame ${i}`, i);
      const out = r.tensor(item.out, true, `destination of frame ${i}`, i);
      return { frame, out };
    });
    const extents: Extent[] = [];
    for (const p of plans) extents.push(p.frame.extent, p.out.extent);
    unreserve = session.reserveBytes(plans.reduce((n, p) => n + p.out.layout.nbytes, 0));
    return await runGpuBatch(r, extents, req.wait_event, async ({ gpu, device, waitEvent, own }) => {
      let headers: FrameHeader[];
      try {
        headers = await gpu.gpuDecompress(plans.map((p) => ({
          frame: p.frame.ptr,
          frameBytes: p.frame.size,
          out: p.out.ptr,
          outBytes: p.out.layout.nbytes,
        })), runOptions(device, { smBudget: settings.smBudget, verify: req.verify ?? true, waitEvent, recordEvent: own.event }));
      } catch (err) {
        throw batchError(err, 'frame');
      }
      if (headers.length !== plans.length) {
        throw new ReplyError('TZIP_INTERNAL', `the GPU codec returned ${headers.length} frame headers for ${plans.length} frames`);
      }
      // The addon read every frame's header back after the decode (in the call's one copy of its
      // results): check them against their destinations as the CPU path does before decoding (the
      // outputs are scratch).
      const tensors = plans.map((p, i): TensorResult => {
        const header = headers[i] as FrameHeader;
        checkFrameSize(i, header, p.frame.size);
        checkFrameDestination(i, header, p.out.layout);
        return { nbytes: header.nbytes, dtype: header.dtype, shape: header.shape, codec: header.codec };
      });
      let inBytes = 0;
      let outBytes = 0;
      for (const p of plans) {
        inBytes += p.frame.size;
        outBytes += p.out.layout.nbytes;
      }
      tally.coded('decompress', plans.length, inBytes, outBytes);
      return { tensors, event_handle: own.handle };
    });
  } finally {
    unreserve?.();
    r.finish();
  }
}
