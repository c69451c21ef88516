/**
 * Request epochs: a number per compress/decompress request, so that the files a request names are
 * checked against the file system once per request (shm-map.ts), not once per handle.
 */

let epoch = 0;

/** A number no earlier request got. */
export function nextEpoch(): number {
  epoch = (epoch + 1) % Number.MAX_SAFE_INTEGER;
  return epoch;
}
