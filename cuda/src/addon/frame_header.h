// A parsed frame header as the JavaScript object src/native.ts calls FrameHeader (readHeader, gpuDecompress).
#pragma once
#include <napi.h>

#include "core/frame.h"

namespace tzip::addon {

/// The property names of a FrameHeader object, made once per batch of headers (a Set with a C string makes the
/// name anew for every property of every object).
struct FrameHeaderKeys {
  explicit FrameHeaderKeys(Napi::Env env)
      : version(Napi::String::New(env, "formatVersion")), dtype(Napi::String::New(env, "dtype")),
        codec(Napi::String::New(env, "codec")), shape(Napi::String::New(env, "shape")),
        nbytes(Napi::String::New(env, "nbytes")), chunk_size(Napi::String::New(env, "chunkSize")),
        n_chunks(Napi::String::New(env, "nChunks")), header_bytes(Napi::String::New(env, "headerBytes")),
        payload_bytes(Napi::String::New(env, "payloadBytes")), frame_bytes(Napi::String::New(env, "frameBytes")),
        checksum(Napi::String::New(env, "checksum")) {}
  Napi::String version, dtype, codec, shape, nbytes, chunk_size, n_chunks, header_bytes, payload_bytes, frame_bytes,
      checksum;
};

/// { formatVersion, dtype, codec, shape, nbytes, chunkSize, nChunks, headerBytes, payloadBytes, frameBytes, checksum };
/// sizes in bytes, as numbers (exact below 2^53).
inline Napi::Object frame_header_object(Napi::Env env, const FrameHeader& h, const FrameHeaderKeys& k) {
  auto num = [&](uint64_t v) { return Napi::Number::New(env, double(v)); };
  Napi::Object r = Napi::Object::New(env);
  r.Set(k.version, num(h.version));
  r.Set(k.dtype, Napi::String::New(env, dtype_name(h.dtype)));
  r.Set(k.codec, Napi::String::New(env, codec_name(h.codec)));
  Napi::Array shape = Napi::Array::New(env, h.shape.size());
  for (uint32_t i = 0; i < h.shape.size(); ++i) shape.Set(i, num(h.shape[i]));
  r.Set(k.shape, shape);
  r.Set(k.nbytes, num(h.nbytes));
  r.Set(k.chunk_size, num(h.chunk_bytes));
  r.Set(k.n_chunks, num(h.n_chunks));
  r.Set(k.header_bytes, num(h.header_bytes));
  r.Set(k.payload_bytes, num(h.payload_bytes));
  r.Set(k.frame_bytes, num(h.frame_bytes()));
  r.Set(k.checksum, num(h.checksum));
  return r;
}

/// One header (readHeader).
inline Napi::Object frame_header_object(Napi::Env env, const FrameHeader& h) {
  return frame_header_object(env, h, FrameHeaderKeys(env));
}

}  // namespace tzip::addon
