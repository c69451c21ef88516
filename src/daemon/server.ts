/**
 * The daemon: a ZeroMQ ROUTER on an ipc:// socket serving the protocol of docs/protocol.md.
 *
 * One receive loop takes messages in order; each request is validated (parse-request.ts) and
 * handled concurrently (codec work runs on the addon's threads), and its reply goes back through
 * one send queue (a ZeroMQ socket takes one send at a time). A message that cannot be served gets
 * an error reply and the loop goes on. ROUTER_NOTIFY tells which sockets connect and disconnect,
 * so a dead client's session ends at once; leases catch the rest.
 */
import { chmodSync, readFileSync, unlinkSync } from 'node:fs';
import { join } from 'node:path';
import { Router } from 'zeromq';
import { TzipError } from '../errors.js';
import { createLogger, textLogger, type Logger } from '../logger.js';
import { defaultChunkSize, formatVersion, type RingCompletionStats } from '../native.js';
import { packageRoot } from '../package-root.js';
import { requestGc } from './gc.js';
import { gpuInventory, gpuMemory } from './gpu.js';
import { ipcAllocations } from './gpu-map.js';
import { ADDON_SM_BUDGET, JobRegistry, wireSettings, type Job } from './jobs.js';
import { PROTOCOL_VERSIONS, type DaemonLimits } from './limits.js';
import { DaemonLock } from './lock.js';
import { daemonUsesMps, mpsPipeDirectory, sharesMps } from './mps.js';
import type { RequestEvent, RequestObserver } from './observer.js';
import { wireJob } from './job-wire.js';
import { handleCompress } from './op-compress.js';
import { handleDecompress } from './op-decompress.js';
import { parseRequest } from './parse-request.js';
import { loadCurveKeys, ZAP_DOMAIN, ZapHandler, type CurveKeys } from './curve.js';
import { checkSocketPathFree, endpointOf, ensurePrivateDir } from './paths.js';
import { RateWindow } from './rates.js';
import { ringCapability, ringOpener, streamOfTag, type RingEvents } from './ring-ops.js';
import { ReplyError, toWireError } from './reply-error.js';
import { STREAMS, type HelloRequest, type JobRequest, type Request, type RingOpenRequest, type SetRequest, type StatsRequest } from './schema.js';
import { Session, SessionTable, type EndReason } from './session.js';
import { scheduleOrphanCleanup } from './shm-cleanup.js';
import { DaemonStats } from './stats.js';
import { RequestTally } from './tally.js';
import { encodeMessage as encodeReply } from './wire.js';

export type { RequestEvent, RequestObserver } from './observer.js';

/** TZIP_TRACE in the environment: each request's time from arrival to reply goes to the log (and the addon prints
 * its GPU calls' stage times to stderr). */
const TRACE = process.env.TZIP_TRACE !== undefined;
/** libzmq's ZMQ_ROUTER_NOTIFY option and its flags (connect | disconnect). */
const ZMQ_ROUTER_NOTIFY = 97;
const ZMQ_NOTIFY_CONNECT_AND_DISCONNECT = 3;
/**
 * libzmq's ZMQ_IPC_FILTER_UID (zmq.h, deprecated in favour of ZAP but built into the libzmq 4.3.5 of
 * zeromq.js 6.8): an ipc:// peer whose SO_PEERCRED uid is not in the list is disconnected at accept,
 * before a byte of it is read (docs/security.md, "Who can connect").
 */
const ZMQ_IPC_FILTER_UID = 59;

/** How to start a {@link Daemon}. */
export interface DaemonOptions {
  socketPath: string;
  limits: DaemonLimits;
  /** The daemon's log (src/logger.ts). Default: text lines on stderr (`tzip serve: ...`), or through `log`. */
  logger?: Logger | undefined;
  /** Where text log lines go when no `logger` is given (info and above; one call per line, no newline). */
  log?: ((line: string) => void) | undefined;
  /** Log every session opening and ending, and socket connections, at info (else they are debug lines). */
  verbose?: boolean | undefined;
  /** Also listen on tcp://127.0.0.1:PORT with CURVE (curve.ts); 0 picks a free port. */
  tcpPort?: number | undefined;
  /** Called once per answered request (observer.ts); what it throws is logged and ignored. */
  observer?: RequestObserver | undefined;
}

/** What a request's handling found out, for its job's counters and its observer event. */
interface RequestContext {
  /** The request's session, once looked up (or opened, for hello). */
  session: Session | undefined;
  /** The account of a compress/decompress request. */
  tally: RequestTally | undefined;
}

