/**
 * Text from files and clients made safe for a terminal or a log line.
 */

/**
 * `text` with its control characters (newline, ESC, NUL, ...: Unicode category Cc) written as JSON escapes (`\n`,
 * `\u001b`). A tensor name or dtype string read from a file, or a client's name, printed this way stays on its line and
 * cannot forge a table row or drive the terminal (an escape sequence that sets the window title or colours).
 */
export function printable(text: string): string {
  return text.replace(/\p{Cc}/gu, (c) => JSON.stringify(c).slice(1, -1));
}
