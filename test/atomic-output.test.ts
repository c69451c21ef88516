// Output files: what `-o PATH` replaces. A symbolic link is followed, a file keeps its mode, a device is written in
// place (never renamed over), a FIFO or socket is refused at once; a FIFO as input is refused without waiting for a
// writer. Devices are made with mknod in the test's own folder, so a regression cannot replace the machine's /dev/null.
import { execFileSync } from 'node:child_process';
import { rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { lstat, readFile, readlink, stat, symlink, writeFile, chmod } from 'node:fs/promises';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { writeAtomically } from '../src/atomic-output.js';
import { TzipError } from '../src/errors.js';
import { writeExactly } from '../src/positioned-io.js';
import { openTzip } from '../src/reader.js';
import { useTempDir } from './helpers/temp-dir.js';

const tmp = useTempDir('atomic-output');
const BYTES = Buffer.from('new bytes\n');

const put = (target: string): Promise<void> => writeAtomically(target, (out) => writeExactly(out, BYTES, 0, target));

/** Makes a character device node (major, minor) at `path`; false when this user may not (not root). */
function mknodChar(path: string, major: number, minor: number): boolean {
  try {
    execFileSync('mknod', [path, 'c', String(major), String(minor)], { stdio: 'ignore' });
    return true;
  } catch {
    return false;
  }
}

/** Whether this user may make device nodes (root): probed once, in the system's temp folder. */
const CAN_MKNOD = ((): boolean => {
  const probe = join(tmpdir(), `tzip-mknod-probe-${process.pid}`);
  const ok = mknodChar(probe, 1, 3);
  rmSync(probe, { force: true });
  return ok;
})();

async function expectIoError(p: Promise<unknown>, detail: RegExp): Promise<void> {
  const err = await p.then(() => undefined, (e: unknown) => e);
  expect(err).toBeInstanceOf(TzipError);
  expect((err as TzipError).code).toBe('TZIP_IO');
  expect((err as TzipError).message).toMatch(detail);
}

describe('writeAtomically', () => {
  it('writes through a symbolic link: the link stays, its destination gets the bytes', async () => {
    const real = join(tmp(), 'real.bin');
    const link = join(tmp(), 'link.bin');
    await writeFile(real, 'old');
    await symlink('real.bin', link);
    await put(link);
    expect((await lstat(link)).isSymbolicLink()).toBe(true);
    expect(await readlink(link)).toBe('real.bin');
    expect(await readFile(real)).toEqual(BYTES);
  });

  it('creates the destination of a dangling link, and refuses a loop of links', async () => {
    const link = join(tmp(), 'dangling.bin');
    await symlink('made-by-link.bin', link);
    await put(link);
    expect((await lstat(link)).isSymbolicLink()).toBe(true);
    expect(await readFile(join(tmp(), 'made-by-link.bin'))).toEqual(BYTES);
    await symlink('loop-b', join(tmp(), 'loop-a'));
    await symlink('loop-a', join(tmp(), 'loop-b'));
    await expectIoError(put(join(tmp(), 'loop-a')), /symbolic links/);
  });

  it("keeps an existing file's permission bits; a new file gets the umask's", async () => {
    const secret = join(tmp(), 'secret.bin');
    await writeFile(secret, 'old');
    await chmod(secret, 0o600);
    await put(secret);
    expect((await stat(secret)).mode & 0o777).toBe(0o600);
    expect(await readFile(secret)).toEqual(BYTES);
    const fresh = join(tmp(), 'fresh.bin');
    await put(fresh);
    expect((await stat(fresh)).mode & 0o777).toBe(0o666 & ~process.umask());
  });

  it('refuses a FIFO at once (no wait for a reader) and leaves it a FIFO', async () => {
    const fifo = join(tmp(), 'out.fifo');
    execFileSync('mkfifo', [fifo]);
    await expectIoError(put(fifo), /is a FIFO/);
    expect((await stat(fifo)).isFIFO()).toBe(true);
  });

  it.skipIf(!CAN_MKNOD)(
    'writes a device in place: a null device stays a device, a full one fails with ENOSPC and stays a device (needs root: mknod)',
    async () => {
      const nul = join(tmp(), 'null');
      const full = join(tmp(), 'full');
      expect(mknodChar(nul, 1, 3) && mknodChar(full, 1, 7)).toBe(true);
      await put(nul);
      expect((await stat(nul)).isCharacterDevice()).toBe(true);
      await expectIoError(put(full), /ENOSPC|no space/i);
      expect((await stat(full)).isCharacterDevice()).toBe(true);
    },
  );
});

describe('openReadOnly (via openTzip)', () => {
  it('refuses a FIFO as input without waiting for a writer', async () => {
    const fifo = join(tmp(), 'in.fifo');
    execFileSync('mkfifo', [fifo]);
    const started = Date.now();
    await expectIoError(openTzip(fifo), /is a FIFO/);
    expect(Date.now() - started).toBeLessThan(5000);
  });
});
