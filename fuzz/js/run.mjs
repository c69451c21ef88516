// Standalone runner of the TypeScript decoders' fuzz targets (fuzz/js/targets.mjs): fast-check (devDependency)
// generates inputs by mutating seeds of real streams, with an execution counter and a time budget.
// COVERAGE-BLIND: unlike libFuzzer it keeps no corpus of inputs that reached new code (jazzer.js, the
// libFuzzer-based JS fuzzer, does not load on this machine: fuzz/README.md). What it does instead: byte-level
// mutations (bit flips, interesting integers at any offset, inserts, deletes, truncation, splicing two seeds) and,
// for the JSON and MessagePack inputs, mutations of the decoded value tree, re-encoded.
// Usage: node fuzz/js/run.mjs --target container|safetensors|protocol --seconds N --seeds DIR
//          [--regressions DIR] [--artifacts PREFIX] [--seed N]
// Exit 0 after the budget with the line "stats: executions E seconds S corpus C"; exit 1 on a failure, whose input
// is written to PREFIX + "crash-<sha1>" (copy it to fuzz/regressions/js_<target>/ with the fix).
import { createHash } from 'node:crypto';
import { existsSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import fc from 'fast-check';
import { Packr, Unpackr } from 'msgpackr';
import { TARGETS, cleanup } from './targets.mjs';

const { values: args } = parseArgs({
  options: {
    target: { type: 'string' }, seconds: { type: 'string', default: '10' }, seeds: { type: 'string' },
    regressions: { type: 'string' }, artifacts: { type: 'string', default: 'build/fuzz/js-' }, seed: { type: 'string' },
  },
});
const target = TARGETS[args.target];
if (!target || !args.seeds) {
  console.error('usage: node fuzz/js/run.mjs --target container|safetensors|protocol --seconds N --seeds DIR');
  process.exit(2);
}
const readDir = (d) => (d && existsSync(d) ? readdirSync(d).sort().map((f) => readFileSync(join(d, f))) : []);
const seeds = readDir(args.seeds);
// Without seeds (make-seeds.mjs found no real files) the run starts from one empty input rather than not at all.
if (seeds.length === 0) { console.error(`no seeds in ${args.seeds}: starting from an empty input`); seeds.push(Buffer.alloc(0)); }

/** Writes the failing input and exits 1. */
function report(bytes, err) {
  const file = `${args.artifacts}crash-${createHash('sha1').update(bytes).digest('hex')}`;
  writeFileSync(file, bytes);
  console.error(`FAILURE in ${args.target}: ${err?.stack ?? err}\ninput (${bytes.byteLength} bytes) written to ${file}`);
  cleanup();
  process.exit(1);
}

// 1. Reproducers of failures found before.
for (const bytes of readDir(args.regressions)) {
  try { await target.check(bytes); } catch (err) { report(bytes, err); }
}

// 2. Mutations of the seeds.
const INTERESTING = [0, 1, 2, 7, 8, 15, 16, 31, 32, 0x7f, 0x80, 0xff, 0x100, 0xfff, 0x1000, 0x7fff, 0x8000, 0xffff,
  0x10000, 0x7fffffff, 0x80000000, 0xffffffff, 2 ** 32, 2 ** 53 - 1, 2 ** 53, 2 ** 63, 2 ** 64 - 1];
const byteOp = fc.oneof(
  fc.record({ op: fc.constant('flip'), at: fc.nat(), bit: fc.nat(7) }),
  fc.record({ op: fc.constant('set'), at: fc.nat(), value: fc.nat(255) }),
  fc.record({ op: fc.constant('int'), at: fc.nat(), width: fc.constantFrom(1, 2, 4, 8), value: fc.constantFrom(...INTERESTING), delta: fc.integer({ min: -2, max: 2 }) }),
  fc.record({ op: fc.constant('insert'), at: fc.nat(), bytes: fc.uint8Array({ maxLength: 16 }) }),
  fc.record({ op: fc.constant('delete'), at: fc.nat(), length: fc.integer({ min: 1, max: 64 }) }),
  fc.record({ op: fc.constant('truncate'), at: fc.nat() }),
  fc.record({ op: fc.constant('splice'), other: fc.nat(), at: fc.nat(), from: fc.nat(), length: fc.nat(4096) }),
);
function applyByteOp(buf, m) {
  if (buf.byteLength === 0 && m.op !== 'insert' && m.op !== 'splice') return buf;
  const at = m.at % Math.max(buf.byteLength, 1);
  switch (m.op) {
    case 'flip': { const b = Buffer.from(buf); b[at] ^= 1 << m.bit; return b; }
    case 'set': { const b = Buffer.from(buf); b[at] = m.value; return b; }
    case 'int': {
      const b = Buffer.from(buf);
      let v = (BigInt(m.value) + BigInt(m.delta)) & ((1n << BigInt(8 * m.width)) - 1n);
      for (let i = 0; i < m.width && at + i < b.byteLength; i++, v >>= 8n) b[at + i] = Number(v & 0xffn);
      return b;
    }
    case 'insert': return Buffer.concat([buf.subarray(0, at), m.bytes, buf.subarray(at)]);
    case 'delete': return Buffer.concat([buf.subarray(0, at), buf.subarray(at + m.length)]);
    case 'truncate': return buf.subarray(0, at);
    case 'splice': {
      const o = seeds[m.other % seeds.length];
      const from = m.from % Math.max(o.byteLength, 1);
      return Buffer.concat([buf.subarray(0, at), o.subarray(from, from + m.length), buf.subarray(at)]);
    }
  }
  return buf;
}

// Value-tree mutations for the JSON (safetensors header) and MessagePack (protocol) inputs.
const leaf = fc.oneof(fc.constantFrom(...INTERESTING, -1, -(2 ** 53), 0.5, NaN, Infinity, null, true, false, '', '__proto__',
  '__metadata__', 'shm', 'cuda_ipc', 'ref', 'compress', 'decompress', 'hello', 'BF16', 'F32', 'U8', 'auto'),
  fc.string({ maxLength: 12 }), fc.uint8Array({ maxLength: 80 }), fc.array(fc.nat(), { maxLength: 4 }));
const treeOp = fc.record({ path: fc.array(fc.nat(), { minLength: 1, maxLength: 6 }), kind: fc.constantFrom('replace', 'delete', 'add'), value: leaf, key: fc.string({ maxLength: 10 }) });
function mutateTree(root, m) {
  let node = root;
  for (let i = 0; i < m.path.length; i++) {
    const keys = node !== null && typeof node === 'object' && !(node instanceof Uint8Array) ? Object.keys(node) : [];
    if (keys.length === 0) return root;
    const key = keys[m.path[i] % keys.length];
    const child = node[key];
    const last = i === m.path.length - 1 || child === null || typeof child !== 'object' || child instanceof Uint8Array;
    if (last) {
      if (m.kind === 'delete') { if (Array.isArray(node)) node.splice(Number(key), 1); else delete node[key]; }
      else if (m.kind === 'add' && !Array.isArray(node)) node[m.key] = m.value;
      else node[key] = m.value;
      return root;
    }
    node = child;
  }
  return root;
}
const packr = new Packr({ useRecords: false, structuredClone: false, variableMapSize: true });
const unpackr = new Unpackr({ useRecords: false, mapsAsObjects: true, int64AsType: 'bigint' });
function treeMutate(seed, ops) {
  if (args.target === 'protocol') {
    let v; try { v = unpackr.unpack(seed); } catch { return seed; }
    for (const m of ops) v = mutateTree(v, m);
    try { return packr.pack(v); } catch { return seed; }
  }
  if (args.target === 'safetensors' && seed.byteLength >= 8) {
    const n = Number(seed.readBigUInt64LE(0));
    let v; try { v = JSON.parse(seed.subarray(8, 8 + n).toString()); } catch { return seed; }
    for (const m of ops) v = mutateTree(v, m);
    let text; try { text = Buffer.from(JSON.stringify(v, (_, x) => (x instanceof Uint8Array ? [...x] : x))); } catch { return seed; }
    const len = Buffer.alloc(8); len.writeBigUInt64LE(BigInt(text.byteLength));
    return Buffer.concat([len, text, seed.subarray(8 + n)]);
  }
  return seed;
}
const input = fc.record({
  seed: fc.nat(seeds.length - 1),
  tree: fc.array(treeOp, { maxLength: args.target === 'container' ? 0 : 3 }),
  bytes: fc.array(byteOp, { maxLength: 6 }),
}).map(({ seed, tree, bytes }) => {
  let b = treeMutate(seeds[seed], structuredClone(tree));
  for (const m of bytes) b = applyByteOp(b, m);
  return Buffer.from(b);
});

let executions = 0;
let accepted = 0;
let failing;
const started = performance.now();
const budgetMs = Number(args.seconds) * 1000;
const property = fc.asyncProperty(input, async (bytes) => {
  executions++;
  try {
    if (await target.check(bytes)) accepted++;
  } catch (err) {
    failing = { bytes, err };  // after shrinking: the smallest failing input
    throw err;
  }
});
// Every seed unmutated first, then mutations until the budget is spent.
for (const s of seeds) {
  executions++;
  try { if (await target.check(s)) accepted++; } catch (err) { report(s, err); }
}
try {
  await fc.assert(property, {
    numRuns: Number.MAX_SAFE_INTEGER, interruptAfterTimeLimit: Math.max(budgetMs - (performance.now() - started), 1),
    markInterruptAsFailure: false, seed: args.seed === undefined ? undefined : Number(args.seed),
  });
} catch (err) {
  report(failing?.bytes ?? Buffer.alloc(0), failing?.err ?? err);
}
cleanup();
console.log(`accepted ${accepted} of ${executions} inputs (decoded and checked); the rest were refused as documented`);
console.log(`stats: executions ${executions} seconds ${Math.round((performance.now() - started) / 1000)} corpus ${seeds.length}`);
