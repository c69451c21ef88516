// ringOpen(file, opts): the N-API binding of the submission ring (addon/ring.h; docs/ring.md "Native API", docs/addon.md
// "Ring"). The JavaScript thread opens and closes the ring and registers and removes its regions; the ring thread
// hands its events (stats, broken, regions no longer in use, stopped) back through one thread-safe function, whose
// callback settles the promises of remove() and close() and calls onStats / onBroken.
//
// Lifetime: a RingJs is shared by the thread-safe function (released by the ring thread as its last act, finalized
// on the JavaScript thread afterwards), the ring object and its methods (their finalizers). While serving, the
// thread-safe function does not keep the event loop alive (as an unref'd handle); a pending remove() or close() does.
// An environment torn down with the ring still serving stops and joins its thread first (a cleanup hook).
#include <napi.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "addon/args.h"
#include "addon/device.h"
#include "addon/register.h"
#include "addon/ring.h"
#include "core/frame.h"

namespace tzip::addon {

namespace {

struct RingJs;
void deliver(Napi::Env env, Napi::Function, RingJs* ctx, void*);
using Tsfn = Napi::TypedThreadSafeFunction<RingJs, void, deliver>;

struct PendingRemoval {
  std::vector<uint32_t> ids;
  Napi::Promise::Deferred deferred;
};

struct RingJs {
  explicit RingJs(Napi::Env e) : env(e) {}
  Napi::Env env;
  std::unique_ptr<RingCore> core;
  Tsfn tsfn;
  bool stopped = false;      // the Stopped event was handled: the thread is joined, the tsfn is going away
  bool hook = false;         // the environment cleanup hook is registered
  uint32_t holds = 0;        // pending promises keeping the event loop alive
  Napi::ObjectReference file;
  Napi::ObjectReference inflight;  // the session's bytes-in-flight word (opts.inflightBytes), while the thread runs
  std::map<uint32_t, Napi::ObjectReference> host_refs;  // the Buffers of host regions, kept alive until removed
  std::vector<PendingRemoval> removals;
  std::vector<Napi::Promise::Deferred> closes;
  Napi::FunctionReference on_stats, on_broken;

