#include "cli/background_writer.h"

#include <exception>

#include "cli/deferral.h"

namespace tzip::cli {

BackgroundWriter::BackgroundWriter(AtomicOutput& out) : out_(out), thread_(&BackgroundWriter::run, this) {}

BackgroundWriter::~BackgroundWriter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void BackgroundWriter::wait_for_turn_locked(std::unique_lock<std::mutex>& lock, uint64_t turn) {
  // Jobs finish in queue order: every job queued before `turn` is done once done_turns_ reaches it.
  cv_.wait(lock, [&] { return done_turns_ >= turn || !error_.empty(); });
  if (!error_.empty()) throw Defer(error_);
}

uint8_t* BackgroundWriter::buffer(uint64_t turn, uint64_t n) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Buffer turn % 2 was last written by job turn - 2; turns are queued one by one, so wait for all before turn - 1.
    wait_for_turn_locked(lock, turn >= 1 ? turn - 1 : 0);
  }
  std::unique_ptr<uint8_t[]>& b = buffers_[turn % 2];
  if (buffer_bytes_[turn % 2] < n) {
    b.reset();
    b.reset(new uint8_t[n]);  // not zeroed: every byte written out is coded first
    buffer_bytes_[turn % 2] = n;
  }
  return b.get();
}

void BackgroundWriter::write(uint64_t turn, std::vector<Piece> pieces, off_t sync_from, off_t sync_to) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back({turn, std::move(pieces), sync_from, sync_to});
    ++queued_turns_;
  }
  cv_.notify_all();
}

void BackgroundWriter::finish() {
  std::unique_lock<std::mutex> lock(mu_);
  wait_for_turn_locked(lock, queued_turns_);
}

void BackgroundWriter::run() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    std::string failure;
    try {
      for (const Piece& p : job.pieces) out_.write_at(p.data, p.n, p.offset);
      if (job.sync_to > job.sync_from) out_.start_writeback(job.sync_from, job.sync_to - job.sync_from);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure.empty() && error_.empty()) error_ = failure;
      ++done_turns_;
    }
    cv_.notify_all();
  }
}

}  // namespace tzip::cli
