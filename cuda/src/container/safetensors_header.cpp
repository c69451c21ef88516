#include "container/safetensors_header.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_set>

#include "core/frame.h"
#include "tzip/hostdevice.h"

namespace tzip::container {

namespace {

[[noreturn]] void not_handled(const std::string& what) { throw NotHandled("safetensors header: " + what); }

/// Orders tensors as compareTensors in src/safetensors.ts: begin, end, then name as UTF-8 bytes (shorter first on a
/// common prefix, as Buffer.compare).
bool tensor_less(const Tensor& a, const Tensor& b) {
  if (a.begin != b.begin) return a.begin < b.begin;
  if (a.end != b.end) return a.end < b.end;
  const size_t n = std::min(a.name.size(), b.name.size());
  const int c = n ? std::memcmp(a.name.data(), b.name.data(), n) : 0;
  return c != 0 ? c < 0 : a.name.size() < b.name.size();
}

/// Whether prod(shape) * esize == nbytes, exactly (the TypeScript side multiplies BigInts).
bool size_matches(const std::vector<uint64_t>& shape, uint32_t esize, uint64_t nbytes) {
  for (uint64_t d : shape)
    if (d == 0) return nbytes == 0;
  unsigned __int128 product = esize;
  for (uint64_t d : shape) {
    product *= d;
    if (product > nbytes) return false;  // every factor is >= 1 from here on: the product never shrinks
  }
  return product == nbytes;
}

std::vector<uint64_t> integer_array(JsonCursor& c) {
  std::vector<uint64_t> v;
  c.expect('[');
  if (c.consume(']')) return v;
  do v.push_back(c.integer());
  while (c.consume(','));
  c.expect(']');
  return v;
}

/// `{"dtype": s, "shape": [...], "data_offsets": [b, e]}`, each key once, no other key (in any order).
Tensor tensor_entry(JsonCursor& c, std::string name) {
  Tensor t;
  t.name = std::move(name);
  bool has_dtype = false, has_shape = false, has_offsets = false;
  c.expect('{');
  if (!c.consume('}')) {
    do {
      const std::string key = c.string();
      c.expect(':');
      if (key == "dtype" && !has_dtype) {
        has_dtype = true;
        if (c.peek() != '"') not_handled("a dtype that is not a string");
        t.dtype = c.string();
        if (t.dtype.empty()) not_handled("an empty dtype");
      } else if (key == "shape" && !has_shape) {
        has_shape = true;
        t.shape = integer_array(c);
      } else if (key == "data_offsets" && !has_offsets) {
        has_offsets = true;
        const std::vector<uint64_t> o = integer_array(c);
        if (o.size() != 2) not_handled("data_offsets that are not [begin, end]");
        t.begin = o[0];
        t.end = o[1];
      } else {
        not_handled("a tensor entry with a key other than dtype, shape and data_offsets once each");
      }
    } while (c.consume(','));
    c.expect('}');
  }
  if (!has_dtype || !has_shape || !has_offsets) not_handled("a tensor entry without dtype, shape or data_offsets");
  return t;
}

/// `{"key": "value", ...}`: the format's map of strings to strings.
void metadata(JsonCursor& c) {
  c.expect('{');
  if (c.consume('}')) return;
  do {
    c.string();
    c.expect(':');
    if (c.peek() != '"') not_handled("__metadata__ with a value that is not a string");
    c.string();
  } while (c.consume(','));
  c.expect('}');
}

}  // namespace

uint64_t parse_header_length(const uint8_t* first8, uint64_t file_size) {
  if (file_size < kLengthPrefixBytes) not_handled("no 8-byte header length");
  const uint64_t n = load_le64(first8);
  if (n > kMaxHeaderBytes) not_handled("header length above the limit");
  if (n > file_size - kLengthPrefixBytes) not_handled("header length past the end of the file");
  return n;
}

SafetensorsHeader parse_safetensors_header(const uint8_t* prefix, uint64_t prefix_len, uint64_t file_size) {
  if (prefix_len < kLengthPrefixBytes) not_handled("no 8-byte header length");
  SafetensorsHeader h;
  h.header_length = parse_header_length(prefix, file_size);
  h.data_offset = kLengthPrefixBytes + h.header_length;
  if (prefix_len < h.data_offset) not_handled("header bytes missing");
  h.data_length = file_size - h.data_offset;

  const uint8_t* text = prefix + kLengthPrefixBytes;
  uint64_t n = h.header_length;
  // The TypeScript parser decodes UTF-8 fatally, then strips trailing NULs (padding some writers use) before JSON.parse.
  if (!is_utf8(text, n)) not_handled("not UTF-8");
  while (n > 0 && text[n - 1] == 0) --n;

  JsonCursor c(text, n);
  std::unordered_set<std::string> keys;
  c.expect('{');
  if (!c.consume('}')) {
    do {
      std::string key = c.string();
      // JSON.parse keeps the last of duplicate keys; rather than reproduce that, such headers are not handled.
      if (!keys.insert(key).second) not_handled("a duplicate key");
      c.expect(':');
      if (key == "__metadata__") metadata(c);
      else h.tensors.push_back(tensor_entry(c, std::move(key)));
    } while (c.consume(','));
    c.expect('}');
  }
  if (!c.at_end()) not_handled("text after the JSON object");

  for (Tensor& t : h.tensors) {
    if (t.begin > t.end) not_handled("reversed data_offsets");
    if (t.end > h.data_length) not_handled("data_offsets past the data section");
    const uint64_t nbytes = t.end - t.begin;
    Dtype d;
    const bool known = parse_dtype_name(t.dtype, &d);
    // The codec layout (docs/container.md, "Entries"; src/safetensors.ts codecLayout): a known dtype keeps dtype and
    // shape (1-D past kMaxNdim dimensions); C64 is F32 with a trailing dimension of 2, as the daemon codes a
    // complex tensor; anything else is its bytes.
    if (known && size_matches(t.shape, dtype_size(d), nbytes)) {
      t.codec_dtype = d;
      t.codec_shape = t.shape.size() <= kMaxNdim ? t.shape : std::vector<uint64_t>{nbytes / dtype_size(d)};
    } else if (t.dtype == "C64" && size_matches(t.shape, 2 * dtype_size(Dtype::F32), nbytes)) {
      t.codec_dtype = Dtype::F32;
      t.codec_shape = t.shape;
      t.codec_shape.push_back(2);
      if (t.codec_shape.size() > kMaxNdim) t.codec_shape = {nbytes / dtype_size(Dtype::F32)};
    } else {
      t.codec_dtype = Dtype::U8;
      t.codec_shape = {nbytes};
    }
  }
  std::sort(h.tensors.begin(), h.tensors.end(), tensor_less);
  uint64_t cursor = 0;
  bool any = false;
  for (const Tensor& t : h.tensors) {
    if (any && t.begin < cursor) not_handled("overlapping tensors");
    if (t.end > cursor) {
      cursor = t.end;
      any = true;
    }
  }
  return h;
}

}  // namespace tzip::container
