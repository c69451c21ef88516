/**
 * Whether the daemon's CUDA work goes through an MPS server (NVIDIA's Multi-Process Service), as far as the
 * environment tells: the CUDA driver of a process connects to the MPS control daemon whose pipes are in
 * `$CUDA_MPS_PIPE_DIRECTORY` (default /tmp/nvidia-mps) when it starts, and runs as an MPS client if it answers, else
 * without MPS (NVIDIA's MPS documentation, "CUDA_MPS_PIPE_DIRECTORY" and nvidia-cuda-mps-control(1)). So: a daemon
 * with no GPU cannot tell (null); with GPUs, it is an MPS client when the control daemon's `control` pipe exists in
 * that folder. The addon offers no query of its own (CUDA 12's cudaDevAttrMpsEnabled would be one: docs/protocol.md).
 */
import { statSync } from 'node:fs';
import { join } from 'node:path';

/** The folder of the MPS control daemon's pipes this process's CUDA would use. */
export function mpsPipeDirectory(env: NodeJS.ProcessEnv = process.env): string {
  const dir = env.CUDA_MPS_PIPE_DIRECTORY;
  return dir !== undefined && dir !== '' ? dir : '/tmp/nvidia-mps';
}

/**
 * Whether this daemon is an MPS client: null without a GPU (nothing to tell), else whether the MPS control daemon's
 * `control` pipe exists in {@link mpsPipeDirectory}. Never throws.
 */
export function daemonUsesMps(hasGpu: boolean, env: NodeJS.ProcessEnv = process.env): boolean | null {
  if (!hasGpu) return null;
  try {
    const st = statSync(join(mpsPipeDirectory(env), 'control'));
    return st.isFIFO() || st.isSocket();
  } catch {
    return false;
  }
}

/** Whether a client and the daemon share an MPS server: both MPS clients; false when either is not; null when either cannot tell. */
export function sharesMps(client: boolean | null, daemon: boolean | null): boolean | null {
  if (client === false || daemon === false) return false;
  if (client === null || daemon === null) return null;
  return true;
}