/** A ROUTER as the daemon uses it: bounded queues, connect/disconnect notifications, a message size cap. */
function makeRouter(limits: DaemonLimits, curve?: CurveKeys): Router {
  const router = new Router({
    linger: 0, sendHighWaterMark: 10_000, receiveHighWaterMark: 10_000,
    ...(curve !== undefined ? { curveServer: true, curveSecretKey: curve.serverSecret, zapDomain: ZAP_DOMAIN } : {}),
  });
  // zeromq.js has no property for these options; its generic setter is protected in the typings.
  const raw = router as unknown as { setInt32Option(option: number, value: number): void };
  raw.setInt32Option(ZMQ_ROUTER_NOTIFY, ZMQ_NOTIFY_CONNECT_AND_DISCONNECT);
  // The ipc socket: only this user's processes, by the kernel's peer credentials (on top of the folder's mode 0700).
  if (curve === undefined && typeof process.getuid === 'function') raw.setInt32Option(ZMQ_IPC_FILTER_UID, process.getuid());
  router.maxMessageSize = limits.transportMaxMessageBytes;
  return router;
}

function packageVersion(): string {
  try {
    const pkg = JSON.parse(readFileSync(join(packageRoot(), 'package.json'), 'utf8')) as { version?: unknown };
    return typeof pkg.version === 'string' ? pkg.version : '0.0.0';
  } catch {
    return '0.0.0';
  }
}

/** A running daemon. */
export class Daemon {
  readonly stats = new DaemonStats();
  readonly sessions: SessionTable;
  /** The jobs of its sessions, their settings and counters, and the daemon's settings (jobs.ts). */
  readonly jobs = new JobRegistry();
  /** Original (tensor) bytes of the compress and decompress requests of the last 10 s (`jobs` op's `daemon.rates`). */
  readonly rates = { compress: new RateWindow(10), decompress: new RateWindow(10) };
  /** Resolves when the daemon has stopped (with the reason). */
  readonly stopped: Promise<string>;
  private resolveStopped!: (reason: string) => void;
  private readonly router: Router;
  /** The CURVE-only TCP socket and its ZAP handler, with --tcp. */
  private tcp: { router: Router; zap: ZapHandler; endpoint: string } | undefined;
  private readonly sendQueue: { router: Router; message: Buffer[] }[] = [];
  private sending = false;
  private stopping = false;
  private inflight = 0;
  private lastActivity = Date.now();
  private timer: NodeJS.Timeout | undefined;
  /** The daemon's log. */
  readonly logger: Logger;
  private readonly observer: RequestObserver | undefined;
  private readonly version = packageVersion();

  private constructor(
    readonly socketPath: string,
    readonly limits: DaemonLimits,
    private readonly lock: DaemonLock,
    private readonly verbose: boolean,
    logger: Logger,
    observer: RequestObserver | undefined,
  ) {
    this.logger = logger;
    this.observer = observer;
    this.stopped = new Promise((resolve) => {
      this.resolveStopped = resolve;
    });
    this.sessions = new SessionTable(limits, (session, reason) => this.onSessionEnd(session, reason));
    this.router = makeRouter(limits);
  }

  /**
   * Takes the lock of `socketPath`, binds the socket (and, with `tcpPort`, the CURVE-only TCP socket on
   * 127.0.0.1) and starts serving.
   * @throws TzipError TZIP_USAGE when another daemon serves the path; TZIP_IO when the folder, a socket
   *   or the CURVE keys cannot be set up, or something other than a socket is at the path (paths.ts,
   *   checkSocketPathFree); TZIP_UNSUPPORTED for `tcpPort` without CURVE in ZeroMQ.
   */
  static async start(options: DaemonOptions): Promise<Daemon> {
    const logger = options.logger ?? (options.log !== undefined ? textLogger(options.log) : createLogger());
    ensurePrivateDir(options.socketPath);
    // Before the lock too, so that a refused path gets no pid file written beside it.
    checkSocketPathFree(options.socketPath);
    const lock = await DaemonLock.acquire(options.socketPath);
    if (lock.replacedStale !== null) logger.warn(`replaced the stale lock of pid ${lock.replacedStale.pid} (no longer running)`, { stale_pid: lock.replacedStale.pid });
    let daemon: Daemon | undefined;
    let bound = false;
    try {
      // Again under the lock, just before the bind (which unlinks whatever is at the path).
      checkSocketPathFree(options.socketPath);
      daemon = new Daemon(options.socketPath, options.limits, lock, options.verbose === true, logger, options.observer);
      await daemon.router.bind(endpointOf(options.socketPath));
      bound = true;
      chmodSync(options.socketPath, 0o600);
      if (options.tcpPort !== undefined) await daemon.listenTcp(options.tcpPort, options.socketPath);
    } catch (err) {
      // A start that fails after the ipc bind (the TCP port taken) leaves no socket file that no daemon serves: clients
      // would find it and wait on it.
      daemon?.router.close();
      if (bound) {
        try {
          unlinkSync(options.socketPath);
        } catch {
          // already gone
        }
      }
      lock.release();
      if (err instanceof TzipError) throw err;
      throw new TzipError('TZIP_IO', `cannot bind ${endpointOf(options.socketPath)}: ${(err as Error).message}`, { file: options.socketPath, cause: err });
    }
    const gpus = gpuInventory(); // asked once, before the first client waits on it
    logger.info(gpus.devices.length > 0
      ? `GPUs served through CUDA IPC: ${gpus.devices.map((d) => `${d.uuid} (${d.name})`).join(', ')}`
      : `no GPU served: ${gpus.reason}`);
    if (gpus.devices.length > 0) {
      const dir = mpsPipeDirectory();
      const mps = daemonUsesMps(true);
      logger.info(mps
        ? `MPS: this daemon is an MPS client (the control pipe is in ${dir}): its kernels run beside the other MPS clients' under their SM budgets`
        : `MPS: no MPS control daemon in ${dir}: the codec's kernels time-slice with other processes' GPU work (start nvidia-cuda-mps-control -d before the daemon and the jobs to share the GPU)`,
      { mps, mps_pipe_directory: dir });
    }
    daemon.startTimers();
    void daemon.receiveLoop(daemon.router, '');
    if (daemon.tcp !== undefined) void daemon.receiveLoop(daemon.tcp.router, 'tcp:');
    return daemon;
  }

