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
import { ADDON_SM_BUDGET, type JobRegistry } from './jobs.js';
import type { RequestEvent } from './observer.js';
import type { DaemonStats } from './stats.js';

/** What the metrics read from the daemon at scrape time (the `Daemon` satisfies it). */
export interface MetricsSource {
  readonly stats: DaemonStats;
  readonly sessions: { readonly size: number; mapped(): { files: number; bytes: number } };
  readonly jobs: Pick<JobRegistry, 'all' | 'effective' | 'daemonSettings'>;
}

type FlowLabels = 'job_name' | 'stream' | 'direction';

/** A label value for a missing field (Prometheus treats an empty value as an absent label). */
const NONE = 'none';

/**
 * Bounds of the request-duration histogram, seconds: 100 µs (a small request on the event loop)
 * to 10 s (a batch of gigabytes), 1-2.5-5 per decade.
 */
export const DURATION_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10];

/**
 * Connections the endpoint holds open at most; more are closed at once. Each is a file descriptor of the daemon, and
 * any local user can connect: without a bound, idle connections could take the descriptors the daemon's clients need
 * (shared-memory files, sockets). A Prometheus server keeps one.
 */
export const MAX_METRICS_CONNECTIONS = 64;
/** Host names (the Host header, port left out) the endpoint answers: its own address's. */
const LOCAL_HOSTS = new Set(['127.0.0.1', 'localhost', '[::1]']);
/** A scrape's request must arrive within this long, ms (a connection that sends nothing is closed then). */
const REQUEST_TIMEOUT_MS = 10_000;

