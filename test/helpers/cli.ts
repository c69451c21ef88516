/**
 * Test helper: runs the compiled `tzip` CLI (bin/tzip: the native CLI or dist/src/cli/main.js) in a child process, compiling
 * the TypeScript first when dist is missing or older than src (scripts/setup.sh normally builds it).
 */
import { execFile, execFileSync, spawn } from 'node:child_process';
import { existsSync, readdirSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';

const ROOT = fileURLToPath(new URL('../..', import.meta.url));
const MAIN = join(ROOT, 'dist', 'src', 'cli', 'main.js');

function newestMtime(dir: string): number {
  let newest = 0;
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    const path = join(dir, entry.name);
    newest = Math.max(newest, entry.isDirectory() ? newestMtime(path) : statSync(path).mtimeMs);
  }
  return newest;
}

/**
 * Compiles src/ to dist/ with the project's tsc unless dist/src holds main.js and was written after
 * the newest source file (tsc leaves unchanged outputs alone, so the newest output file is compared).
 */
export function ensureBuilt(): void {
  if (existsSync(MAIN) && newestMtime(join(ROOT, 'dist', 'src')) >= newestMtime(join(ROOT, 'src'))) return;
  execFileSync(process.execPath, [join(ROOT, 'node_modules', 'typescript', 'bin', 'tsc'), '-p', join(ROOT, 'tsconfig.json')], { stdio: 'inherit' });
}

/** A `tzip serve` child process (see {@link startServe}). */
export interface ServeChild {
  /** SIGTERM, then resolves when it has exited. */
  stop(): Promise<void>;
  /** What it wrote to stderr so far (its log, and the addon's TZIP_TRACE lines). */
  stderr(): string;
}

/**
 * Starts `tzip serve --socket socket` in a child process (compiling first, as {@link ensureBuilt}) and resolves once
 * its socket exists (within 15 s). Tests whose daemon must be another process (one that opens this process's CUDA
 * IPC handles, or one started with `opts.env`) use it. @throws Error with the child's stderr when the socket did not
 * appear.
 */
export async function startServe(socket: string, opts: { env?: NodeJS.ProcessEnv } = {}): Promise<ServeChild> {
  ensureBuilt();
  const child = spawn(process.execPath, [MAIN, 'serve', '--socket', socket], { stdio: ['ignore', 'ignore', 'pipe'], env: { ...process.env, ...opts.env } });
  let stderr = '';
  child.stderr?.on('data', (b: Buffer) => { stderr += b.toString(); });
  const stop = async (): Promise<void> => {
    if (child.exitCode !== null || child.signalCode !== null) return;
    const exited = new Promise((r) => child.once('exit', r));
    child.kill('SIGTERM');
    await exited;
  };
  for (let i = 0; i < 300 && !existsSync(socket); i++) await new Promise((r) => setTimeout(r, 50));
  if (!existsSync(socket)) {
    await stop();
    throw new Error(`tzip serve did not start: ${stderr}`);
  }
  return { stop, stderr: () => stderr };
}

/** What a CLI run produced. */
export interface CliResult {
  code: number;
  stdout: string;
  stderr: string;
}

/**
 * The `tzip` command as users run it: bin/tzip, which runs the native CLI (build/Release/tzip-native) when it is built
 * and the Node CLI otherwise; the native CLI hands everything it does not do itself to the Node CLI.
 */
const LAUNCHER = join(ROOT, 'bin', 'tzip');

/** Runs `tzip ...args` (bin/tzip) with `cwd`; never rejects (the exit code is in the result). */
export function runTzip(args: readonly string[], cwd: string): Promise<CliResult> {
  return new Promise((resolve) => {
    execFile(LAUNCHER, [...args], { cwd, maxBuffer: 64 << 20, env: { ...process.env, FORCE_COLOR: '0', TZIP_NODE: process.execPath } }, (error, stdout, stderr) => {
      const code = error === null ? 0 : typeof error.code === 'number' ? error.code : -1;
      resolve({ code, stdout, stderr });
    });
  });
}
