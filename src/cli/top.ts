/**
 * `tzip top`: a live terminal view of the daemon (its SM budget and codec settings, its GPUs' memory, its
 * codec rates) and of every job it serves (state, settings, bytes before and after, ratio, GB/s, and the
 * same per stream), refreshed every second in the manner of `nvidia-smi` and `htop`. q or Ctrl-C quits. With
 * stdout not a terminal it prints one screen as plain text and exits (as `top -b -n 1`); with --json, one snapshot
 * as JSON (the `jobs` reply, as `tzip jobs --json` prints it) and exits.
 *
 * It asks the daemon's `jobs` op (protocol version 3) once a refresh. A daemon that is not running, stops
 * or restarts is shown as such and asked again at the next refresh, so `tzip top` can be started first.
 * Drawn with ink (React for terminals); the lines are computed by {@link topLines}, a plain function of
 * the last answer, so what the screen says is testable without a terminal.
 */
import { InvalidArgumentError, Option, type Command } from 'commander';
import type { ReactElement } from 'react';
import { DaemonClient } from './daemon-client.js';
import { formatGBps, formatRatio, formatSize } from './format.js';
import {
  daemonSettingsText, devicesText, fetchJobs, figuresGBps, formatDuration, formatRate, jobFigures, jobState, mpsText, pidsText,
  settingText, socketOption, streamFigures, type Figures, type JobsReport,
} from './jobs.js';
import { printResult } from './output.js';

/** What the screen shows: the last answer of the daemon and, when the last request failed, why. */
export interface TopView {
  /** The daemon's endpoint as the user reads it. */
  where: string;
  /** The last `jobs` reply (kept while the daemon is away, shown as of `lastOkAt`). */
  report: JobsReport | null;
  /** Why the last request failed, or null when it was answered. */
  error: string | null;
  /** When the last reply came (ms since the epoch). */
  lastOkAt: number | null;
  /** Refresh interval, ms. */
  intervalMs: number;
  /** False for the one screen printed when stdout is not a terminal (no retry, no keys). Default true. */
  live?: boolean;
}

/** One line of the screen. */
export interface Line {
  text: string;
  color?: string;
  bold?: boolean;
  inverse?: boolean;
  dim?: boolean;
}

function clock(ms: number): string {
  return new Date(ms).toTimeString().slice(0, 8);
}

/** An htop-style meter: `[|||||     ]` of `width` characters for `used` of `total`. */
function meter(used: number, total: number, width: number): string {
  const inner = Math.max(1, width - 2);
  const n = total > 0 ? Math.min(inner, Math.round((used / total) * inner)) : 0;
  return `[${'|'.repeat(n)}${' '.repeat(inner - n)}]`;
}

function cut(text: string, width: number): string {
  return text.length <= width ? text : `${text.slice(0, Math.max(0, width - 1))}~`;
}

interface Column {
  head: string;
  width: number;
  right?: boolean;
  /** On a narrow terminal columns go in this order (1 first); 0: always shown. */
  drop: number;
}

/** The job table's columns, each row's cells in this order. */
const COLUMNS: readonly Column[] = [
  { head: 'JOB', width: 0, drop: 0 }, { head: 'STATE', width: 8, drop: 5 }, { head: 'USER', width: 8, drop: 3 },
  { head: 'PIDS', width: 10, drop: 2 }, { head: 'DEVICES', width: 12, drop: 1 }, { head: 'MPS', width: 3, drop: 4 },
  { head: 'CODEC', width: 5, drop: 8 }, { head: 'SMS', width: 4, right: true, drop: 7 }, { head: 'REQS', width: 7, right: true, drop: 9 },
  { head: 'ERR', width: 4, right: true, drop: 6 }, { head: 'ORIGINAL', width: 9, right: true, drop: 0 },
  { head: 'CODED', width: 9, right: true, drop: 10 }, { head: 'RATIO', width: 6, right: true, drop: 0 }, { head: 'GB/s', width: 6, right: true, drop: 0 },
];

/** The least width of the job names' column before other columns make room for it. */
const MIN_NAME_WIDTH = 12;

/**
 * The columns that fit `width` (htop's way: the least useful go first) and the width of the name column (what the
 * others leave, at most 32 and at most the longest name), with a function picking a row's cells for them.
 */
