#include "cli/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "cli/deferral.h"

namespace tzip::cli {

MappedFile::MappedFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Defer("open " + path + ": " + std::strerror(errno));
  if (fstat(fd, &st_) != 0 || !S_ISREG(st_.st_mode)) {
    close(fd);
    throw Defer(path + " is not a regular file");
  }
  size_ = uint64_t(st_.st_size);
  if (size_ > 0) {
    // Populated up front up to 1 GiB (one call instead of a fault per page); larger files are read as touched, so
    // that a file larger than memory is not pulled in whole.
    const int populate = size_ <= (uint64_t(1) << 30) ? MAP_POPULATE : 0;
    void* p = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE | populate, fd, 0);
    if (p == MAP_FAILED) {
      close(fd);
      throw Defer("mmap " + path + ": " + std::strerror(errno));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  close(fd);
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) munmap(const_cast<uint8_t*>(data_), size_);
}

bool MappedFile::same_file_as(const std::string& path) const {
  struct stat other;
  return stat(path.c_str(), &other) == 0 && other.st_dev == st_.st_dev && other.st_ino == st_.st_ino;
}

}  // namespace tzip::cli
