/**
 * How a command's result reaches stdout: one JSON document (`--json`) or human-readable text.
 */

/**
 * Prints `doc` as one pretty-printed JSON document when `json` is true, else the text `render()` returns.
 */
export function printResult(json: boolean | undefined, doc: unknown, render: () => string): void {
  process.stdout.write(json === true ? `${JSON.stringify(doc, null, 2)}\n` : `${render()}\n`);
}
