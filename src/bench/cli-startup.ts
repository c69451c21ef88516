/**
 * Benchmark of the CLI's start-up: the wall time of `tzip --version`, `tzip inspect FILE` and `tzip jobs`
 * (against a daemon this script starts) next to a bare `node -e 0`, each run as a fresh process, the
 * commands taken in turn round after round (so a busy machine slows them alike), median and minimum.
 *
 *   node dist/src/bench/cli-startup.js [--runs N] [--file SAFETENSORS]
 *
 * `inspect` reads two .tzip files made with `tzip compress`: FILE (default the bundled model's weights,
 * data/demo/minilm-weights-bf16.safetensors: 104 entries, whose table takes time to lay out and print) and
 * a small one of FILE's two smallest tensors (start-up alone). Prints the machine, the load average, the
 * commands and the times: wall time (median, minimum) and CPU time (user + system, mean per run, from this
 * process's children's times in /proc/self/stat, which count in clock ticks: summed over the runs, the mean is
 * finer than a tick). On a shared machine the CPU time varies less than the wall time.
 */
import { spawn, spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { describeMachine, machineInfo } from '../machine.js';
import { packageRoot } from '../package-root.js';

const MAIN = join(packageRoot(), 'dist', 'src', 'cli', 'main.js');

interface Case {
  label: string;
  argv: string[];
  times: number[];
  /** CPU ticks (user + system) of its runs, summed. */
  cpuTicks: number;
}

/** Clock ticks per second of /proc's times (USER_HZ: 100 on Linux for every architecture in use). */
const USER_HZ = 100;

/** User + system time of this process's waited-for children, in clock ticks (/proc/self/stat fields 16, 17); null off Linux. */
function childTicks(): number | null {
  try {
    const stat = readFileSync('/proc/self/stat', 'utf8');
    // Fields after the command name, which is in parentheses and may hold spaces.
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    return Number(fields[13]) + Number(fields[14]);
  } catch {
    return null;
  }
}

function arg(name: string, fallback: string): string {
  const i = process.argv.indexOf(name);
  return i >= 0 && i + 1 < process.argv.length ? (process.argv[i + 1] as string) : fallback;
}

function median(xs: readonly number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 === 1 ? (s[m] as number) : ((s[m - 1] as number) + (s[m] as number)) / 2;
}

/** Runs `argv` once; returns its wall time in ms and CPU time in ticks. @throws Error when it exits non-zero. */
function timeOnce(argv: readonly string[], env: NodeJS.ProcessEnv): { ms: number; ticks: number } {
  const ticks0 = childTicks() ?? 0;
  const t0 = performance.now();
  const r = spawnSync(argv[0] as string, argv.slice(1), { env, stdio: ['ignore', 'ignore', 'pipe'] });
  const ms = performance.now() - t0;
  const ticks = (childTicks() ?? 0) - ticks0;
  if (r.status !== 0) throw new Error(`${argv.join(' ')} exited ${r.status}: ${r.stderr.toString()}`);
  return { ms, ticks };
}

/** Writes a safetensors file of the two smallest tensors of `source` (their bytes as they are). */
function smallSafetensors(source: string, dest: string): void {
  const bytes = readFileSync(source);
  const n = Number(bytes.readBigUInt64LE(0));
  const header = JSON.parse(bytes.subarray(8, 8 + n).toString('utf8')) as Record<string, { dtype: string; shape: number[]; data_offsets: [number, number] }>;
  const picked = Object.entries(header).filter(([k]) => k !== '__metadata__')
    .sort((a, b) => (a[1].data_offsets[1] - a[1].data_offsets[0]) - (b[1].data_offsets[1] - b[1].data_offsets[0])).slice(0, 2);
  const out: Record<string, unknown> = {};
  const parts: Buffer[] = [];
  let at = 0;
  for (const [name, t] of picked) {
    const data = bytes.subarray(8 + n + t.data_offsets[0], 8 + n + t.data_offsets[1]);
    out[name] = { dtype: t.dtype, shape: t.shape, data_offsets: [at, at + data.length] };
    parts.push(data);
    at += data.length;
  }
  const json = Buffer.from(JSON.stringify(out));
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(json.length));
  writeFileSync(dest, Buffer.concat([len, json, ...parts]));
}

/** Starts `tzip serve` on `socket`; resolves when it listens. */
function startDaemon(socket: string): Promise<import('node:child_process').ChildProcess> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [MAIN, 'serve', '--json', '--socket', socket], { stdio: ['ignore', 'pipe', 'inherit'] });
    let out = '';
    child.stdout.on('data', (b: Buffer) => {
      out += b.toString();
      if (out.includes('"listening"')) resolve(child);
    });
    child.once('exit', (code) => reject(new Error(`tzip serve exited ${code} before listening`)));
  });
}