  private async listenTcp(port: number, socketPath: string): Promise<void> {
    const keys = loadCurveKeys(socketPath);
    const zap = await ZapHandler.start(keys, (line) => this.logger.warn(line));
    const router = makeRouter(this.limits, keys);
    try {
      await router.bind(`tcp://127.0.0.1:${port}`);
    } catch (err) {
      router.close();
      zap.close();
      throw new TzipError('TZIP_IO', `cannot bind tcp://127.0.0.1:${port}: ${(err as Error).message}`, { cause: err });
    }
    this.tcp = { router, zap, endpoint: router.lastEndpoint ?? `tcp://127.0.0.1:${port}` };
    this.logger.info(`also listening on ${this.tcp.endpoint} (CURVE; keys in ${keys.dir})`, { endpoint: this.tcp.endpoint });
  }

  /** The ZeroMQ endpoint served. */
  get endpoint(): string {
    return endpointOf(this.socketPath);
  }

  /** The CURVE-only TCP endpoint (with `tcpPort`), e.g. tcp://127.0.0.1:5555. */
  get tcpEndpoint(): string | undefined {
    return this.tcp?.endpoint;
  }

  private startTimers(): void {
    const period = Math.max(50, Math.min(1000, Math.floor(this.limits.leaseMs / 4)));
    let last = Date.now();
    this.timer = setInterval(() => {
      const now = Date.now();
      this.sessions.sweep(now, now - last - period);
      this.jobs.prune(now);
      last = now;
      if (this.limits.idleExitMs > 0 && this.sessions.size === 0 && this.inflight === 0 &&
          Date.now() - this.lastActivity > this.limits.idleExitMs) {
        void this.stop(`idle for ${Math.round(this.limits.idleExitMs / 1000)} s with no client`);
      }
    }, period);
  }

  /** Serves one socket; `tag` keeps its routing ids apart from the other socket's in the session table. */
  private async receiveLoop(router: Router, tag: string): Promise<void> {
    while (!router.closed) {
      let parts: Buffer[];
      try {
        parts = await router.receive();
      } catch (err) {
        if (router.closed || this.stopping) break;
        this.logger.error(`receive failed: ${(err as Error).message}`);
        continue;
      }
      try {
        this.onMessage(parts, router, tag);
      } catch (err) {
        // onMessage answers everything itself; this is a daemon bug, not a reason to stop serving.
        this.logger.error(`internal error on a message: ${(err as Error).stack ?? String(err)}`);
      }
    }
  }

