// Protocol version 3 (docs/protocol.md "Jobs") under hostile or careless input, against a real daemon in this process
// over ipc:// (ZeroMQ DEALERs, real /dev/shm files) with its Prometheus endpoint on a real port: odd numbers and
// names on the `job`, `jobs` and `set` ops and the `stream`/`sm_budget` fields, a registry grown by many jobs, settings
// changed while requests run (every frame still valid, round trips compared as raw bytes), the metrics endpoint
// (paths, methods, many connections, label values that break the text format), and JSON log lines of a `tzip serve`
// child given such names.
import { spawn } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { createServer, request as httpRequest } from 'node:http';
import { connect, type AddressInfo, type Socket } from 'node:net';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { Packr, Unpackr } from 'msgpackr';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { MAX_ENDED_JOBS } from '../src/daemon/jobs.js';
import { defaultLimits } from '../src/daemon/limits.js';
import { DaemonMetrics, MAX_METRICS_CONNECTIONS } from '../src/daemon/metrics.js';
import { Daemon } from '../src/daemon/server.js';
import { TzipError } from '../src/errors.js';
import {
  addonAvailable, compress, cudaIpcGetMemHandle, gpu, gpuAlloc, gpuCopyFromDevice, gpuCopyToDevice, gpuDevices, gpuFree, maxCompressedSize, readHeader,
} from '../src/native.js';
import { bf16Weights } from './helpers/bf16-weights.js';
import { ensureBuilt } from './helpers/cli.js';
import { DaemonConn, shmFile } from './helpers/daemon-conn.js';
import { useTempDir } from './helpers/temp-dir.js';

const MAIN = fileURLToPath(new URL('../dist/src/cli/main.js', import.meta.url));
const tmp = useTempDir('hostile-v3');
const BF16 = { code: 4, bits: 16, lanes: 1 };
const CPU = { type: 1, id: 0 };
const packr = new Packr({ useRecords: false });
const unpackr = new Unpackr({ useRecords: false, mapsAsObjects: true, int64AsType: 'number' });

let daemon: Daemon;
let metrics: DaemonMetrics;
let metricsUrl: string;
const logged: string[] = [];

beforeAll(async () => {
  metrics = new DaemonMetrics();
  metricsUrl = await metrics.listen(0);
  daemon = await Daemon.start({ socketPath: join(tmp(), 'd', 'tzip.sock'), limits: { ...defaultLimits(), leaseMs: 5000 },
    log: (line) => logged.push(line), observer: metrics.observe });
  metrics.attach(daemon);
});

afterAll(async () => {
  await daemon.stop('tests done');
  await metrics.close();
});

async function v3(name: string, job?: Record<string, unknown> | null): Promise<DaemonConn> {
  const c = new DaemonConn(daemon.endpoint, name);
  const h = await c.req({ op: 'hello', versions: [1, 2, 3], pid: c.pid, shm_prefix: c.prefix, name, ...(job !== undefined ? { job } : {}) });
  expect(h.ok, JSON.stringify(h)).toBe(true);
  c.sid = h.sid;
  return c;
}

/** One request on a connection of its own (no session). */
async function once(body: Record<string, unknown>): Promise<Record<string, any>> {
  const c = new DaemonConn(daemon.endpoint);
  try {
    return await c.req(body);
  } finally {
    c.close();
  }
}

async function jobsList(): Promise<Record<string, any>[]> {
  const r = await once({ op: 'jobs' });
  expect(r.ok, JSON.stringify(r).slice(0, 500)).toBe(true);
  return r.jobs;
}

/** /dev/shm files of a bf16 tensor: its input (holding `data`), a frame region, and a region to decompress into. */
function tensorFiles(c: DaemonConn, data: Buffer, tag: string) {
  const n = data.length / 2;
  const cap = maxCompressedSize(data.length, 1);
  const names = { in: `${c.prefix}${tag}-in`, frame: `${c.prefix}${tag}-frame`, back: `${c.prefix}${tag}-back` };
  shmFile(names.in, data.length, data);
  const framePath = shmFile(names.frame, cap);
  const backPath = shmFile(names.back, data.length);
  const tensor = (name: string) => ({ device: CPU, dtype: BF16, shape: [n], byte_offset: 0, data: { kind: 'shm', name, offset: 0, size: data.length } });
  return {
    compress: { tensors: [{ tensor: tensor(names.in), out: { kind: 'shm', name: names.frame, offset: 0, size: cap } }], codec: 'auto' },
    decompress: (bytes: number) => ({ frames: [{ frame: { kind: 'shm', name: names.frame, offset: 0, size: bytes }, out: tensor(names.back) }] }),
    frame: (bytes: number) => readFileSync(framePath).subarray(0, bytes),
    back: () => readFileSync(backPath),
  };
}

/** Compress then decompress `data` through the daemon; returns the replies, the frame's bytes and the bytes back. */
async function roundTrip(c: DaemonConn, data: Buffer, tag: string, extra: Record<string, unknown> = {}) {
  const f = tensorFiles(c, data, tag);
  const r = await c.call('compress', { ...f.compress, ...extra });
  expect(r.ok, JSON.stringify(r)).toBe(true);
  const d = await c.call('decompress', { ...f.decompress(r.frames[0].bytes), ...extra });
  expect(d.ok, JSON.stringify(d)).toBe(true);
  return { compress: r, decompress: d, frame: f.frame(r.frames[0].bytes), back: f.back() };
}

/** Sends every request on `c`'s socket before reading any reply; replies by request id. */
async function pipelined(c: DaemonConn, bodies: Record<string, unknown>[], firstId: number): Promise<Map<number, Record<string, any>>> {
  for (let i = 0; i < bodies.length; i++) await c.sock.send(packr.pack({ id: firstId + i, sid: c.sid, ...bodies[i] }));
  const out = new Map<number, Record<string, any>>();
  while (out.size < bodies.length) {
    const [reply] = await c.sock.receive();
    const r = unpackr.unpack(reply as Buffer) as Record<string, any>;
    out.set(r.id as number, r);
  }
  return out;
}

