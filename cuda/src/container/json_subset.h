// A reader of the JSON that safetensors writers produce: objects, arrays, strings and unsigned integers without sign,
// fraction or exponent, in UTF-8. It is deliberately not a JSON parser: anything outside that subset (a fraction, a
// literal, a byte-order mark, an escape that makes a lone UTF-16 surrogate, which no UTF-8 string holds and both of
// tzip's readers refuse) and anything that is not JSON at all throws NotHandled,
// and a caller that must take every valid header hands such text to a full parser (the native CLI: to the Node CLI).
// What it accepts, it reads exactly as JSON.parse reads it.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace tzip::container {

/// Text outside what this reader takes (see the file comment); what() says what it met.
struct NotHandled : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Whether `n` bytes at `p` are UTF-8 as a fatal WHATWG decoder (JavaScript's TextDecoder) accepts it: no overlong
/// form, no encoded surrogate (U+D800-U+DFFF), nothing above U+10FFFF, no cut sequence.
bool is_utf8(const uint8_t* p, uint64_t n);

/// A cursor over JSON text of the subset above. Every method skips JSON whitespace (space, tab, LF, CR) first and
/// throws NotHandled when the text does not go on as asked.
class JsonCursor {
 public:
  JsonCursor(const uint8_t* text, uint64_t n) : p_(text), n_(n) {}

  /// Consumes `c` when it comes next; false (nothing consumed) otherwise.
  bool consume(char c);
  /// Consumes `c`, which must come next.
  void expect(char c);
  /// The next value's first byte ('{', '[', '"', a digit, ...), or 0 at the end of the text.
  char peek();
  /// A string, its escapes decoded, as UTF-8 (the bytes Buffer.from(JSON.parse(...), 'utf8') gives).
  std::string string();
  /// An unsigned integer from 0 to 2^53 - 1 written with digits only (JSON forbids leading zeros).
  uint64_t integer();
  /// Whether only whitespace is left.
  bool at_end();

 private:
  void skip_ws();
  uint32_t hex4();
  [[noreturn]] void fail(const std::string& what) const;
  const uint8_t* p_;
  uint64_t n_, i_ = 0;
};

}  // namespace tzip::container
