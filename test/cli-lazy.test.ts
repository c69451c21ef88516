// The CLI loads a command's modules only when that command runs (src/cli/main.ts): the compiled CLI runs with a
// preload that logs every ES module Node loads (a module.register load hook) and every CommonJS module and addon in
// require's cache at exit, and each command's log is checked for what it must not load. Start-up time itself is a
// benchmark (src/bench/cli-startup.ts), not a test.
import { execFile } from 'node:child_process';
import { readFileSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defaultLimits } from '../src/daemon/limits.js';
import { Daemon } from '../src/daemon/server.js';
import { compressFile } from '../src/writer.js';
import { ensureBuilt } from './helpers/cli.js';
import { useTempDir } from './helpers/temp-dir.js';

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const MAIN = join(ROOT, 'dist', 'src', 'cli', 'main.js');
const tmp = useTempDir('cli-lazy');

const HOOKS = `import { appendFileSync } from 'node:fs';
export async function load(url, context, next) {
  appendFileSync(process.env.TZIP_MODULE_LOG, url + '\\n');
  return next(url, context);
}
`;
const PRELOAD = `import { register, createRequire } from 'node:module';
import { appendFileSync } from 'node:fs';
register('./hooks.mjs', import.meta.url);
const require = createRequire(import.meta.url);
process.on('exit', () => appendFileSync(process.env.TZIP_MODULE_LOG, Object.keys(require.cache).join('\\n') + '\\n'));
`;

let daemon: Daemon;
let socket: string;
let tzipFile: string;

/** The modules `tzip ...args` loaded (file URLs and paths, one a line), after checking it exited 0. */
function modulesOf(args: string[]): Promise<string> {
  const log = join(tmp(), `modules-${Math.random().toString(16).slice(2)}.log`);
  writeFileSync(log, '');
  return new Promise((resolve, reject) => {
    execFile(process.execPath, ['--import', pathToFileURL(join(tmp(), 'preload.mjs')).href, MAIN, ...args],
      { cwd: tmp(), env: { ...process.env, TZIP_MODULE_LOG: log, FORCE_COLOR: '0' } }, (error, _stdout, stderr) => {
        if (error !== null) {
          reject(new Error(`tzip ${args.join(' ')} failed: ${stderr}`));
          return;
        }
        const text = readFileSync(log, 'utf8');
        rmSync(log);
        resolve(text);
      });
  });
}

beforeAll(async () => {
  ensureBuilt();
  writeFileSync(join(tmp(), 'hooks.mjs'), HOOKS);
  writeFileSync(join(tmp(), 'preload.mjs'), PRELOAD);
  socket = join(tmp(), 'd', 'tzip.sock');
  daemon = await Daemon.start({ socketPath: socket, limits: defaultLimits(), log: () => undefined });
  // A real .tzip to inspect: the bundled model's weights, compressed by the CLI.
  tzipFile = join(tmp(), 'weights.tzip');
  await new Promise<void>((resolve, reject) => {
    execFile(process.execPath, [MAIN, 'compress', join(ROOT, 'data', 'demo', 'minilm-weights-bf16.safetensors'), '-o', tzipFile],
      (error, _o, stderr) => (error === null ? resolve() : reject(new Error(stderr))));
  });
});

afterAll(async () => {
  await daemon?.stop('tests done');
});

const ADDON = 'build/Release/tzip.node';
const COMMAND_MODULES = ['compress', 'decompress', 'verify', 'inspect', 'extract', 'bench', 'serve', 'jobs', 'top', 'set'];

function commandModules(log: string): string[] {
  return COMMAND_MODULES.filter((c) => log.includes(`/dist/src/cli/${c}.js`));
}

describe('lazy loading of commands', () => {
  it('tzip --version loads no command, no addon, no zod, no ZeroMQ', async () => {
    const log = await modulesOf(['--version']);
    expect(log).toContain('/dist/src/cli/main.js');
    expect(commandModules(log)).toEqual([]);
    for (const heavy of [ADDON, '/node_modules/zod/', '/node_modules/zeromq/', '/node_modules/ink/', '/node_modules/cli-table3/']) expect(log).not.toContain(heavy);
  });

  it('tzip inspect loads inspect and the addon, not ZeroMQ, ink or the daemon', async () => {
    const log = await modulesOf(['inspect', tzipFile]);
    expect(commandModules(log)).toEqual(['inspect']);
    expect(log).toContain(ADDON);
    for (const heavy of ['/node_modules/zeromq/', '/node_modules/ink/', '/node_modules/react/', '/dist/src/daemon/server.js', '/node_modules/pino/']) expect(log).not.toContain(heavy);
  });

  it('tzip jobs loads jobs and ZeroMQ, not the addon, zod, ink or the daemon', async () => {
    const log = await modulesOf(['jobs', '--socket', socket]);
    expect(commandModules(log)).toEqual(['jobs']);
    expect(log).toContain('/node_modules/zeromq/');
    for (const heavy of [ADDON, '/node_modules/zod/', '/node_modules/ink/', '/node_modules/react/', '/dist/src/daemon/server.js', '/node_modules/msgpackr-extract/']) {
      expect(log).not.toContain(heavy);
    }
  });

  it('tzip compress and decompress of a file load no zod, cli-progress, xxhash-wasm or folder code, and round-trip', async () => {
    const input = join(ROOT, 'data', 'demo', 'minilm-weights-bf16.safetensors');
    const packed = join(tmp(), 'lazy.tzip');
    const restored = join(tmp(), 'lazy.safetensors');
    const lazy = ['/node_modules/zod/', '/node_modules/cli-progress/', '/node_modules/xxhash-wasm/', '/dist/src/folder.js', '/dist/src/cli/folder-output.js'];
    const compressLog = await modulesOf(['compress', input, '-o', packed, '--codec', 'fast']);
    expect(commandModules(compressLog)).toEqual(['compress']);
    expect(compressLog).toContain(ADDON);
    for (const heavy of [...lazy, '/dist/src/restore.js', '/dist/src/reader.js', '/node_modules/commander/esm.mjs']) expect(compressLog).not.toContain(heavy);
    // The same bytes as the library writes, which loads everything the CLI leaves out.
    const direct = join(tmp(), 'direct.tzip');
    await compressFile(input, direct, { codec: 'fast' });
    expect(readFileSync(packed).equals(readFileSync(direct))).toBe(true);
    const decompressLog = await modulesOf(['decompress', packed, '-o', restored]);
    expect(commandModules(decompressLog)).toEqual(['decompress']);
    for (const heavy of [...lazy, '/dist/src/writer.js']) expect(decompressLog).not.toContain(heavy);
    expect(readFileSync(restored).equals(readFileSync(input))).toBe(true);
  }, 60_000);

  it('tzip --help loads every command and lists it, without ink', async () => {
    const log = await modulesOf(['--help']);
    expect(commandModules(log)).toEqual(COMMAND_MODULES);
    expect(log).not.toContain('/node_modules/ink/');
  });
});
