/**
 * One job as the `jobs` op lists it (docs/protocol.md, "Jobs"): who runs it, its sessions, ranks and devices, whether
 * it is attached and shares the daemon's MPS server, its effective settings and overrides, and its traffic per stream
 * with totals (ratio: compressed over original, lower is better).
 */
import { wireSettings, type Job, type JobRegistry } from './jobs.js';
import { sharesMps } from './mps.js';
import { STREAMS } from './schema.js';

export function wireJob(jobs: JobRegistry, job: Job, daemonMps: boolean | null): object {
  const streams: Record<string, unknown> = {};
  let original = 0;
  let coded = 0;
  let seconds = 0;
  let requests = 0;
  let errors = 0;
  for (const name of STREAMS) {
    const s = job.streams[name];
    const dir = (d: typeof s.compress) => ({ requests: d.requests, items: d.items, bytes_in: d.bytesIn, bytes_out: d.bytesOut, seconds: d.seconds });
    streams[name] = { compress: dir(s.compress), decompress: dir(s.decompress), errors: s.errors };
    original += s.compress.bytesIn + s.decompress.bytesOut;
    coded += s.compress.bytesOut + s.decompress.bytesIn;
    seconds += s.compress.seconds + s.decompress.seconds;
    requests += s.compress.requests + s.decompress.requests;
    errors += s.errors;
  }
  const ranks = [...job.ranks].sort((a, b) => a - b);
  const attachedAt = job.attachedAt;
  return {
    name: job.name,
    user: jobs.userOf(job),
    state: job.sessions.size > 0 ? 'running' : 'ended',
    ended_at_ms: job.endedAt,
    pids: [...job.pids],
    sessions: job.sessions.size,
    devices: [...job.devices],
    ...(ranks.length === 1 ? { rank: ranks[0] } : {}),
    ranks,
    world_size: job.worldSize,
    attached: attachedAt !== null,
    attached_at_ms: attachedAt,
    mps: job.mps,
    shares_mps: sharesMps(job.mps, daemonMps),
    settings: wireSettings(jobs.effective(job)),
    overrides: wireSettings(job.settings),
    streams,
    totals: {
      requests,
      errors,
      bytes_in: original,
      bytes_out: coded,
      // Compressed over original, as tzip writes ratios everywhere (the CLI, CompressedTensor.ratio): lower is better.
      ratio: original > 0 ? coded / original : null,
      seconds,
      gbps: seconds > 0 ? original / seconds / 1e9 : null,
    },
  };
}
