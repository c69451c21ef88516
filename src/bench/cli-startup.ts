/**
 * Benchmark of the CLI's start-up: the wall time of `tzip --version`, `tzip inspect FILE` and `tzip jobs`
 * (against a daemon this script starts) next to a bare `node -e 0`, each run as a fresh process, the
 * commands taken in turn round after round (so a busy machine slows them alike), median and minimum.
 *
 *   node dist/src/bench/cli-startup.js [--runs N] [--file SAFETENSORS]
 *
 * The .tzip that `inspect` reads is made from FILE (default data/demo/minilm-weights-bf16.safetensors)
 * with `tzip compress`. Prints the machine, the load average, the commands and the times.
 */
import { spawn, spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
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

/** Runs `argv` once; returns its wall time in ms. @throws Error when it exits non-zero. */
function timeOnce(argv: readonly string[], env: NodeJS.ProcessEnv): number {
  const t0 = performance.now();
  const r = spawnSync(argv[0] as string, argv.slice(1), { env, stdio: ['ignore', 'ignore', 'pipe'] });
  const ms = performance.now() - t0;
  if (r.status !== 0) throw new Error(`${argv.join(' ')} exited ${r.status}: ${r.stderr.toString()}`);
  return ms;
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
  const made = spawnSync(process.execPath, [MAIN, 'compress', file, '-o', tzipFile], { stdio: 'inherit' });
  if (made.status !== 0) throw new Error(`tzip compress ${file} failed`);
  const daemon = await startDaemon(socket);
  try {
    const node = process.execPath;
    const cases: Case[] = [
      { label: 'node -e 0', argv: [node, '-e', '0'], times: [] },
      { label: 'tzip --version', argv: [node, MAIN, '--version'], times: [] },
      { label: 'tzip inspect weights.tzip', argv: [node, MAIN, 'inspect', tzipFile], times: [] },
      { label: 'tzip jobs', argv: [node, MAIN, 'jobs', '--socket', socket], times: [] },
      { label: 'tzip jobs --json', argv: [node, MAIN, '--json', 'jobs', '--socket', socket], times: [] },
    ];
    for (const c of cases) timeOnce(c.argv, env); // warm the page cache
    const loadBefore = loadavg();
    for (let r = 0; r < runs; r++) for (const c of cases) c.times.push(timeOnce(c.argv, env));
    const loadAfter = loadavg();
    const base = cases[0] as Case;
    const baseMedian = median(base.times);
    const baseMin = Math.min(...base.times);
    console.log(`tzip CLI start-up: ${runs} runs of each command, in turn; wall time of a fresh process (spawnSync)`);
    console.log(`machine: ${describeMachine(machineInfo())}`);
    console.log(`load average (1 min) ${loadBefore[0]?.toFixed(2)} before, ${loadAfter[0]?.toFixed(2)} after`);
    console.log(`command: node ${process.argv.slice(1).map((a) => a.replace(packageRoot() + '/', '')).join(' ')}`);
    console.log(`inspect reads ${tzipFile.replace(dir, '$TMP')} (from ${file.replace(packageRoot() + '/', '')}); jobs asks a tzip serve on $TMP/d/tzip.sock`);
    console.log('');
    console.log(`${'command'.padEnd(28)}${'median ms'.padStart(10)}${'min ms'.padStart(9)}${'x node (median)'.padStart(17)}${'x node (min)'.padStart(14)}`);
    for (const c of cases) {
      const med = median(c.times);
      const min = Math.min(...c.times);
      console.log(`${c.label.padEnd(28)}${med.toFixed(1).padStart(10)}${min.toFixed(1).padStart(9)}${(med / baseMedian).toFixed(2).padStart(17)}${(min / baseMin).toFixed(2).padStart(14)}`);
    }
  } finally {
    daemon.kill('SIGTERM');
    await new Promise((r) => daemon.once('exit', r));
    rmSync(dir, { recursive: true, force: true });
  }
}

await main();