  void hold() {
    if (holds++ == 0 && !stopped) tsfn.Ref(env);
  }
  void unhold() {
    if (holds > 0 && --holds == 0 && !stopped) tsfn.Unref(env);
  }
  void drop(const std::vector<uint32_t>& ids) {
    core->forget(ids);
    for (const uint32_t id : ids) host_refs.erase(id);
  }
};

void cleanup_hook(void* arg) {
  auto* r = static_cast<RingJs*>(arg);
  r->hook = false;
  r->core->request_stop();
  r->core->join();
}

const char* op_name(uint8_t op) { return op == ring::kCompress ? "compress" : "decompress"; }

/// Calls onStats / onBroken. A callback that throws becomes the environment's uncaught exception, as for any
/// callback of Node; the C++ exception must not leave the thread-safe function's callback (that would terminate).
void call_back(const Napi::FunctionReference& f, Napi::Value arg) {
  try {
    f.Call({arg});
  } catch (const Napi::Error& e) {
    e.ThrowAsJavaScriptException();
  }
}

/// The thread's events, on the JavaScript thread (env is null when the environment is going away).
void deliver(Napi::Env env, Napi::Function, RingJs* r, void*) {
  if (env == nullptr || r == nullptr) return;
  Napi::HandleScope scope(env);
  RingCore::Events ev = r->core->take_events();
  if (ev.stopped && !r->stopped) {
    r->core->join();  // its last act was this event's notification: returns at once
    r->stopped = true;
    if (r->hook) {
      napi_remove_env_cleanup_hook(env, cleanup_hook, r);
      r->hook = false;
    }
  }
  // remove(): every removal whose regions no batch uses any more (all of them once the thread has stopped).
  for (size_t i = 0; i < r->removals.size();) {
    PendingRemoval& p = r->removals[i];
    if (!r->stopped && !r->core->idle(p.ids)) {
      ++i;
      continue;
    }
    r->drop(p.ids);
    p.deferred.Resolve(env.Undefined());
    r->removals.erase(r->removals.begin() + ptrdiff_t(i));
    r->unhold();
  }
  if (r->stopped) {
    std::vector<uint32_t> ids;
    for (const auto& kv : r->host_refs) ids.push_back(kv.first);
    r->drop(ids);
    r->host_refs.clear();
    for (auto& d : r->closes) d.Resolve(env.Undefined());
    r->closes.clear();
    r->holds = 0;
  }
  // The callbacks last: one that throws does not keep the promises above from settling.
  if (!ev.stats.empty() && !r->on_stats.IsEmpty()) {
    Napi::Array arr = Napi::Array::New(env, ev.stats.size());
    for (uint32_t i = 0; i < ev.stats.size(); ++i) {
      const RingCore::StatsEntry& s = ev.stats[i];
      Napi::Object o = Napi::Object::New(env);
      o.Set("op", op_name(s.op));
      o.Set("stream", Napi::Number::New(env, s.stream));
      o.Set("items", Napi::Number::New(env, double(s.items)));
      o.Set("inBytes", Napi::Number::New(env, double(s.in_bytes)));
      o.Set("outBytes", Napi::Number::New(env, double(s.out_bytes)));
      o.Set("seconds", Napi::Number::New(env, s.seconds));
      o.Set("errors", Napi::Number::New(env, double(s.errors)));
      o.Set("gpu", Napi::Boolean::New(env, s.gpu));
      arr.Set(i, o);
    }
    call_back(r->on_stats, arr);
  }
  if (!ev.broken.empty() && !r->on_broken.IsEmpty()) call_back(r->on_broken, Napi::String::New(env, ev.broken));
  if (r->stopped) {
    r->file.Reset();
    r->inflight.Reset();
    r->on_stats.Reset();
    r->on_broken.Reset();
  }
}

RingJs* ring_of(const Napi::CallbackInfo& info) { return static_cast<RingJs*>(info.Data()); }

/// The settings of `o` (ringOpen's options or setSettings' argument; docs/addon.md "Ring"): smBudget, the default of
/// SQEs that give 0 (`base`'s when absent); codec (a codec name, or null/absent: each SQE's own); smBudgetOverride
/// (an SM count, 0: all SMs, as a job's budget may be beyond what an SQE's byte holds; null/absent: each SQE's own).
RingCore::Settings settings_of(const Napi::Object& o, const RingCore::Settings& base, const std::string& who) {
  RingCore::Settings st = base;
  if (has_opt(o, "smBudget")) st.sm_budget = i32_of(o.Get("smBudget"), who + "smBudget");
  st.codec = -1;
  if (const Napi::Value cv = o.Get("codec"); present(cv)) {
    if (!cv.IsString()) invalid(who + "codec must be a codec name or null");
    const std::string name = cv.As<Napi::String>().Utf8Value();
    Codec c = Codec::RAW;
    bool is_auto = false;
    if (!parse_codec_name(name, &c, &is_auto)) invalid(who + "unknown codec '" + name + "' (auto, fast, max, bytes, raw)");
    st.codec = is_auto ? int(ring::kCodecAuto) : int(c);
  }
  st.sm_override = -1;
  if (const Napi::Value v = o.Get("smBudgetOverride"); present(v)) {
    const int32_t b = i32_of(v, who + "smBudgetOverride");
    if (b < 0) invalid(who + "smBudgetOverride must be a number of SMs (0: all), or null");
    st.sm_override = b;
  }
  return st;
}

// setSettings({ smBudget, codec, smBudgetOverride }): what every SQE run from now on gets (RingCore::set_settings).
Napi::Value SetSettings(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guarded(env, [&]() -> Napi::Value {
    RingJs* r = ring_of(info);
    const Napi::Object o = options_of(info, 0);
    if (!has_opt(o, "smBudget")) invalid("setSettings: smBudget is required");
    r->core->set_settings(settings_of(o, RingCore::Settings{}, "setSettings: "));
    return env.Undefined();
  });
}

void require_open(RingJs* r) {
  if (r->stopped || r->core->stopping()) invalid("the ring is closed");
  if (r->core->state() == ring::State::Broken) invalid("the ring is broken");
}

/// Whether every byte of [p, p + n) lies in mappings of this process that are writable (/proc/self/maps): a
/// read-only mapping (mapShared(path, false)) must never become a destination, as a write to it would kill the
/// process with SIGSEGV.
bool range_writable(const uint8_t* p, uint64_t n) {
  if (n == 0) return true;
  uint64_t at = reinterpret_cast<uintptr_t>(p);
  const uint64_t end = at + n;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line) && at < end) {
    unsigned long long lo = 0, hi = 0;
    char perms[8] = {0};
    if (std::sscanf(line.c_str(), "%llx-%llx %7s", &lo, &hi, perms) != 3) continue;
    if (hi <= at || lo > at) continue;  // maps are sorted: the one holding `at`, or none
    if (perms[1] != 'w') return false;
    at = hi;
  }
  return at >= end;
}

