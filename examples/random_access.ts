// Random access: open a .tzip file and decode one tensor by name; no other frame is read.
// Build it with the package's TypeScript (tsc, with examples/ in tsconfig's include), then:
//   tzip compress model.safetensors -o model.tzip
//   node dist/examples/random_access.js model.tzip encoder.weight
import { openTzip } from '../src/reader.js';

const [path, name] = process.argv.slice(2);
if (path === undefined || name === undefined) {
  console.error('usage: random_access FILE.tzip TENSOR');
  process.exit(1);
}

const reader = await openTzip(path);
try {
  const entry = reader.entry(name);
  const bytes = await reader.readTensor(name); // raw little-endian bytes, exactly as in the safetensors file
  console.log(`${name}: ${entry.fileDtype} [${entry.fileShape.join(', ')}], ${bytes.byteLength} bytes`);
  if (entry.fileDtype === 'F32') {
    const values = new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
    console.log('first values:', Array.from(values.subarray(0, 4)));
  }
} finally {
  await reader.close();
}
