/**
 * Checkpoint folders (a Hugging Face model folder: config.json, tokenizer files, one or many `*.safetensors` shards and
 * `model.safetensors.index.json`). `tzip compress DIR -o OUT` writes a folder that mirrors DIR: each shard
 * `NAME.safetensors` becomes `NAME.tzip` (an ordinary .tzip file that every command reads), every other file is copied
 * byte for byte; `tzip decompress` maps back. Per-shard files rather than one archive keep what a .tzip gives a single
 * file (one tensor read without decoding the others, one shard verified or restored on its own), and the index keeps
 * naming its shards by their safetensors names, which decompress restores (docs/container.md, "Checkpoint folders").
 *
 * Folders are flat: HF checkpoint folders are, and a folder that is not (a `.cache/` of a download tool, a second
 * model) is refused by name rather than half-mirrored. Nothing is silently skipped, so that decompress(compress(DIR))
 * holds every file of DIR, byte-identical.
 */
import { randomBytes } from 'node:crypto';
import { copyFile, lstat, mkdir, open, readdir, readFile, realpath, rename, rm, stat } from 'node:fs/promises';
import type { Stats } from 'node:fs';
import { basename, dirname, isAbsolute, join, relative, resolve } from 'node:path';
import { performance } from 'node:perf_hooks';
import { TzipError, toTzipError } from './errors.js';
import { decompressFile, type RestoreOptions } from './restore.js';
import { compressFile, type CompressFileOptions } from './writer.js';

/** Suffix of a safetensors shard in a checkpoint folder. */
export const SAFETENSORS_SUFFIX = '.safetensors';
/** Suffix of a compressed shard. */
export const TZIP_SUFFIX = '.tzip';
/** Suffix of a sharded checkpoint's index (`model.safetensors.index.json`, `diffusion_pytorch_model.safetensors.index.json`). */
export const INDEX_SUFFIX = '.safetensors.index.json';

/** One file of a checkpoint folder. */
export interface FolderFile {
  /** Its name in the folder. */
  name: string;
  /** Its path (the folder as given, joined with the name). */
  path: string;
  /** 'shard' for a file with the listing's shard suffix, 'other' for a file carried unchanged. */
  kind: 'shard' | 'other';
  /** Its size in bytes. */
  bytes: number;
}

/** What {@link listFolder} takes as a shard, and what it refuses. */
export interface FolderRules {
  /** Files with this suffix are shards. */
  shardSuffix: string;
  /**
   * Files with this suffix are refused, with the reason: a `.tzip` in a folder to compress would come back as a
   * `.safetensors`, and a `.safetensors` beside `.tzip` shards could collide with a restored one.
   */
  refuse?: { suffix: string; why: string } | undefined;
}

export { isFolder } from './is-folder.js';

/** Whether `path` (absolute, links resolved) is `folder` itself or lies under it. */
function isInside(folder: string, path: string): boolean {
  const rel = relative(folder, path);
  return rel === '' || (!rel.startsWith('..') && !isAbsolute(rel));
}

/**
 * The files of the checkpoint folder `dir`, sorted by name. A symbolic link to a file of the same folder is taken as
 * that file (its bytes are what is read); everything else that is not a plain file is refused.
 * @throws TzipError TZIP_USAGE naming the entry for a subfolder (folders are flat), a link that leads out of the folder
 *   or to nothing, a FIFO, socket or device, a file with `rules.refuse`'s suffix, or a folder without any shard;
 *   TZIP_IO when the folder cannot be read.
 */
export async function listFolder(dir: string, rules: FolderRules): Promise<FolderFile[]> {
  let real: string;
  let names: string[];
  try {
    real = await realpath(dir);
    names = (await readdir(dir)).sort();
  } catch (err) {
    throw toTzipError(err, { file: dir });
  }
  const files: FolderFile[] = [];
  for (const name of names) {
    const path = join(dir, name);
    let info: Stats;
    try {
      info = await lstat(path);
      if (info.isSymbolicLink()) {
        let target: string;
        try {
          target = await realpath(path);
        } catch (err) {
          if ((err as NodeJS.ErrnoException).code === 'ENOENT') throw new TzipError('TZIP_USAGE', 'is a symbolic link to nothing (dangling)', { file: path });
          throw err;
        }
        // A link out of the folder would put a file of somewhere else into the output, and a folder tree of links (a
        // Hugging Face cache snapshot, whose links lead to ../../blobs) is better copied with `cp -L` first, knowingly.
        if (!isInside(real, target)) {
          throw new TzipError('TZIP_USAGE', `is a symbolic link out of the folder (to ${target}): copy the checkpoint with its links followed (cp -rL) and give that folder`, { file: path });
        }
        info = await stat(path);
      }
    } catch (err) {
      throw toTzipError(err, { file: path });
    }
    if (info.isDirectory()) {
      throw new TzipError('TZIP_USAGE', 'is a folder: tzip takes flat checkpoint folders (as Hugging Face model folders are) and does not recurse; move it out or compress it on its own', { file: path });
    }
    if (!info.isFile()) throw new TzipError('TZIP_USAGE', 'is not a regular file (a FIFO, socket or device): a checkpoint folder holds files only', { file: path });
    if (rules.refuse !== undefined && name.endsWith(rules.refuse.suffix)) throw new TzipError('TZIP_USAGE', rules.refuse.why, { file: path });
    files.push({ name, path, kind: name.endsWith(rules.shardSuffix) ? 'shard' : 'other', bytes: info.size });
  }
  if (!files.some((f) => f.kind === 'shard')) {
    throw new TzipError('TZIP_USAGE', `holds no ${rules.shardSuffix} file: not a checkpoint folder for this command`, { file: dir });
  }
  return files;
}

