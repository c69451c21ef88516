/**
 * The daemon's access to the addon's GPU entry points (src/native.ts; the contract is the addon's
 * GPU API: gpuDevices, gpuCompress, gpuDecompress, CUDA IPC open/close, interprocess events):
 * the GPUs this daemon sees (found once, by UUID), and the mapping of the addon's errors into
 * error replies.
 *
 * An addon built without the GPU functions, or a machine with no driver or no GPU, is a daemon
 * with no GPU: every request naming GPU memory gets TZIP_NO_DEVICE, and the client falls back as
 * for a daemon that is away.
 *
 * The state here is the process's, not a Daemon's, as what it describes is: the addon (one per
 * process, and a test's stand-in replaces it for the process), the GPUs CUDA lets this process
 * see (CUDA_VISIBLE_DEVICES is read once, when CUDA initialises) and the GPUs it holds a CUDA
 * context on (one primary context per process and GPU, kept until the process exits). Two daemons
 * in one process (tests start several) see the same GPUs through the same contexts.
 */
import {
  cudaEventCreateInterprocess,
  cudaEventDestroy,
  cudaIpcCloseMemHandle,
  cudaIpcOpenEventHandle,
  cudaIpcOpenMemHandle,
  cudaMemGetInfo,
  gpuCompress,
  gpuDecompress,
  gpuDevices,
  type GpuDevice,
  type GpuRunOptions,
} from '../native.js';
import { REPLY_ERROR_CODES, ReplyError, type ReplyErrorCode } from './reply-error.js';

export type { GpuDevice, GpuRunOptions };

/** The addon's GPU functions the daemon uses (src/native.ts). */
export interface GpuApi {
  gpuDevices: typeof gpuDevices;
  gpuCompress: typeof gpuCompress;
  gpuDecompress: typeof gpuDecompress;
  cudaIpcOpenMemHandle: typeof cudaIpcOpenMemHandle;
  cudaIpcCloseMemHandle: typeof cudaIpcCloseMemHandle;
  cudaIpcOpenEventHandle: typeof cudaIpcOpenEventHandle;
  cudaEventCreateInterprocess: typeof cudaEventCreateInterprocess;
  cudaEventDestroy: typeof cudaEventDestroy;
  /** Free and total memory of a device (absent in a test's stand-in: memory then reads as unknown). */
  cudaMemGetInfo?: typeof cudaMemGetInfo;
}

const ADDON: GpuApi = {
  gpuDevices, gpuCompress, gpuDecompress, cudaIpcOpenMemHandle, cudaIpcCloseMemHandle, cudaIpcOpenEventHandle,
  cudaEventCreateInterprocess, cudaEventDestroy, cudaMemGetInfo,
};

/** A test's stand-in for the addon's GPU functions (per process, as the addon it replaces). */
let override: GpuApi | null | undefined;

/** The GPU functions (the addon's, or a test's stand-in; null: a test's daemon without GPU support). */
export function gpuApi(): GpuApi | null {
  return override !== undefined ? override : ADDON;
}

/**
 * For tests: serve GPU requests with `api` (a stand-in for the addon; null: none) instead of the
 * addon's functions, or with the addon's again (undefined). The GPU inventory is asked again.
 */
export function useGpuApiForTests(api: GpuApi | null | undefined): void {
  override = api;
  resetGpuInventory();
}

/** The GPUs this daemon serves, found once. */
export interface GpuInventory {
  devices: GpuDevice[];
  /** Why there are none (empty when there are). */
  reason: string;
}

/** The GPUs this process sees (per process: CUDA's device list is the process's). */
let inventory: GpuInventory | undefined;
/**
 * Ordinals of the UUID strings requests have named (as sent), filled by {@link ordinalOf}: one lookup per tensor
 * (derived from {@link inventory}, so per process as it is).
 */
const ordinals = new Map<string, number>();

/** Lower-case UUID without its 'GPU-' / 'MIG-' prefix: how UUIDs are compared. */
export function normalizeUuid(uuid: string): string {
  return uuid.trim().toLowerCase().replace(/^(gpu|mig)-/, '');
}

