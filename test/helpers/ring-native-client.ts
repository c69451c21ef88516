// A client of the submission ring's file (docs/ring.md) for tests: creates the ring file under /dev/shm, packs SQEs
// into it, publishes them and reaps CQEs, through its own mapShared mapping of the file (the daemon maps it again).
// JavaScript cannot call futex(2): a submission finds the ring thread awake (spinning) or wakes it through the
// thread's futex timeout (10 ms).
import { rmSync, writeFileSync } from 'node:fs';
import { mapShared, ringBytes } from '../../src/native.js';

export const OP = { nop: 0, compress: 1, decompress: 2 } as const;
export const FLAG = { link: 1, verify: 2, wait: 4, signal: 8 } as const;
export const CODEC: Record<string, number> = { raw: 0, fast: 1, max: 2, bytes: 3, auto: 255 };
export const CODEC_NAMES = ['raw', 'fast', 'max', 'bytes'];
/** tzip::Dtype codes (cuda/include/tzip/format.h) by safetensors name. */
export const DTYPE: Record<string, number> = {
  BOOL: 0, U8: 1, I8: 2, F8_E4M3: 3, F8_E5M2: 4, I16: 5, U16: 6, F16: 7, BF16: 8, I32: 9, U32: 10, F32: 11, I64: 12,
  U64: 13, F64: 14,
};
export const DTYPE_BYTES: Record<string, number> = {
  BOOL: 1, U8: 1, I8: 1, F8_E4M3: 1, F8_E5M2: 1, I16: 2, U16: 2, F16: 2, BF16: 2, I32: 4, U32: 4, F32: 4, I64: 8,
  U64: 8, F64: 8,
};

/** Header word offsets. */
export const H = {
  magic: 0, entries: 8, sqHead: 64, sqTail: 128, sqSleeping: 132, sqDoorbell: 192, cqHead: 256, state: 260,
  cqTail: 320, cqWaiting: 324, cqDoorbell: 384,
} as const;

/** A region reference of an SQE. */
export interface RegionRef {
  id: number;
  generation: number;
  offset?: number | bigint;
  bytes: number | bigint;
}

export interface Sqe {
  userData: bigint;
  op: number;
  flags?: number;
  codec?: number;
  dtype?: number;
  ndim?: number;
  smBudget?: number;
  stream?: number;
  reserved?: number;
  src?: RegionRef;
  dst?: RegionRef;
  shape?: (number | bigint)[];
  waitValue?: bigint;
  signalValue?: bigint;
}

export interface Cqe {
  userData: bigint;
  status: number;
  codec: number;
  result: bigint;
  message: string;
  /** The 3 reserved bytes, which must be 0. */
  reserved: number[];
}

const big = (v: number | bigint | undefined): bigint => BigInt(v ?? 0);

/** The 128 bytes of an SQE. */
export function encodeSqe(s: Sqe): Buffer {
  const b = Buffer.alloc(128);
  b.writeBigUInt64LE(s.userData, 0);
  b[8] = s.op;
  b[9] = s.flags ?? 0;
  b[10] = s.codec ?? 0;
  b[11] = s.dtype ?? 0;
  b[12] = s.ndim ?? s.shape?.length ?? 0;
  b[13] = s.smBudget ?? 0;
  b[14] = s.stream ?? 0;
  b[15] = s.reserved ?? 0;
  b.writeUInt32LE(s.src?.id ?? 0, 16);
  b.writeUInt32LE(s.src?.generation ?? 0, 20);
  b.writeBigUInt64LE(big(s.src?.offset), 24);
  b.writeBigUInt64LE(big(s.src?.bytes), 32);
  b.writeUInt32LE(s.dst?.id ?? 0, 40);
  b.writeUInt32LE(s.dst?.generation ?? 0, 44);
  b.writeBigUInt64LE(big(s.dst?.offset), 48);
  b.writeBigUInt64LE(big(s.dst?.bytes), 56);
  (s.shape ?? []).forEach((d, k) => b.writeBigUInt64LE(big(d), 64 + 8 * k));
  b.writeBigUInt64LE(s.waitValue ?? 0n, 112);
  b.writeBigUInt64LE(s.signalValue ?? 0n, 120);
  return b;
}