/** The name `name` takes in the output folder: `from` suffix swapped for `to` (other files keep their names). */
export function mappedName(name: string, from: string, to: string): string {
  return name.endsWith(from) ? name.slice(0, name.length - from.length) + to : name;
}

/** `path` (absolute) with the links of its longest existing ancestor resolved, the rest (not there yet) appended. */
async function realpathOfAncestor(path: string): Promise<string> {
  let head = path;
  const rest: string[] = [];
  for (;;) {
    try {
      return join(await realpath(head), ...rest);
    } catch {
      const up = dirname(head);
      if (up === head) return path;
      rest.unshift(basename(head));
      head = up;
    }
  }
}

/** An output folder being written (see {@link startOutputFolder}). */
export interface OutputFolder {
  /** The temporary folder the files go to. */
  temp: string;
  /** Renames the temporary folder to the output folder. */
  commit(): Promise<void>;
  /** Removes the temporary folder and what it holds. */
  abort(): Promise<void>;
}

/**
 * Starts writing the output folder `output` for the input folder `input`: files go to a fresh temporary folder beside
 * it, renamed to `output` only when every file is written (a rename replaces an empty folder), so a failed or
 * interrupted run leaves no half-filled folder under the output's name, as a single output file is written.
 * @throws TzipError TZIP_USAGE naming `output` when it is a file, a folder that is not empty (tzip never mixes its
 *   files with others: there is no option to overwrite, as for single files none is needed), or the input folder or a
 *   folder inside it; TZIP_IO when the temporary folder cannot be created.
 */
export async function startOutputFolder(input: string, output: string): Promise<OutputFolder> {
  let target = resolve(output);
  let existing: Stats | null = null;
  try {
    existing = await stat(target);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw toTzipError(err, { file: output });
  }
  if (existing !== null) {
    if (!existing.isDirectory()) throw new TzipError('TZIP_USAGE', 'exists and is not a folder: the output of a folder is a folder', { file: output });
    let entries: string[];
    try {
      entries = await readdir(target);
      target = await realpath(target); // a link to an empty folder: that folder is replaced, the link stays
    } catch (err) {
      throw toTzipError(err, { file: output });
    }
    if (entries.length > 0) {
      throw new TzipError('TZIP_USAGE', 'exists and is not empty: give a new folder (or an empty one); tzip does not mix its output with other files', { file: output });
    }
  }
  // Checked before anything is created: `-o DIR/new/sub` must not leave DIR/new behind when it is refused.
  const realInput = await realpath(input).catch((err: unknown) => { throw toTzipError(err, { file: input }); });
  if (isInside(realInput, await realpathOfAncestor(target))) {
    throw new TzipError('TZIP_USAGE', `is inside the input folder ${input}: write the output elsewhere`, { file: output });
  }
  let parent: string;
  try {
    await mkdir(dirname(target), { recursive: true });
    parent = await realpath(dirname(target));
  } catch (err) {
    throw toTzipError(err, { file: output });
  }
  target = join(parent, basename(target));
  const temp = join(parent, `.${basename(target)}.${process.pid}.${randomBytes(4).toString('hex')}.tmp`);
  try {
    await mkdir(temp);
  } catch (err) {
    throw toTzipError(err, { file: output });
  }
  return {
    temp,
    async commit() {
      try {
        await rename(temp, target);
      } catch (err) {
        await rm(temp, { recursive: true, force: true }).catch(() => undefined);
        throw toTzipError(err, { file: output });
      }
    },
    async abort() {
      await rm(temp, { recursive: true, force: true }).catch(() => undefined);
    },
  };
}