  private onMessage(parts: Buffer[], router: Router, tag: string): void {
    const routing = parts[0];
    if (routing === undefined) return;
    const rest = parts.slice(1);
    const key = tag + routing.toString('hex');
    if (rest.length === 1 && (rest[0] as Buffer).length === 0) {
      const what = this.sessions.notify(key);
      this.sessionLog(`socket ${key} ${what === 'connect' ? 'connected' : 'disconnected'}`);
      return;
    }
    this.lastActivity = Date.now();
    const arrived = process.hrtime.bigint();
    // A REQ socket puts an empty delimiter before the body; the reply must carry it too.
    const prefix = rest.length === 2 && (rest[0] as Buffer).length === 0 ? [routing, rest[0] as Buffer] : [routing];
    if (rest.length !== prefix.length) {
      const code = this.countAndReply(router, prefix, null, 'invalid', new ReplyError('TZIP_PROTOCOL', `a request is one message part; got ${rest.length}`));
      this.observe('invalid', null, arrived, code);
      return;
    }
    const body = rest[rest.length - 1] as Buffer;
    const parsed = parseRequest(body, this.limits);
    if (parsed.error !== undefined) {
      const code = this.countAndReply(router, prefix, parsed.id, 'invalid', parsed.error);
      this.observe('invalid', null, arrived, code);
      return;
    }
    const request = parsed.request;
    const ctx: RequestContext = { session: undefined, tally: undefined };
    this.inflight++;
    this.dispatch(request, key, parsed.handleTable === true, ctx).then(
      (result) => this.countAndReply(router, prefix, request.id, request.op, undefined, result),
      (err: unknown) => this.countAndReply(router, prefix, request.id, request.op, err),
    ).then((code) => {
      try {
        this.observe(request, ctx, arrived, code);
      } catch (err) {
        // A bug in the counting must not become an unhandled rejection (which ends the process).
        this.logger.error(`counting a ${request.op} request failed: ${err instanceof Error ? err.stack ?? err.message : String(err)}`);
      }
    }).finally(() => {
      if (TRACE) {
        // Absolute times on the monotonic clock, the clock of the addon's trace lines ("called at").
        const now = process.hrtime.bigint();
        this.logger.info(`trace: ${request.op} answered ${(Number(now - arrived) / 1e3).toFixed(1)} us after it arrived (arrived at ${arrived} ns, answered at ${now} ns)`);
      }
      this.inflight--;
      if (request.op === 'shutdown') void this.stop('shutdown requested by a client');
    });
  }

  /** Answers a request; returns the error reply's code, or null for a success. */
  private countAndReply(router: Router, prefix: Buffer[], id: number | null, op: string, err: unknown, result?: object): string | null {
    this.stats.countRequest(op);
    let message: object;
    let code: string | null = null;
    if (err !== undefined) {
      const error = toWireError(err);
      code = error.code;
      this.stats.countError(error.code);
      if (error.code === 'TZIP_INTERNAL') this.logger.error(`${op}: ${err instanceof Error ? err.stack ?? err.message : String(err)}`, { op, code: error.code });
      message = { id, ok: false, error };
    } else {
      message = { id, ok: true, ...result };
    }
    let body: Buffer;
    try {
      body = encodeReply(message);
    } catch (e) {
      const error = toWireError(e);
      code = error.code;
      body = encodeReply({ id, ok: false, error });
    }
    this.send(router, [...prefix, body]);
    return code;
  }

  /**
   * After a request's reply: counts a compress/decompress into its job's stream and the daemon's rates, and tells the
   * observer. `request` is the op name alone for a message that was not a request.
   */
  private observe(request: Request | 'invalid', ctx: RequestContext | null, arrived: bigint, error: string | null): void {
    const seconds = Number(process.hrtime.bigint() - arrived) / 1e9;
    const op = request === 'invalid' ? 'invalid' : request.op;
    const session = ctx?.session;
    const tally = ctx?.tally;
    const codecOp = request !== 'invalid' && (request.op === 'compress' || request.op === 'decompress') ? request : undefined;
    const ok = error === null;
    const event: RequestEvent = {
      op,
      job: session !== undefined ? this.jobs.jobOf(session)?.name ?? JobRegistry.jobNameOf(session) : null,
      stream: codecOp !== undefined ? codecOp.stream ?? 'other' : null,
      device: tally?.device ?? null,
      seconds,
      items: ok ? tally?.items ?? 0 : 0,
      bytesIn: ok ? tally?.bytesIn ?? 0 : 0,
      bytesOut: ok ? tally?.bytesOut ?? 0 : 0,
      error,
    };
    if (codecOp !== undefined && session !== undefined) {
      this.jobs.record(session, codecOp.op, codecOp.stream, { seconds, items: event.items, bytesIn: event.bytesIn, bytesOut: event.bytesOut, error });
      if (ok) {
        if (codecOp.op === 'compress') this.rates.compress.add(event.bytesIn);
        else this.rates.decompress.add(event.bytesOut);
      }
    }
    if (this.observer === undefined) return;
    try {
      this.observer(event);
    } catch (err) {
      this.logger.error(`the request observer failed: ${err instanceof Error ? err.message : String(err)}`, { op });
    }
  }

  /** A line about sessions and sockets: info with `verbose`, else debug. */
  private sessionLog(msg: string, fields?: Record<string, unknown>): void {
    if (this.verbose) this.logger.info(msg, fields);
    else this.logger.debug(msg, fields);
  }

  private send(router: Router, message: Buffer[]): void {
    if (router.closed) return;
    this.sendQueue.push({ router, message });
    if (!this.sending) void this.drain();
  }

  private async drain(): Promise<void> {
    this.sending = true;
    try {
      while (this.sendQueue.length > 0) {
        const { router, message } = this.sendQueue.shift() as { router: Router; message: Buffer[] };
        if (router.closed) continue;
        try {
          await router.send(message);
        } catch (err) {
          if (!router.closed) this.logger.warn(`reply not sent: ${(err as Error).message}`);
        }
      }
    } finally {
      this.sending = false;
    }
  }

