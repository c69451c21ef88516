// A whole input file mapped read-only (MAP_POPULATE up to 1 GiB: the pages of a cached file are mapped in one go
// rather than one fault at a time).
#pragma once
#include <sys/stat.h>

#include <cstdint>
#include <string>

namespace tzip::cli {

class MappedFile {
 public:
  /// Opens and maps `path`, which must be a regular file. Throws Defer on any error or another kind of file.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  /// The file's stat (device and inode tell it apart from the output).
  const struct stat& info() const { return st_; }
  /// Whether `path` names this very file (same device and inode), e.g. an output that would overwrite the input.
  bool same_file_as(const std::string& path) const;

 private:
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  struct stat st_ {};
};

}  // namespace tzip::cli
