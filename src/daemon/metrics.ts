/**
 * The daemon's Prometheus metrics (prom-client), served on http://127.0.0.1:PORT/metrics by
 * `tzip serve --metrics PORT` (docs/configuration.md, "Metrics").
 *
 * Counters and the request-duration histogram are fed by the daemon's observer hook, one event
 * per answered request (DaemonOptions.observer); gauges (sessions, jobs, mapped bytes, the SM
 * budget) and the session counters are read from the daemon when Prometheus scrapes. Names follow
 * Prometheus' conventions: the `tzip_` prefix, `_total` on counters, base units in the name
 * (`_bytes`, `_seconds`). The job a request came from is the label `job_name`, not `job`:
 * Prometheus gives every scraped series a `job` label of its own (the scrape job), and a
 * metric's own `job` label would be renamed `exported_job` on ingestion.
 *
 * The endpoint listens on 127.0.0.1 only and has no authentication: every local user can read
 * it (job names and byte counts, no tensor data).
 */
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { collectDefaultMetrics, Counter, Gauge, Histogram, Registry } from 'prom-client';
import { TzipError } from '../errors.js';
import { ipcAllocations } from './gpu-map.js';
import type { DaemonStats } from './stats.js';

/** One answered request, as the daemon's observer hook reports it (docs/protocol.md). */
export interface RequestEvent {
  op: string;
  /** The session's job name (a session without a job: its hello name or `pid-<pid>`), null without a session. */
  job: string | null;
  /** The request's stream tag (gradients, optimizer, checkpoint, sendrecv, other), null when untagged. */
  stream: string | null;
  /** Where the codec ran, null for requests that ran no codec. */
  device: 'cpu' | 'gpu' | null;
  /** From arrival to reply, seconds. */
  seconds: number;
  /** Tensors (compress) or frames (decompress) in the request. */
  items: number;
  /** Bytes read: tensor bytes (compress), frame bytes (decompress); 0 for other ops. */
  bytesIn: number;
  /** Bytes written: frame bytes (compress), tensor bytes (decompress); 0 for other ops. */
  bytesOut: number;
  /** The error code of an error reply, null for a success. */
  error: string | null;
}

/** What the metrics read from the daemon at scrape time (the `Daemon` satisfies it). */
export interface MetricsSource {
  readonly stats: DaemonStats;
  readonly sessions: { readonly size: number; all(): Iterable<{ mappings: { count: number; bytes: number } }> };
}

/** A label value for a missing field (Prometheus treats an empty value as an absent label). */
const NONE = 'none';

/**
 * Bounds of the request-duration histogram, seconds: 100 µs (a small request on the event loop)
 * to 10 s (a batch of gigabytes), 1-2.5-5 per decade.
 */
export const DURATION_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10];

/** The metrics of one daemon in a registry of their own, and the HTTP endpoint serving them. */
export class DaemonMetrics {
  readonly registry = new Registry();
  private source: MetricsSource | undefined;
  private server: Server | undefined;
  private readonly requests: Counter<'op'>;
  private readonly errors: Counter<'op' | 'code'>;
  private readonly bytesIn: Counter<'job_name' | 'stream' | 'direction'>;
  private readonly bytesOut: Counter<'job_name' | 'stream' | 'direction'>;
  private readonly tensors: Counter<'job_name' | 'stream' | 'direction'>;
  private readonly duration: Histogram<'op' | 'device'>;