  private async dispatch(request: Request, routingKey: string, handleTable: boolean, ctx: RequestContext): Promise<object> {
    switch (request.op) {
      case 'hello':
        return this.hello(request, routingKey, ctx);
      case 'stats':
        return this.statsReply(request);
      case 'jobs':
        return this.jobsReply();
      case 'set':
        return this.setReply(request);
      default:
        break;
    }
    if (this.stopping) throw new ReplyError('TZIP_BUSY', 'the daemon is shutting down');
    const session = this.sessions.lookup(request.sid, routingKey);
    ctx.session = session;
    if (request.op === 'heartbeat' || request.op === 'job' || request.op === 'ring_open' || request.op === 'ring_register') {
      // A ring of the session broke since its last such request: this one says so, once (docs/ring.md). Requests that
      // free memory (release, ring_release, ring_close) and the ZeroMQ data path are served as usual.
      const broken = session.rings.takeBrokenReport();
      if (broken !== undefined) throw broken;
    }
    switch (request.op) {
      case 'ring_open':
      case 'ring_register':
      case 'ring_release':
      case 'ring_close':
        return this.ringOp(request, session);
      case 'heartbeat':
        return { lease_ms: this.limits.leaseMs, ...this.settingsOf(session) };
      case 'job':
        return this.jobOp(request, session);
      case 'release': {
        const everything = request.names === undefined && request.handles === undefined;
        let released = 0;
        if (everything || request.names !== undefined) released += session.mappings.drop(request.names);
        if (everything || request.handles !== undefined) released += session.gpuIfAny?.release(request.handles) ?? 0;
        if (request.end === true) this.sessions.end(session, 'goodbye');
        if (request.reclaim === true) requestGc(0, true);
        return { released };
      }
      case 'shutdown':
        this.logger.info(`shutdown requested by pid ${session.pid}`);
        return {};
      default:
        break;
    }
    if (handleTable && session.version < 2) {
      throw new ReplyError('TZIP_PROTOCOL', `handle tables ("handles" and {kind: "ref"} handles) are protocol version 2; this session said hello with version ${session.version}`);
    }
    if ((request.stream !== undefined || request.sm_budget !== undefined) && session.version < 3) {
      throw new ReplyError('TZIP_PROTOCOL', `"stream" and "sm_budget" are protocol version 3; this session said hello with version ${session.version}`);
    }
    if (session.inflight >= this.limits.maxInflightPerSession) {
      throw new ReplyError('TZIP_BUSY', `this session has ${session.inflight} requests in flight (the cap is ${this.limits.maxInflightPerSession})`);
    }
    session.inflight++;
    session.requests++;
    const tally = new RequestTally(this.stats);
    ctx.tally = tally;
    const applied = this.jobs.apply(session, request.sm_budget);
    try {
      const result = request.op === 'compress'
        ? await handleCompress(request, session, this.limits, tally, applied)
        : await handleDecompress(request, session, this.limits, tally, applied);
      return { ...result, ...this.settingsOf(session) };
    } finally {
      session.inflight--;
      session.touch();
    }
  }

  /** The ring ops (protocol version 4, ring-ops.ts). */
  private async ringOp(request: Extract<Request, { op: 'ring_open' | 'ring_register' | 'ring_release' | 'ring_close' }>, session: Session): Promise<object> {
    if (session.version < 4) {
      throw new ReplyError('TZIP_PROTOCOL', `the "${request.op}" op is protocol version 4; this session said hello with version ${session.version}`);
    }
    const opener = ringOpener();
    if (opener === null) throw new ReplyError('TZIP_UNSUPPORTED', 'this build of the tzip daemon has no submission ring in its native addon (hello offered no "ring"): use compress/decompress requests');
    session.touch();
    switch (request.op) {
      case 'ring_open':
        return this.ringOpen(request, session, opener);
      case 'ring_register':
        return session.rings.register(request);
      case 'ring_release':
        return session.rings.release(request);
      case 'ring_close':
        return session.rings.close(request);
    }
  }

  private ringOpen(request: RingOpenRequest, session: Session, opener: NonNullable<ReturnType<typeof ringOpener>>): object {
    // The thread starts with the job's settings (jobs.ts, ringSettings), as a ZeroMQ request of the session would.
    const opened = session.rings.open(request, (smBudget) => this.jobs.ringSettings(session, smBudget), this.ringEventsOf(session), opener);
    this.sessionLog(`session ${session.sid} of pid ${session.pid}: ring ${opened.ring} opened on /dev/shm/${request.name.replace(/^\//, '')} (${request.entries} entries${request.device !== undefined ? `, GPU ${request.device.id}` : ', CPU'})`);
    return opened;
  }

