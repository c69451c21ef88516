/**
 * `tzip serve`: runs the daemon that PyTorch processes hand tensors to (docs/protocol.md) until
 * a client sends `shutdown`, SIGINT/SIGTERM arrives, or (with --idle-exit) no client came for a while.
 */
import { InvalidArgumentError, Option, type Command } from 'commander';
import { defaultLimits, SESSION_LIMITS, type SessionLimit } from '../daemon/limits.js';
import { resolveSocketPath } from '../daemon/paths.js';
import { Daemon } from '../daemon/server.js';
import { parsePositiveInt, threadsOption, type GlobalOptions } from './options.js';

interface ServeOptions extends GlobalOptions {
  socket?: string;
  leaseMs?: number;
  maxMessageBytes?: number;
  maxBatch?: number;
  maxRegions?: number;
  maxIpcHandles?: number;
  maxInflightBytes?: number;
  threads?: number;
  idleExit?: number;
  verbose?: boolean;
  tcp?: number;
}

function parsePort(value: string): number {
  const n = Number(value);
  if (!/^\d+$/.test(value.trim()) || n > 65535) throw new InvalidArgumentError(`'${value}' is not a TCP port (0-65535; 0 picks a free one).`);
  return n;
}

function parseSeconds(value: string): number {
  const n = Number(value);
  if (value.trim() === '' || !Number.isFinite(n) || n < 0) throw new InvalidArgumentError(`'${value}' is not a number of seconds >= 0.`);
  return n;
}

/** Adds the `serve` command to `program`. */
export function registerServe(program: Command): void {
  program
    .command('serve')
    .description('run the tzip daemon: PyTorch processes (python-bridge, tzip.connect()) send it tensors in shared memory over ZeroMQ')
    .addOption(new Option('--socket <path>', 'socket path (default: $TZIP_SOCKET, else $XDG_RUNTIME_DIR/tzip/tzip.sock, else /tmp/tzip-$UID/tzip.sock)'))
    .addOption(new Option('--lease-ms <ms>', 'a client silent for this long loses its session (default: 10000)').argParser(parsePositiveInt))
    .addOption(new Option('--max-message-bytes <bytes>', 'largest request message served (default: 1048576)').argParser(parsePositiveInt))
    .addOption(new Option('--max-batch <n>', 'most tensors per compress/decompress request (default: 4096)').argParser(parsePositiveInt))
    .addOption(new Option('--max-regions <n>', `most ${SESSION_LIMITS.maxRegionsPerSession.what} (default: ${defaultLimits().maxRegionsPerSession})`).argParser(parsePositiveInt))
    .addOption(new Option('--max-ipc-handles <n>', `most ${SESSION_LIMITS.maxIpcHandlesPerSession.what} (default: ${defaultLimits().maxIpcHandlesPerSession})`).argParser(parsePositiveInt))
    .addOption(new Option('--max-inflight-bytes <bytes>', `most ${SESSION_LIMITS.maxInflightBytesPerSession.what} (default: ${defaultLimits().maxInflightBytesPerSession})`).argParser(parsePositiveInt))
    .addOption(threadsOption())
    .addOption(new Option('--idle-exit <seconds>', 'exit after this long without any client (default: 0, never)').argParser(parseSeconds))
    .addOption(new Option('--tcp <port>', 'also listen on tcp://127.0.0.1:PORT, CURVE only: clients need the keys in the socket folder\'s curve/ (0: a free port)').argParser(parsePort))
    .addOption(new Option('--verbose', 'log sessions and connections'))
    .action(async (_opts: unknown, cmd: Command) => {
      const opts = cmd.optsWithGlobals<ServeOptions>();
      const limits = defaultLimits();
      if (opts.leaseMs !== undefined) {
        limits.leaseMs = opts.leaseMs;
        limits.heartbeatMs = Math.max(1, Math.floor(opts.leaseMs / 3));
      }
      if (opts.maxMessageBytes !== undefined) {
        limits.maxMessageBytes = opts.maxMessageBytes;
        limits.transportMaxMessageBytes = Math.max(limits.transportMaxMessageBytes, opts.maxMessageBytes);
      }
      if (opts.maxBatch !== undefined) limits.maxBatch = opts.maxBatch;
      for (const name of Object.keys(SESSION_LIMITS) as SessionLimit[]) {
        const value = opts[SESSION_LIMITS[name].option];
        if (value !== undefined) limits[name] = value;
      }
      if (opts.threads !== undefined) limits.threads = opts.threads;
      if (opts.idleExit !== undefined) limits.idleExitMs = Math.round(opts.idleExit * 1000);
      const socketPath = resolveSocketPath(opts.socket);
      const daemon = await Daemon.start({ socketPath, limits, verbose: opts.verbose === true, tcpPort: opts.tcp });
      const tcp = daemon.tcpEndpoint;
      const ready = { event: 'listening', socket: socketPath, endpoint: daemon.endpoint, ...(tcp !== undefined ? { tcp } : {}), pid: process.pid };
      process.stdout.write(opts.json === true
        ? `${JSON.stringify(ready)}\n`
        : `tzip serve: listening on ${daemon.endpoint}${tcp !== undefined ? ` and ${tcp} (CURVE)` : ''} (pid ${process.pid})\n`);
      const onSignal = (signal: NodeJS.Signals): void => {
        void daemon.stop(`${signal} received`);
      };
      process.once('SIGINT', onSignal);
      process.once('SIGTERM', onSignal);
      await daemon.stopped;
      process.removeListener('SIGINT', onSignal);
      process.removeListener('SIGTERM', onSignal);
    });
}