/** The metrics of one daemon in a registry of their own, and the HTTP endpoint serving them. */
export class DaemonMetrics {
  readonly registry = new Registry();
  private source: MetricsSource | undefined;
  private server: Server | undefined;
  private readonly requests: Counter<'op'>;
  private readonly errors: Counter<'op' | 'code'>;
  private readonly bytesIn: Counter<FlowLabels>;
  private readonly bytesOut: Counter<FlowLabels>;
  private readonly tensors: Counter<FlowLabels>;
  /** The `job_name` series of the flow counters, by job: dropped with the job (see {@link dropEndedJobs}). */
  private readonly jobSeries = new Map<string, Map<string, Record<FlowLabels, string>>>();
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
      name: 'tzip_jobs', help: 'Jobs listed by the daemon: running (a session open) or ended (listed for 60 s after their last session)', labelNames: ['state'], registers,
      collect() {
        if (metrics.source === undefined) return;
        let running = 0;
        let ended = 0;
        for (const job of metrics.source.jobs.all()) {
          if (job.sessions.size > 0) running++;
          else ended++;
        }
        this.set({ state: 'running' }, running);
        this.set({ state: 'ended' }, ended);
      },
    });
    new Gauge({
      name: 'tzip_job_sessions', help: 'Live sessions of each job the daemon lists', labelNames: ['job_name'], registers,
      collect() {
        if (metrics.source === undefined) return;
        this.reset();
        for (const job of metrics.source.jobs.all()) this.set({ job_name: job.name }, job.sessions.size);
      },
    });
    new Gauge({
      name: 'tzip_job_attached', help: '1 while a session of the job is attached (tzip.attach(), or a hello that named the job: job=, TZIP_JOB, TZIP_ATTACH=1), else 0', labelNames: ['job_name'], registers,
      collect() {
        if (metrics.source === undefined) return;
        this.reset();
        for (const job of metrics.source.jobs.all()) this.set({ job_name: job.name }, job.attached ? 1 : 0);
      },
    });
    new Gauge({
      name: 'tzip_job_sm_budget', help: 'SMs the GPU kernels of a job\'s requests use when they name none (its setting, else the daemon\'s; 0: all)', labelNames: ['job_name'], registers,
      collect() {
        if (metrics.source === undefined) return;
        this.reset();
        const jobs = metrics.source.jobs;
        for (const job of jobs.all()) this.set({ job_name: job.name }, jobs.effective(job).smBudget ?? ADDON_SM_BUDGET);
      },
    });
    new Gauge({
      name: 'tzip_sm_budget', help: 'The daemon\'s SM budget: SMs of the GPU kernels of requests whose request and job name none (0: all)', registers,
      collect() {
        if (metrics.source !== undefined) this.set(metrics.source.jobs.daemonSettings.smBudget ?? ADDON_SM_BUDGET);
      },
    });
    new Gauge({
      name: 'tzip_mapped_bytes', help: 'Bytes of client shared memory mapped by the daemon', registers,
      collect() {
        if (metrics.source !== undefined) this.set(metrics.source.sessions.mapped().bytes);
      },
    });
    new Gauge({
      name: 'tzip_mapped_files', help: 'Client shared-memory files mapped by the daemon', registers,
      collect() {
        if (metrics.source !== undefined) this.set(metrics.source.sessions.mapped().files);
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
      let series = this.jobSeries.get(labels.job_name);
      if (series === undefined) {
        // A new job: drop the series of jobs the registry dropped now, not only at the next scrape (a client renaming its
        // job after every request, with nobody scraping, would otherwise grow them without bound).
        this.dropEndedJobs();
        series = new Map();
        this.jobSeries.set(labels.job_name, series);
      }
      series.set(`${labels.stream}\0${labels.direction}`, labels);
    }
  };

  /**
   * Drops the flow counters' series of jobs the daemon no longer lists (60 s after their last session ended,
   * jobs.ts): a daemon serving many jobs over months keeps a bounded number of series. A job that comes back
   * later starts from zero, which Prometheus reads as a counter reset.
   */
  private dropEndedJobs(): void {
    if (this.source === undefined) return;
    const listed = new Set(this.source.jobs.all().map((j) => j.name));
    for (const [job, series] of this.jobSeries) {
      if (listed.has(job)) continue;
      for (const labels of series.values()) {
        this.bytesIn.remove(labels);
        this.bytesOut.remove(labels);
        this.tensors.remove(labels);
      }
      this.jobSeries.delete(job);
    }
  }

  /** Reads gauges from `source` (the running daemon) from now on. */
  attach(source: MetricsSource): void {
    this.source = source;
  }

  /** The metrics in Prometheus' text format (what GET /metrics answers). */
  text(): Promise<string> {
    this.dropEndedJobs();
    return this.registry.metrics();
  }

  /**
   * Serves GET /metrics on 127.0.0.1:`port` (0: a free port).
   * @returns the URL of the metrics, e.g. http://127.0.0.1:9464/metrics
   * @throws TzipError TZIP_IO when the port cannot be bound (in use, or privileged).
   */
  async listen(port: number): Promise<string> {
    const server = createServer({ requestTimeout: REQUEST_TIMEOUT_MS, headersTimeout: REQUEST_TIMEOUT_MS }, (req, res) => this.serve(req, res));
    server.maxConnections = MAX_METRICS_CONNECTIONS;
    await new Promise<void>((resolve, reject) => {
      server.once('error', (err) => reject(new TzipError('TZIP_IO', `cannot serve metrics on 127.0.0.1:${port}: ${err.message}`, { cause: err })));
      server.listen({ port, host: '127.0.0.1', exclusive: true }, () => resolve());
    });
    this.server = server;
    return `http://127.0.0.1:${(server.address() as AddressInfo).port}/metrics`;
  }

  private serve(req: IncomingMessage, res: ServerResponse): void {
    // DNS rebinding: a web page the user opens can have its own host name resolve to 127.0.0.1 and read this
    // endpoint as same-origin (job names); its requests carry that name in Host, a scrape of this machine does not.
    const host = (req.headers.host ?? '').toLowerCase().replace(/:\d*$/, '');
    if (!LOCAL_HOSTS.has(host)) {
      res.writeHead(403, { 'Content-Type': 'text/plain' }).end('tzip daemon metrics answer requests for 127.0.0.1 or localhost only\n');
      return;
    }
    const path = (req.url ?? '/').split('?')[0];
    if (req.method !== 'GET' && req.method !== 'HEAD') {
      res.writeHead(405, { Allow: 'GET, HEAD', 'Content-Type': 'text/plain' }).end('only GET and HEAD\n');
      return;
    }
    if (path !== '/metrics') {
      res.writeHead(404, { 'Content-Type': 'text/plain' }).end('tzip daemon metrics are at /metrics\n');
      return;
    }
    this.text().then(
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