function fitColumns(width: number, longestName: number): { cols: Column[]; pick: (cells: readonly string[]) => string[] } {
  const shown = COLUMNS.map((c) => ({ ...c }));
  const used = (): number => shown.reduce((n, c) => n + c.width + 1, 0);
  for (let d = 1; used() + MIN_NAME_WIDTH > width && d <= 10; d++) {
    const i = shown.findIndex((c) => c.drop === d);
    if (i >= 0) shown.splice(i, 1);
  }
  (shown[0] as Column).width = Math.max(8, Math.min(32, Math.max(MIN_NAME_WIDTH, longestName), width - used()));
  const keep = shown.map((c) => COLUMNS.findIndex((k) => k.head === c.head));
  return { cols: shown, pick: (cells) => keep.map((i) => cells[i] ?? '') };
}

function row(cols: readonly Column[], cells: readonly string[]): string {
  return cols.map((c, i) => {
    const v = cut(cells[i] ?? '', c.width);
    return c.right === true ? v.padStart(c.width) : v.padEnd(c.width);
  }).join(' ');
}

function figureCells(f: Figures): string[] {
  return [String(f.requests), String(f.errors), formatSize(f.original), formatSize(f.coded), formatRatio(f.coded, f.original), formatGBps(figuresGBps(f))];
}

/**
 * The screen's lines for `view` at time `now` on a terminal `width` columns wide (each line at most that long).
 * Jobs come in the daemon's order, each followed by its streams that had requests or errors.
 */
export function topLines(view: TopView, width: number, now: number): Line[] {
  const w = Math.max(40, width);
  const lines: Line[] = [];
  const title = `tzip top - ${view.where}`;
  const time = clock(now);
  lines.push({ text: `${cut(title, w - time.length - 1).padEnd(w - time.length)}${time}`, bold: true });
  const r = view.report;
  if (view.error !== null) {
    lines.push({ text: cut(`daemon not reachable: ${view.error}`, w), color: 'red', bold: true });
    if (view.live !== false) lines.push({ text: cut(`retrying every ${(view.intervalMs / 1000).toFixed(view.intervalMs % 1000 === 0 ? 0 : 1)} s${r !== null && view.lastOkAt !== null ? `; below: as of ${clock(view.lastOkAt)}` : ''}`, w), color: 'yellow' });
  }
  if (r !== null) {
    const stale = view.error !== null;
    const d = r.daemon;
    const attached = r.jobs.filter((j) => jobState(j) === 'attached').length;
    lines.push({ text: cut(`daemon pid ${d.pid}  tzip ${d.version}  up ${formatDuration(d.uptime_ms)}  jobs ${r.jobs.length} (${attached} attached)`, w), dim: stale });
    lines.push({ text: cut(`settings: ${daemonSettingsText(d)}  MPS client: ${mpsText(d.mps)}`, w), dim: stale });
    const gpus = d.gpus ?? [];
    if (gpus.length === 0) lines.push({ text: 'GPU  none: CPU tensors only', dim: stale });
    const labelWidth = Math.max(0, ...gpus.map((g, i) => `GPU ${g.index ?? i} ${cut(g.name, 24)}`.length)) + 1;
    for (const [i, g] of gpus.entries()) {
      const used = g.memory_used_bytes ?? 0;
      const total = g.memory_total_bytes ?? 0;
      const mem = g.memory_total_bytes === null || g.memory_used_bytes === null ? 'memory ?' : `${formatSize(used)} / ${formatSize(total)}`;
      const label = `GPU ${g.index ?? i} ${cut(g.name, 24)}`.padEnd(labelWidth);
      lines.push({ text: cut(`${label}mem${meter(used, total, 32)} ${mem}  ${g.uuid}`, w), color: stale ? undefined : 'green', dim: stale });
    }
    lines.push({ text: cut(`codec rates (last 10 s): compress ${formatRate(d.rates?.compress_gbps)}  decompress ${formatRate(d.rates?.decompress_gbps)}`, w), color: stale ? undefined : 'cyan', dim: stale });
    lines.push({ text: '' });
    const { cols, pick } = fitColumns(w, Math.max(0, ...r.jobs.map((j) => j.name.length + 1)));
    lines.push({ text: cut(row(cols, cols.map((c) => c.head)), w).padEnd(w), inverse: true, bold: true });
    if (r.jobs.length === 0) lines.push({ text: 'no jobs: a process that says hello (tzip.connect(), tzip.attach()) is listed here', dim: true });
    for (const job of r.jobs) {
      const state = jobState(job);
      lines.push({
        text: cut(row(cols, pick([job.name, state, job.user ?? '-', pidsText(job.pids), devicesText(job.devices), mpsText(job.shares_mps),
          settingText(job.settings?.codec), settingText(job.settings?.sm_budget), ...figureCells(jobFigures(job))])), w),
        color: stale ? undefined : state === 'attached' ? 'green' : undefined,
        dim: stale || state === 'ended',
        bold: state === 'attached',
      });
      for (const [name, s] of Object.entries(job.streams ?? {})) {
        const f = streamFigures(s);
        if (f.requests === 0 && f.errors === 0) continue;
        lines.push({ text: cut(row(cols, pick([`  ${name}`, '', '', '', '', '', '', '', ...figureCells(f)])), w), dim: true });
      }
    }
  }
  if (view.live === false) return lines;
  lines.push({ text: '' });
  lines.push({ text: cut(`q quit   refresh ${(view.intervalMs / 1000).toString()} s${view.lastOkAt !== null ? `   updated ${clock(view.lastOkAt)}` : ''}`, w), dim: true });
  return lines;
}

