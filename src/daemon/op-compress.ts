/**
 * `compress`: a batch of tensors in the client's shared memory (GPU memory: op-gpu.ts), each coded into one frame written
 * into an output region the client gave (sized at least maxCompressedSize of the tensor); the
 * reply says each frame's length and codec.
 *
 * Every handle of the batch is checked before any work starts; then all tensors are coded
 * concurrently (on the addon's worker threads) and the reply waits for all of them, so nothing
 * writes into the client's memory after the reply. The first failing tensor (by index) is the
 * error reply.
 */
import type { Codec } from '../native.js';
import { compress, maxCompressedSize, readHeader } from '../native.js';
import { runsInline, type DaemonLimits } from './limits.js';
import { tensorOnGpu } from './gpu-regions.js';
import { handleGpuCompress } from './op-gpu.js';
import { countCompressed, type FrameResult } from './op-results.js';
import { checkNotShrunk, checkOverlaps, resolveHandle, resolveTensor, type ResolvedRegion } from './regions.js';
import { ReplyError, toWireError } from './reply-error.js';
import type { CompressRequest } from './schema.js';
import type { AppliedSettings } from './jobs.js';
import type { Session } from './session.js';
import type { RequestTally } from './tally.js';

/**
 * Handles a validated compress request of `session` (GPU memory: op-gpu.ts) with the job's `settings`: their codec,
 * when set, for every tensor (jobs.ts).
 */
export async function handleCompress(req: CompressRequest, session: Session, limits: DaemonLimits, tally: RequestTally,
  settings: AppliedSettings): Promise<{ frames: FrameResult[]; event_handle?: Buffer }> {
  if (req.tensors.length > limits.maxBatch) {
    throw new ReplyError('TZIP_TOO_LARGE', `batch of ${req.tensors.length} tensors is above the cap of ${limits.maxBatch}`);
  }
  if (req.tensors.some((item) => tensorOnGpu(item.tensor) || item.out.kind === 'cuda_ipc')) {
    tally.device = 'gpu';
    return handleGpuCompress(req, session, tally, settings);
  }
  tally.device = 'cpu';
  const epoch = session.nextEpoch();
  let unreserve: (() => void) | undefined;
  try {
    const plans = req.tensors.map((item, i) => {
      const input = resolveTensor(session, item.tensor, false, `tensor ${i}`, i, epoch);
      const out = resolveHandle(session, item.out, true, `output of tensor ${i}`, i, epoch);
      const need = maxCompressedSize(input.layout.nbytes, input.layout.shape.length, req.chunk_size);
      if (out.bytes.length < need) {
        throw new ReplyError('TZIP_HANDLE', `output of tensor ${i}: region of ${out.bytes.length} bytes is smaller than maxCompressedSize ${need}`, { index: i, need });
      }
      return { input, out, codec: settings.codec ?? ((item.codec ?? req.codec ?? 'auto') as Codec) };
    });
    const regions: ResolvedRegion[] = [];
    for (const p of plans) regions.push(p.input.region, p.out);
    checkOverlaps(regions);
    const bytes = plans.reduce((n, p) => n + p.input.layout.nbytes, 0);
    unreserve = session.reserveBytes(bytes);

    const inline = runsInline(limits, plans.length, bytes);
    const settled = await Promise.allSettled(plans.map(async (p) => {
      const frame = await compress(p.input.region.bytes, {
        inline,
        dtype: p.input.layout.dtype,
        shape: p.input.layout.shape,
        codec: p.codec,
        threads: req.threads ?? limits.threads,
        chunkSize: req.chunk_size,
        out: p.out.bytes,
      });
      return { bytes: frame.length, codec: readHeader(frame).codec, dtype: p.input.layout.dtype, shape: p.input.layout.shape };
    }));
    checkNotShrunk(session, regions);
    const frames: FrameResult[] = [];
    for (let i = 0; i < settled.length; i++) {
      const s = settled[i] as PromiseSettledResult<FrameResult>;
      if (s.status === 'rejected') {
        const wire = toWireError(s.reason, i);
        throw new ReplyError(wire.code, `tensor ${i}: ${wire.message}`, { index: i });
      }
      frames.push(s.value);
    }
    countCompressed(tally, plans, frames);
    return { frames };
  } finally {
    unreserve?.();
    // The files of this request may be dropped to make room again (shm-map.ts).
    session.mappings.endRequest(epoch);
  }
}