  /** What the rings of `session` report: completions counted as requests are, broken rings logged. */
  private ringEventsOf(session: Session): RingEvents {
    return {
      onStats: (batch) => this.countRingCompletions(session, batch),
      onBroken: (ring, why) => {
        this.logger.warn(`session ${session.sid} of pid ${session.pid}: ring ${ring} broken (${why}); its ZeroMQ requests and the other sessions are served as before`,
          { ring, pid: session.pid, why });
      },
    };
  }

  /**
   * Hands the job settings of each of `sessions` to its rings, which apply them to every SQE they check from then on
   * (docs/ring.md, "Who applies the job's settings"): called whenever the settings that apply to a session may have
   * changed, before the reply that says so.
   */
  private applyRingSettings(sessions: Iterable<Session>): void {
    for (const session of sessions) {
      if (session.rings.count > 0) session.rings.applySettings((smBudget) => this.jobs.ringSettings(session, smBudget));
    }
  }

  /**
   * A batch of a ring's completions, counted as ZeroMQ requests are (observe): into the session's job per stream and
   * direction, the daemon's totals and rates, and one observer event per entry.
   */
  private countRingCompletions(session: Session, batch: readonly RingCompletionStats[]): void {
    session.touch();
    const counters = this.sessions.ringCounters;
    for (const s of batch) {
      const op = s.op === 'decompress' ? 'decompress' : 'compress';
      const stream = streamOfTag(s.stream);
      const items = Math.max(0, s.items);
      const errors = Math.max(0, s.errors);
      counters.sqes += items + errors;
      counters.sqeErrors += errors;
      for (let i = 0; i < errors; i++) this.jobs.record(session, op, stream, { seconds: 0, items: 0, bytesIn: 0, bytesOut: 0, error: 'ring' });
      if (items === 0) continue;
      this.jobs.record(session, op, stream, { seconds: s.seconds, items, bytesIn: s.inBytes, bytesOut: s.outBytes, error: null });
      this.stats.addCodec(op, items, s.inBytes, s.outBytes);
      if (s.gpu) this.stats.gpuRequests++;
      if (op === 'compress') this.rates.compress.add(s.inBytes);
      else this.rates.decompress.add(s.outBytes);
      if (this.observer === undefined) continue;
      const event: RequestEvent = {
        op, job: this.jobs.jobOf(session)?.name ?? JobRegistry.jobNameOf(session), stream, device: s.gpu ? 'gpu' : 'cpu',
        seconds: s.seconds, items, bytesIn: s.inBytes, bytesOut: s.outBytes, error: null,
      };
      try {
        this.observer(event);
      } catch (err) {
        this.logger.error(`the request observer failed: ${err instanceof Error ? err.message : String(err)}`, { op });
      }
    }
  }

  /** `settings` of a reply to a session of protocol version 3 (the effective settings of its job); {} before. */
  private settingsOf(session: Session): { settings?: ReturnType<typeof wireSettings> } {
    if (session.version < 3) return {};
    return { settings: wireSettings(this.jobs.effective(this.jobs.jobOf(session))) };
  }

  /**
   * Once per session, a warning when the client and this daemon do not share an MPS server (one is an MPS client, the
   * other not: docs/protocol.md, "Jobs"), so their GPU work time-slices instead of running side by side. Nothing
   * when either cannot tell (a client that said nothing of MPS, a daemon without a GPU).
   */
  private warnIfMpsNotShared(session: Session, jobName: string): void {
    if (session.mpsWarned) return;
    const clientMps = session.job?.mps ?? null;
    const daemonMps = daemonUsesMps(gpuInventory().devices.length > 0);
    if (clientMps === null || daemonMps === null || sharesMps(clientMps, daemonMps) !== false) return;
    session.mpsWarned = true;
    this.logger.warn(`pid ${session.pid} (job ${JSON.stringify(jobName)}) ${clientMps ? 'is' : 'is not'} an MPS client and this daemon ${daemonMps ? 'is' : 'is not'}: `
      + 'their GPU work time-slices instead of running side by side (start nvidia-cuda-mps-control -d before both)',
    { job: jobName, pid: session.pid, client_mps: clientMps, daemon_mps: daemonMps });
  }

