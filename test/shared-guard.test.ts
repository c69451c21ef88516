/**
 * The addon's SIGBUS guard of mapShared (cuda/src/addon/shared_guard.h): a /dev/shm file that shrinks under a
 * mapping must not kill the process that reads or writes the mapping. Run in a child process, so that a missing
 * guard shows as that child dying of SIGBUS rather than as this test runner dying.
 */
import { spawnSync } from 'node:child_process';
import { describe, expect, it } from 'vitest';
import { addonPath } from '../src/native.js';

const CHILD = `
const a = require(process.argv[1]);
const fs = require('node:fs');
const path = '/dev/shm/tzip-guard-test-' + process.pid;
const n = 4 << 20;
fs.writeFileSync(path, Buffer.alloc(n, 7));
(async () => {
  try {
    const m = a.mapShared(path, true);
    const before = a.mapSharedFaulted(m);
    fs.truncateSync(path, 4096);
    const frame = await a.compress(m, { dtype: 'U8', shape: [n], codec: 'bytes' });   // codec threads read cut pages
    const back = await a.decompress(frame, {});
    const readBack = [back[0], back[4095], back[4096], back[n - 1]];                   // the first page, then zeros
    m.fill(9, 4096);                                                                  // the JS thread writes cut pages
    const other = a.mapShared(path, false);                                           // a new mapping of the cut file
    console.log(JSON.stringify({ before, after: a.mapSharedFaulted(m), readBack, otherLength: other.length,
                                 otherFaulted: a.mapSharedFaulted(other) }));
  } finally {
    fs.unlinkSync(path);
  }
})();
`;

/** Runs `script` in a child Node with the addon's path as argv[1]; expects it to exit 0 (no signal); its stdout's JSON. */
function runChild(script: string): unknown {
  const r = spawnSync(process.execPath, ['-e', script, addonPath()], { encoding: 'utf8', timeout: 60_000 });
  expect(r.signal, r.stderr).toBeNull();
  expect(r.status, r.stderr).toBe(0);
  return JSON.parse(r.stdout.trim());
}

describe('mapShared SIGBUS guard', () => {
  it('survives a file shrunk under its mapping, reads zeros there and reports the mapping faulted', () => {
    expect(runChild(CHILD)).toEqual({
      before: false, after: true, readBack: [7, 7, 0, 0], otherLength: 4096, otherFaulted: false,
    });
  });
});

// A /dev/shm file above Node's Buffer size limit (2^32 bytes in Node 20; a sparse file, no memory used): mapShared
// must refuse it with an error. The Buffer made through node-addon-api with a finalizer freed its record twice there
// ('free(): double free'), which would let a client that names such a file kill the daemon for every other job.
const BIG_CHILD = `
const a = require(process.argv[1]);
const fs = require('node:fs');
const path = '/dev/shm/tzip-big-map-test-' + process.pid;
fs.closeSync(fs.openSync(path, 'w'));
fs.truncateSync(path, 5 * 2 ** 30);
try {
  try {
    a.mapShared(path, false);
    console.log(JSON.stringify({ mapped: true }));
  } catch (e) {
    console.log(JSON.stringify({ code: e.code, message: e.message }));
  }
} finally {
  fs.unlinkSync(path);
}
`;

describe('mapShared of a file larger than a Buffer', () => {
  it('is TZIP_UNSUPPORTED, and the process lives', () => {
    const out = runChild(BIG_CHILD) as { code: string; message: string };
    expect(out.code).toBe('TZIP_UNSUPPORTED');
    expect(out.message).toContain("above Node's Buffer size limit");
  });
});
