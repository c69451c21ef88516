import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    include: ['test/**/*.test.ts'],
    environment: 'node',
    // The native addon and worker pools do not mix well with worker_threads.
    pool: 'forks',
    testTimeout: 60_000,
    hookTimeout: 60_000,
    // A suite with no test files is a broken suite, not a pass.
    passWithNoTests: false,
  },
});