Napi::Value region_object(Napi::Env env, const RingCore::RegionInfo& i) {
  Napi::Object o = Napi::Object::New(env);
  o.Set("id", Napi::Number::New(env, i.id));
  o.Set("generation", Napi::Number::New(env, i.generation));
  o.Set("bytes", Napi::Number::New(env, double(i.bytes)));
  return o;
}

// addHost(buffer): the whole Buffer (a mapShared mapping) as a host region.
Napi::Value AddHost(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guarded(env, [&]() -> Napi::Value {
    RingJs* r = ring_of(info);
    require_open(r);
    if (info.Length() < 1) invalid("addHost(buffer) needs a Buffer");
    const Bytes b = bytes_of(info[0], "addHost: buffer");
    ring::Region reg;
    reg.kind = ring::RegionKind::Host;
    reg.base = reinterpret_cast<uintptr_t>(b.data);
    reg.bytes = b.size;
    reg.writable = range_writable(b.data, b.size);
    const RingCore::RegionInfo ri = r->core->add_region(reg);
    r->host_refs[ri.id] = Napi::Persistent(info[0].As<Napi::Object>());
    return region_object(env, ri);
  });
}

// addDevice(ptr, bytes, device): [ptr, ptr + bytes) of one allocation on `device` as a device region.
Napi::Value AddDevice(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guarded(env, [&]() -> Napi::Value {
    RingJs* r = ring_of(info);
    require_open(r);
    const uint64_t ptr = arg_u64(info, 0, "addDevice: ptr");
    const uint64_t bytes = arg_u64(info, 1, "addDevice: bytes");
    const int device = device_arg(info, 2);
    {
      DeviceScope scope(device);
      check_device_range(ptr, bytes, device, "addDevice: region");
    }
    ring::Region reg;
    reg.kind = ring::RegionKind::Device;
    reg.device = device;
    reg.base = ptr;
    reg.bytes = bytes;
    return region_object(env, r->core->add_region(reg));
  });
}

Napi::Value rejected(Napi::Env env, const tzip::Error& e) {
  auto d = Napi::Promise::Deferred::New(env);
  d.Reject(make_error(env, e).Value());
  return d.Promise();
}

Napi::Value resolved(Napi::Env env) {
  auto d = Napi::Promise::Deferred::New(env);
  d.Resolve(env.Undefined());
  return d.Promise();
}

// remove(ids) => Promise<void>: resolves once no batch uses the regions.
Napi::Value Remove(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RingJs* r = ring_of(info);
  try {
    if (info.Length() < 1 || !info[0].IsArray()) invalid("remove(ids) needs an array of region ids");
    const Napi::Array a = info[0].As<Napi::Array>();
    std::vector<uint32_t> ids;
    for (uint32_t i = 0; i < a.Length(); ++i) {
      const uint64_t id = u64_of(a.Get(i), "remove: region ids");
      if (id > UINT32_MAX) invalid("remove: region id " + std::to_string(id) + " is out of range");
      ids.push_back(uint32_t(id));
    }
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    if (r->stopped) return resolved(env);  // every region went with the thread
    const std::string why = r->core->release(ids);
    if (!why.empty()) invalid(why);
    if (r->core->idle(ids)) {
      r->drop(ids);
      return resolved(env);
    }
    PendingRemoval p{std::move(ids), Napi::Promise::Deferred::New(env)};
    Napi::Value promise = p.deferred.Promise();
    r->removals.push_back(std::move(p));
    r->hold();
    return promise;
  } catch (const Napi::Error&) {
    throw;
  } catch (const std::exception&) {
    return rejected(env, current_error());
  }
}

