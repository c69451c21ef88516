/**
 * The request observer (`DaemonOptions.observer`): one event per answered request, for metrics (src/daemon/metrics.ts)
 * and anything else that watches the daemon from inside its process. Called on the daemon's event loop right after
 * the reply is queued; an observer that throws is logged and ignored (it never changes a reply).
 */

/** One answered request. */
export interface RequestEvent {
  /** The request's op (hello, compress, ...); 'invalid' for a message that was not a request. */
  op: string;
  /** Name of the job of the request's session (jobs.ts), or null (no session: hello that failed, stats, jobs, set). */
  job: string | null;
  /** compress/decompress: the request's `stream` ('other' when it named none); other ops: null. */
  stream: string | null;
  /** compress/decompress: where its codec work ran (null when it failed before that was known); other ops: null. */
  device: 'cpu' | 'gpu' | null;
  /** From the request's arrival to its reply, seconds. */
  seconds: number;
  /** Tensors (compress) or frames (decompress) coded; 0 for other ops and failed requests. */
  items: number;
  /** Bytes read: tensor bytes (compress), frame bytes (decompress); 0 otherwise. */
  bytesIn: number;
  /** Bytes written: frame bytes (compress), tensor bytes (decompress); 0 otherwise. */
  bytesOut: number;
  /** The error reply's code (src/errors.json), or null for a success. */
  error: string | null;
}

/** What `DaemonOptions.observer` is. */
export type RequestObserver = (e: RequestEvent) => void;
