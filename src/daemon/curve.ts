/**
 * The optional TCP endpoint's security: CURVE keys and the ZAP handler that admits clients.
 *
 * `tzip serve --tcp PORT` also listens on `tcp://127.0.0.1:PORT`, which every local user can reach,
 * so that socket speaks only CURVE (ZeroMQ RFC 26): traffic is encrypted and a client is admitted
 * only when its public key is in the allow-list. The keys live in the private socket folder
 * (mode 0700, see paths.ts), in `curve/`:
 *
 *   server.public, server.secret   the daemon's key pair (Z85 text, 40 characters)
 *   client.public, client.secret   a key pair for this user's clients (admitted)
 *   authorized_keys                optional: more client public keys, one Z85 key a line (# comments)
 *
 * Missing key pairs are created (files 0600). A client of the same user reads `server.public` and its
 * key pair from the folder (python-bridge: `tzip.connect("tcp://127.0.0.1:PORT")`), which is what
 * makes TCP as private as the ipc:// socket: only processes that can read the folder get in.
 * The ZAP handler (RFC 27) answers on `inproc://zeromq.zap.01` of the daemon's ZeroMQ context.
 */
import { chmodSync, existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { Router, capability, curveKeyPair } from 'zeromq';
import { TzipError } from '../errors.js';

/** The ZAP domain the TCP socket asks the handler about. */
export const ZAP_DOMAIN = 'tzip';
const ZAP_ENDPOINT = 'inproc://zeromq.zap.01';
const Z85_KEY = /^[0-9a-zA-Z.\-:+=^!/*?&<>()[\]{}@%$#]{40}$/;

/** The daemon's CURVE keys and the client public keys it admits (Z85). */
export interface CurveKeys {
  dir: string;
  serverPublic: string;
  serverSecret: string;
  authorized: Set<string>;
}

function readKey(path: string): string {
  const key = readFileSync(path, 'utf8').trim();
  if (!Z85_KEY.test(key)) throw new TzipError('TZIP_IO', 'not a Z85-encoded CURVE key (40 characters)', { file: path });
  return key;
}

/** Reads the key pair `<name>.public`/`<name>.secret` of `dir`, creating it (0600 files) when missing. */
function keyPair(dir: string, name: string): { publicKey: string; secretKey: string } {
  const pub = join(dir, `${name}.public`);
  const sec = join(dir, `${name}.secret`);
  if (!existsSync(pub) || !existsSync(sec)) {
    const k = curveKeyPair();
    writeFileSync(sec, `${k.secretKey}\n`, { mode: 0o600 });
    writeFileSync(pub, `${k.publicKey}\n`, { mode: 0o600 });
  }
  return { publicKey: readKey(pub), secretKey: readKey(sec) };
}

/**
 * The keys of the daemon whose socket is `socketPath` (its folder must already be private): the
 * `curve/` folder next to the socket, created with mode 0700 and filled as the module doc says.
 * @throws TzipError TZIP_UNSUPPORTED when this ZeroMQ build has no CURVE; TZIP_IO when a key file
 *   cannot be written or read, or is not a Z85 key.
 */
export function loadCurveKeys(socketPath: string): CurveKeys {
  if (!capability.curve) throw new TzipError('TZIP_UNSUPPORTED', 'this ZeroMQ build has no CURVE support: the TCP endpoint needs it');
  const dir = join(dirname(socketPath), 'curve');
  try {
    mkdirSync(dir, { mode: 0o700 });
    // Made here: 0700 whatever the umask took away. An existing one keeps its mode (the daemon changes the mode only
    // of folders it creates); the private socket folder around it already keeps others out.
    chmodSync(dir, 0o700);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'EEXIST') {
      throw new TzipError('TZIP_IO', `cannot create the CURVE key folder: ${(err as Error).message}`, { file: dir, cause: err });
    }
  }
  try {
    const server = keyPair(dir, 'server');
    const client = keyPair(dir, 'client');
    const authorized = new Set([client.publicKey]);
    const extra = join(dir, 'authorized_keys');
    if (existsSync(extra)) {
      for (const line of readFileSync(extra, 'utf8').split('\n')) {
        const key = line.trim();
        if (key === '' || key.startsWith('#')) continue;
        if (!Z85_KEY.test(key)) throw new TzipError('TZIP_IO', `not a Z85 CURVE public key: '${key.slice(0, 60)}'`, { file: extra });
        authorized.add(key);
      }
    }
    return { dir, serverPublic: server.publicKey, serverSecret: server.secretKey, authorized };
  } catch (err) {
    if (err instanceof TzipError) throw err;
    throw new TzipError('TZIP_IO', `cannot set up the CURVE keys: ${(err as Error).message}`, { file: dir, cause: err });
  }
}

/** Z85 encoding (RFC 32) of a 32-byte CURVE key, to compare with the allow-list. */
function z85(bytes: Uint8Array): string {
  const chars = '0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#';
  let out = '';
  for (let i = 0; i < bytes.length; i += 4) {
    let v = ((bytes[i] as number) * 2 ** 24) + ((bytes[i + 1] as number) << 16) + ((bytes[i + 2] as number) << 8) + (bytes[i + 3] as number);
    let block = '';
    for (let k = 0; k < 5; k++) {
      block = chars[v % 85] + block;
      v = Math.floor(v / 85);
    }
    out += block;
  }
  return out;
}

/**
 * The ZAP handler: admits CURVE clients whose public key is in `keys.authorized`, refuses
 * everything else (other mechanisms, other domains, unknown keys). Runs until `close()`.
 * Binds before the TCP socket does, as libzmq asks the handler at each handshake.
 */
export class ZapHandler {
  private readonly socket = new Router({ linger: 0 });
  /** Handshakes refused so far (for stats and tests). */
  refused = 0;

  private constructor(private readonly keys: CurveKeys, private readonly log: (line: string) => void) {}

  /** Binds the handler and starts answering. */
  static async start(keys: CurveKeys, log: (line: string) => void): Promise<ZapHandler> {
    const h = new ZapHandler(keys, log);
    await h.socket.bind(ZAP_ENDPOINT);
    void h.loop();
    return h;
  }

  private async loop(): Promise<void> {
    while (!this.socket.closed) {
      let parts: Buffer[];
      try {
        parts = await this.socket.receive();
      } catch {
        break;
      }
      // [routing, empty, version, request id, domain, address, identity, mechanism, credentials...]
      const [routing, empty, version, requestId, domain, address, , mechanism, key] = parts;
      if (routing === undefined || empty === undefined || version === undefined || requestId === undefined) continue;
      let status = '400';
      let text = 'refused';
      if (version.toString() !== '1.0') {
        text = 'unknown ZAP version';
      } else if (domain?.toString() !== ZAP_DOMAIN || mechanism?.toString() !== 'CURVE' || key === undefined || key.length !== 32) {
        text = 'only CURVE clients of the tzip domain';
      } else if (!this.keys.authorized.has(z85(key))) {
        text = 'client key not authorized';
      } else {
        status = '200';
        text = 'OK';
      }
      if (status !== '200') {
        this.refused++;
        this.log(`TCP handshake from ${address?.toString() ?? '?'} refused: ${text}`);
      }
      try {
        await this.socket.send([routing, empty, '1.0', requestId, status, text, status === '200' ? 'tzip-client' : '', '']);
      } catch {
        if (this.socket.closed) break;
      }
    }
  }

  close(): void {
    this.socket.close();
  }
}
