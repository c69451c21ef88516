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

uint32_t JsonCursor::hex4() {
  if (n_ - i_ < 4) fail("a cut \\u escape");
  uint32_t v = 0;
  for (int k = 0; k < 4; ++k) {
    const uint8_t c = p_[i_++];
    v <<= 4;
    if (c >= '0' && c <= '9') v |= c - '0';
    else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
    else fail("a bad \\u escape");
  }
  return v;
}

std::string JsonCursor::string() {
  expect('"');
  std::string s;
  for (uint64_t run = i_; i_ < n_;) {
    const uint8_t c = p_[i_];
    if (c == '"' || c == '\\') {
      s.append(reinterpret_cast<const char*>(p_ + run), i_ - run);
      ++i_;
      if (c == '"') return s;
      if (i_ == n_) break;
      const uint8_t e = p_[i_++];
      switch (e) {
        case '"': s += '"'; break;
        case '\\': s += '\\'; break;
        case '/': s += '/'; break;
        case 'b': s += '\b'; break;
        case 'f': s += '\f'; break;
        case 'n': s += '\n'; break;
        case 'r': s += '\r'; break;
        case 't': s += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xdc00 && cp <= 0xdfff) fail("a lone low surrogate");
          if (cp >= 0xd800 && cp <= 0xdbff) {
            if (n_ - i_ < 2 || p_[i_] != '\\' || p_[i_ + 1] != 'u') fail("a lone high surrogate");
            i_ += 2;
            const uint32_t lo = hex4();
            if (lo < 0xdc00 || lo > 0xdfff) fail("a lone high surrogate");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          }
          if (cp < 0x80) {
            s += char(cp);
          } else if (cp < 0x800) {
            s += char(0xc0 | (cp >> 6));
            s += char(0x80 | (cp & 0x3f));
          } else if (cp < 0x10000) {
            s += char(0xe0 | (cp >> 12));
            s += char(0x80 | ((cp >> 6) & 0x3f));
            s += char(0x80 | (cp & 0x3f));
          } else {
            s += char(0xf0 | (cp >> 18));
            s += char(0x80 | ((cp >> 12) & 0x3f));
            s += char(0x80 | ((cp >> 6) & 0x3f));
            s += char(0x80 | (cp & 0x3f));
          }
          break;
        }
        default: fail("a bad escape");
      }
      run = i_;
      continue;
    }
    if (c < 0x20) fail("a control character in a string");  // invalid JSON
    ++i_;
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
