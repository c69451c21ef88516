/**
 * {@link isFolder} on its own, so that `tzip compress FILE` and `tzip decompress FILE` decide between a file and a
 * folder without loading src/folder.ts and, through it, the other direction's modules (issue 36).
 */
import { stat } from 'node:fs/promises';

/** Whether `path` names a folder (a link to one included); false when nothing is there, so the file path reports it. */
export async function isFolder(path: string): Promise<boolean> {
  try {
    return (await stat(path)).isDirectory();
  } catch {
    return false;
  }
}