/**
 * Parses Prometheus' text exposition format strictly (https://prometheus.io/docs/instrumenting/exposition_formats/):
 * every line a comment or `name{label="value",...} number`, label values with only `\\`, `\"`, `\n` escapes.
 * @returns the samples, label values unescaped.
 */
function parseExposition(text: string): { name: string; labels: Record<string, string>; value: number }[] {
  const samples: { name: string; labels: Record<string, string>; value: number }[] = [];
  for (const line of text.split('\n')) {
    if (line === '' || line.startsWith('# HELP ') || line.startsWith('# TYPE ')) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*",?)*)\})? (\S+)$/.exec(line);
    if (m === null) throw new Error(`not a sample line: ${JSON.stringify(line)}`);
    const labels: Record<string, string> = {};
    for (const l of (m[2] ?? '').matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"/g)) {
      labels[l[1] as string] = (l[2] as string).replace(/\\(["\\n])/g, (_s, c: string) => (c === 'n' ? '\n' : c));
    }
    // Go's ParseFloat (what Prometheus reads values with) takes NaN and Inf in any case; prom-client writes "Nan".
    const value = /^nan$/i.test(m[3] as string) ? Number.NaN : /^[+-]?inf(inity)?$/i.test(m[3] as string) ? (m[3]!.startsWith('-') ? -Infinity : Infinity) : Number(m[3]);
    if (Number.isNaN(value) && !/^nan$/i.test(m[3] as string)) throw new Error(`not a sample value: ${JSON.stringify(line)}`);
    samples.push({ name: m[1] as string, labels, value });
  }
  return samples;
}

async function scrape() {
  const res = await fetch(metricsUrl);
  expect(res.status).toBe(200);
  return parseExposition(await res.text());
}

describe('hostile numbers on stream and sm_budget', () => {
  it('refuses every sm_budget that is not an integer 0..1024 and every unknown stream, and keeps serving', async () => {
    const c = await v3('numbers', { name: 'numbers' });
    try {
      const data = bf16Weights(4096, 11);
      const f = tensorFiles(c, data, 'n');
      for (const smBudget of [-1, 1025, 1.5, Number.NaN, Number.POSITIVE_INFINITY, 2 ** 40, '4', true, null, [4], { n: 4 }]) {
        const r = await c.call('compress', { ...f.compress, sm_budget: smBudget });
        expect(r.ok, `sm_budget ${String(smBudget)}`).toBe(false);
        expect(r.error.code).toBe('TZIP_PROTOCOL');
        const s = await once({ op: 'set', job: 'numbers', sm_budget: smBudget === null ? 'x' : smBudget });
        expect(s.ok, `set sm_budget ${String(smBudget)}`).toBe(false);
        expect(s.error.code).toBe('TZIP_PROTOCOL');
      }
      // 2^64 - 1 on the wire (a uint64: a bigint in the daemon)
      const big = Buffer.concat([Buffer.from([0x84]),
        packr.pack('id'), packr.pack(77), packr.pack('op'), packr.pack('set'), packr.pack('job'), packr.pack('numbers'), packr.pack('sm_budget'),
        Buffer.from([0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff])]);
      const raw = new DaemonConn(daemon.endpoint);
      const b = await raw.raw(big);
      raw.close();
      expect(b).toMatchObject({ id: 77, ok: false, error: { code: 'TZIP_PROTOCOL' } });
      for (const stream of ['', 'GRADIENTS', 'gradients\n', 'weights', 7, null]) {
        const r = await c.call('compress', { ...f.compress, stream });
        expect(r.ok, `stream ${JSON.stringify(stream)}`).toBe(false);
        expect(r.error.code).toBe('TZIP_PROTOCOL');
      }
      for (const bad of [{ rank: -1 }, { rank: 2 ** 31 }, { rank: 0.5 }, { world_size: 0 }, { world_size: 1e10 }, { mps: 'yes' }, { devices: 'cpu' },
        { devices: Array(65).fill('cpu') }, { devices: [''] }, { user: 'u'.repeat(201) }, { extra: 1 }]) {
        const r = await c.call('job', { job: { name: 'numbers', ...bad }, attached: true });
        expect(r.ok, JSON.stringify(bad).slice(0, 60)).toBe(false);
        expect(r.error.code).toBe('TZIP_PROTOCOL');
      }
      for (const attached of [1, 'true', null]) expect((await c.call('job', { job: { name: 'numbers' }, attached })).ok).toBe(false);
      // nothing above changed a setting; the edges are accepted and the round trip is exact
      expect((await jobsList()).find((j) => j.name === 'numbers')?.settings).toEqual({ codec: null, sm_budget: null });
      for (const smBudget of [0, 1024]) {
        const t = await roundTrip(c, data, `e${smBudget}`, { sm_budget: smBudget, stream: 'sendrecv' });
        expect(t.back.equals(data)).toBe(true);
      }
      expect((await once({ op: 'set', job: 'numbers', sm_budget: -0 })).settings).toEqual({ codec: null, sm_budget: 0 });
    } finally {
      c.close();
    }
  });
});

/** Job names a user may well type or a script make: every one must come back as it went in. */
const ODD_NAMES = [
  'train "llama" \\ 7b', 'ジョブ-日本語', '🚀 emoji job', 'label"} 1 fake_metric{a="b\\', 'C:\\path\\n', ' leading and trailing ', 'U+2028\u2028and U+FFFD\ufffd',
  'a'.repeat(200), '{}', 'none', '__proto__', 'constructor',
];
/**
 * Names with control characters: terminal escapes (a job name is printed by `tzip jobs` and `tzip top` on the terminal
 * of whoever runs them), NUL, a newline that would break a log line or a table row.
 */
const NOT_TEXT = ['\u001b[2J\u001b[Hcleared', 'nul\u0000byte', 'bell\u0007', 'c1\u009b31m', 'two\nlines', 'tab\there', 'cr\r'];

/** A msgpack str of `bytes` as they are (not checked as UTF-8). */
function rawStr(bytes: Buffer): Buffer {
  return Buffer.concat([Buffer.from([0xd9, bytes.length]), bytes]);
}

describe('odd job names', () => {
  it('keeps every odd name exact through hello, jobs, set, the job op and the metrics text', async () => {
    const conns: DaemonConn[] = [];
    try {
      for (const [i, name] of ODD_NAMES.entries()) {
        const c = await v3(`odd${i}`, { name, user: name.slice(0, 50), devices: ['cpu'] });
        conns.push(c);
        const t = await roundTrip(c, bf16Weights(2048, i + 1), `odd${i}`, { stream: 'checkpoint' });
        expect(t.back.equals(bf16Weights(2048, i + 1))).toBe(true);
        const s = await once({ op: 'set', job: name, sm_budget: 3 });
        expect(s, name).toMatchObject({ ok: true, job: name, settings: { codec: null, sm_budget: 3 } });
      }
      const listed = await jobsList();
      for (const name of ODD_NAMES) expect(listed.filter((j) => j.name === name), name).toHaveLength(1);
      const samples = await scrape();
      for (const name of ODD_NAMES) {
        expect(samples.find((x) => x.name === 'tzip_bytes_in_total' && x.labels.job_name === name && x.labels.stream === 'checkpoint' &&
          x.labels.direction === 'compress')?.value, name).toBe(4096);
        expect(samples.find((x) => x.name === 'tzip_job_sm_budget' && x.labels.job_name === name)?.value, name).toBe(3);
      }
      // over 200 UTF-16 code units is refused, 200 emoji (400 units) too
      for (const name of ['a'.repeat(201), '']) {
        const r = await conns[0]!.call('job', { job: { name }, attached: true });
        expect(r.ok, name.slice(0, 10)).toBe(false);
        expect(r.error.code).toBe('TZIP_PROTOCOL');
      }
    } finally {
      for (const c of conns) c.close();
    }
  });

  it('refuses names with control characters in hello, job and set; a hello name with them names its job without them', async () => {
    const c = await v3('not-text');
    try {
      for (const name of NOT_TEXT) {
        const j = await c.call('job', { job: { name }, attached: true });
        expect(j.ok, JSON.stringify(name)).toBe(false);
        expect(j.error.code).toBe('TZIP_PROTOCOL');
        const u = await c.call('job', { job: { name: 'fine', user: name }, attached: true });
        expect(u.ok, `user ${JSON.stringify(name)}`).toBe(false);
        const s = await once({ op: 'set', job: name, codec: 'off' });
        expect(s.ok, `set ${JSON.stringify(name)}`).toBe(false);
        expect(s.error.code).toBe('TZIP_PROTOCOL');
        const h = new DaemonConn(daemon.endpoint);
        const hr = await h.req({ op: 'hello', versions: [3], pid: h.pid, shm_prefix: h.prefix, name: 'x', job: { name } });
        h.close();
        expect(hr.ok, `hello ${JSON.stringify(name)}`).toBe(false);
      }
      // invalid UTF-8 in a msgpack str (a lone surrogate's CESU-8 bytes, a stray continuation byte) is read as U+FFFD
      for (const [i, bad] of [Buffer.from([0x61, 0xed, 0xa0, 0x80]), Buffer.from([0x61, 0x80, 0x62])].entries()) {
        const msg = Buffer.concat([Buffer.from([0x85]), packr.pack('id'), packr.pack(5), packr.pack('op'), packr.pack('job'), packr.pack('sid'),
          packr.pack(c.sid), packr.pack('attached'), packr.pack(true), packr.pack('job'), Buffer.from([0x81]), packr.pack('name'), rawStr(bad)]);
        const r = await c.raw(msg);
        expect(r, bad.toString('hex')).toMatchObject({ ok: true, job: ['a\ufffd\ufffd\ufffd', 'a\ufffdb'][i] });
      }
      // the hello name of a session without a job names its job: control characters there are not passed on
      const h = new DaemonConn(daemon.endpoint, 'x');
      const hr = await h.req({ op: 'hello', versions: [1, 2, 3], pid: h.pid, shm_prefix: h.prefix, name: 'v1\u001b[2Jname\nline' });
      expect(hr.ok, JSON.stringify(hr)).toBe(true);
      expect(hr.job).toBe('v1\ufffd[2Jname\ufffdline');
      h.close();
      // every reply of jobs is well-formed UTF-8 (a Python client decodes it strictly)
      const raw = new DaemonConn(daemon.endpoint);
      await raw.sock.send(packr.pack({ id: 1, op: 'jobs' }));
      const [reply] = await raw.sock.receive();
      raw.close();
      const strings: string[] = [];
      const walk = (v: unknown): void => {
        if (typeof v === 'string') strings.push(v);
        else if (Array.isArray(v)) v.forEach(walk);
        else if (v !== null && typeof v === 'object' && !(v instanceof Uint8Array)) Object.entries(v).forEach(([k, x]) => { strings.push(k); walk(x); });
      };
      walk(unpackr.unpack(reply as Buffer));
      for (const s of strings) {
        expect(/[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/.test(s), `lone surrogate in ${JSON.stringify(s)}`).toBe(false);
        expect(/[\u0000-\u001f\u007f-\u009f]/.test(s), JSON.stringify(s)).toBe(false);
      }
    } finally {
      c.close();
    }
  });
});

describe('settings changed while requests run, on ended jobs, from old sessions', () => {
  it('every frame stays valid and every round trip exact while set switches the job codec between pipelined requests', async () => {
    const c = await v3('steer', { name: 'steer' });
    try {
      const tensors = Array.from({ length: 12 }, (_, i) => bf16Weights(150_000, 200 + i));
      const files = tensors.map((t, i) => tensorFiles(c, t, `st${i}`));
      const codecs = ['off', 'fast', null, 'max', 'auto', 'off', null];
      const sending = pipelined(c, files.map((f) => ({ op: 'compress', ...f.compress, stream: 'gradients' })), 5000);
      for (const codec of codecs) expect((await once({ op: 'set', job: 'steer', codec })).ok).toBe(true);
      const replies = await sending;
      for (let i = 0; i < tensors.length; i++) {
        const r = replies.get(5000 + i) as Record<string, any>;
        expect(r.ok, JSON.stringify(r)).toBe(true);
        const frame = (files[i] as ReturnType<typeof tensorFiles>).frame(r.frames[0].bytes);
        const header = readHeader(frame);
        expect(header.codec).toBe(r.frames[0].codec);
        expect(header.frameBytes).toBe(r.frames[0].bytes);
        expect(r.settings).toHaveProperty('codec');
        const d = await c.call('decompress', { ...(files[i] as ReturnType<typeof tensorFiles>).decompress(r.frames[0].bytes), verify: true });
        expect(d.ok, JSON.stringify(d)).toBe(true);
        expect((files[i] as ReturnType<typeof tensorFiles>).back().equals(tensors[i] as Buffer), `tensor ${i}`).toBe(true);
      }
      // off set while a large request runs: that request and the next are valid; the next one is raw
      const big = bf16Weights(4_000_000, 300);
      const bf = tensorFiles(c, big, 'big');
      const inflight = pipelined(c, [{ op: 'compress', ...bf.compress }], 9000);
      expect((await once({ op: 'set', job: 'steer', codec: 'off' })).settings.codec).toBe('off');
      const r = (await inflight).get(9000) as Record<string, any>;
      expect(r.ok, JSON.stringify(r)).toBe(true);
      expect(readHeader(bf.frame(r.frames[0].bytes)).codec).toBe(r.frames[0].codec);
      expect((await c.call('decompress', bf.decompress(r.frames[0].bytes))).ok).toBe(true);
      expect(bf.back().equals(big)).toBe(true);
      const next = await roundTrip(c, big, 'big2');
      expect(next.compress.frames[0].codec).toBe('raw');
      expect(next.frame.subarray(next.frame.length - big.length).equals(big)).toBe(true);
      expect(next.back.equals(big)).toBe(true);
      expect((await once({ op: 'set', job: 'steer', codec: null })).settings.codec).toBe(null);
    } finally {
      c.close();
    }
  });

  it('set on an ended job is kept for the session that comes back; set from a version-1 session steers its job', async () => {
    const data = bf16Weights(30_000, 400);
    const a = await v3('ender', { name: 'ender' });
    await roundTrip(a, data, 'en0');
    expect((await a.call('release', { end: true })).ok).toBe(true);
    a.close();
    expect((await jobsList()).find((j) => j.name === 'ender')?.state).toBe('ended');
    expect(await once({ op: 'set', job: 'ender', codec: 'max' })).toMatchObject({ ok: true, job: 'ender', settings: { codec: 'max' } });
    const b = await v3('ender-again', { name: 'ender' });
    try {
      const t = await roundTrip(b, data, 'en1');
      expect(t.compress.frames[0].codec).toBe('max');
      expect(t.back.equals(data)).toBe(true);
    } finally {
      b.close();
    }

    const old = new DaemonConn(daemon.endpoint, 'old-client');
    try {
      expect((await old.hello()).version).toBe(1);
      // set needs no session, and an old session may send it with its sid
      expect(await old.call('set', { job: 'old-client', codec: 'off' })).toMatchObject({ ok: true, job: 'old-client', settings: { codec: 'off' } });
      const t = await roundTrip(old, data, 'old');
      expect(t.compress.frames[0].codec).toBe('raw');
      expect(t.compress).not.toHaveProperty('settings');
      expect(t.back.equals(data)).toBe(true);
      for (const codec of ['raw', 'bytes', 'OFF', 'none', 1]) {
        expect((await old.call('set', { job: 'old-client', codec })).error?.code, String(codec)).toBe('TZIP_PROTOCOL');
      }
      expect((await old.call('set', { sid: 'not-a-session', codec: 'off' })).error?.code).toBe('TZIP_PROTOCOL');
      expect((await old.call('set', { job: 'old-client', codec: null })).settings.codec).toBe(null);
    } finally {
      old.close();
    }
  });
});

/** A raw HTTP request to the metrics port: status and body (undefined status: the connection was closed). */
function http(method: string, path: string, headers: Record<string, string> = {}): Promise<{ status: number | undefined; body: string }> {
  const url = new URL(metricsUrl);
  return new Promise((resolve) => {
    const req = httpRequest({ host: url.hostname, port: url.port, method, path, headers, agent: false }, (res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (d: string) => { body += d; });
      res.on('end', () => resolve({ status: res.statusCode, body }));
      res.on('error', () => resolve({ status: res.statusCode, body }));
    });
    req.on('error', () => resolve({ status: undefined, body: '' }));
    req.end();
  });
}

describe('the metrics endpoint under odd requests', () => {
  it('answers /metrics only, to GET and HEAD only; odd paths, methods and headers get 404/405/4xx, never a crash', async () => {
    for (const path of ['/', '/metrics/', '/METRICS', '//metrics', '/metrics/../metrics', '/%00', '/metrics%20', `/${'x'.repeat(10_000)}`, '*']) {
      const r = await http('GET', path);
      expect(r.status, path.slice(0, 30)).not.toBe(200);
      expect(r.status === undefined || (r.status >= 400 && r.status < 500), `${path.slice(0, 30)}: ${r.status}`).toBe(true);
    }
    for (const method of ['POST', 'PUT', 'DELETE', 'OPTIONS', 'PATCH', 'TRACE', 'CONNECT']) {
      const r = await http(method, '/metrics');
      expect(r.status === 405 || r.status === 400 || r.status === undefined, `${method}: ${r.status}`).toBe(true);
    }
    expect((await http('GET', '/metrics?name[]=tzip_sessions&x=%ZZ')).status).toBe(200);
    // Host names other than the loopback's (DNS rebinding: a web page's own name resolved to 127.0.0.1) are refused
    for (const host of ['evil.example', 'evil.example:9464', '127.0.0.1.evil.example', '10.0.0.1:80']) {
      expect((await http('GET', '/metrics', { host })).status, host).toBe(403);
    }
    for (const host of ['127.0.0.1', 'localhost:9464', 'LOCALHOST', `127.0.0.1:${new URL(metricsUrl).port}`]) {
      expect((await http('GET', '/metrics', { host })).status, host).toBe(200);
    }
    const head = await http('HEAD', '/metrics');
    expect(head).toEqual({ status: 200, body: '' });
    // a header block far over Node's limit: 431, and the endpoint still serves
    expect((await http('GET', '/metrics', { 'x-big': 'y'.repeat(20_000) })).status).toBe(431);
    parseExposition((await http('GET', '/metrics')).body);
  });

  it('serves 50 scrapes at once and the daemon keeps answering requests meanwhile', async () => {
    const c = await v3('scraped', { name: 'scraped' });
    try {
      const data = bf16Weights(20_000, 500);
      const scrapes = Array.from({ length: 50 }, () => http('GET', '/metrics'));
      const t = await roundTrip(c, data, 'sc');
      expect(t.back.equals(data)).toBe(true);
      for (const r of await Promise.all(scrapes)) {
        expect(r.status).toBe(200);
        parseExposition(r.body);
      }
    } finally {
      c.close();
    }
  });

  it('bounds the connections a local user can hold open (each is a file descriptor of the daemon), and still serves', async () => {
    const url = new URL(metricsUrl);
    const held: Socket[] = [];
    let closed = 0;
    try {
      for (let i = 0; i < 300; i++) {
        const s = connect({ host: url.hostname, port: Number(url.port) });
        s.on('error', () => {});
        s.on('close', () => { closed++; });
        held.push(s);
      }
      await Promise.all(held.map((s) => new Promise<void>((r) => { if (s.readyState === 'open') r(); else s.once('connect', () => r()).once('close', () => r()); })));
      const deadline = Date.now() + 2000;
      while (closed < 300 - MAX_METRICS_CONNECTIONS && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
      expect(closed).toBeGreaterThanOrEqual(300 - MAX_METRICS_CONNECTIONS);
      const c = await v3('held');
      try {
        const data = bf16Weights(10_000, 600);
        expect((await roundTrip(c, data, 'held')).back.equals(data)).toBe(true);
      } finally {
        c.close();
      }
    } finally {
      for (const s of held) s.destroy();
    }
    // once they are gone, scrapes are served again
    const deadline = Date.now() + 2000;
    let r = await http('GET', '/metrics');
    while (r.status !== 200 && Date.now() < deadline) r = await http('GET', '/metrics');
    expect(r.status).toBe(200);
  });

  it('a metrics port in use is a TZIP_IO error naming the port', async () => {
    const taken = createServer();
    await new Promise<void>((r) => taken.listen(0, '127.0.0.1', () => r()));
    const port = (taken.address() as AddressInfo).port;
    const m = new DaemonMetrics();
    try {
      const err = await m.listen(port).then(() => undefined, (e: unknown) => e);
      expect(err).toBeInstanceOf(TzipError);
      expect((err as TzipError).code).toBe('TZIP_IO');
      expect((err as TzipError).message).toContain(String(port));
    } finally {
      await m.close();
      await new Promise((r) => taken.close(r));
    }
  });
});

/** A `tzip serve` child with `args` (and --json, --metrics 0): its ready line, its stderr so far, and its exit. */
async function serveChild(args: string[]) {
  ensureBuilt();
  const sock = join(tmp(), `serve-${Math.random().toString(16).slice(2)}`, 'tzip.sock');
  const env: NodeJS.ProcessEnv = {};
  for (const [k, v] of Object.entries(process.env)) if (!k.startsWith('TZIP_')) env[k] = v;
  env.XDG_CONFIG_HOME = join(tmp(), 'no-config');
  const child = spawn(process.execPath, [MAIN, '--json', 'serve', '--socket', sock, '--metrics', '0', ...args], { env, stdio: ['ignore', 'pipe', 'pipe'] });
  let stderr = '';
  child.stderr.setEncoding('utf8').on('data', (d: string) => { stderr += d; });
  const exited = new Promise<number | null>((r) => child.once('exit', (code) => r(code)));
  const ready = await new Promise<{ endpoint: string; metrics: string }>((resolve, reject) => {
    let out = '';
    child.stdout.setEncoding('utf8').on('data', (d: string) => {
      out += d;
      const line = out.split('\n')[0];
      if (out.includes('\n') && line !== undefined) resolve(JSON.parse(line));
    });
    void exited.then((code) => reject(new Error(`tzip serve exited ${code}: ${stderr}`)));
  });
  return { child, ready, exited, stderr: () => stderr };
}

/** Hello names (free text since version 1) and job names of every odd kind, sent to a daemon that logs every session. */
async function oddTraffic(endpoint: string): Promise<void> {
  const evil = 'evil\ntzip serve: stopped: forged line\r\n{"level":"error","msg":"forged"}\u001b[2J "q" \\ \u2028 \u0000 end';
  const c = new DaemonConn(endpoint, evil);
  const h = await c.req({ op: 'hello', versions: [1, 2, 3], pid: c.pid, shm_prefix: c.prefix, name: evil });
  expect(h.ok, JSON.stringify(h)).toBe(true);
  c.sid = h.sid;
  for (const name of ODD_NAMES) {
    expect((await c.call('job', { job: { name }, attached: true })).ok).toBe(true);
    expect((await c.req({ op: 'set', job: name, codec: 'off', sm_budget: 7 })).ok).toBe(true);
  }
  expect((await c.req({ op: 'set', job: 'missing "job"\\', codec: 'max' })).ok).toBe(false);
  expect((await c.call('job', { job: null, attached: false })).ok).toBe(true);
  expect((await c.call('compress', { tensors: [{ tensor: { device: CPU, dtype: BF16, shape: [4], byte_offset: 0,
    data: { kind: 'shm', name: `${c.prefix}gone`, offset: 0, size: 8 } }, out: { kind: 'shm', name: `${c.prefix}gone2`, offset: 0, size: 4096 } }] })).ok).toBe(false);
  await c.raw(Buffer.from([0xc1])); // not MessagePack
  c.close();
}

describe('the logs of tzip serve given odd names', () => {
  for (const format of ['json', 'text'] as const) {
    it(`--log-format ${format}: one record per line, each ${format === 'json' ? 'parses as JSON' : 'starts with "tzip serve: "'}; a scrape racing the stop is served or refused`, async () => {
      const d = await serveChild(['--log-format', format, '--log-level', 'debug', '--verbose']);
      try {
        await oddTraffic(d.ready.endpoint);
        // stop the daemon while scraping it
        const s = new DaemonConn(d.ready.endpoint, 'stopper');
        await s.hello();
        let stopping = true;
        const scrapes = (async () => {
          const results: (number | string)[] = [];
          while (stopping) {
            try {
              const res = await fetch(d.ready.metrics);
              const body = await res.text();
              if (res.status === 200) parseExposition(body);
              results.push(res.status);
            } catch (err) {
              results.push(String((err as Error).cause ?? err));
              break;
            }
          }
          return results;
        })();
        await new Promise((r) => setTimeout(r, 50));
        expect((await s.call('shutdown')).ok).toBe(true);
        s.close();
        expect(await d.exited).toBe(0);
        stopping = false;
        const results = await scrapes;
        expect(results.filter((x) => x === 200).length).toBeGreaterThan(0);
        for (const x of results) expect(x === 200 || /ECONNREFUSED|ECONNRESET|closed|socket/i.test(String(x)), String(x)).toBe(true);
      } finally {
        d.child.kill('SIGKILL');
      }
      const lines = d.stderr().split('\n').filter((l) => l !== '');
      expect(lines.length).toBeGreaterThan(ODD_NAMES.length);
      for (const line of lines) {
        if (format === 'json') {
          const r = JSON.parse(line) as Record<string, unknown>;
          expect(r).toMatchObject({ name: 'tzip serve', level: expect.stringMatching(/^(debug|info|warn|error)$/), msg: expect.any(String) });
        } else {
          expect(line.startsWith('tzip serve: '), JSON.stringify(line)).toBe(true);
          expect(line.startsWith('tzip serve: stopped: forged'), JSON.stringify(line)).toBe(false);
          expect(/\p{Cc}/u.test(line), JSON.stringify(line)).toBe(false);
        }
      }
      if (format === 'json') {
        const msgs = lines.map((l) => String((JSON.parse(l) as { msg: string }).msg));
        expect(msgs.some((m) => m.includes('evil\ntzip serve: stopped: forged line'))).toBe(true);
        for (const name of ODD_NAMES) expect(msgs.some((m) => m.includes(JSON.stringify(name))), name).toBe(true);
      }
    });
  }
});

describe('the reader of the log going away', () => {
  for (const format of ['text', 'json'] as const) {
    it(`--log-format ${format}: the daemon serves on after its stderr pipe is closed (EPIPE on every line)`, async () => {
      const d = await serveChild(['--log-format', format, '--verbose']);
      try {
        d.child.stderr.destroy();
        await new Promise((r) => setTimeout(r, 100));
        for (let i = 0; i < 3; i++) {
          const c = new DaemonConn(d.ready.endpoint, `after-epipe-${i}`);
          c.sock.receiveTimeout = 5000;
          expect((await c.hello()).ok).toBe(true);
          const data = bf16Weights(4096, 1000 + i);
          const h = await c.req({ op: 'hello', versions: [1, 2, 3], pid: c.pid, shm_prefix: c.prefix, name: `v3-${i}`, job: { name: 'epipe' } });
          c.sid = h.sid;
          expect((await roundTrip(c, data, `ep${format}${i}`)).back.equals(data)).toBe(true);
          c.close();
        }
        expect(d.child.exitCode).toBe(null);
      } finally {
        d.child.kill('SIGKILL');
      }
    });
  }
});

describe('a failed start with JSON logs', () => {
  it('is a JSON error record on stderr and no text line; exit 3; --json still has its error document on stdout', async () => {
    ensureBuilt();
    const taken = createServer();
    await new Promise<void>((r) => taken.listen(0, '127.0.0.1', () => r()));
    const port = (taken.address() as AddressInfo).port;
    const env: NodeJS.ProcessEnv = {};
    for (const [k, v] of Object.entries(process.env)) if (!k.startsWith('TZIP_')) env[k] = v;
    env.XDG_CONFIG_HOME = join(tmp(), 'no-config');
    try {
      for (const json of [false, true]) {
        const sock = join(tmp(), `failed-${json}`, 'tzip.sock');
        const child = spawn(process.execPath, [MAIN, ...(json ? ['--json'] : []), 'serve', '--socket', sock, '--metrics', String(port), '--log-format', 'json'],
          { env, stdio: ['ignore', 'pipe', 'pipe'] });
        let out = '';
        let err = '';
        child.stdout.setEncoding('utf8').on('data', (d: string) => { out += d; });
        child.stderr.setEncoding('utf8').on('data', (d: string) => { err += d; });
        const code = await new Promise<number | null>((r) => child.once('exit', (c) => r(c)));
        expect(code, err).toBe(3);
        const lines = err.split('\n').filter((l) => l !== '');
        expect(lines.length).toBeGreaterThan(0);
        const records = lines.map((l) => JSON.parse(l) as Record<string, unknown>);
        const failure = records.find((r) => r.level === 'error');
        expect(failure).toMatchObject({ code: 'TZIP_IO', exit_code: 3 });
        expect(String(failure?.msg)).toContain(String(port));
        if (json) expect(JSON.parse(out)).toMatchObject({ error: { code: 'TZIP_IO', exitCode: 3 } });
        else expect(out).toBe('');
        expect(existsSync(sock)).toBe(false);
      }
      // --log-level silent: no log, but the failure is still said (main.ts's line), exit 3
      const child = spawn(process.execPath, [MAIN, 'serve', '--socket', join(tmp(), 'failed-silent', 'tzip.sock'), '--metrics', String(port),
        '--log-format', 'json', '--log-level', 'silent'], { env, stdio: ['ignore', 'ignore', 'pipe'] });
      let err = '';
      child.stderr.setEncoding('utf8').on('data', (d: string) => { err += d; });
      expect(await new Promise<number | null>((r) => child.once('exit', (c) => r(c)))).toBe(3);
      expect(err).toContain(String(port));
    } finally {
      await new Promise((r) => taken.close(r));
    }
  });
});

describe('a start that fails half-way', () => {
  it('a taken TCP port fails the start with TZIP_IO and leaves no socket file; the path can be served right after', async () => {
    const taken = createServer();
    await new Promise<void>((r) => taken.listen(0, '127.0.0.1', () => r()));
    const port = (taken.address() as AddressInfo).port;
    const socketPath = join(tmp(), 'half', 'tzip.sock');
    try {
      const err = await Daemon.start({ socketPath, limits: defaultLimits(), log: () => {}, tcpPort: port }).then(() => undefined, (e: unknown) => e);
      expect(err).toBeInstanceOf(TzipError);
      expect((err as TzipError).code).toBe('TZIP_IO');
      expect((err as TzipError).message).toContain(String(port));
      expect(existsSync(socketPath), 'socket file left behind').toBe(false);
    } finally {
      await new Promise((r) => taken.close(r));
    }
    const d = await Daemon.start({ socketPath, limits: defaultLimits(), log: () => {} });
    try {
      const c = new DaemonConn(d.endpoint, 'after-half');
      expect((await c.hello()).ok).toBe(true);
      c.close();
    } finally {
      await d.stop('test done');
    }
  });
});

describe('a session renaming its job while its requests run', () => {
  it('counts every answered request exactly once, in one of the jobs it was in; the daemon serves on after an abrupt disconnect', async () => {
    const c = await v3('loop-hello');
    const data = bf16Weights(30_000, 800);
    const f = tensorFiles(c, data, 'loop');
    const names = ['loop-a', 'loop-b', 'loop-c'];
    const bodies: Record<string, unknown>[] = [];
    for (let i = 0; i < 40; i++) { // 40 compress requests in flight at most: under the session's cap of 64
      bodies.push({ op: 'job', job: i % 7 === 6 ? null : { name: names[i % 3] }, attached: i % 2 === 0 });
      bodies.push({ op: 'compress', ...f.compress, stream: 'optimizer' });
    }
    const replies = await pipelined(c, bodies, 20_000);
    let ok = 0;
    for (const [id, r] of replies) {
      expect(r.ok, JSON.stringify(r)).toBe(true);
      if ((id - 20_000) % 2 === 1) {
        ok++;
        expect(readHeader(f.frame(r.frames[0].bytes)).frameBytes).toBe(r.frames[0].bytes);
      }
    }
    const listed = await jobsList();
    const counted = listed.filter((j) => [...names, 'loop-hello'].includes(j.name)).reduce((n, j) => n + j.streams.optimizer.compress.requests, 0);
    expect(counted).toBe(ok);
    // requests in flight when the socket goes away: the session ends, the daemon serves the next client
    await pipelined(c, [{ op: 'compress', ...f.compress }], 30_000).catch(() => undefined);
    for (let i = 0; i < 5; i++) await c.sock.send(packr.pack({ id: 40_000 + i, sid: c.sid, op: 'compress', ...f.compress }));
    c.close();
    const after = await v3('after-loop', { name: 'after-loop' });
    try {
      const t = await roundTrip(after, data, 'after');
      expect(t.back.equals(data)).toBe(true);
    } finally {
      after.close();
    }
  });
});

describe('random v3 messages', () => {
  it('answers 2000 random job/jobs/set/heartbeat/compress messages with a reply each, never an internal error', async () => {
    const c = await v3('fuzz', { name: 'fuzz' });
    let seed = 12345;
    const rnd = (n: number) => {
      seed = (seed * 1103515245 + 12345) & 0x7fffffff;
      return seed % n;
    };
    const values = (): unknown => {
      const pool: unknown[] = [null, true, false, 0, -1, 1, 1024, 1025, 2 ** 31, 2 ** 53, -(2 ** 53), 0.5, Number.NaN, Number.POSITIVE_INFINITY,
        '', 'fuzz', 'x'.repeat(300), '\u001b[2J', 'off', 'fast', 'max', 'auto', 'raw', 'gradients', 'other', [], [1, 2], {}, { name: 'fuzz' },
        { name: 'fuzz-2', rank: 1 }, { name: '' }, Buffer.alloc(3), c.sid, 'f'.repeat(32)];
      return pool[rnd(pool.length)];
    };
    const ops = ['job', 'jobs', 'set', 'heartbeat', 'compress', 'decompress', 'stats'];
    const fields = ['job', 'attached', 'codec', 'sm_budget', 'stream', 'sid', 'tensors', 'frames', 'name', 'versions'];
    const internalBefore = logged.filter((l) => /internal/i.test(l)).length;
    for (let i = 0; i < 2000; i += 50) {
      const bodies: Record<string, unknown>[] = [];
      for (let k = 0; k < 50; k++) {
        const body: Record<string, unknown> = { op: ops[rnd(ops.length)], sid: c.sid };
        for (let f = rnd(4); f > 0; f--) body[fields[rnd(fields.length)] as string] = values();
        bodies.push(body);
      }
      const replies = await pipelined(c, bodies, 100_000 + i);
      for (const r of replies.values()) {
        expect(typeof r.ok).toBe('boolean');
        if (!r.ok) expect(r.error.code, JSON.stringify(r.error)).not.toBe('TZIP_INTERNAL');
      }
    }
    expect(logged.filter((l) => /internal/i.test(l)).length).toBe(internalBefore);
    // random set ops may have left the daemon's settings changed: cleared for the tests after
    expect((await once({ op: 'set', codec: null, sm_budget: null })).ok).toBe(true);
    const after = await v3('after-fuzz');
    const t = await roundTrip(after, bf16Weights(4096, 900), 'af');
    expect(t.back.equals(bf16Weights(4096, 900))).toBe(true);
    after.close();
    c.close();
  });
});

describe('a registry grown by a hostile client', () => {
  it('bounds the ranks a job lists when one session names a new rank again and again', async () => {
    const c = await v3('ranky');
    try {
      const bodies = Array.from({ length: 3000 }, (_, i) => ({ op: 'job', job: { name: 'ranky', rank: i, world_size: 3000 }, attached: true }));
      const replies = await pipelined(c, bodies, 1000);
      for (const r of replies.values()) expect(r.ok, JSON.stringify(r)).toBe(true);
      const j = (await jobsList()).find((x) => x.name === 'ranky');
      expect(j?.ranks.length).toBeLessThanOrEqual(1024);
      expect(j?.ranks).toContain(2999); // the latest ranks are kept
      // the same job, attached, 3000 times: one info line (log at info what changed), not 3000
      expect(logged.filter((l) => l.includes('job "ranky"')).length).toBeLessThanOrEqual(2);
    } finally {
      c.close();
    }
  });

  it('bounds the jobs listed and the metrics series of a session that renames its job after every request, scraped or not', async () => {
    const c = await v3('renamer');
    const data = bf16Weights(2048, 99);
    const f = tensorFiles(c, data, 'rn');
    try {
      const n = MAX_ENDED_JOBS + 100;
      for (let i = 0; i < n; i++) {
        const j = await c.call('job', { job: { name: `rename-${i}` }, attached: true });
        expect(j.ok, JSON.stringify(j)).toBe(true);
        const r = await c.call('compress', { ...f.compress, stream: 'gradients' });
        expect(r.ok, JSON.stringify(r)).toBe(true);
      }
      const listed = await jobsList();
      expect(listed.length).toBeLessThanOrEqual(MAX_ENDED_JOBS + daemon.sessions.size);
      expect(listed.some((j) => j.name === `rename-${n - 1}`)).toBe(true);
      expect(listed.some((j) => j.name === 'rename-0')).toBe(false);
      // no scrape since the renames: the series of dropped jobs must not pile up in the daemon between scrapes
      const series = (await metrics.registry.getSingleMetric('tzip_bytes_in_total')!.get()).values;
      const names = new Set(listed.map((j) => j.name));
      expect(series.filter((v) => !names.has(String(v.labels.job_name))).length).toBeLessThanOrEqual(1);
      // a scrape of it all is valid text, one sample per listed job at most per stream and direction
      const samples = await scrape();
      expect(samples.filter((x) => x.name === 'tzip_bytes_in_total' && String(x.labels.job_name).startsWith('rename-')).length).toBeLessThanOrEqual(MAX_ENDED_JOBS + 1);

      // `set` on a job not listed: a clear message of bounded size, not every one of a thousand names
      const s = await once({ op: 'set', job: 'no-such-job', codec: 'off' });
      expect(s.ok).toBe(false);
      expect(s.error.code).toBe('TZIP_USAGE');
      expect(s.error.message).toContain('no-such-job');
      expect(s.error.message).toContain(`rename-${n - 1}`);
      expect(s.error.message.length).toBeLessThan(4096);
    } finally {
      c.close();
    }
  });
});

const probe = addonAvailable() ? gpu() : { available: false, reason: 'the native addon is not built', devices: [] };

// The real GPU: this process shares device memory by CUDA IPC handles ([version 2]["c"] + cudaIpcMemHandle_t, as
// PyTorch does), the daemon is a `tzip serve` child (a process cannot open its own IPC handles).
describe.skipIf(!probe.available)(`codec switched while GPU requests run${probe.available ? '' : ` (skipped: no GPU: ${probe.reason})`}`, () => {
  it('every GPU frame is the CPU codec\'s bytes for the codec it records, and decodes exactly, while set flips the job codec', async () => {
    const d = await serveChild([]);
    const dev = gpuDevices()[0] as { uuid: string };
    const n = 1 << 20;
    const tensors = Array.from({ length: 8 }, (_, i) => bf16Weights(n, 700 + i));
    const bytes = 2 * n;
    const cap = maxCompressedSize(bytes, 1);
    const ptrs = tensors.map(() => ({ src: gpuAlloc(0, bytes), frame: gpuAlloc(0, cap), back: gpuAlloc(0, bytes) }));
    const c = new DaemonConn(d.ready.endpoint, 'gpu-steer');
    const q = new DaemonConn(d.ready.endpoint);
    try {
      ptrs.forEach((p, i) => gpuCopyToDevice(p.src, tensors[i] as Buffer, 0));
      const ipc = (ptr: bigint, size: number) => ({ kind: 'cuda_ipc', device_uuid: dev.uuid, handle: Buffer.concat([Buffer.from([2, 0x63]), cudaIpcGetMemHandle(ptr, 0)]), offset: 0, size });
      const tensor = (ptr: bigint) => ({ device: { type: 2, id: 0 }, dtype: BF16, shape: [n], byte_offset: 0, data: ipc(ptr, bytes) });
      const h = await c.req({ op: 'hello', versions: [1, 2, 3], pid: c.pid, shm_prefix: c.prefix, job: { name: 'gpu-steer', devices: [dev.uuid] } });
      expect(h.ok, JSON.stringify(h)).toBe(true);
      c.sid = h.sid;
      const sending = pipelined(c, ptrs.map((p) => ({ op: 'compress', codec: 'fast', stream: 'gradients', tensors: [{ tensor: tensor(p.src), out: ipc(p.frame, cap) }] })), 100);
      for (const codec of ['off', 'max', null, 'off', 'fast', null]) expect((await q.req({ op: 'set', job: 'gpu-steer', codec })).ok).toBe(true);
      const replies = await sending;
      for (let i = 0; i < ptrs.length; i++) {
        const r = replies.get(100 + i) as Record<string, any>;
        expect(r.ok, JSON.stringify(r)).toBe(true);
        const p = ptrs[i] as (typeof ptrs)[number];
        const got = gpuCopyFromDevice(p.frame, r.frames[0].bytes, 0);
        const want = await compress(tensors[i] as Buffer, { dtype: 'BF16', shape: [n], codec: r.frames[0].codec });
        expect(got.equals(want), `tensor ${i} (${r.frames[0].codec})`).toBe(true);
        const back = await c.call('decompress', { frames: [{ frame: ipc(p.frame, r.frames[0].bytes), out: tensor(p.back) }] });
        expect(back.ok, JSON.stringify(back)).toBe(true);
        expect(gpuCopyFromDevice(p.back, bytes, 0).equals(tensors[i] as Buffer), `tensor ${i} back`).toBe(true);
      }
      expect((await c.call('shutdown')).ok).toBe(true);
      expect(await d.exited).toBe(0);
    } finally {
      c.close();
      q.close();
      d.child.kill('SIGKILL');
      for (const p of ptrs) {
        gpuFree(p.src, 0);
        gpuFree(p.frame, 0);
        gpuFree(p.back, 0);
      }
    }
  }, 120_000);
});