type Ink = typeof import('ink');
type React = typeof import('react');

/**
 * The view as an ink component. ink and React are given, not imported by this module: they load only when
 * `tzip top` runs (ink alone takes longer to load than the rest of the CLI), not for `tzip --help`.
 */
function topApp(ink: Ink, react: React): (props: { client: DaemonClient; intervalMs: number }) => ReactElement {
  const { Box, Text, useApp, useInput, useStdin, useStdout } = ink;
  const { createElement: h, useEffect, useState } = react;

  /** The terminal's size, following resizes. */
  function useTerminalSize(): { columns: number; rows: number } {
    const { stdout } = useStdout();
    const [size, setSize] = useState({ columns: stdout.columns || 100, rows: stdout.rows || 40 });
    useEffect(() => {
      const onResize = (): void => setSize({ columns: stdout.columns || 100, rows: stdout.rows || 40 });
      stdout.on('resize', onResize);
      return () => {
        stdout.off('resize', onResize);
      };
    }, [stdout]);
    return size;
  }

  return function TopApp(props: { client: DaemonClient; intervalMs: number }): ReactElement {
    const { client, intervalMs } = props;
    const { exit } = useApp();
    const { isRawModeSupported } = useStdin();
    const size = useTerminalSize();
    const [view, setView] = useState<TopView>({ where: client.where, report: null, error: null, lastOkAt: null, intervalMs });
    const [now, setNow] = useState(Date.now());
    useInput((input) => {
      if (input === 'q' || input === 'Q') exit();
    }, { isActive: isRawModeSupported === true });
    useEffect(() => {
      let stopped = false;
      let timer: NodeJS.Timeout | undefined;
      const tick = async (): Promise<void> => {
        const started = Date.now();
        try {
          // A daemon that does not answer within two refreshes is shown as away; the next refresh asks again.
          const report = await fetchJobs(client, Math.max(1000, 2 * intervalMs));
          if (!stopped) setView((v) => ({ ...v, report, error: null, lastOkAt: Date.now() }));
        } catch (err) {
          if (!stopped) setView((v) => ({ ...v, error: err instanceof Error ? err.message : String(err) }));
        }
        if (stopped) return;
        setNow(Date.now());
        timer = setTimeout(() => void tick(), Math.max(0, intervalMs - (Date.now() - started)));
      };
      void tick();
      return () => {
        stopped = true;
        if (timer !== undefined) clearTimeout(timer);
        client.close();
      };
    }, [client, intervalMs]);
    // Like htop: never taller than the terminal (ink redraws a taller output from the top each time).
    const lines = topLines(view, size.columns, now).slice(0, Math.max(1, size.rows - 1));
    return h(Box, { flexDirection: 'column' }, ...lines.map((l, i) => h(Text, {
      key: i, wrap: 'truncate', color: l.color, bold: l.bold, inverse: l.inverse, dimColor: l.dim,
    }, l.text === '' ? ' ' : l.text)));
  };
}

