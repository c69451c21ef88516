// A parsed frame header as the JavaScript object src/native.ts calls FrameHeader (readHeader, gpuDecompress).
#pragma once
#include <napi.h>

#include "frame.h"

namespace tzip::addon {

/// { formatVersion, dtype, codec, shape, nbytes, chunkSize, nChunks, headerBytes, payloadBytes, frameBytes, checksum };
/// sizes in bytes, as numbers (exact below 2^53).
inline Napi::Object frame_header_object(Napi::Env env, const FrameHeader& h) {
  auto num = [&](uint64_t v) { return Napi::Number::New(env, double(v)); };
  Napi::Object r = Napi::Object::New(env);
  r.Set("formatVersion", h.version);
  r.Set("dtype", dtype_name(h.dtype));
  r.Set("codec", codec_name(h.codec));
  Napi::Array shape = Napi::Array::New(env, h.shape.size());
  for (uint32_t i = 0; i < h.shape.size(); ++i) shape.Set(i, num(h.shape[i]));
  r.Set("shape", shape);
  r.Set("nbytes", num(h.nbytes));
  r.Set("chunkSize", h.chunk_bytes);
  r.Set("nChunks", num(h.n_chunks));
  r.Set("headerBytes", num(h.header_bytes));
  r.Set("payloadBytes", num(h.payload_bytes));
  r.Set("frameBytes", num(h.frame_bytes()));
  r.Set("checksum", h.checksum);
  return r;
}

}  // namespace tzip::addon
