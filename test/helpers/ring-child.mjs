// A ring client that is killed mid-submission (test/daemon-ring.test.ts): says hello with protocol version 4 to the
// daemon at argv[2], opens a ring on a ring file of its own, registers two shared-memory regions, writes a batch of
// two compress SQEs (LINK on the first) and publishes only the first, so the batch is half-published, then prints one
// JSON line ({sid, prefix, ring}) and waits to be killed.
import { closeSync, ftruncateSync, openSync, writeSync } from 'node:fs';
import { createRequire } from 'node:module';
import { Packr, Unpackr } from 'msgpackr';
import { Dealer } from 'zeromq';

const endpoint = process.argv[2];
const addon = createRequire(import.meta.url)(new URL('../../build/Release/tzip.node', import.meta.url).pathname);
const packr = new Packr({ useRecords: false });
const unpackr = new Unpackr({ useRecords: false, mapsAsObjects: true, int64AsType: 'number' });
const sock = new Dealer({ linger: 0 });
sock.connect(endpoint);
let next = 1;
async function req(msg) {
  await sock.send(packr.pack({ id: next++, ...msg }));
  const [reply] = await sock.receive();
  const r = unpackr.unpack(reply);
  if (!r.ok) throw new Error(`${msg.op}: ${JSON.stringify(r.error)}`);
  return r;
}
function file(name, size) {
  const fd = openSync(`/dev/shm/${name}`, 'w+', 0o600);
  ftruncateSync(fd, size);
  closeSync(fd);
  return `/dev/shm/${name}`;
}

const prefix = `tzip-${process.pid}-${Math.floor(Math.random() * 2 ** 32).toString(16).padStart(8, '0')}-`;
const hello = await req({ op: 'hello', versions: [1, 2, 3, 4], pid: process.pid, shm_prefix: prefix, name: 'ring-child' });
const sid = hello.sid;
const entries = 8;
const ringPath = file(`${prefix}ring-0`, 4096 + entries * 192);
const ring = addon.mapShared(ringPath, true);
ring.write('TZRING01', 0, 'latin1');
ring.writeUInt32LE(entries, 8);
const opened = await req({ op: 'ring_open', sid, name: `${prefix}ring-0`, entries });
const n = 4096;
const srcPath = file(`${prefix}src`, n * 2);
const fd = openSync(srcPath, 'r+');
writeSync(fd, Buffer.alloc(n * 2, 0x3f));
closeSync(fd);
file(`${prefix}dst`, 2 * addon.maxCompressedSize(n * 2, 1));
const reg = await req({ op: 'ring_register', sid, ring: opened.ring, regions: [{ kind: 'shm', name: `${prefix}src` }, { kind: 'shm', name: `${prefix}dst` }] });
const [src, dst] = reg.regions;
const cap = addon.maxCompressedSize(n * 2, 1);
for (let i = 0; i < 2; i++) {
  const at = 4096 + i * 128;
  ring.fill(0, at, at + 128);
  ring.writeBigUInt64LE(BigInt(i + 1), at);
  ring.writeUInt8(1, at + 8); // compress
  ring.writeUInt8(i === 0 ? 1 : 0, at + 9); // LINK on the first
  ring.writeUInt8(255, at + 10); // auto
  ring.writeUInt8(8, at + 11); // BF16
  ring.writeUInt8(1, at + 12);
  ring.writeUInt32LE(src.id, at + 16);
  ring.writeUInt32LE(src.generation, at + 20);
  ring.writeBigUInt64LE(BigInt(n * 2), at + 32);
  ring.writeUInt32LE(dst.id, at + 40);
  ring.writeUInt32LE(dst.generation, at + 44);
  ring.writeBigUInt64LE(BigInt(i * cap), at + 48);
  ring.writeBigUInt64LE(BigInt(cap), at + 56);
  ring.writeBigUInt64LE(BigInt(n), at + 64);
}
ring.writeUInt32LE(1, 64); // sq_head = 1: the batch's second SQE is never published
process.stdout.write(`${JSON.stringify({ sid, prefix, ring: opened.ring })}\n`);
setInterval(() => undefined, 1000);