function parseInterval(value: string): number {
  const n = Number(value);
  if (value.trim() === '' || !Number.isFinite(n) || n < 0.1 || n > 3600) throw new InvalidArgumentError(`'${value}' is not a number of seconds from 0.1 to 3600.`);
  return n;
}

interface TopOptions {
  socket?: string;
  interval: number;
  /** The root program's --json. */
  json?: boolean;
}

/**
 * Not on a terminal (stdout a file or a pipe), like `top -b -n 1`: one screen as plain text, after one request.
 * @throws TzipError when the daemon does not answer (after the screen that says so is printed).
 */
async function printOnce(client: DaemonClient, intervalMs: number): Promise<void> {
  const view: TopView = { where: client.where, report: null, error: null, lastOkAt: null, intervalMs, live: false };
  let failure: unknown;
  try {
    view.report = await fetchJobs(client);
    view.lastOkAt = Date.now();
  } catch (err) {
    failure = err;
    view.error = err instanceof Error ? err.message : String(err);
  } finally {
    client.close();
  }
  const width = Math.max(120, ...(view.report?.jobs ?? []).map((j) => j.name.length + 110));
  process.stdout.write(`${topLines(view, width, Date.now()).map((l) => l.text.trimEnd()).join('\n')}\n`);
  if (failure !== undefined) throw failure;
}

/**
 * `tzip top --json`, on a terminal or not: one snapshot, the `jobs` reply `tzip jobs --json` prints (`{daemon, jobs}`),
 * then exit. A stream of JSON screens would be a format of its own; a script that polls runs this once a refresh.
 * @throws TzipError when the daemon does not answer (main.ts prints it as the JSON error document, exit 3).
 */
async function printJson(client: DaemonClient): Promise<void> {
  try {
    const report = await fetchJobs(client);
    printResult(true, report, () => '');
  } finally {
    client.close();
  }
}

/**
 * Runs the view until q, Ctrl-C, SIGINT or SIGTERM; one screen of text when stdout is not a terminal; one JSON
 * snapshot with --json.
 */
async function runTop(opts: TopOptions): Promise<void> {
  const client = DaemonClient.open({ socket: opts.socket });
  const intervalMs = Math.round(opts.interval * 1000);
  if (opts.json === true) {
    await printJson(client);
    return;
  }
  if (process.stdout.isTTY !== true) {
    await printOnce(client, intervalMs);
    return;
  }
  // With CI or CONTINUOUS_INTEGRATION set, ink (is-in-ci, read when ink loads) draws only the last frame, at exit:
  // a live view asked for on a terminal is drawn live wherever it runs (a CI job's shell, a test's tmux).
  delete process.env.CI;
  delete process.env.CONTINUOUS_INTEGRATION;
  const [ink, react] = await Promise.all([import('ink'), import('react')]);
  const TopApp = topApp(ink, react);
  // The alternate screen (as htop and less use): the shell's screen comes back as it was on quit.
  process.stdout.write('\x1b[?1049h\x1b[H');
  const app = ink.render(react.createElement(TopApp, { client, intervalMs }), { exitOnCtrlC: true, patchConsole: true });
  // Ctrl-C reaches ink as a key while it reads the terminal in raw mode; as SIGINT when stdin is not a terminal.
  const onSignal = (): void => app.unmount();
  process.once('SIGINT', onSignal);
  process.once('SIGTERM', onSignal);
  try {
    await app.waitUntilExit();
  } finally {
    process.removeListener('SIGINT', onSignal);
    process.removeListener('SIGTERM', onSignal);
    client.close();
    process.stdout.write('\x1b[?1049l');
  }
}

/** Adds the `top` command to `program`. */
export function registerTop(program: Command): void {
  program
    .command('top')
    .description('live view of the daemon (SM budget, GPU memory, codec rates) and of every job it serves, refreshed every second; q quits (not on a terminal: one screen as text; --json: one snapshot, as `tzip jobs --json`)')
    .addOption(socketOption())
    .addOption(new Option('--interval <seconds>', 'refresh interval').argParser(parseInterval).default(1))
    .action(async (_opts: unknown, cmd: Command) => {
      await runTop(cmd.optsWithGlobals<TopOptions>());
    });
}