async function main(): Promise<void> {
  const runs = Number(arg('--runs', '30'));
  const file = arg('--file', join(packageRoot(), 'data', 'demo', 'minilm-weights-bf16.safetensors'));
  const dir = mkdtempSync(join(tmpdir(), 'tzip-cli-startup-'));
  const tzipFile = join(dir, 'weights.tzip');
  const socket = join(dir, 'd', 'tzip.sock');
  const env = { ...process.env, FORCE_COLOR: '0' };
  const smallSource = join(dir, 'small.safetensors');
  const smallFile = join(dir, 'small.tzip');
  smallSafetensors(file, smallSource);
  for (const [from, to] of [[file, tzipFile], [smallSource, smallFile]] as const) {
    const made = spawnSync(process.execPath, [MAIN, 'compress', from, '-o', to], { stdio: ['ignore', 'ignore', 'inherit'] });
    if (made.status !== 0) throw new Error(`tzip compress ${from} failed`);
  }
  const daemon = await startDaemon(socket);
  try {
    const node = process.execPath;
    const cases: Case[] = [
      { label: 'node -e 0', argv: [node, '-e', '0'], times: [], cpuTicks: 0 },
      { label: 'tzip --version', argv: [node, MAIN, '--version'], times: [], cpuTicks: 0 },
      { label: 'tzip inspect small.tzip', argv: [node, MAIN, 'inspect', smallFile], times: [], cpuTicks: 0 },
      { label: 'tzip inspect weights.tzip', argv: [node, MAIN, 'inspect', tzipFile], times: [], cpuTicks: 0 },
      { label: 'tzip jobs', argv: [node, MAIN, 'jobs', '--socket', socket], times: [], cpuTicks: 0 },
      { label: 'tzip jobs --json', argv: [node, MAIN, '--json', 'jobs', '--socket', socket], times: [], cpuTicks: 0 },
    ];
    for (const c of cases) timeOnce(c.argv, env); // warm the page cache
    const loadBefore = loadavg();
    for (let r = 0; r < runs; r++) {
      for (const c of cases) {
        const t = timeOnce(c.argv, env);
        c.times.push(t.ms);
        c.cpuTicks += t.ticks;
      }
    }
    const hasCpu = childTicks() !== null;
    const cpuMs = (c: Case): number => (c.cpuTicks * 1000) / USER_HZ / runs;
    const loadAfter = loadavg();
    const base = cases[0] as Case;
    const baseMedian = median(base.times);
    const baseMin = Math.min(...base.times);
    console.log(`tzip CLI start-up: ${runs} runs of each command, in turn; wall time of a fresh process (spawnSync)`);
    console.log(`machine: ${describeMachine(machineInfo())}`);
    console.log(`load average (1 min) ${loadBefore[0]?.toFixed(2)} before, ${loadAfter[0]?.toFixed(2)} after`);
    console.log(`command: node ${process.argv.slice(1).map((a) => a.replace(packageRoot() + '/', '')).join(' ')}`);
    console.log(`inspect reads small.tzip (the 2 smallest tensors of the file) and weights.tzip (${file.replace(packageRoot() + '/', '')}); jobs asks a tzip serve on $TMP/d/tzip.sock`);
    console.log('');
    const cpuHead = hasCpu ? `${'CPU ms'.padStart(9)}${'x node'.padStart(8)}` : '';
    console.log(`${'command'.padEnd(28)}${'wall: median ms'.padStart(16)}${'x node'.padStart(8)}${'min ms'.padStart(9)}${'x node'.padStart(8)}${cpuHead}`);
    for (const c of cases) {
      const med = median(c.times);
      const min = Math.min(...c.times);
      const cpu = hasCpu ? `${cpuMs(c).toFixed(1).padStart(9)}${(cpuMs(c) / cpuMs(base)).toFixed(2).padStart(8)}` : '';
      console.log(`${c.label.padEnd(28)}${med.toFixed(1).padStart(16)}${(med / baseMedian).toFixed(2).padStart(8)}${min.toFixed(1).padStart(9)}${(min / baseMin).toFixed(2).padStart(8)}${cpu}`);
    }
  } finally {
    daemon.kill('SIGTERM');
    await new Promise((r) => daemon.once('exit', r));
    rmSync(dir, { recursive: true, force: true });
  }
}

await main();
