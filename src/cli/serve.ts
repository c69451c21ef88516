/**
 * `tzip serve`: runs the daemon that PyTorch processes hand tensors to (docs/protocol.md) until
 * a client sends `shutdown`, SIGINT/SIGTERM arrives, or (with --idle-exit) no client came for a while.
 *
 * Its settings come from flags, the environment, a config file and defaults, in that order of
 * precedence (src/config.ts, docs/configuration.md); `--print-config` shows them and exits. With
 * `--metrics PORT` it serves Prometheus metrics on 127.0.0.1 (src/daemon/metrics.ts). The
 * daemon, the metrics and the logger's modules are loaded when the command runs, so registering
 * it costs the CLI's other commands nothing.
 */
import { Option, type Command } from 'commander';
import { CONFIG_KEYS, CONFIG_KEY_NAMES, configJson, flagAttribute, formatConfigText, resolveConfig, type ConfigKey, type KeySpec, type ResolvedConfig, type ServeConfig } from '../config.js';
import { TzipError } from '../errors.js';
import type { DaemonLimits } from '../daemon/limits.js';
import type { Logger } from '../logger.js';
import { exitCodeFor } from './exit-codes.js';
import type { GlobalOptions } from './options.js';

interface ServeOptions extends GlobalOptions {
  config?: string;
  printConfig?: boolean;
  [attribute: string]: unknown;
}

/** The help text of a key's flag: what it does, its default, its variable. */
function flagHelp(spec: KeySpec<unknown>): string {
  let d = spec.defaultText;
  if (d === undefined) {
    const value = spec.default(process.env);
    d = typeof value === 'string' ? value : JSON.stringify(value);
  }
  return `${spec.what} (default: ${d}; env ${spec.env})`;
}

/** `limits` (the defaults of src/daemon/limits.ts) with the configuration's values set. */
function limitsOf(c: ServeConfig, limits: DaemonLimits): DaemonLimits {
  limits.leaseMs = c.lease_ms;
  limits.heartbeatMs = Math.max(1, Math.floor(c.lease_ms / 3));
  limits.maxMessageBytes = c.max_message_bytes;
  limits.transportMaxMessageBytes = Math.max(limits.transportMaxMessageBytes, c.max_message_bytes);
  limits.maxBatch = c.max_batch;
  limits.maxRegionsPerSession = c.max_regions;
  limits.maxIpcHandlesPerSession = c.max_ipc_handles;
  limits.maxInflightBytesPerSession = c.max_inflight_bytes;
  limits.threads = c.threads ?? undefined;
  // Under half a millisecond still means "exit when idle" (rounded to 0 it would be "never").
  limits.idleExitMs = c.idle_exit_s > 0 ? Math.max(1, Math.round(c.idle_exit_s * 1000)) : 0;
  return limits;
}

/** Adds the `serve` command to `program`. */
export function registerServe(program: Command): void {
  const command = program
    .command('serve')
    .description('run the tzip daemon: PyTorch processes (python-bridge, tzip.connect()) send it tensors in shared memory over ZeroMQ')
    .addOption(new Option('--config <path>', 'config file (default: $TZIP_CONFIG, else $XDG_CONFIG_HOME/tzip/config.json, else ~/.config/tzip/config.json)'))
    .addOption(new Option('--print-config', 'print the settings in effect and where each came from (flag, env, file, default), then exit'));
  for (const key of CONFIG_KEY_NAMES) {
    const spec = CONFIG_KEYS[key] as KeySpec<unknown>;
    // Values stay strings here: config.ts parses and checks flags, variables and the file alike.
    command.addOption(new Option(spec.arg !== undefined ? `${spec.flag} ${spec.arg}` : spec.flag, flagHelp(spec)));
  }
  command.addHelpText('after', '\nPrecedence: flags > environment variables > config file > defaults (docs/configuration.md).');
  command.action(async (_opts: unknown, cmd: Command) => {
    const opts = cmd.optsWithGlobals<ServeOptions>();
    const flags: Partial<Record<ConfigKey, string | boolean>> = {};
    for (const key of CONFIG_KEY_NAMES) {
      const value = opts[flagAttribute(CONFIG_KEYS[key].flag)];
      if (typeof value === 'string' || typeof value === 'boolean') flags[key] = value;
    }
    const config = await resolveConfig({ flags, configPath: opts.config, env: process.env });
    if (opts.printConfig === true) {
      process.stdout.write(opts.json === true ? `${JSON.stringify(configJson(config), null, 2)}\n` : formatConfigText(config));
      return;
    }
    await serve(config, opts.json === true);
  });
}

/**
 * The socket path of the configuration's `socket` (any spelling of src/daemon/paths.ts), its errors naming where the
 * value came from.
 */
