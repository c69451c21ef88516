/**
 * `decompress`: a batch of frames in the client's shared memory (GPU memory: op-gpu.ts), each decoded into a destination
 * tensor the client described (dtype and shape must be the frame's, per the rules of
 * docs/protocol.md "Tensors and frames"); the codec writes straight into the client's memory.
 *
 * All handles and headers are checked first; the reply waits for every frame (nothing is written
 * after it). The first failing frame (by index) is the error reply.
 */
import { decompress, readHeader, type FrameHeader } from '../native.js';
import { runsInline, type DaemonLimits } from './limits.js';
import { tensorOnGpu } from './gpu-regions.js';
import { handleGpuDecompress } from './op-gpu.js';
import { checkFrameDestination, checkFrameSize, type TensorResult } from './op-results.js';
import { checkNotShrunk, checkOverlaps, resolveHandle, resolveTensor, type ResolvedRegion } from './regions.js';
import { ReplyError, toWireError } from './reply-error.js';
import type { DecompressRequest } from './schema.js';
import type { AppliedSettings } from './jobs.js';
import type { Session } from './session.js';
import type { RequestTally } from './tally.js';

/**
 * Handles a validated decompress request of `session` (GPU memory: op-gpu.ts) with the job's `settings` (their SM
 * budget on a GPU; a codec setting does not apply: a frame records its codec).
 */
export async function handleDecompress(req: DecompressRequest, session: Session, limits: DaemonLimits, tally: RequestTally,
  settings: AppliedSettings): Promise<{ tensors: TensorResult[]; event_handle?: Buffer }> {
  if (req.frames.length > limits.maxBatch) {
    throw new ReplyError('TZIP_TOO_LARGE', `batch of ${req.frames.length} frames is above the cap of ${limits.maxBatch}`);
  }
  if (req.frames.some((item) => item.frame.kind === 'cuda_ipc' || tensorOnGpu(item.out))) {
    tally.device = 'gpu';
    return handleGpuDecompress(req, session, tally, settings);
  }
  tally.device = 'cpu';
  const epoch = session.nextEpoch();
  let unreserve: (() => void) | undefined;
  try {
    const plans = req.frames.map((item, i) => {
      const frame = resolveHandle(session, item.frame, false, `frame ${i}`, i, epoch);
      let header: FrameHeader;
      try {
        header = readHeader(frame.bytes);
      } catch (err) {
        const wire = toWireError(err, i);
        throw new ReplyError(wire.code, `frame ${i}: ${wire.message}`, { index: i });
      }
      checkFrameSize(i, header, frame.bytes.length);
      const out = resolveTensor(session, item.out, true, `destination of frame ${i}`, i, epoch);
      checkFrameDestination(i, header, out.layout);
      return { frame, header, out };
    });
    const regions: ResolvedRegion[] = [];
    for (const p of plans) regions.push(p.frame, p.out.region);
    checkOverlaps(regions);
    const bytes = plans.reduce((n, p) => n + p.header.nbytes, 0);
    unreserve = session.reserveBytes(bytes);

    const inline = runsInline(limits, plans.length, bytes);
    const settled = await Promise.allSettled(plans.map((p) =>
      decompress(p.frame.bytes, { out: p.out.region.bytes, verify: req.verify ?? true, threads: req.threads ?? limits.threads, inline })));
    checkNotShrunk(session, regions);
    for (let i = 0; i < settled.length; i++) {
      const s = settled[i] as PromiseSettledResult<unknown>;
      if (s.status === 'rejected') {
        const wire = toWireError(s.reason, i);
        throw new ReplyError(wire.code, `frame ${i}: ${wire.message}`, { index: i });
      }
    }
    let inBytes = 0;
    let outBytes = 0;
    for (const p of plans) {
      inBytes += p.frame.bytes.length;
      outBytes += p.header.nbytes;
    }
    tally.coded('decompress', plans.length, inBytes, outBytes);
    return { tensors: plans.map((p) => ({ nbytes: p.header.nbytes, dtype: p.header.dtype, shape: p.header.shape, codec: p.header.codec })) };
  } finally {
    unreserve?.();
    // The files of this request may be dropped to make room again (shm-map.ts).
    session.mappings.endRequest(epoch);
  }
}