// close() => Promise<void>: stops the thread after the batch in flight.
Napi::Value Close(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  RingJs* r = ring_of(info);
  if (r->stopped) return resolved(env);
  auto d = Napi::Promise::Deferred::New(env);
  r->closes.push_back(d);
  r->hold();
  r->core->request_stop();
  return d.Promise();
}

Napi::Value State(const Napi::CallbackInfo& info) {
  RingJs* r = ring_of(info);
  switch (r->core->state()) {
    case ring::State::Serving: return Napi::String::New(info.Env(), r->stopped ? "closed" : "serving");
    case ring::State::Closed: return Napi::String::New(info.Env(), "closed");
    case ring::State::Broken: return Napi::String::New(info.Env(), "broken");
  }
  return info.Env().Undefined();
}

/// A copy of the ring for a finalizer to hold.
std::shared_ptr<RingJs>* share(const std::shared_ptr<RingJs>& r) { return new std::shared_ptr<RingJs>(r); }

Napi::Function method(Napi::Env env, const std::shared_ptr<RingJs>& r, const char* name, Napi::Function::Callback cb) {
  Napi::Function f = Napi::Function::New(env, cb, name, r.get());
  f.AddFinalizer([](Napi::Env, std::shared_ptr<RingJs>* p) { delete p; }, share(r));
  return f;
}

