/**
 * `tzip jobs`: the daemon's registry of jobs (protocol version 3, the `jobs` op of docs/protocol.md) as a
 * table, or with --json the reply itself (`{daemon, jobs}`). Also the reply's types and the per-job
 * figures (bytes before and after, ratio, GB/s) that `tzip top` shows too.
 */
import { Option, type Command } from 'commander';
import { DaemonClient } from './daemon-client.js';
import { formatGBps, formatRatio, formatSize } from './format.js';
import type { GlobalOptions } from './options.js';
import { printResult } from './output.js';
import { makeTable } from './table.js';

/** Counters of one direction of one stream (bytes_in: what the codec read, bytes_out: what it wrote). */
export interface WireDirection {
  requests: number;
  items?: number;
  bytes_in: number;
  bytes_out: number;
  seconds: number;
}

/** Counters of one stream (gradients, optimizer, checkpoint, sendrecv, other) of a job. */
export interface WireStream {
  compress: WireDirection;
  decompress: WireDirection;
  errors: number;
}

/** Settings of a job or of the daemon (null: not set). */
export interface WireSettings {
  codec: string | null;
  sm_budget: number | null;
}

/** One job of the `jobs` reply. */
export interface WireJob {
  name: string;
  user: string | null;
  pids: number[];
  sessions: number;
  devices: string[];
  rank?: number | number[] | null;
  world_size?: number | null;
  attached: boolean;
  attached_at_ms: number | null;
  /** "running", or "ended" once its last session ended (then listed for 60 s). */
  state?: string;
  ended_at_ms?: number | null;
  ranks?: number[];
  mps: boolean | null;
  shares_mps: boolean | null;
  /** The settings its requests run with (its own, else the daemon's). */
  settings: WireSettings;
  /** Its own settings (null: the daemon's apply). */
  overrides?: WireSettings;
  streams: Record<string, WireStream>;
  /** bytes_in: original (tensor) bytes, bytes_out: frame bytes, over all streams and both directions. */
  totals?: { bytes_in: number; bytes_out: number; ratio: number | null; gbps: number | null };
}

/** A GPU of the daemon. */
export interface WireGpu {
  uuid: string;
  name: string;
  index?: number;
  memory_used_bytes: number | null;
  memory_total_bytes: number | null;
}

/** The daemon part of the `jobs` reply. */
export interface WireDaemon {
  pid: number;
  version: string;
  socket: string;
  uptime_ms: number;
  /** Its settings (null: not set, each request's own applies). */
  sm_budget: number | null;
  /** The addon's SM budget of a GPU call that names none. */
  sm_budget_default?: number;
  codec: string | null;
  mps: boolean | null;
  gpus: WireGpu[];
  rates: { compress_gbps: number; decompress_gbps: number };
}

/** The `jobs` reply without `id` and `ok`. */
export interface JobsReport {
  daemon: WireDaemon;
  jobs: WireJob[];
}

/** Asks the daemon for its jobs. @throws TzipError as {@link DaemonClient.request}. */
export async function fetchJobs(client: DaemonClient, timeoutMs?: number): Promise<JobsReport> {
  const reply = await client.request({ op: 'jobs' }, timeoutMs);
  const { id: _id, ok: _ok, ...rest } = reply;
  return { ...(rest as unknown as JobsReport), jobs: Array.isArray(reply.jobs) ? (reply.jobs as WireJob[]) : [] };
}

/** A job's or a stream's figures: original (uncompressed) and coded (frame) bytes both ways, requests, errors, seconds. */
export interface Figures {
  requests: number;
  errors: number;
  /** Uncompressed bytes: tensors compressed plus tensors decompressed. */
  original: number;
  /** Frame bytes: frames written plus frames read. */
  coded: number;
  /** Seconds the daemon spent on the requests. */
  seconds: number;
}

/** The figures of one stream. */
export function streamFigures(s: WireStream): Figures {
  const c = s.compress;
  const d = s.decompress;
  return {
    requests: (c?.requests ?? 0) + (d?.requests ?? 0),
    errors: s.errors ?? 0,
    original: (c?.bytes_in ?? 0) + (d?.bytes_out ?? 0),
    coded: (c?.bytes_out ?? 0) + (d?.bytes_in ?? 0),
    seconds: (c?.seconds ?? 0) + (d?.seconds ?? 0),
  };
}

/** The figures of a job: the sum over its streams. */
export function jobFigures(job: WireJob): Figures {
  const sum: Figures = { requests: 0, errors: 0, original: 0, coded: 0, seconds: 0 };
  for (const s of Object.values(job.streams ?? {})) {
    const f = streamFigures(s);
    sum.requests += f.requests;
    sum.errors += f.errors;
    sum.original += f.original;
    sum.coded += f.coded;
    sum.seconds += f.seconds;
  }
  return sum;
}

/** GB/s (10^9 bytes per second) of original bytes over the daemon's seconds; undefined before any. */
export function figuresGBps(f: Figures): number | undefined {
  return f.seconds > 0 ? f.original / f.seconds / 1e9 : undefined;
}

/** A rate given in GB/s (10^9 bytes/s) in the unit that shows it: "12.3 GB/s", "250 MB/s", "4.1 kB/s", "0 B/s". */
export function formatRate(gbps: number | undefined): string {
  if (gbps === undefined || !Number.isFinite(gbps)) return '-';
  const bps = gbps * 1e9;
  if (bps >= 1e9) return `${formatGBps(gbps)} GB/s`;
  if (bps >= 1e6) return `${(bps / 1e6).toPrecision(3)} MB/s`;
  if (bps >= 1e3) return `${(bps / 1e3).toPrecision(3)} kB/s`;
  return `${Math.round(bps)} B/s`;
}