/**
 * Copies the file `from` to `to` byte for byte and syncs it, as the .tzip shards beside it are synced before the
 * folder is renamed into place. @throws TzipError TZIP_IO naming `from` (reading) or `label` (writing).
 */
export async function copyVerbatim(from: string, to: string, label: string): Promise<void> {
  try {
    await copyFile(from, to);
  } catch (err) {
    throw toTzipError(err, { file: from });
  }
  try {
    const handle = await open(to, 'r+');
    try {
      await handle.sync();
    } finally {
      await handle.close();
    }
  } catch (err) {
    throw toTzipError(err, { file: label });
  }
}

/**
 * `err` with its file renamed from a path under the temporary folder `temp` to the same name under `output`, so that a
 * failed write names the file the user asked for, not a temporary one.
 */
export function underOutput(err: unknown, temp: string, output: string): unknown {
  if (!(err instanceof TzipError) || err.file === undefined || !err.file.startsWith(`${temp}/`)) return err;
  const copy = new TzipError(err.code, err.detail, { file: join(output, err.file.slice(temp.length + 1)), tensor: err.tensor, needBytes: err.needBytes, cause: err.cause });
  copy.stack = err.stack;
  return copy;
}

/** A problem {@link checkIndexes} found. */
export interface IndexProblem {
  /** The index file's name. */
  index: string;
  message: string;
}

/**
 * Checks every `*.safetensors.index.json` of a compressed folder against its shards: its `weight_map` must name, for
 * every tensor, a shard `NAME.safetensors` whose `NAME.tzip` is in the folder and holds that tensor. This is what a
 * sharded loader (transformers) relies on after decompress; the files are carried verbatim, so a problem here was in
 * the input folder too. A missing shard is one problem, not one per tensor it should hold.
 * @param tensorsOf the tensor names of a shard of the folder, by its .tzip name; null for a shard that cannot be read
 *   (already a failure of its own), whose tensors are then not checked.
 */
export async function checkIndexes(files: readonly FolderFile[], tensorsOf: (tzipName: string) => Promise<ReadonlySet<string> | null>): Promise<IndexProblem[]> {
  const problems: IndexProblem[] = [];
  const present = new Set(files.map((f) => f.name));
  for (const file of files.filter((f) => f.kind === 'other' && f.name.endsWith(INDEX_SUFFIX))) {
    let weightMap: unknown;
    try {
      weightMap = (JSON.parse(await readFile(file.path, 'utf8')) as { weight_map?: unknown }).weight_map;
    } catch (err) {
      if (err instanceof SyntaxError) {
        problems.push({ index: file.name, message: `is not JSON: ${err.message}` });
        continue;
      }
      throw toTzipError(err, { file: file.path });
    }
    if (weightMap === null || typeof weightMap !== 'object' || Array.isArray(weightMap)) {
      problems.push({ index: file.name, message: 'has no "weight_map" object' });
      continue;
    }
    const byShard = new Map<string, string[]>();
    for (const [tensor, shard] of Object.entries(weightMap as Record<string, unknown>)) {
      if (typeof shard !== 'string' || !shard.endsWith(SAFETENSORS_SUFFIX) || shard.includes('/')) {
        problems.push({ index: file.name, message: `tensor '${tensor}': ${JSON.stringify(shard)} is not a shard of this folder (NAME${SAFETENSORS_SUFFIX})` });
        continue;
      }
      byShard.set(shard, [...(byShard.get(shard) ?? []), tensor]);
    }
    for (const [shard, tensors] of byShard) {
      const tzipName = mappedName(shard, SAFETENSORS_SUFFIX, TZIP_SUFFIX);
      if (!present.has(tzipName)) {
        problems.push({ index: file.name, message: `names ${shard} for ${tensors.length} tensors, and ${tzipName} is missing` });
        continue;
      }
      const names = await tensorsOf(tzipName);
      if (names === null) continue;
      for (const tensor of tensors) {
        if (!names.has(tensor)) problems.push({ index: file.name, message: `tensor '${tensor}': not in ${tzipName} (its shard ${shard})` });
      }
    }
  }
  return problems;
}

/** One file of {@link compressFolder}'s or {@link decompressFolder}'s result. Sizes in bytes, time in seconds. */
export interface FolderFileResult {
  /** Its name in the input folder. */
  name: string;
  /** Its name in the output folder. */
  output: string;
  /** 'shard' for a file compressed or decompressed, 'copied' for one carried unchanged. */
  kind: 'shard' | 'copied';
  inputBytes: number;
  outputBytes: number;
  /** Entries of the shard's container (tensors and gaps); 0 for a copied file. */
  entries: number;
  seconds: number;
}