  /** The `job` op: the session's job set, changed or cleared, attached or not. */
  private jobOp(request: JobRequest, session: Session): object {
    if (session.version < 3) {
      throw new ReplyError('TZIP_PROTOCOL', `the "job" op is protocol version 3; this session said hello with version ${session.version}`);
    }
    const before = this.jobs.jobOf(session)?.name;
    const wasAttached = session.attached;
    session.setJob(request.job, request.attached);
    const job = this.jobs.join(session);
    // The session may have moved to a job of other settings.
    this.applyRingSettings([session]);
    this.warnIfMpsNotShared(session, job.name);
    // At info only when the job or its attachment changed: a client repeating its job (a rank, devices) at every
    // step would otherwise write a line each time.
    const changed = before !== job.name || wasAttached !== request.attached;
    (changed ? this.logger.info : this.logger.debug).call(this.logger,
      `session ${session.sid} of pid ${session.pid}: job ${JSON.stringify(job.name)} ${request.attached ? 'attached' : 'detached'}`,
      { job: job.name, ...(before !== undefined && before !== job.name ? { previous_job: before } : {}) });
    return { job: job.name, ...this.settingsOf(session) };
  }

  /** The `set` op: a job's settings or the daemon's. */
  private setReply(request: SetRequest): object {
    const { job, settings } = this.jobs.set(request.job, { codec: request.codec, sm_budget: request.sm_budget });
    // A job's settings are its sessions'; the daemon's apply to every job without settings of its own.
    this.applyRingSettings(job !== null ? (this.jobs.get(job) as Job).sessions : this.sessions.all());
    const changed = [request.codec !== undefined ? `codec=${request.codec ?? 'default'}` : '', request.sm_budget !== undefined ? `sm_budget=${request.sm_budget ?? 'default'}` : '']
      .filter((x) => x !== '').join(' ');
    if (changed !== '') this.logger.info(`settings of ${job === null ? 'the daemon' : `job ${JSON.stringify(job)}`}: ${changed}`, { job, ...wireSettings(settings) });
    const reply: Record<string, unknown> = { job, settings: wireSettings(settings) };
    if (job !== null) reply.overrides = wireSettings((this.jobs.get(job) as Job).settings);
    return reply;
  }

  /** The `jobs` op: every job listed and the daemon's state. */
  private jobsReply(): object {
    const now = Date.now();
    const gpus = gpuMemory();
    const mps = daemonUsesMps(gpus.length > 0);
    return {
      jobs: this.jobs.all(now).map((job) => wireJob(this.jobs, job, mps)),
      daemon: {
        pid: process.pid,
        version: this.version,
        socket: this.socketPath,
        uptime_ms: now - this.stats.startedAt,
        sm_budget: this.jobs.daemonSettings.smBudget,
        sm_budget_default: ADDON_SM_BUDGET,
        codec: this.jobs.daemonSettings.codec,
        mps,
        gpus: gpus.map((g) => ({ uuid: g.uuid, name: g.name, memory_used_bytes: g.memoryUsedBytes, memory_total_bytes: g.memoryTotalBytes })),
        rates: { compress_gbps: this.rates.compress.perSecond(now) / 1e9, decompress_gbps: this.rates.decompress.perSecond(now) / 1e9 },
      },
    };
  }

  private hello(request: HelloRequest, routingKey: string, ctx: RequestContext): object {
    if (this.stopping) throw new ReplyError('TZIP_BUSY', 'the daemon is shutting down');
    const common = request.versions.filter((v) => PROTOCOL_VERSIONS.includes(v));
    if (common.length === 0) {
      throw new ReplyError('TZIP_VERSION', `no protocol version in common: the client speaks ${request.versions.join(', ')}, this daemon ${PROTOCOL_VERSIONS.join(', ')}`,
        { versions: [...PROTOCOL_VERSIONS] });
    }
    const version = Math.max(...common);
    const jobInfo = request.job ?? null;
    if (jobInfo !== null && version < 3) {
      throw new ReplyError('TZIP_PROTOCOL', `"job" in hello is protocol version 3; the versions in common are ${common.join(', ')}`);
    }
    const gpus = gpuInventory();
    const ring = ringCapability(this.limits);
    const session = this.sessions.open(request.pid, request.shm_prefix, request.name ?? '', version, routingKey);
    // A hello that names its job is a job attached from its start (TZIP_ATTACH=1, or a client given the job).
    session.setJob(jobInfo, jobInfo !== null);
    const job = this.jobs.join(session);
    this.warnIfMpsNotShared(session, job.name);
    ctx.session = session;
    this.stats.sessionsOpened++;
    this.sessionLog(`session ${session.sid} opened by pid ${session.pid} (${session.name || 'unnamed'})`, { job: job.name });
    return {
      ...(version >= 3 ? { job: job.name, ...this.settingsOf(session) } : {}),
      ...(version >= 4 && ring !== undefined ? { ring } : {}),
      version,
      sid: session.sid,
      lease_ms: this.limits.leaseMs,
      heartbeat_ms: this.limits.heartbeatMs,
      daemon: {
        pid: process.pid,
        version: this.version,
        protocol_versions: [...PROTOCOL_VERSIONS],
        format_version: formatVersion(),
        chunk_size: defaultChunkSize(),
        gpu: gpus.devices.length > 0,
        handle_kinds: gpus.devices.length > 0 ? ['shm', 'cuda_ipc'] : ['shm'],
        gpus: gpus.devices.map((d) => ({ uuid: d.uuid, name: d.name, index: d.ordinal })),
        ...(gpus.devices.length === 0 ? { gpu_reason: gpus.reason } : {}),
      },
      limits: {
        max_message_bytes: this.limits.maxMessageBytes,
        max_batch: this.limits.maxBatch,
        max_ndim: this.limits.maxNdim,
        max_inflight: this.limits.maxInflightPerSession,
        max_regions: this.limits.maxRegionsPerSession,
        max_ipc_handles: this.limits.maxIpcHandlesPerSession,
        max_inflight_bytes: this.limits.maxInflightBytesPerSession,
      },
    };
  }

