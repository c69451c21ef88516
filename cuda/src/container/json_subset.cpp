#include "container/json_subset.h"

namespace tzip::container {

bool is_utf8(const uint8_t* p, uint64_t n) {
  uint64_t i = 0;
  while (i < n) {
    const uint8_t b = p[i];
    if (b < 0x80) {
      ++i;
      continue;
    }
    uint32_t len;
    uint8_t lo = 0x80, hi = 0xbf;  // allowed range of the second byte (WHATWG "UTF-8 decoder")
    if (b >= 0xc2 && b <= 0xdf) {
      len = 2;
    } else if (b >= 0xe0 && b <= 0xef) {
      len = 3;
      if (b == 0xe0) lo = 0xa0;       // overlong
      else if (b == 0xed) hi = 0x9f;  // surrogates
    } else if (b >= 0xf0 && b <= 0xf4) {
      len = 4;
      if (b == 0xf0) lo = 0x90;       // overlong
      else if (b == 0xf4) hi = 0x8f;  // above U+10FFFF
    } else {
      return false;
    }
    if (n - i < len || p[i + 1] < lo || p[i + 1] > hi) return false;
    for (uint32_t k = 2; k < len; ++k)
      if (p[i + k] < 0x80 || p[i + k] > 0xbf) return false;
    i += len;
  }
  return true;
}

void JsonCursor::fail(const std::string& what) const {
  throw NotHandled(what + " at byte " + std::to_string(i_) + " of the JSON");
}

void JsonCursor::skip_ws() {
  while (i_ < n_ && (p_[i_] == ' ' || p_[i_] == '\t' || p_[i_] == '\n' || p_[i_] == '\r')) ++i_;
}

bool JsonCursor::consume(char c) {
  skip_ws();
  if (i_ < n_ && p_[i_] == uint8_t(c)) {
    ++i_;
    return true;
  }
  return false;
}

void JsonCursor::expect(char c) {
  if (!consume(c)) fail(std::string("expected '") + c + "'");
}

char JsonCursor::peek() {
  skip_ws();
  return i_ < n_ ? char(p_[i_]) : 0;
}

std::string_view JsonCursor::string() {
  expect('"');
  const uint64_t begin = i_;
  for (; i_ < n_; ++i_) {
    const uint8_t c = p_[i_];
    if (c == '"') {
      const std::string_view s(reinterpret_cast<const char*>(p_ + begin), i_ - begin);
      ++i_;
      return s;
    }
    if (c == '\\') fail("an escape in a string");
    if (c < 0x20) fail("a control character in a string");  // invalid JSON
  }
  fail("an unterminated string");
}

uint64_t JsonCursor::integer() {
  skip_ws();
  const uint64_t begin = i_;
  uint64_t v = 0;
  while (i_ < n_ && p_[i_] >= '0' && p_[i_] <= '9') {
    if (i_ - begin >= 16) fail("an integer of more than 16 digits");  // 2^53 - 1 has 16
    v = v * 10 + (p_[i_] - '0');
    ++i_;
  }
  if (i_ == begin) fail("not an unsigned integer");
  if (p_[begin] == '0' && i_ - begin > 1) fail("a leading zero");  // invalid JSON
  if (i_ < n_ && (p_[i_] == '.' || p_[i_] == 'e' || p_[i_] == 'E')) fail("a fraction or exponent");
  if (v > (uint64_t(1) << 53) - 1) fail("an integer above 2^53 - 1");
  return v;
}

bool JsonCursor::at_end() {
  skip_ws();
  return i_ == n_;
}

}  // namespace tzip::container