Napi::Value RingOpen(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guarded(env, [&]() -> Napi::Value {
    if (info.Length() < 2) invalid("ringOpen(file, opts) needs the ring file's mapping and options");
    const Bytes file = bytes_of(info[0], "ringOpen: file");
    const Napi::Object o = options_of(info, 1);
    if (!has_opt(o, "entries")) invalid("ringOpen: opts.entries is required");
    const uint64_t entries = u64_of(o.Get("entries"), "ringOpen: opts.entries");
    if (!ring::valid_entries(entries)) invalid("ringOpen: opts.entries must be a power of two from 8 to 4096");
    if (file.size != ring::ring_bytes(entries))
      invalid("ringOpen: the ring file is " + std::to_string(file.size) + " bytes; " + std::to_string(entries) +
              " entries need exactly " + std::to_string(ring::ring_bytes(entries)));
    if (reinterpret_cast<uintptr_t>(file.data) % 64) invalid("ringOpen: the ring file's mapping is not 64-byte aligned");
    if (!range_writable(file.data, file.size)) invalid("ringOpen: the ring file's mapping is read-only");
    uint8_t head[12];
    for (int i = 0; i < 12; ++i) head[i] = __atomic_load_n(file.data + i, __ATOMIC_RELAXED);
    if (std::memcmp(head, ring::kMagic, 8) != 0) invalid("ringOpen: the file does not start with \"TZRING01\"");
    const uint32_t file_entries = uint32_t(head[8]) | uint32_t(head[9]) << 8 | uint32_t(head[10]) << 16 | uint32_t(head[11]) << 24;
    if (file_entries != entries)
      invalid("ringOpen: the file says " + std::to_string(file_entries) + " entries, opts.entries is " + std::to_string(entries));

    RingCore::Options opt;
    opt.file = const_cast<uint8_t*>(file.data);
    opt.entries = uint32_t(entries);
    opt.settings = settings_of(o, RingCore::Settings{}, "ringOpen: opts.");
    Napi::Value inflight = o.Get("inflightBytes");
    if (present(inflight)) {
      const Bytes w = bytes_of(inflight, "ringOpen: opts.inflightBytes");
      if (w.size != 8 || reinterpret_cast<uintptr_t>(w.data) % 8)
        invalid("ringOpen: opts.inflightBytes must be 8 bytes, 8-byte aligned (a SharedArrayBuffer's BigInt64 word)");
      opt.inflight = reinterpret_cast<int64_t*>(const_cast<uint8_t*>(w.data));
      if (!has_opt(o, "maxInflightBytes")) invalid("ringOpen: opts.maxInflightBytes is required with opts.inflightBytes");
      const uint64_t m = u64_of(o.Get("maxInflightBytes"), "ringOpen: opts.maxInflightBytes");
      opt.max_inflight = m > uint64_t(INT64_MAX) ? INT64_MAX : int64_t(m);
    }
    if (has_opt(o, "cpuThreads")) {
      const uint64_t t = u64_of(o.Get("cpuThreads"), "ringOpen: opts.cpuThreads");
      if (t < 1 || t > 1024) invalid("ringOpen: opts.cpuThreads must be between 1 and 1024");
      opt.cpu_threads = uint32_t(t);
    } else {
      opt.cpu_threads = std::max(1u, std::thread::hardware_concurrency());
    }
    if (has_opt(o, "spinUs")) {
      const uint64_t s = u64_of(o.Get("spinUs"), "ringOpen: opts.spinUs");
      if (s > 1000000) invalid("ringOpen: opts.spinUs must be at most 1000000");
      opt.spin_us = long(s);
    }
    for (const char* key : {"onStats", "onBroken"})
      if (!o.Get(key).IsFunction()) invalid(std::string("ringOpen: opts.") + key + " must be a function");
    std::unique_ptr<RingGpu> gpu;
    if (has_opt(o, "device")) {
      const int device = device_of(o.Get("device"), "ringOpen: opts.device");
      gpu = std::make_unique<RingGpu>(device);
    }

    auto r = std::make_shared<RingJs>(env);
    RingJs* raw = r.get();
    r->core = std::make_unique<RingCore>(opt, std::move(gpu), [raw] { raw->tsfn.NonBlockingCall(); },
                                         [raw] { raw->tsfn.Release(); });
    r->file = Napi::Persistent(info[0].As<Napi::Object>());
    if (opt.inflight != nullptr) r->inflight = Napi::Persistent(inflight.As<Napi::Object>());
    r->on_stats = Napi::Persistent(o.Get("onStats").As<Napi::Function>());
    r->on_broken = Napi::Persistent(o.Get("onBroken").As<Napi::Function>());
    r->tsfn = Tsfn::New(env, "tzip ring", 0, 1, raw,
                        [](Napi::Env, std::shared_ptr<RingJs>* holder, RingJs*) { delete holder; }, share(r));
    r->tsfn.Unref(env);
    // After the tsfn: cleanup hooks run last-registered first, so the thread is joined before the tsfn goes.
    if (napi_add_env_cleanup_hook(env, cleanup_hook, raw) == napi_ok) r->hook = true;
    try {
      r->core->start();
    } catch (const std::exception& e) {
      if (r->hook) napi_remove_env_cleanup_hook(env, cleanup_hook, raw);
      r->hook = false;
      r->stopped = true;
      r->tsfn.Release();
      throw tzip::Error(tzip::ErrorCode::Internal, std::string("ringOpen: cannot start the ring thread: ") + e.what());
    }

    Napi::Object obj = Napi::Object::New(env);
    obj.Set("addHost", method(env, r, "addHost", AddHost));
    obj.Set("addDevice", method(env, r, "addDevice", AddDevice));
    obj.Set("remove", method(env, r, "remove", Remove));
    obj.Set("close", method(env, r, "close", Close));
    obj.Set("setSettings", method(env, r, "setSettings", SetSettings));
    obj.DefineProperty(Napi::PropertyDescriptor::Accessor<State>("state", napi_enumerable, raw));
    // A ring dropped without close() stops; its thread-safe function then finishes the clean-up.
    obj.AddFinalizer([](Napi::Env, std::shared_ptr<RingJs>* p) {
      (*p)->core->request_stop();
      delete p;
    }, share(r));
    return obj;
  });
}

}  // namespace

void register_ring(Napi::Env, Napi::Object exports) {
  exports.Set("ringOpen", Napi::Function::New(exports.Env(), RingOpen, "ringOpen"));
}

}  // namespace tzip::addon
