// The CPU kernels' worker threads: one team for the process, the calling thread and a helper per
// other core, splitting one kernel call's work into equal parts.
//
// Why not OpenMP: XLA calls a kernel from whichever of its own threads runs it, and GNU OpenMP keeps
// a separate team per calling thread, so on a 2-core machine several teams' threads spun against
// each other and against XLA's (the products of a SmolLM2 step ran 1.3-1.7x slower inside a jitted
// program than alone). Here the helpers spin briefly between calls (a decode step calls a kernel
// every few dozen microseconds), then sleep.

#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sched.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace specjax {

inline void Pause() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// The floating-point control state (rounding, flush to zero, denormals as zero).
inline unsigned Control() {
#if defined(__x86_64__)
  return _mm_getcsr();
#else
  return 0;
#endif
}

inline void SetControl(unsigned control) {
#if defined(__x86_64__)
  _mm_setcsr(control);
#endif
}

// Flushes denormals to zero (FTZ and DAZ) while it lives. XLA's own kernels treat denormals as
// zero, but its custom calls run under the default control state, where each operation on a
// denormal costs a microcode assist: the attention's weighted sums over far-off slots and bfloat16
// products ran up to 4x slower. Every kernel sets it, so each result is the same wherever computed.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(Control()) { SetControl(saved_ | kFlushBits); }
  ~FlushDenormals() { SetControl(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
#if defined(__x86_64__)
  static constexpr unsigned kFlushBits = 0x8040;  // MXCSR's flush-to-zero and denormals-are-zero
#else
  static constexpr unsigned kFlushBits = 0;
#endif
  unsigned saved_;
};

class Team {
 public:
  // The team of the process: SPECJAX_CPU_THREADS threads, else one per core.
  static Team& Get() {
    static Team* team = new Team(Threads());  // never destroyed: helpers outlive static teardown
    return *team;
  }

  int size() const { return static_cast<int>(helpers_.size()) + 1; }

  // Runs work(part, parts) for part = 0 .. parts - 1 with parts = size(), part 0 on the calling
  // thread, the others on the helpers; returns when every part is done. Calls from several threads
  // (XLA runs independent operations concurrently) take turns: each already uses every core.
  template <typename Work>
  void Run(const Work& work) {
    const int parts = size();
    if (parts == 1) return work(0, 1);
    std::lock_guard<std::mutex> one_at_a_time(call_lock_);
    work_ = [](const void* context, int part, int parts) {
      (*static_cast<const Work*>(context))(part, parts);
    };
    context_ = &work;
    control_ = Control();
    pending_.store(parts - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> guard(lock_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    // Whatever part 0 does, the helpers finish with `work` before it goes out of scope; the first
    // exception of any part is rethrown here, once every part is done.
    std::exception_ptr failure;
    try {
      work(0, parts);
    } catch (...) {
      failure = std::current_exception();
    }
    while (pending_.load(std::memory_order_acquire) != 0) Pause();
    if (!failure) std::swap(failure, helper_failure_);
    helper_failure_ = nullptr;
    if (failure) std::rethrow_exception(failure);
  }

 private:
  // The cores this process may run on (its affinity mask, which a container's CPU set narrows;
  // hardware_concurrency counts the whole machine).
  static int Threads() {
    if (const char* value = std::getenv("SPECJAX_CPU_THREADS")) return std::max(1, std::atoi(value));
#if defined(__linux__)
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0) return std::max(1, CPU_COUNT(&allowed));
#endif
    return std::max(1u, std::thread::hardware_concurrency());
  }

  explicit Team(int threads) {
    for (int i = 1; i < threads; ++i) helpers_.emplace_back([this, i] { Help(i); });
    for (auto& helper : helpers_) helper.detach();
  }

  void Help(int part) {
    uint64_t seen = 0;
    for (;;) {
      // Spin about 0.2 ms for the next call, then sleep until one comes.
      auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
      uint64_t now;
      int spins = 0;
      while ((now = generation_.load(std::memory_order_acquire)) == seen) {
        Pause();
        if (++spins % 64 == 0 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> guard(lock_);
          wake_.wait(guard, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        }
      }
      seen = now;
      // The helper computes as the caller does (FlushDenormals: the same results, at full speed).
      if (Control() != control_) SetControl(control_);
      try {
        work_(context_, part, size());
      } catch (...) {
        std::lock_guard<std::mutex> guard(lock_);
        if (!helper_failure_) helper_failure_ = std::current_exception();
      }
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::vector<std::thread> helpers_;
  std::mutex call_lock_, lock_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  void (*work_)(const void*, int, int) = nullptr;
  const void* context_ = nullptr;
  unsigned control_ = 0;
  std::exception_ptr helper_failure_;  // the first exception a helper's part threw (under lock_)
};

}  // namespace specjax
