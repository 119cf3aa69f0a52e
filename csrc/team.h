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

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
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
    work(0, parts);
    while (pending_.load(std::memory_order_acquire) != 0) Pause();
  }

 private:
  static int Threads() {
    if (const char* value = std::getenv("SPECJAX_CPU_THREADS")) return std::max(1, std::atoi(value));
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
      // The helper computes as the caller would: XLA's threads flush denormals to zero (and a
      // helper that did not would both round differently and run those sums far slower).
      if (Control() != control_) SetControl(control_);
      work_(context_, part, size());
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
};

}  // namespace specjax
