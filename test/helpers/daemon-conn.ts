// A raw client of a daemon for tests: one ZeroMQ DEALER speaking MessagePack (docs/protocol.md), and /dev/shm files
// made for its requests and removed after the test file.
import { closeSync, ftruncateSync, openSync, rmSync, writeSync } from 'node:fs';
import { Packr, Unpackr } from 'msgpackr';
import { Dealer } from 'zeromq';
import { afterAll } from 'vitest';

const packr = new Packr({ useRecords: false });
const unpackr = new Unpackr({ useRecords: false, mapsAsObjects: true, int64AsType: 'number' });

/** One connection: `hello` opens a session (shm prefix of its own), `call` sends a request with its sid. */
export class DaemonConn {
  readonly sock = new Dealer({ linger: 0 });
  sid = '';
  readonly prefix = `tzip-${process.pid}-${Math.floor(Math.random() * 2 ** 32).toString(16).padStart(8, '0')}-`;
  private next = 1;
  /** `pid`: the pid hello claims (default this process's). */
  constructor(endpoint: string, private readonly name = 'vitest', readonly pid = process.pid) {
    this.sock.connect(endpoint);
  }
  /** Sends the given frames as they are and returns the decoded reply. */
  async raw(...parts: Buffer[]): Promise<Record<string, any>> {
    await this.sock.send(parts);
    const [reply] = await this.sock.receive();
    return unpackr.unpack(reply as Buffer) as Record<string, any>;
  }
  async req(msg: Record<string, unknown>): Promise<Record<string, any>> {
    return this.raw(packr.pack({ id: this.next++, ...msg }));
  }
  async hello(): Promise<Record<string, any>> {
    const r = await this.req({ op: 'hello', versions: [1], pid: this.pid, shm_prefix: this.prefix, name: this.name });
    this.sid = r.sid;
    return r;
  }
  call(op: string, body: Record<string, unknown> = {}) {
    return this.req({ op, sid: this.sid, ...body });
  }
  close() {
    this.sock.close();
  }
}

const made: string[] = [];
afterAll(() => {
  for (const f of made.splice(0)) rmSync(f, { force: true });
});

/** Creates /dev/shm/NAME of `size` bytes (mode 0600), `data` at its start; removed after the test file. */
export function shmFile(name: string, size: number, data?: Uint8Array): string {
  const path = `/dev/shm/${name}`;
  const fd = openSync(path, 'w+', 0o600);
  ftruncateSync(fd, size);
  if (data !== undefined) writeSync(fd, data, 0, data.length, 0);
  closeSync(fd);
  made.push(path);
  return path;
}