/** Result of {@link compressFolder} and {@link decompressFolder}. Sizes are the sums over the files. */
export interface FolderResult {
  files: FolderFileResult[];
  inputBytes: number;
  outputBytes: number;
  seconds: number;
}

/** Options of {@link compressFolder} and {@link decompressFolder}. */
export interface FolderOptions {
  /** Called before each shard with its input path; returns the progress callback for that shard's bytes. */
  onShard?: ((path: string) => { update(done: number, total: number): void; stop(): void }) | undefined;
}

/** How one shard is turned into the other form: writes `to` from `from`, returns its sizes and entry count. */
type ShardStep = (from: string, to: string, onProgress: (done: number, total: number) => void) =>
  Promise<{ inputBytes: number; outputBytes: number; entries: number }>;

/** The common walk of {@link compressFolder} and {@link decompressFolder}. */
async function transformFolder(input: string, output: string, rules: FolderRules, to: string, step: ShardStep, options: FolderOptions): Promise<FolderResult> {
  const started = performance.now();
  const files = await listFolder(input, rules);
  const out = await startOutputFolder(input, output);
  const results: FolderFileResult[] = [];
  try {
    for (const file of files) {
      const fileStarted = performance.now();
      const name = file.kind === 'shard' ? mappedName(file.name, rules.shardSuffix, to) : file.name;
      const dest = join(out.temp, name);
      if (file.kind === 'shard') {
        const progress = options.onShard?.(file.path);
        try {
          const r = await step(file.path, dest, (d, t) => progress?.update(d, t));
          results.push({ name: file.name, output: name, kind: 'shard', ...r, seconds: (performance.now() - fileStarted) / 1000 });
        } finally {
          progress?.stop();
        }
      } else {
        await copyVerbatim(file.path, dest, join(output, name));
        results.push({ name: file.name, output: name, kind: 'copied', inputBytes: file.bytes, outputBytes: file.bytes, entries: 0, seconds: (performance.now() - fileStarted) / 1000 });
      }
    }
    await out.commit();
  } catch (err) {
    await out.abort();
    throw underOutput(err, out.temp, output);
  }
  return {
    files: results,
    inputBytes: results.reduce((s, f) => s + f.inputBytes, 0),
    outputBytes: results.reduce((s, f) => s + f.outputBytes, 0),
    seconds: (performance.now() - started) / 1000,
  };
}

/**
 * Compresses the checkpoint folder `input` into the new folder `output`: each `NAME.safetensors` into `NAME.tzip`
 * (as {@link compressFile}, with `options`), every other file copied byte for byte.
 * @throws TzipError as {@link listFolder} and {@link startOutputFolder} (refusals), and as {@link compressFile} for a
 *   shard; the output folder is then not created.
 */
export async function compressFolder(input: string, output: string, options: CompressFileOptions & FolderOptions = {}): Promise<FolderResult> {
  const rules: FolderRules = {
    shardSuffix: SAFETENSORS_SUFFIX,
    refuse: { suffix: TZIP_SUFFIX, why: `is a .tzip file: a compressed folder names each shard NAME.safetensors NAME.tzip, so decompress would turn this one into a ${SAFETENSORS_SUFFIX} file` },
  };
  return transformFolder(input, output, rules, TZIP_SUFFIX, async (from, to, onProgress) => {
    const r = await compressFile(from, to, { codec: options.codec, threads: options.threads, chunkSize: options.chunkSize, onProgress });
    return { inputBytes: r.inputBytes, outputBytes: r.outputBytes, entries: r.entries.length };
  }, options);
}

/**
 * Restores the folder `input` written by {@link compressFolder} into the new folder `output`: each `NAME.tzip` into
 * `NAME.safetensors` (as {@link decompressFile}), every other file copied byte for byte.
 * @throws TzipError as {@link listFolder} and {@link startOutputFolder} (refusals), and as {@link decompressFile} for a
 *   shard; the output folder is then not created.
 */
export async function decompressFolder(input: string, output: string, options: RestoreOptions & FolderOptions = {}): Promise<FolderResult> {
  const rules: FolderRules = {
    shardSuffix: TZIP_SUFFIX,
    refuse: { suffix: SAFETENSORS_SUFFIX, why: `is a safetensors file: a folder that tzip compress wrote holds none (its shards are .tzip files), and it could collide with a restored shard` },
  };
  return transformFolder(input, output, rules, SAFETENSORS_SUFFIX, async (from, to, onProgress) => {
    const r = await decompressFile(from, to, { threads: options.threads, onProgress });
    return { inputBytes: r.inputBytes, outputBytes: r.outputBytes, entries: r.entryCount };
  }, options);
}
