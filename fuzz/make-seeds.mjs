// Seed corpora of real streams for every fuzz target (scripts/fuzz.sh runs this at build time; nothing large is
// committed). Usage: node fuzz/make-seeds.mjs OUT_DIR   (needs dist/ and the native addon, as the CLI does).
//   OUT/frame        the golden frames (test/golden/*.tzf) and frames of slices of the bundled MiniLM model's
//                    weights and gradients (data/demo/*.safetensors, made by tzip.demo_data), every codec, 4 KiB and
//                    64 KiB chunks
//   OUT/chunk        every stored chunk of those frames, in fuzz_chunk's input layout (cuda/test/fuzz_chunk.cpp)
//   OUT/codec_<c>    those frames of codec c, in fuzz_codec_frame.h's input layout
//   OUT/safetensors  small safetensors files of real MiniLM tensors (real names, dtypes, metadata), sliced
//   OUT/container    those files compressed into .tzip by the real writer (src/writer.ts, what `tzip compress` runs)
import { mkdirSync, readdirSync, readFileSync, rmSync, writeFileSync, existsSync } from 'node:fs';
import { join } from 'node:path';
import { compress, readHeader } from '../dist/src/native.js';
import { openSafetensors } from '../dist/src/safetensors.js';
import { compressFile } from '../dist/src/writer.js';

const out = process.argv[2];
if (!out) throw new Error('usage: node fuzz/make-seeds.mjs OUT_DIR');
rmSync(out, { recursive: true, force: true });
const dir = (name) => { const d = join(out, name); mkdirSync(d, { recursive: true }); return d; };
const DTYPES = ['BOOL', 'U8', 'I8', 'F8_E4M3', 'F8_E5M2', 'I16', 'U16', 'F16', 'BF16', 'I32', 'U32', 'F32', 'I64', 'U64', 'F64'];
const SIZE = { BOOL: 1, U8: 1, I8: 1, F8_E4M3: 1, F8_E5M2: 1, I16: 2, U16: 2, F16: 2, BF16: 2, I32: 4, U32: 4, F32: 4, I64: 8, U64: 8, F64: 8 };
const CODEC_IDS = { raw: 0, fast: 1, max: 2, bytes: 3 };
const FLOATS = ['BF16', 'F16', 'F32'];
const align16 = (x) => (x + 15) & ~15;
const u16 = (v) => { const b = Buffer.alloc(2); b.writeUInt16LE(v); return b; };

const frames = [];  // { name, frame }
const goldenDir = 'test/golden';
for (const f of readdirSync(goldenDir).filter((f) => f.endsWith('.tzf')).sort()) {
  frames.push({ name: `golden-${f}`, frame: readFileSync(join(goldenDir, f)) });
}

// Real tensors: slices of MiniLM's weights and gradients in F32 and BF16, and an F16 cast made by the codec's own
// dtype split would not be real, so F16 comes from the golden vectors only.
const demo = 'data/demo';
const models = ['minilm-weights-f32', 'minilm-weights-bf16', 'minilm-grads-f32', 'minilm-grads-bf16']
  .map((m) => join(demo, `${m}.safetensors`)).filter((p) => existsSync(p));
if (models.length === 0) console.error(`make-seeds: no ${demo}/*.safetensors (python -m tzip.demo_data): golden seeds only`);
const picked = ['embeddings.word_embeddings.weight', 'encoder.layer.0.attention.self.query.weight',
  'encoder.layer.3.output.dense.bias', 'embeddings.LayerNorm.weight', 'encoder.layer.5.intermediate.dense.weight'];
const files = [];  // opened safetensors
for (const path of models) files.push(await openSafetensors(path));
for (const file of files) {
  const base = file.path.split('/').pop().replace('.safetensors', '');
  for (const t of file.header.tensors.filter((x) => picked.includes(x.name))) {
    for (const [bytes, chunkSize] of [[3000, 4096], [9000, 4096], [70000, 65536]]) {
      const esize = SIZE[t.dtype];
      const n = Math.min(Math.floor(bytes / esize), (t.end - t.begin) / esize);
      const data = await file.read(t.begin, t.begin + n * esize);
      for (const codec of ['fast', 'max', 'bytes', 'raw']) {
        if (bytes === 70000 && codec !== 'max' && codec !== 'fast') continue;  // a few large seeds are enough
        const frame = await compress(data, { dtype: t.dtype, shape: [n], codec, chunkSize, threads: 1 });
        frames.push({ name: `${base}-${t.name}-${n}-${codec}-${chunkSize}.tzf`, frame });
      }
    }
  }
}
const frameDir = dir('frame');
for (const { name, frame } of frames) writeFileSync(join(frameDir, name), frame);

