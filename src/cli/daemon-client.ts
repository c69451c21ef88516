/**
 * A no-session client of the daemon for the CLI's control commands (`tzip jobs`, `tzip top`, `tzip set`):
 * one ZeroMQ DEALER on the daemon's endpoint, speaking MessagePack (docs/protocol.md), asking ops that
 * need no session (`jobs`, `set`, `stats`).
 *
 * The endpoint is `--socket` or `$TZIP_SOCKET` in any spelling of src/daemon/paths.ts (a path,
 * `ipc:///abs/path`, `tcp://127.0.0.1:PORT`); a `tcp://` endpoint is the daemon's CURVE-only TCP
 * socket, reached with the keys in the `curve/` folder next to the default socket (or
 * `$TZIP_CURVE_DIR`), as the Python client does.
 */
import { existsSync, readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { join } from 'node:path';
import { Packr, Unpackr } from 'msgpackr/pack';
import type { Dealer as DealerType } from 'zeromq';
import { TzipError, type TzipErrorCode, TZIP_ERROR_CODES } from '../errors.js';
import { curveDirFor, resolveEndpoint, type Endpoint } from '../daemon/paths.js';

// Start-up time (src/bench/cli-startup.ts): zeromq is a CommonJS package, and require() loads it without the ESM
// loader's detour through CommonJS (a second parse for its export names). msgpackr is taken from its plain-JS entry
// ('msgpackr/pack'): its main entry first looks for the native msgpackr-extract, of no use for messages this small.
const { Dealer } = createRequire(import.meta.url)('zeromq') as typeof import('zeromq');

// As src/daemon/wire.ts reads and writes messages: plain maps, no msgpackr extensions (records, structured clones).
const packr = new Packr({ useRecords: false, structuredClone: false, variableMapSize: true });
const unpackr = new Unpackr({ useRecords: false, mapsAsObjects: true, int64AsType: 'number', structuredClone: false });

/** How long a request waits for a reply before the daemon's pid file is read to tell whether it still runs, ms. */
const LOCK_CHECK_AFTER_MS = 300;

/** How long a request waits for its reply by default, ms. */
export const DEFAULT_TIMEOUT_MS = 5000;

/** The CURVE keys a client of the daemon's TCP socket uses (Z85 text). */
interface ClientCurveKeys {
  serverPublic: string;
  publicKey: string;
  secretKey: string;
}

function readClientCurveKeys(dir: string): ClientCurveKeys {
  const read = (name: string): string => {
    const path = join(dir, name);
    try {
      return readFileSync(path, 'utf8').trim();
    } catch (err) {
      throw new TzipError('TZIP_IO', `cannot read the daemon's CURVE key (start \`tzip serve --tcp PORT\` first, or set TZIP_CURVE_DIR): ${(err as Error).message}`, { file: path, cause: err });
    }
  };
  return { serverPublic: read('server.public'), publicKey: read('client.public'), secretKey: read('client.secret') };
}

/** A success reply, as decoded: `{id, ok: true, ...the op's fields}`. */
export type Reply = Record<string, unknown>;

/** Options of {@link DaemonClient.open}. */
export interface DaemonClientOptions {
  /** `--socket`: the endpoint in any spelling of src/daemon/paths.ts; default `$TZIP_SOCKET`, else the default socket. */
  socket?: string | undefined;
  /** The environment read for `TZIP_SOCKET`, `XDG_RUNTIME_DIR`, `TZIP_CURVE_DIR` (default process.env). */
  env?: NodeJS.ProcessEnv | undefined;
}

/** The TzipError code for a daemon's error code (the daemon's own codes, TZIP_PROTOCOL etc., are not the CLI's). */
function cliCode(daemonCode: string): TzipErrorCode {
  if ((TZIP_ERROR_CODES as readonly string[]).includes(daemonCode)) return daemonCode as TzipErrorCode;
  // TZIP_PROTOCOL / TZIP_VERSION: a daemon that does not speak this request (an older one): unsupported.
  if (daemonCode === 'TZIP_PROTOCOL' || daemonCode === 'TZIP_VERSION') return 'TZIP_UNSUPPORTED';
  if (daemonCode === 'TZIP_BUSY') return 'TZIP_IO';
  return 'TZIP_INTERNAL';
}

/**
 * One connection to the daemon. Requests are answered one at a time (`request` waits for the reply
 * with its id, dropping late replies to earlier requests that timed out).
 */
export class DaemonClient {
  private sock: DealerType | undefined;
  private nextId = 1;

  private constructor(readonly endpoint: Endpoint, private readonly curve: ClientCurveKeys | undefined) {}

  /**
   * A client of the daemon at `options.socket` (no connection is made until the first request).
   * @throws TzipError TZIP_USAGE for a bad endpoint spelling; TZIP_IO when a `tcp://` endpoint's keys cannot be read.
   */
  static open(options: DaemonClientOptions = {}): DaemonClient {
    const env = options.env ?? process.env;
    const endpoint = resolveEndpoint(options.socket, env);
    return new DaemonClient(endpoint, endpoint.kind === 'tcp' ? readClientCurveKeys(curveDirFor(env)) : undefined);
  }

  /** How the endpoint reads in messages: the socket path, or the TCP endpoint. */
  get where(): string {
    return this.endpoint.kind === 'ipc' ? this.endpoint.path : this.endpoint.endpoint;
  }

  private socket(): DealerType {
    if (this.sock === undefined) {
      const curve = this.curve === undefined ? {} : {
        curveServerKey: this.curve.serverPublic, curvePublicKey: this.curve.publicKey, curveSecretKey: this.curve.secretKey,
      };
      this.sock = new Dealer({ linger: 0, ...curve });
      this.sock.connect(this.endpoint.endpoint);
    }
    return this.sock;
  }

  /**
   * Sends `{id, ...message}` and returns the success reply.
   * @throws TzipError TZIP_IO when no daemon listens (no socket file) or none answers within `timeoutMs`;
   *   the daemon's error (its code mapped to the CLI's: TZIP_USAGE stays, an op this daemon does not know
   *   is TZIP_UNSUPPORTED) with its message otherwise.
   */
  async request(message: { op: string } & Record<string, unknown>, timeoutMs = DEFAULT_TIMEOUT_MS): Promise<Reply> {
    if (this.endpoint.kind === 'ipc' && !existsSync(this.endpoint.path)) {
      // A daemon removes its socket when it stops; without the file nothing can answer (and ZeroMQ would wait).
      throw new TzipError('TZIP_IO', `no tzip daemon at ${this.endpoint.path} (no socket file): start one with \`tzip serve\`, or name its socket with --socket or TZIP_SOCKET`);
    }
    const sock = this.socket();
    const id = this.nextId++;
    const deadline = Date.now() + timeoutMs;
    sock.sendTimeout = timeoutMs;
    try {
      await sock.send(packr.pack({ id, ...message }));
    } catch (err) {
      this.reset();
      throw new TzipError('TZIP_IO', `cannot send to the tzip daemon at ${this.where}: ${(err as Error).message}`, { cause: err });
    }
    let lockChecked = false;
    for (;;) {
      const left = deadline - Date.now();
      let bytes: Buffer | undefined;
      if (left > 0) {
        // A daemon answers these ops at once; one that has not after a moment may be dead with its socket file left.
        sock.receiveTimeout = lockChecked ? left : Math.min(left, LOCK_CHECK_AFTER_MS);
        try {
          [bytes] = await sock.receive();
        } catch (err) {
          if ((err as { code?: string }).code !== 'EAGAIN') {
            this.reset();
            throw new TzipError('TZIP_IO', `cannot read from the tzip daemon at ${this.where}: ${(err as Error).message}`, { cause: err });
          }
          if (!lockChecked) {
            lockChecked = true;
            const dead = await this.deadDaemon();
            if (dead !== undefined) {
              this.reset();
              throw new TzipError('TZIP_IO', dead);
            }
            continue;
          }
        }
      }
      if (bytes === undefined) {
        // The request may still be queued for a daemon that comes back: a fresh socket keeps its late reply away.
        this.reset();
        throw new TzipError('TZIP_IO', `no reply from the tzip daemon at ${this.where} within ${(timeoutMs / 1000).toFixed(1)} s (is it running? \`tzip serve\`)`);
      }
      let reply: Record<string, unknown>;
      try {
        reply = unpackr.unpack(bytes) as Record<string, unknown>;
      } catch {
        continue;
      }
      if (reply === null || typeof reply !== 'object' || reply.id !== id) continue;
      if (reply.ok === true) return reply;
      const error = (reply.error ?? {}) as { code?: unknown; message?: unknown };
      const code = typeof error.code === 'string' ? error.code : 'TZIP_INTERNAL';
      const text = typeof error.message === 'string' ? error.message : 'no message';
      const detail = code === 'TZIP_PROTOCOL' && text.startsWith('unknown op')
        ? `the daemon at ${this.where} does not know op '${message.op}' (${code}: ${text}): it is older than this tzip; restart it with this version's \`tzip serve\``
        : `${text} (${code})`;
      throw new TzipError(cliCode(code), detail);
    }
  }

  /**
   * Why no daemon can answer on the ipc socket, when its pid file (src/daemon/lock.ts) says its daemon is gone;
   * undefined when it may still answer (alive, busy, or a TCP endpoint, which has no pid file).
   */
  private async deadDaemon(): Promise<string | undefined> {
    if (this.endpoint.kind !== 'ipc') return undefined;
    // Loaded only here: a live daemon answers before, and the lock module's imports cost start-up time.
    const { holderAlive, lockPathOf, readLockInfo } = await import('../daemon/lock.js');
    const info = readLockInfo(lockPathOf(this.endpoint.path));
    if (info === null) return `no tzip daemon at ${this.endpoint.path} (a socket file but no pid file: none started, or it was killed): start one with \`tzip serve\``;
    if (holderAlive(info)) return undefined;
    return `no tzip daemon at ${this.endpoint.path}: its daemon (pid ${info.pid}, since ${info.since}) is gone and left its socket file; start one with \`tzip serve\``;
  }

  /** Drops the connection; the next request opens a new one (a daemon that restarted is reached afresh). */
  reset(): void {
    this.sock?.close();
    this.sock = undefined;
  }

  /** Closes the connection. */
  close(): void {
    this.reset();
  }
}