async function socketPathOf(config: ResolvedConfig): Promise<string> {
  const { resolveSocketPath } = await import('../daemon/paths.js');
  const source = config.sources.socket;
  // From the environment, paths.ts reads TZIP_SOCKET itself (and names it in its messages).
  if (source.from === 'env') return resolveSocketPath(undefined, process.env);
  if (source.from !== 'file') return resolveSocketPath(config.values.socket);
  try {
    return resolveSocketPath(config.values.socket);
  } catch (err) {
    if (!(err instanceof TzipError)) throw err;
    throw new TzipError(err.code, `the config file's socket ${JSON.stringify(config.values.socket)}: ${err.detail.replace(/^--socket is \S+: /, '')}`, { file: source.path, cause: err });
  }
}

/**
 * A start that failed, for JSON logs: the error as an `error` record (`code`, `file`), the `--json` error document on
 * stdout as main.ts writes it, and the exit code main.ts would give.
 */
function startFailed(err: unknown, logger: Logger, json: boolean): void {
  const code = exitCodeFor(err);
  const message = err instanceof Error ? err.message : String(err);
  const detail = err instanceof TzipError
    ? { code: err.code, message: err.message, file: err.file ?? null, tensor: err.tensor ?? null, exitCode: code }
    : { code: 'INTERNAL', message, file: null, tensor: null, exitCode: code };
  logger.error(`cannot start: ${message}`, { code: detail.code, file: detail.file ?? undefined, exit_code: code,
    ...(detail.code === 'INTERNAL' && err instanceof Error ? { stack: err.stack } : {}) });
  if (json) process.stdout.write(`${JSON.stringify({ error: detail }, null, 2)}\n`);
  process.exitCode = code;
}

/** Runs the daemon with `config` until it stops. */
async function serve(config: ResolvedConfig, json: boolean): Promise<void> {
  const c = config.values;
  const [{ defaultLimits }, { Daemon }, { createLogger }] = await Promise.all([
    import('../daemon/limits.js'), import('../daemon/server.js'), import('../logger.js'),
  ]);
  const logger = createLogger({ level: c.log_level, format: c.log_format });
  let socketPath: string;
  let metrics: InstanceType<typeof import('../daemon/metrics.js').DaemonMetrics> | undefined;
  let metricsUrl: string | undefined;
  let daemon: Awaited<ReturnType<typeof Daemon.start>>;
  try {
    socketPath = await socketPathOf(config);
    const limits = limitsOf(c, defaultLimits());
    // The metrics port is bound before the daemon's socket: a port in use fails the start before any client can connect.
    metrics = c.metrics_port !== null ? new (await import('../daemon/metrics.js')).DaemonMetrics() : undefined;
    metricsUrl = metrics !== undefined && c.metrics_port !== null ? await metrics.listen(c.metrics_port) : undefined;
    daemon = await Daemon.start({
      socketPath, limits, verbose: c.verbose, tcpPort: c.tcp_port ?? undefined, logger, observer: metrics?.observe,
    });
  } catch (err) {
    await metrics?.close();
    if (c.log_format !== 'json' || c.log_level === 'silent') throw err; // silent: the error is still said (main.ts)
    // JSON logs: the failure is a record of the log like any other, and no text line follows it (main.ts writes one for
    // an error it is thrown): whatever reads stderr as JSON lines reads this too. The exit code is the same.
    startFailed(err, logger, json);
    return;
  }
  // Before the first request can be read (the receive loop's first message arrives in a later turn of the event loop):
  // the daemon's SM budget, which `set` changes at run time.
  daemon.jobs.daemonSettings.smBudget = c.sm_budget;
  daemon.jobs.startSettings.smBudget = c.sm_budget;
  metrics?.attach(daemon);
  if (metricsUrl !== undefined) logger.info(`metrics on ${metricsUrl}`, { metrics: metricsUrl });
  const tcp = daemon.tcpEndpoint;
  const ready = {
    event: 'listening', socket: socketPath, endpoint: daemon.endpoint, ...(tcp !== undefined ? { tcp } : {}),
    ...(metricsUrl !== undefined ? { metrics: metricsUrl } : {}), pid: process.pid,
  };
  process.stdout.write(json
    ? `${JSON.stringify(ready)}\n`
    : `tzip serve: listening on ${daemon.endpoint}${tcp !== undefined ? ` and ${tcp} (CURVE)` : ''}${metricsUrl !== undefined ? `, metrics on ${metricsUrl}` : ''} (pid ${process.pid})\n`);
  const onSignal = (signal: NodeJS.Signals): void => {
    void daemon.stop(`${signal} received`);
  };
  process.once('SIGINT', onSignal);
  process.once('SIGTERM', onSignal);
  await daemon.stopped;
  await metrics?.close();
  process.removeListener('SIGINT', onSignal);
  process.removeListener('SIGTERM', onSignal);
}
