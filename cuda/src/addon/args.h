// Argument parsing and error conversion shared by the addon's N-API files (addon.cpp, addon/*.cpp): byte views,
// 64-bit integers from number | bigint, options objects, and JavaScript errors with a `.code`.
#pragma once
#include <napi.h>

#include <cstdint>
#include <cstdlib>
#include <exception>
#include <new>
#include <string>

#include "addon/coded_error.h"
#include "core/errors.h"

namespace tzip::addon {

/// A JavaScript Error with `.code` (the code's name), `.needBytes` for truncated headers and, for a CodedError of a
/// batched GPU call, `.itemErrors` (per item its code's name, '' for an item that succeeded).
inline Napi::Error make_error(Napi::Env env, const tzip::Error& e) {
  Napi::Error err = Napi::Error::New(env, e.what());
  err.Set("code", Napi::String::New(env, tzip::error_code_name(e.code())));
  if (e.need_bytes()) err.Set("needBytes", Napi::Number::New(env, double(e.need_bytes())));
  const auto* coded = dynamic_cast<const CodedError*>(&e);
  if (coded != nullptr && !coded->item_errors.empty()) {
    Napi::Array items = Napi::Array::New(env, coded->item_errors.size());
    for (uint32_t i = 0; i < coded->item_errors.size(); ++i) {
      const int32_t c = coded->item_errors[i];
      items.Set(i, Napi::String::New(env, c == 0 ? "" : tzip::error_code_name(tzip::ErrorCode(c))));
    }
    err.Set("itemErrors", items);
  }
  return err;
}

/// The error of a failed host allocation of `bytes` bytes for `what`.
inline CodedError out_of_memory(uint64_t bytes, const std::string& what) {
  return CodedError(tzip::ErrorCode::OutOfMemory, "out of memory: cannot allocate " + std::to_string(bytes) +
                                                      " bytes for " + what);
}

/// Any exception a codec call or an addon function threw, as an addon error: codec and addon errors as they are,
/// std::bad_alloc as TZIP_OUT_OF_MEMORY, anything else (a bug) as TZIP_INTERNAL. Call it inside a catch block.
inline CodedError current_error() {
  try {
    throw;
  } catch (const CodedError& e) {
    return e;
  } catch (const tzip::Error& e) {
    return CodedError(e.code(), e.what(), e.need_bytes());  // needBytes: tzip inspect reads long headers by it
  } catch (const std::bad_alloc&) {
    return CodedError(tzip::ErrorCode::OutOfMemory, "out of memory (std::bad_alloc)");
  } catch (const std::exception& e) {
    return CodedError(tzip::ErrorCode::Internal, std::string("internal error: ") + e.what());
  }
}

/// Runs `f` (a synchronous N-API function body) and turns codec and addon errors into JavaScript exceptions
/// (std::bad_alloc: TZIP_OUT_OF_MEMORY; another C++ exception: TZIP_INTERNAL, rather than terminating the process).
template <class F>
Napi::Value guarded(Napi::Env env, F&& f) {
  try {
    return f();
  } catch (const Napi::Error&) {
    throw;
  } catch (const std::exception&) {
    throw make_error(env, current_error());
  }
}

/// Set by the finalizers of external_buffer's Buffers (on the JavaScript thread); see external_buffer.
inline thread_local bool t_external_released = false;

/// Hands the `n` bytes at `p` to JavaScript as a Buffer whose finalizer `release(env, p, hint)` gives them back (free,
/// munmap) and then sets t_external_released. When the Buffer cannot be made, `p` is released exactly once and a
/// CodedError for `what` is thrown: TZIP_UNSUPPORTED above Node's Buffer size limit (buffer.constants.MAX_LENGTH,
/// 2^32 bytes in Node 20), else TZIP_OUT_OF_MEMORY. Above the limit Node calls the finalizer itself before failing;
/// node-addon-api's Buffer::New then deletes its finalizer record a second time, and a caller that frees the bytes
/// again makes it a third: a double free that killed the process on a valid 4 GiB + 64 KiB frame (an adversarial
/// pass found it). So N-API is called directly, and the bytes are released here only when Node did not (the flag;
/// a finalizer of another Buffer run by a GC inside the call can only make this leak `p`, never free it twice).
inline Napi::Buffer<uint8_t> external_buffer(Napi::Env env, uint8_t* p, uint64_t n, napi_finalize release, void* hint,
                                             const std::string& what) {
  napi_value value = nullptr;
  t_external_released = false;
  const napi_status status = n > SIZE_MAX ? napi_invalid_arg
                                          : napi_create_external_buffer(env, size_t(n), p, release, hint, &value);
  if (status == napi_ok) return Napi::Buffer<uint8_t>(env, value);
  if (!t_external_released) release(env, p, hint);
  bool too_large = n > SIZE_MAX;
  bool pending = false;
  if (napi_is_exception_pending(env, &pending) == napi_ok && pending) {
    napi_value exc = nullptr;
    napi_get_and_clear_last_exception(env, &exc);
    if (exc != nullptr) {
      const Napi::Value code = Napi::Value(env, exc).As<Napi::Object>().Get("code");
      too_large = too_large || (code.IsString() && code.As<Napi::String>().Utf8Value() == "ERR_BUFFER_TOO_LARGE");
    }
  }
  if (too_large)
    throw CodedError(tzip::ErrorCode::Unsupported, "cannot make a Buffer of " + std::to_string(n) + " bytes for " +
                                                       what + ": above Node's Buffer size limit");
  throw out_of_memory(n, what);
}

/// external_buffer's finalizer for malloc'd bytes.
inline void free_external(napi_env, void* data, void*) {
  std::free(data);
  t_external_released = true;
}

/// A new Buffer of `n` bytes (not zeroed) for `what`: malloc'd and handed to V8 as an external buffer, so that a failed
/// allocation is TZIP_OUT_OF_MEMORY instead of V8's fatal out-of-memory abort; a size above Node's Buffer limit
/// (buffer.constants.MAX_LENGTH) is TZIP_UNSUPPORTED.
inline Napi::Buffer<uint8_t> new_buffer(Napi::Env env, uint64_t n, const std::string& what) {
  if (n == 0) return Napi::Buffer<uint8_t>::New(env, 0);
  auto* p = n > SIZE_MAX ? nullptr : static_cast<uint8_t*>(std::malloc(size_t(n)));
  if (p == nullptr) throw out_of_memory(n, what);
  return external_buffer(env, p, n, free_external, nullptr, what);
}

[[noreturn]] inline void invalid(const std::string& what) { throw tzip::Error(tzip::ErrorCode::InvalidArgument, what); }

/// A byte view of a Uint8Array/Buffer argument (any offset, any alignment).
struct Bytes {
  const uint8_t* data = nullptr;
  uint64_t size = 0;
};

inline Bytes bytes_of(const Napi::Value& v, const char* what) {
  if (!v.IsTypedArray() || v.As<Napi::TypedArray>().TypedArrayType() != napi_uint8_array)
    invalid(std::string(what) + " must be a Uint8Array or Buffer");
  auto a = v.As<Napi::Uint8Array>();
  return {a.Data(), a.ByteLength()};
}

/// `v` as a non-negative integer (a number that is a safe integer, or a bigint up to 2^64 - 1) into *out; false when
/// it is not one. For loops over batch items, where u64_of's message would be built for every field.
inline bool try_u64(const Napi::Value& v, uint64_t* out) {
  if (v.IsBigInt()) {
    bool lossless = true;
    *out = v.As<Napi::BigInt>().Uint64Value(&lossless);
    return lossless;
  }
  if (!v.IsNumber()) return false;
  const double d = v.As<Napi::Number>().DoubleValue();
  if (!(d >= 0) || d > 9007199254740991.0 || d != double(uint64_t(d))) return false;
  *out = uint64_t(d);
  return true;
}

/// A non-negative integer from a number (a safe integer) or a bigint (up to 2^64 - 1).
inline uint64_t u64_of(const Napi::Value& v, const std::string& what) {
  uint64_t x = 0;
  if (try_u64(v, &x)) return x;
  invalid(what + (v.IsBigInt() ? " is out of range" : " must be a non-negative integer"));
}

/// Argument i as u64_of; TZIP_INVALID_ARGUMENT when it is missing.
inline uint64_t arg_u64(const Napi::CallbackInfo& info, size_t i, const char* what) {
  if (info.Length() <= i) invalid(std::string(what) + " is required");
  return u64_of(info[i], what);
}

/// A signed 32-bit integer from a number.
inline int32_t i32_of(const Napi::Value& v, const std::string& what) {
  if (!v.IsNumber()) invalid(what + " must be an integer");
  const double d = v.As<Napi::Number>().DoubleValue();
  if (!(d >= -2147483648.0 && d <= 2147483647.0) || d != double(int64_t(d))) invalid(what + " must be a 32-bit integer");
  return int32_t(d);
}

/// The options object at argument i ({} when absent).
inline Napi::Object options_of(const Napi::CallbackInfo& info, size_t i) {
  if (info.Length() <= i || info[i].IsUndefined()) return Napi::Object::New(info.Env());
  if (!info[i].IsObject()) invalid("options must be an object");
  return info[i].As<Napi::Object>();
}

/// Whether `v` (a property read with Get) is there: neither undefined nor null.
inline bool present(const Napi::Value& v) { return !v.IsUndefined() && !v.IsNull(); }

/// Whether `o.key` is present and neither undefined nor null.
inline bool has_opt(const Napi::Object& o, const char* key) { return present(o.Get(key)); }

}  // namespace tzip::addon
