/**
 * Text tables for the CLI (cli-table3), coloured only when stdout is a terminal.
 */
import Table from 'cli-table3';

/** Horizontal alignment of a column. */
export type Align = 'left' | 'right' | 'center';

/** A table with the given header and column alignments; colours are off unless stdout is a TTY. */
export function makeTable(head: string[], colAligns: Align[]): InstanceType<typeof Table> {
  const plain = !process.stdout.isTTY;
  return new Table({ head, colAligns, style: plain ? { head: [], border: [] } : {} });
}