/** The GPUs the addon sees (asked once per daemon; never throws). */
export function gpuInventory(): GpuInventory {
  if (inventory !== undefined) return inventory;
  const api = gpuApi();
  if (api === null) {
    inventory = { devices: [], reason: 'this build of the tzip daemon has no GPU support in its native addon' };
    return inventory;
  }
  try {
    const devices = api.gpuDevices();
    inventory = { devices, reason: devices.length === 0 ? 'no CUDA driver or no GPU visible to the daemon' : '' };
  } catch (err) {
    inventory = { devices: [], reason: `the GPUs could not be listed: ${err instanceof Error ? err.message : String(err)}` };
  }
  return inventory;
}

/** For tests: forget the inventory (the next call asks the addon again). */
export function resetGpuInventory(): void {
  inventory = undefined;
  ordinals.clear();
  usedOrdinals.clear();
}

/**
 * Ordinals of the GPUs a request has run on: the process holds a CUDA context on these (per process: the primary
 * context is the process's, whichever daemon's request made it).
 */
const usedOrdinals = new Set<number>();

/** Notes that a request runs on GPU `ordinal` (so that {@link gpuMemory} may ask its memory without making a context). */
export function noteGpuUsed(ordinal: number): void {
  usedOrdinals.add(ordinal);
}

/** One GPU's memory, device-wide (every process's allocations), bytes. */
export interface GpuMemory {
  uuid: string;
  name: string;
  /** Null until a request has run on the GPU: asking CUDA earlier would make the daemon a context there (hundreds of MB). */
  memoryUsedBytes: number | null;
  memoryTotalBytes: number;
}

/** Memory of every GPU the daemon serves (cudaMemGetInfo; never throws: unknown is null). */
export function gpuMemory(): GpuMemory[] {
  const api = gpuApi();
  return gpuInventory().devices.map((d) => {
    let used: number | null = null;
    let total = d.totalMemory;
    if (usedOrdinals.has(d.ordinal) && api?.cudaMemGetInfo !== undefined) {
      try {
        const m = api.cudaMemGetInfo(d.ordinal);
        used = m.total - m.free;
        total = m.total;
      } catch {
        used = null;
      }
    }
    return { uuid: d.uuid, name: d.name, memoryUsedBytes: used, memoryTotalBytes: total };
  });
}

/**
 * The daemon's ordinal of the GPU named `uuid`.
 * @throws ReplyError TZIP_NO_DEVICE when the daemon has no GPU or does not see this one.
 */
export function ordinalOf(uuid: string, what: string, index: number): number {
  const known = ordinals.get(uuid);
  if (known !== undefined) return known;
  const inv = gpuInventory();
  if (inv.devices.length === 0) {
    throw new ReplyError('TZIP_NO_DEVICE', `${what}: this tzip daemon has no usable GPU (${inv.reason}); GPU tensors cannot be served`, { index });
  }
  const want = normalizeUuid(uuid);
  const found = inv.devices.find((d) => normalizeUuid(d.uuid) === want);
  if (found === undefined) {
    throw new ReplyError('TZIP_NO_DEVICE',
      `${what}: GPU ${uuid} is not visible to this tzip daemon (it sees ${inv.devices.map((d) => d.uuid).join(', ')}); ` +
      'start the daemon where that GPU is visible (CUDA_VISIBLE_DEVICES)', { index });
  }
  if (ordinals.size < 64) ordinals.set(uuid, found.ordinal);
  return found.ordinal;
}

/**
 * An error of the addon's GPU functions as a reply: an error that carries a code of the protocol
 * (the codec's TZIP_CORRUPT, TZIP_CHECKSUM, ..., the addon's TZIP_CUDA) keeps it, anything else
 * gets `fallback`; the message is kept, prefixed with `what`.
 */
export function gpuReplyError(err: unknown, what: string, index: number | undefined, fallback: ReplyErrorCode = 'TZIP_INTERNAL'): ReplyError {
  if (err instanceof ReplyError) return new ReplyError(err.code, `${what}: ${err.message}`, { ...err.extra, index: err.extra.index ?? index });
  const code = err instanceof Error ? (err as { code?: unknown }).code : undefined;
  const message = err instanceof Error ? err.message : String(err);
  const known = typeof code === 'string' && (REPLY_ERROR_CODES as readonly string[]).includes(code);
  return new ReplyError(known ? (code as ReplyErrorCode) : fallback, `${what}: ${message}`, { index });
}
