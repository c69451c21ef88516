// The SIGBUS guard of shared_guard.h. The registry is a fixed array of atomics so that the signal handler reads it
// without locks or allocation; registration takes a mutex (JS thread and finalizers only).
#include "addon/shared_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>

namespace tzip::addon {
namespace {

constexpr size_t kSlots = 65536;

struct Slot {
  std::atomic<uintptr_t> base{0};
  std::atomic<size_t> size{0};
  std::atomic<int> faulted{0};
};

Slot g_slots[kSlots];
std::atomic<size_t> g_used{0};  // slots [0, g_used) may be in use
std::mutex g_mutex;
struct sigaction g_previous;
bool g_installed = false;
uintptr_t g_page = 4096;  // set before the handler is installed (sysconf is not async-signal-safe)

void forward(int sig, siginfo_t* info, void* ctx) {
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) {
      g_previous.sa_sigaction(sig, info, ctx);
      return;
    }
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN && g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
    return;
  }
  // Default action: restore it and return; the access faults again and the process ends as it would have.
  signal(sig, SIG_DFL);
}

void on_sigbus(int sig, siginfo_t* info, void* ctx) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
  const size_t used = g_used.load(std::memory_order_acquire);
  for (size_t i = 0; i < used; ++i) {
    Slot& s = g_slots[i];
    const uintptr_t base = s.base.load(std::memory_order_acquire);
    if (base == 0 || addr < base || addr - base >= s.size.load(std::memory_order_acquire)) continue;
    const uintptr_t page = addr & ~(g_page - 1);
    void* p = mmap(reinterpret_cast<void*>(page), size_t(g_page), PROT_READ | PROT_WRITE,
                   MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) break;
    s.faulted.store(1, std::memory_order_release);
    return;
  }
  forward(sig, info, ctx);
}

void install_locked() {
  if (g_installed) return;
  g_page = uintptr_t(sysconf(_SC_PAGESIZE));
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  if (sigaction(SIGBUS, &sa, &g_previous) == 0) g_installed = true;
}

}  // namespace

bool guard_register(void* base, size_t size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  install_locked();
  const size_t used = g_used.load(std::memory_order_relaxed);
  size_t i = 0;
  while (i < used && g_slots[i].base.load(std::memory_order_relaxed) != 0) ++i;
  if (i == kSlots) return false;
  Slot& s = g_slots[i];
  s.faulted.store(0, std::memory_order_relaxed);
  s.size.store(size, std::memory_order_relaxed);
  s.base.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
  if (i == used) g_used.store(used + 1, std::memory_order_release);
  return true;
}

void guard_unregister(void* base) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const size_t used = g_used.load(std::memory_order_relaxed);
  for (size_t i = 0; i < used; ++i) {
    if (g_slots[i].base.load(std::memory_order_relaxed) == reinterpret_cast<uintptr_t>(base)) {
      g_slots[i].base.store(0, std::memory_order_release);
      return;
    }
  }
}

bool guard_faulted(const void* base) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const size_t used = g_used.load(std::memory_order_relaxed);
  for (size_t i = 0; i < used; ++i) {
    if (g_slots[i].base.load(std::memory_order_relaxed) == reinterpret_cast<uintptr_t>(base))
      return g_slots[i].faulted.load(std::memory_order_acquire) != 0;
  }
  return false;
}

}  // namespace tzip::addon
