/**
 * Locates the tzip package root (the folder holding package.json), so that files shipped
 * beside the code (build/Release/tzip.node, data/demo, .venv) are found the same way whether
 * this code runs compiled from dist/src/*.js or as TypeScript from src/*.ts (vitest).
 */
import { existsSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

let cached: string | undefined;

/**
 * Absolute path of the package root: the nearest folder at or above this module's folder
 * that contains a package.json.
 * @throws Error when no package.json exists above this module (a broken install).
 */
export function packageRoot(): string {
  if (cached !== undefined) return cached;
  let dir = dirname(fileURLToPath(import.meta.url));
  for (;;) {
    if (existsSync(join(dir, 'package.json'))) {
      cached = dir;
      return dir;
    }
    const parent = dirname(dir);
    if (parent === dir) throw new Error(`no package.json found above ${fileURLToPath(import.meta.url)}`);
    dir = parent;
  }
}