  constructor() {
    const registers = [this.registry];
    // This process's CPU, memory, file descriptors, event-loop lag and GC (process_*, nodejs_*: the names every Node exporter uses).
    collectDefaultMetrics({ register: this.registry });
    this.requests = new Counter({ name: 'tzip_requests_total', help: 'Requests answered, by op (invalid: undecodable or unknown)', labelNames: ['op'], registers });
    this.errors = new Counter({ name: 'tzip_errors_total', help: 'Error replies, by op and error code (docs/protocol.md, "Errors")', labelNames: ['op', 'code'], registers });
    const flow = ['job_name', 'stream', 'direction'] as const;
    this.bytesIn = new Counter({ name: 'tzip_bytes_in_total', help: 'Bytes read by the codec: tensor bytes (direction compress), frame bytes (decompress)', labelNames: flow, registers });
    this.bytesOut = new Counter({ name: 'tzip_bytes_out_total', help: 'Bytes written by the codec: frame bytes (direction compress), tensor bytes (decompress)', labelNames: flow, registers });
    this.tensors = new Counter({ name: 'tzip_tensors_total', help: 'Tensors compressed or frames decompressed', labelNames: flow, registers });
    this.duration = new Histogram({ name: 'tzip_request_duration_seconds', help: 'Time from a request\'s arrival to its reply, by op and device (none: no codec ran)', labelNames: ['op', 'device'], buckets: DURATION_BUCKETS, registers });

    const metrics = this;
    new Gauge({
      name: 'tzip_sessions', help: 'Live client sessions', registers,
      collect() {
        if (metrics.source !== undefined) this.set(metrics.source.sessions.size);
      },
    });
    new Gauge({
      name: 'tzip_mapped_bytes', help: 'Bytes of client shared memory mapped by the daemon', registers,
      collect() {
        if (metrics.source === undefined) return;
        let bytes = 0;
        for (const s of metrics.source.sessions.all()) bytes += s.mappings.bytes;
        this.set(bytes);
      },
    });
    new Gauge({
      name: 'tzip_mapped_files', help: 'Client shared-memory files mapped by the daemon', registers,
      collect() {
        if (metrics.source === undefined) return;
        let files = 0;
        for (const s of metrics.source.sessions.all()) files += s.mappings.count;
        this.set(files);
      },
    });
    new Gauge({
      name: 'tzip_cuda_ipc_allocations', help: 'Client CUDA allocations the daemon holds open (cudaIpcOpenMemHandle)', registers,
      collect() {
        this.set(ipcAllocations.count);
      },
    });
    // Counted by the daemon itself (DaemonStats); prom-client's counters only go up by inc(), so each scrape sets them
    // to the daemon's totals (which only grow, as a counter must).
    new Counter({
      name: 'tzip_sessions_opened_total', help: 'Sessions opened (hello)', registers,
      collect() {
        if (metrics.source === undefined) return;
        this.reset();
        this.inc(metrics.source.stats.sessionsOpened);
      },
    });
    new Counter({
      name: 'tzip_sessions_ended_total', help: 'Sessions ended, by reason (goodbye, disconnect, lease, shutdown, ...)', labelNames: ['reason'], registers,
      collect() {
        if (metrics.source === undefined) return;
        this.reset();
        for (const [reason, n] of Object.entries(metrics.source.stats.sessionsEnded)) this.inc({ reason }, n);
      },
    });
  }

  /** Counts one answered request (the daemon's observer hook). */
  readonly observe = (e: RequestEvent): void => {
    this.requests.inc({ op: e.op });
    if (e.error !== null) this.errors.inc({ op: e.op, code: e.error });
    this.duration.observe({ op: e.op, device: e.device ?? NONE }, e.seconds);
    if ((e.op === 'compress' || e.op === 'decompress') && e.error === null) {
      const labels = { job_name: e.job ?? NONE, stream: e.stream ?? NONE, direction: e.op };
      this.bytesIn.inc(labels, e.bytesIn);
      this.bytesOut.inc(labels, e.bytesOut);
      this.tensors.inc(labels, e.items);
    }
  };

  /** Reads gauges from `source` (the running daemon) from now on. */
  attach(source: MetricsSource): void {
    this.source = source;
  }

  /** The metrics in Prometheus' text format. */
  text(): Promise<string> {
    return this.registry.metrics();
  }

  /**
   * Serves GET /metrics on 127.0.0.1:`port` (0: a free port).
   * @returns the URL of the metrics, e.g. http://127.0.0.1:9464/metrics
   * @throws TzipError TZIP_IO when the port cannot be bound (in use, or privileged).
   */
  async listen(port: number): Promise<string> {
    const server = createServer((req, res) => this.serve(req, res));
    await new Promise<void>((resolve, reject) => {
      server.once('error', (err) => reject(new TzipError('TZIP_IO', `cannot serve metrics on 127.0.0.1:${port}: ${err.message}`, { cause: err })));
      server.listen({ port, host: '127.0.0.1', exclusive: true }, () => resolve());
    });
    this.server = server;
    return `http://127.0.0.1:${(server.address() as AddressInfo).port}/metrics`;
  }

  private serve(req: IncomingMessage, res: ServerResponse): void {
    const path = (req.url ?? '/').split('?')[0];
    if (req.method !== 'GET' && req.method !== 'HEAD') {
      res.writeHead(405, { Allow: 'GET, HEAD', 'Content-Type': 'text/plain' }).end('only GET and HEAD\n');
      return;
    }
    if (path !== '/metrics') {
      res.writeHead(404, { 'Content-Type': 'text/plain' }).end('tzip daemon metrics are at /metrics\n');
      return;
    }
    this.registry.metrics().then(
      (body) => {
        res.writeHead(200, { 'Content-Type': this.registry.contentType }).end(req.method === 'HEAD' ? undefined : body);
      },
      (err: unknown) => {
        res.writeHead(500, { 'Content-Type': 'text/plain' }).end(`cannot collect the metrics: ${(err as Error).message}\n`);
      },
    );
  }

  /** Stops serving (open scrape connections included). Idempotent. */
  async close(): Promise<void> {
    const server = this.server;
    if (server === undefined) return;
    this.server = undefined;
    await new Promise<void>((resolve) => {
      server.close(() => resolve());
      server.closeAllConnections();
    });
  }
}