/** "attached", "detached" or "ended". */
export function jobState(job: WireJob): string {
  if (job.state === 'ended' || job.sessions === 0) return 'ended';
  return job.attached ? 'attached' : 'detached';
}

/** A setting for a table: its value, or "-" when not set. */
export function settingText(v: string | number | null | undefined): string {
  return v === null || v === undefined ? '-' : String(v);
}

/** An MPS flag: yes, no, or ? (cannot tell). */
export function mpsText(v: boolean | null | undefined): string {
  return v === true ? 'yes' : v === false ? 'no' : '?';
}

/** Devices as a short list: "cpu", "GPU-8f3c1a2b", two at most then "+N". */
export function devicesText(devices: readonly string[] | undefined): string {
  const list = (devices ?? []).map((d) => (d.startsWith('GPU-') ? d.slice(0, 12) : d));
  if (list.length === 0) return '-';
  return list.length <= 2 ? list.join(' ') : `${list.slice(0, 2).join(' ')} +${list.length - 2}`;
}

/** Pids as a short list: three at most then "+N". */
export function pidsText(pids: readonly number[] | undefined): string {
  const list = pids ?? [];
  if (list.length === 0) return '-';
  return list.length <= 3 ? list.join(' ') : `${list.slice(0, 3).join(' ')} +${list.length - 3}`;
}

/** A duration: "42 s", "5 m 03 s", "2 h 07 m", "3 d 04 h". */
export function formatDuration(ms: number): string {
  const s = Math.max(0, Math.floor(ms / 1000));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} m ${String(s % 60).padStart(2, '0')} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${String(Math.floor(s / 60) % 60).padStart(2, '0')} m`;
  return `${Math.floor(s / 86400)} d ${String(Math.floor(s / 3600) % 24).padStart(2, '0')} h`;
}

/** The daemon's settings in words: "codec per request, SM budget per request". */
export function daemonSettingsText(d: WireDaemon): string {
  const fallback = d.sm_budget_default === undefined ? '' : `, else ${d.sm_budget_default}`;
  const sm = d.sm_budget === null || d.sm_budget === undefined ? `per request${fallback}` : d.sm_budget === 0 ? '0 (all SMs)' : String(d.sm_budget);
  return `codec ${d.codec ?? 'per request'}, SM budget ${sm}`;
}

/** The daemon's lines above the table. */
function daemonText(report: JobsReport): string {
  const d = report.daemon;
  const lines = [
    `tzip daemon pid ${d.pid} (tzip ${d.version}), up ${formatDuration(d.uptime_ms)}, socket ${d.socket}`,
    `settings: ${daemonSettingsText(d)}; MPS client: ${mpsText(d.mps)}`,
  ];
  for (const [i, g] of (d.gpus ?? []).entries()) {
    const mem = g.memory_used_bytes === null || g.memory_total_bytes === null
      ? 'memory ?' : `memory ${formatSize(g.memory_used_bytes)} / ${formatSize(g.memory_total_bytes)}`;
    lines.push(`GPU ${g.index ?? i} ${g.name} (${g.uuid}): ${mem}`);
  }
  if ((d.gpus ?? []).length === 0) lines.push('GPU: none (CPU tensors only)');
  lines.push(`codec rates, last 10 s: compress ${formatRate(d.rates?.compress_gbps)}, decompress ${formatRate(d.rates?.decompress_gbps)}`);
  return lines.join('\n');
}

/** The text of `tzip jobs`. */
export function jobsText(report: JobsReport): string {
  const head = daemonText(report);
  if (report.jobs.length === 0) return `${head}\nno jobs`;
  const table = makeTable(
    ['job', 'state', 'user', 'pids', 'devices', 'MPS shared', 'codec', 'SMs', 'requests', 'errors', 'original', 'coded', 'ratio', 'GB/s'],
    ['left', 'left', 'left', 'left', 'left', 'left', 'left', 'right', 'right', 'right', 'right', 'right', 'right', 'right'],
  );
  for (const job of report.jobs) {
    const f = jobFigures(job);
    table.push([
      job.name, jobState(job), job.user ?? '-', pidsText(job.pids), devicesText(job.devices), mpsText(job.shares_mps),
      settingText(job.settings?.codec), settingText(job.settings?.sm_budget), String(f.requests), String(f.errors),
      formatSize(f.original), formatSize(f.coded), formatRatio(f.coded, f.original), formatGBps(figuresGBps(f)),
    ]);
  }
  return `${head}\n${table.toString()}`;
}

/** `--socket ENDPOINT` of the client commands. */
export function socketOption(): Option {
  return new Option('--socket <endpoint>', 'the daemon: a socket path, ipc:///abs/path or tcp://127.0.0.1:PORT (default: $TZIP_SOCKET, else $XDG_RUNTIME_DIR/tzip/tzip.sock, else /tmp/tzip-$UID/tzip.sock)');
}

interface JobsOptions extends GlobalOptions {
  socket?: string;
}

/** Adds the `jobs` command to `program`. */
export function registerJobs(program: Command): void {
  program
    .command('jobs')
    .description('list the jobs the running daemon serves: sessions, settings, bytes before and after, ratio, GB/s')
    .addOption(socketOption())
    .action(async (_opts: unknown, cmd: Command) => {
      const opts = cmd.optsWithGlobals<JobsOptions>();
      const client = DaemonClient.open({ socket: opts.socket });
      try {
        const report = await fetchJobs(client);
        printResult(opts.json, report, () => jobsText(report));
      } finally {
        client.close();
      }
    });
}
