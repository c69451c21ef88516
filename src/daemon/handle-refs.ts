/**
 * Protocol version 2's handle table: a compress or decompress request may list memory handles once
 * (`handles`) and name regions of them anywhere a handle goes (`{kind: "ref", index, offset, size}`,
 * docs/protocol.md "Handle tables"). Expanded here, right after validation, into the full handles
 * the rest of the daemon reads, so the ownership, GPU and bounds checks are the same either way.
 *
 * The point is the size of a batch: a 200-tensor GPU request whose tensors lie in the client's one
 * staging buffer repeated the 66-byte CUDA IPC handle and the ref-counter name in every tensor's
 * two handles (563 bytes of MessagePack per tensor), and decoding and validating them was most of
 * the daemon's work per tensor (docs/benchmarks.md).
 */
import { ReplyError } from './reply-error.js';
import type {
  CompressRequest, DecompressRequest, HandleRef, MemoryHandle, Tensor, WireCompressRequest, WireDecompressRequest,
} from './schema.js';

type WireHandle = MemoryHandle | HandleRef;
type WireTensor = Omit<Tensor, 'data'> & { data: WireHandle };

/** Resolves handles of one request against its table. */
class HandleTable {
  constructor(private readonly handles: readonly MemoryHandle[] | undefined) {}

  /**
   * `h` in full: itself, or the region `ref` names of its table entry.
   * @throws ReplyError TZIP_PROTOCOL (no table, or no such entry), TZIP_HANDLE (the region is not
   *   inside the entry's), TZIP_TOO_LARGE (the region's end in its file or allocation is beyond 2^53),
   *   all with `index` = the item's.
   */
  expand(h: WireHandle, what: string, index: number): MemoryHandle {
    if (h.kind !== 'ref') return h;
    const entry = this.handles?.[h.index];
    if (entry === undefined) {
      throw new ReplyError('TZIP_PROTOCOL',
        `${what}: names handles[${h.index}], but the request has ${this.handles === undefined ? 'no "handles"' : `${this.handles.length} handles`}`,
        { index });
    }
    if (!Number.isSafeInteger(h.offset + h.size) || h.offset + h.size > entry.size) {
      throw new ReplyError('TZIP_HANDLE',
        `${what}: bytes [${h.offset}, ${h.offset + h.size}) of handles[${h.index}] are beyond its ${entry.size} bytes`, { index });
    }
    if (!Number.isSafeInteger(entry.offset + h.offset + h.size)) {
      throw new ReplyError('TZIP_TOO_LARGE',
        `${what}: handles[${h.index}] at offset ${entry.offset} + ${h.offset} + size ${h.size} is beyond 2^53`, { index });
    }
    return { ...entry, offset: entry.offset + h.offset, size: h.size };
  }

  /** `t` with its `data` in full (see {@link expand}). */
  tensor(t: WireTensor, what: string, index: number): Tensor {
    return t.data.kind === 'ref' ? { ...t, data: this.expand(t.data, what, index) } : (t as Tensor);
  }
}

/**
 * The request with every {@link HandleRef} replaced by the region it names, and without `handles`
 * (a request without a table is walked the same way: a reference in it is refused).
 * @throws ReplyError as {@link HandleTable.expand}.
 */
export function expandCompress(req: WireCompressRequest): CompressRequest {
  const { handles, ...rest } = req;
  const table = new HandleTable(handles);
  return {
    ...rest,
    tensors: req.tensors.map((item, i) => ({
      ...item,
      tensor: table.tensor(item.tensor, `tensor ${i}`, i),
      out: table.expand(item.out, `output of tensor ${i}`, i),
    })),
  };
}

/** As {@link expandCompress}, for decompress requests. */
export function expandDecompress(req: WireDecompressRequest): DecompressRequest {
  const { handles, ...rest } = req;
  const table = new HandleTable(handles);
  return {
    ...rest,
    frames: req.frames.map((item, i) => ({
      frame: table.expand(item.frame, `frame ${i}`, i),
      out: table.tensor(item.out, `destination of frame ${i}`, i),
    })),
  };
}
