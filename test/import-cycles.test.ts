/**
 * No import cycles in src/ (the team's rule, /work/shared/DESIGN.md: "no import cycles"), type-only imports included:
 * a cycle of `import type` is no cycle at run time, but it still ties the modules into one (issue 12, Structure).
 *
 * The graph is what TypeScript's own pre-processor reads from each file (`ts.preProcessFile`: every `import`, `import
 * type`, `export ... from` and dynamic `import()`), each relative specifier resolved to the .ts file it names; its
 * strongly connected components (Tarjan) of more than one module, or a module importing itself, are the cycles.
 */
import { readdirSync, readFileSync, statSync } from 'node:fs';
import { dirname, join, relative, resolve } from 'node:path';
import ts from 'typescript';
import { describe, expect, it } from 'vitest';
import { packageRoot } from '../src/package-root.js';

const SRC = join(packageRoot(), 'src');

function tsFiles(dir: string): string[] {
  return readdirSync(dir).flatMap((name) => {
    const p = join(dir, name);
    if (statSync(p).isDirectory()) return tsFiles(p);
    return p.endsWith('.ts') && !p.endsWith('.d.ts') ? [p] : [];
  });
}

/** Each module of src/ and the modules of src/ it imports (relative specifiers: './x.js' is ./x.ts). */
function importGraph(): Map<string, string[]> {
  const files = new Set(tsFiles(SRC));
  const graph = new Map<string, string[]>();
  for (const f of files) {
    const info = ts.preProcessFile(readFileSync(f, 'utf8'), true, true);
    const deps: string[] = [];
    for (const { fileName } of info.importedFiles) {
      if (!fileName.startsWith('.')) continue;
      const target = resolve(dirname(f), fileName).replace(/\.js$/, '.ts');
      const found = [target, `${target}.ts`, join(target, 'index.ts')].find((t) => files.has(t));
      if (found === undefined) throw new Error(`${relative(SRC, f)}: cannot resolve the import '${fileName}' to a file of src/`);
      deps.push(found);
    }
    graph.set(f, deps);
  }
  return graph;
}

/** The strongly connected components that are cycles (Tarjan's algorithm), as lists of paths relative to src/. */
function cycles(graph: Map<string, string[]>): string[][] {
  let next = 0;
  const index = new Map<string, number>();
  const low = new Map<string, number>();
  const stack: string[] = [];
  const onStack = new Set<string>();
  const found: string[][] = [];
  const visit = (v: string): void => {
    index.set(v, next);
    low.set(v, next);
    next++;
    stack.push(v);
    onStack.add(v);
    for (const w of graph.get(v) ?? []) {
      if (!index.has(w)) {
        visit(w);
        low.set(v, Math.min(low.get(v) as number, low.get(w) as number));
      } else if (onStack.has(w)) {
        low.set(v, Math.min(low.get(v) as number, index.get(w) as number));
      }
    }
    if (low.get(v) !== index.get(v)) return;
    const scc: string[] = [];
    for (;;) {
      const w = stack.pop() as string;
      onStack.delete(w);
      scc.push(w);
      if (w === v) break;
    }
    if (scc.length > 1 || (graph.get(v) ?? []).includes(v)) found.push(scc.map((p) => relative(SRC, p)).sort());
  };
  for (const v of graph.keys()) if (!index.has(v)) visit(v);
  return found;
}

describe('the import graph of src/', () => {
  it('has no cycle, type-only imports included', () => {
    const graph = importGraph();
    expect(graph.size).toBeGreaterThan(40);
    expect(cycles(graph)).toEqual([]);
  });

  it('the check finds a cycle where there is one (two modules importing each other, one of them type-only)', () => {
    const a = join(SRC, 'a.ts');
    const b = join(SRC, 'b.ts');
    const c = join(SRC, 'c.ts');
    expect(cycles(new Map([[a, [b]], [b, [a]], [c, [a]]]))).toEqual([['a.ts', 'b.ts']]);
    expect(cycles(new Map([[a, [a]]]))).toEqual([['a.ts']]);
    // and on the real graph: the type-only import that session.ts's narrow interfaces replaced would close one again
    const graph = importGraph();
    const ringOps = join(SRC, 'daemon', 'ring-ops.ts');
    graph.set(ringOps, [...(graph.get(ringOps) ?? []), join(SRC, 'daemon', 'session.ts')]);
    expect(cycles(graph)).toEqual([['daemon/ring-ops.ts', 'daemon/session.ts']]);
  });
});