// Chunks and per-codec records, from each frame's chunk table (docs/format.md, section 5).
const chunkDir = dir('chunk');
const codecDirs = Object.fromEntries(Object.keys(CODEC_IDS).map((c) => [c, dir(`codec_${c}`)]));
for (const { name, frame } of frames) {
  let h;
  try { h = readHeader(frame); } catch { continue; }
  if (h.nChunks === 0) continue;
  const dcode = DTYPES.indexOf(h.dtype), esize = SIZE[h.dtype];
  const table = align16(48 + 8 * h.shape.length);
  const records = [];
  for (let i = 0; i < h.nChunks && i < 4; i++) {
    const off = Number(frame.readBigUInt64LE(table + 16 * i)), size = frame.readUInt32LE(table + 16 * i + 8);
    const stored = frame.subarray(h.headerBytes + off, h.headerBytes + off + size);
    const raw = Math.min(h.chunkSize, h.nbytes - i * h.chunkSize);
    // fuzz_chunk: [dtype][codec][u16 field][stored]; raw size = 65536 - field (rounded down to elements).
    writeFileSync(join(chunkDir, `${name}-c${i}`), Buffer.concat([Buffer.from([dcode, CODEC_IDS[h.codec]]), u16(65536 - raw), stored]));
    // fuzz_codec_frame.h: [stored u16][raw field u16][stored]; last raw = chunk_size - field.
    if (size <= 65535) records.push(Buffer.concat([u16(size), u16(h.chunkSize - raw), stored]));
  }
  const sel = h.codec === 'fast' || h.codec === 'max' ? FLOATS.indexOf(h.dtype) : dcode;
  if (records.length > 0 && (h.nChunks <= 4 || records.length === 4)) {
    writeFileSync(join(codecDirs[h.codec], name),
      Buffer.concat([Buffer.from([sel, (h.chunkSize - 4096) / 256]), ...records]));
  }
}

// Small safetensors files of real tensors (sliced, shapes rewritten to the slice) and their .tzip files.
const stDir = dir('safetensors'), tzDir = dir('container');
async function writeSafetensors(path, tensors, metadata) {
  const header = {};
  if (metadata) header.__metadata__ = metadata;
  let at = 0;
  for (const t of tensors) { header[t.name] = { dtype: t.dtype, shape: t.shape, data_offsets: [at, at + t.data.byteLength] }; at += t.data.byteLength; }
  let json = Buffer.from(JSON.stringify(header));
  json = Buffer.concat([json, Buffer.alloc(align16(json.byteLength + 8) - 8 - json.byteLength, 0x20)]);
  const len = Buffer.alloc(8); len.writeBigUInt64LE(BigInt(json.byteLength));
  writeFileSync(path, Buffer.concat([len, json, ...tensors.map((t) => t.data)]));
}
let k = 0;
for (const file of files) {
  const base = file.path.split('/').pop().replace('.safetensors', '');
  const meta = file.header.metadata;
  const sets = [file.header.tensors.slice(0, 6), file.header.tensors.filter((_, i) => i % 9 === 0)];
  for (const [j, set] of sets.entries()) {
    const tensors = [];
    for (const t of set) {
      const esize = SIZE[t.dtype] ?? 1;
      const n = Math.min((t.end - t.begin) / esize, j === 0 ? 700 : 6);
      tensors.push({ name: t.name, dtype: t.dtype, shape: [n], data: await file.read(t.begin, t.begin + n * esize) });
    }
    const st = join(stDir, `${base}-${j}.safetensors`);
    await writeSafetensors(st, tensors, meta ?? undefined);
    for (const codec of ['auto', 'raw']) {
      const tz = join(tzDir, `${base}-${j}-${codec}.tzip`);
      await compressFile(st, tz, { codec, chunkSize: 4096, threads: 1 });
      // The same file as a writer before the header digest wrote it (prefix flags and digest, bytes 10-15, zero):
      // mutations of its JSON reach the safetensors parser instead of stopping at the digest check.
      const old = readFileSync(tz);
      old.fill(0, 10, 16);
      writeFileSync(join(tzDir, `${base}-${j}-${codec}-v0.tzip`), old);
      k += 2;
    }
  }
}
for (const file of files) await file.close();
console.log(`make-seeds: ${frames.length} frames, ${readdirSync(chunkDir).length} chunks, ${k} .tzip files in ${out}`);
