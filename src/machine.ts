/**
 * A description of the machine a measurement ran on (for benchmark and demo reports), from
 * node:os and the addon's gpu().
 */
import os from 'node:os';
import { addonAvailable, gpu } from './native.js';

/** The machine a report was made on. */
export interface MachineInfo {
  /** CPU model string of the first core (os.cpus()). */
  cpuModel: string;
  /** Logical cores (os.cpus().length). */
  cores: number;
  /** Cores this process may use (os.availableParallelism()). */
  availableParallelism: number;
  /** Physical memory in bytes. */
  memoryBytes: number;
  platform: string;
  arch: string;
  nodeVersion: string;
  /** GPU status from the addon (undefined when the addon is not built). */
  gpu: string | undefined;
}

/** Gathers {@link MachineInfo} for this process. */
export function machineInfo(): MachineInfo {
  const cpus = os.cpus();
  let gpuText: string | undefined;
  if (addonAvailable()) {
    const g = gpu();
    gpuText = g.available ? g.devices.map((d) => `${d.name} (${d.sms} SMs)`).join(', ') : `none (${g.reason})`;
  }
  return {
    cpuModel: cpus[0]?.model.trim() ?? 'unknown',
    cores: cpus.length,
    availableParallelism: os.availableParallelism(),
    memoryBytes: os.totalmem(),
    platform: os.platform(),
    arch: os.arch(),
    nodeVersion: process.version,
    gpu: gpuText,
  };
}

/** One line: "CPU: <model>, <n> cores, <m> GB RAM, linux x64, Node v20, GPU: ...". */
export function describeMachine(m: MachineInfo): string {
  return `CPU: ${m.cpuModel}, ${m.cores} cores (${m.availableParallelism} usable), ${(m.memoryBytes / 1e9).toFixed(1)} GB RAM, ` +
    `${m.platform} ${m.arch}, Node ${m.nodeVersion}, GPU: ${m.gpu ?? 'unknown (addon not built)'}`;
}