  private statsReply(request: StatsRequest): object {
    const reply: Record<string, unknown> = {
      pid: process.pid,
      version: this.version,
      socket: this.socketPath,
      uptime_ms: Date.now() - this.stats.startedAt,
      sessions: this.sessions.size,
      sessions_opened: this.stats.sessionsOpened,
      sessions_ended: { ...this.stats.sessionsEnded },
      inflight: this.inflight - 1, // not counting this stats request
      requests: { ...this.stats.requests },
      errors: { ...this.stats.errors },
      compress: { items: this.stats.compress.items, bytes_in: this.stats.compress.bytesIn, bytes_out: this.stats.compress.bytesOut },
      decompress: { items: this.stats.decompress.items, bytes_in: this.stats.decompress.bytesIn, bytes_out: this.stats.decompress.bytesOut },
      mapped: this.sessions.mapped(),
      rings: this.ringStats(),
      gpu: { devices: gpuInventory().devices.map((d) => d.uuid), requests: this.stats.gpuRequests, allocations: ipcAllocations.count,
        mps: daemonUsesMps(gpuInventory().devices.length > 0) },
    };
    if (request.sid !== undefined) {
      const s = this.sessions.peek(request.sid);
      if (s !== undefined) {
        reply.session = {
          sid: s.sid,
          pid: s.pid,
          name: s.name,
          job: this.jobs.jobOf(s)?.name ?? null,
          requests: s.requests,
          inflight: s.inflight,
          inflight_bytes: s.inflightBytes,
          sockets: s.routingIds.size,
          mapped: { files: s.mappings.count + s.rings.mappedFiles, bytes: s.mappings.bytes + s.rings.mappedBytes },
          rings: { open: s.rings.count, regions: s.rings.regionCount },
          gpu: { allocations: s.gpuIfAny?.allocations ?? 0, events: s.gpuIfAny?.events ?? 0 },
          lease_left_ms: Math.max(0, this.limits.leaseMs - (Date.now() - s.lastSeen)),
        };
      }
    }
    return reply;
  }

  /** `stats`'s `rings`: the daemon's submission rings (docs/ring.md). */
  private ringStats(): object {
    const c = this.sessions.ringCounters;
    return { available: ringOpener() !== null, open: c.open, opened: c.opened, broken: c.broken, regions: c.regions, sqes: c.sqes, sqe_errors: c.sqeErrors };
  }

  private onSessionEnd(session: Session, reason: EndReason): void {
    this.stats.countEnd(reason);
    const job = this.jobs.jobOf(session)?.name;
    this.jobs.leave(session);
    requestGc(0, true);
    this.sessionLog(`session ${session.sid} of pid ${session.pid} ended (${reason})`, { job });
    if (reason === 'disconnect' || reason === 'lease') scheduleOrphanCleanup(session, (line) => this.logger.info(line));
  }

  /**
   * Stops serving: waits up to 10 s for requests in flight, ends every session, closes and
   * removes the socket, releases the lock. Idempotent.
   */
  async stop(reason: string): Promise<void> {
    if (this.stopping) return;
    this.stopping = true;
    if (this.timer !== undefined) clearInterval(this.timer);
    const deadline = Date.now() + 10_000;
    while (this.inflight > 0 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 10));
    // Let queued replies (the shutdown reply among them) leave before closing.
    const sendDeadline = Date.now() + 1000;
    while ((this.sending || this.sendQueue.length > 0) && Date.now() < sendDeadline) await new Promise((r) => setTimeout(r, 5));
    this.sessions.endAll('shutdown');
    // The rings' threads stop after their batch in flight; the client memory they hold is let go after.
    await Promise.race([this.sessions.closing(), new Promise((r) => setTimeout(r, 10_000).unref())]);
    this.router.close();
    if (this.tcp !== undefined) {
      this.tcp.router.close();
      this.tcp.zap.close();
    }
    try {
      unlinkSync(this.socketPath);
    } catch {
      // already gone
    }
    this.lock.release();
    this.logger.info(`stopped: ${reason}`);
    this.resolveStopped(reason);
  }
}
