// Types of fuzz/js/targets.mjs, for test/fuzz-regressions.test.ts.
export class FuzzFailure extends Error {}
export interface FuzzTarget {
  /** true: accepted and decoded consistently; false: refused as documented; throws FuzzFailure otherwise. */
  check(bytes: Buffer): Promise<boolean>;
}
export const container: FuzzTarget;
export const safetensors: FuzzTarget;
export const protocol: FuzzTarget;
export const TARGETS: { container: FuzzTarget; safetensors: FuzzTarget; protocol: FuzzTarget };
export function cleanup(): void;