export function decodeCqe(b: Buffer): Cqe {
  const msg = b.subarray(24, 64);
  const nul = msg.indexOf(0);
  return {
    userData: b.readBigUInt64LE(0),
    status: b.readInt32LE(8),
    codec: b[12]!,
    reserved: [b[13]!, b[14]!, b[15]!],
    result: b.readBigUInt64LE(16),
    message: msg.subarray(0, nul < 0 ? 40 : nul).toString('latin1'),
  };
}

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

export class RingClient {
  /** The client's own mapping of the ring file. */
  readonly mem: Buffer;

  private constructor(readonly path: string, readonly entries: number) {
    this.mem = mapShared(path, true);
  }

  /** Creates the ring file at `path` (ring_bytes(entries) zero bytes, magic and entries) and maps it. */
  static create(path: string, entries: number): RingClient {
    const b = Buffer.alloc(ringBytes(entries));
    b.write('TZRING01', 0, 'latin1');
    b.writeUInt32LE(entries, 8);
    writeFileSync(path, b);
    return new RingClient(path, entries);
  }

  word(off: number): number {
    return this.mem.readUInt32LE(off);
  }

  setWord(off: number, v: number): void {
    this.mem.writeUInt32LE(v >>> 0, off);
  }

  get state(): number {
    return this.word(H.state);
  }

  /** Free SQ slots. */
  free(): number {
    return this.entries - ((this.word(H.sqHead) - this.word(H.sqTail)) >>> 0);
  }

  /** Byte offset of SQ entry `i` (free-running). */
  sqeOffset(i: number): number {
    return 4096 + ((i >>> 0) & (this.entries - 1)) * 128;
  }

  /** Writes SQEs (encoded or raw 128-byte buffers) at the next slots and publishes them (sq_head += n). */
  submit(sqes: (Sqe | Buffer)[]): void {
    const head = this.word(H.sqHead);
    if (sqes.length > this.free()) throw new Error(`ring-client: ${sqes.length} SQEs, ${this.free()} free slots`);
    sqes.forEach((s, i) => (Buffer.isBuffer(s) ? s : encodeSqe(s)).copy(this.mem, this.sqeOffset(head + i)));
    this.publish(sqes.length);
  }

  /** sq_head += n, and the doorbell rung when the thread sleeps (it wakes at its futex timeout at the latest). */
  publish(n: number): void {
    this.setWord(H.sqHead, this.word(H.sqHead) + n);
    if (this.word(H.sqSleeping) !== 0) this.setWord(H.sqDoorbell, this.word(H.sqDoorbell) + 1);
  }

  /** CQEs written and not yet reaped. */
  ready(): number {
    return (this.word(H.cqHead) - this.word(H.cqTail)) >>> 0;
  }

  /** Waits until `n` CQEs are ready (rejects after `timeoutMs`), reads them and advances cq_tail. */
  async reap(n: number, timeoutMs = 20_000): Promise<Cqe[]> {
    const out: Cqe[] = [];
    const until = Date.now() + timeoutMs;
    while (out.length < n) {
      const ready = this.ready();
      if (ready === 0) {
        if (Date.now() > until) throw new Error(`ring-client: ${out.length} of ${n} CQEs after ${timeoutMs} ms`);
        await sleep(1);
        continue;
      }
      let tail = this.word(H.cqTail);
      for (let k = 0; k < ready && out.length < n; k++, tail++) {
        const off = 4096 + this.entries * 128 + ((tail >>> 0) & (this.entries - 1)) * 64;
        out.push(decodeCqe(Buffer.from(this.mem.subarray(off, off + 64))));
      }
      this.setWord(H.cqTail, tail);
    }
    return out;
  }

  /** submit then reap as many. */
  async call(sqes: (Sqe | Buffer)[], timeoutMs?: number): Promise<Cqe[]> {
    this.submit(sqes);
    return this.reap(sqes.length, timeoutMs);
  }

  remove(): void {
    rmSync(this.path, { force: true });
  }
}
