// A synthetic small-weight bf16 tensor for daemon tests (the codec tests use the real model): exponents in a narrow
// range (117-122), random mantissas and signs, from a fixed LCG so every run sends the same bytes.

/** `n` bf16 values as little-endian bytes (2n), from `seed`. */
export function bf16Weights(n: number, seed = 1): Buffer {
  const out = Buffer.alloc(n * 2);
  let s = seed;
  for (let i = 0; i < n; i++) {
    s = (s * 1103515245 + 12345) & 0x7fffffff;
    out.writeUInt16LE(((s >> 8) & 0x8000) | ((117 + (s % 6)) << 7) | ((s >> 3) & 0x7f), i * 2);
  }
  return out;
}
