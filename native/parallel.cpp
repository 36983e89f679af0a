// The worker pool behind allspark::parallel_for (parallel.h explains why it exists).
//
// Workers wait on a ticket: the caller publishes a region (function, range, chunk size), then a new
// ticket (a region counter and how many workers take part, in one atomic word, so a worker never mixes
// two regions' answers) and runs chunk 0 itself; worker i < active runs chunk i + 1 and counts down
// `pending`, which the caller waits for. A worker that has seen no new region for SPIN_US sleeps on a
// condition variable; the caller wakes sleepers only when there are some. Workers are created on first
// use, grow with torch's thread count and are never joined (they sleep when idle and die with the process).
#include "parallel.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

namespace allspark {
namespace {

// Long enough to bridge a decode step's serial work and the Python work between steps (~0.1-1 ms),
// short enough that an idle engine stops using CPU at once.
constexpr int64_t SPIN_US = 2000;

thread_local bool in_region = false;
thread_local bool own_pool = false;   // OwnPoolScope

class Pool {
 public:
  // false when another region is running (the caller then runs the range itself)
  bool run(int64_t chunks, int64_t begin, int64_t end, int64_t chunk, const std::function<void(int64_t, int64_t)>& f) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    grow(chunks - 1);
    fn_ = &f;
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    error_ = nullptr;
    pending_.store(chunks - 1, std::memory_order_relaxed);
    const uint64_t region = (ticket_.load(std::memory_order_relaxed) >> 16) + 1;
    ticket_.store(region << 16 | static_cast<uint64_t>(chunks - 1), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_m_);
      sleep_cv_.notify_all();
    }
    run_chunk(0);
    while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
    return true;
  }

 private:
  void grow(int64_t workers) {
    while (num_workers_ < workers) {
      const int64_t id = num_workers_++;
      const uint64_t seen = ticket_.load(std::memory_order_relaxed);   // the region about to start is new to it
      std::thread([this, id, seen] { work(id, seen); }).detach();
    }
  }

  void run_chunk(int64_t i) {
    const int64_t b = begin_ + i * chunk_;
    const int64_t e = std::min(end_, b + chunk_);
    if (b >= e) return;
    in_region = true;
    try {
      (*fn_)(b, e);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_m_);
      if (!error_) error_ = std::current_exception();
    }
    in_region = false;
  }

  void work(int64_t id, uint64_t seen) {
    for (;;) {
      uint64_t t;
      auto start = std::chrono::steady_clock::now();
      int64_t spins = 0;
      while ((t = ticket_.load(std::memory_order_acquire)) == seen) {
        _mm_pause();
        if (++spins % 256 != 0 || std::chrono::steady_clock::now() - start < std::chrono::microseconds(SPIN_US))
          continue;
        std::unique_lock<std::mutex> lock(sleep_m_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        sleep_cv_.wait(lock, [&] { return ticket_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        start = std::chrono::steady_clock::now();
      }
      seen = t;
      if (id < static_cast<int64_t>(t & 0xFFFF)) {
        run_chunk(id + 1);
        pending_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  std::mutex busy_;
  int64_t num_workers_ = 0;
  std::atomic<uint64_t> ticket_{0};   // region counter << 16 | workers taking part
  std::atomic<int64_t> pending_{0};
  std::atomic<int> sleepers_{0};
  std::mutex sleep_m_, error_m_;
  std::condition_variable sleep_cv_;
  // the region being run (written before its ticket, read by its workers after they see the ticket)
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1;
  std::exception_ptr error_;
};

// A forked child has none of the parent's workers: it starts a fresh pool (the old one is left unused).
std::atomic<Pool*> the_pool{nullptr};
std::mutex the_pool_m;

Pool& pool() {
  if (Pool* p = the_pool.load(std::memory_order_acquire)) return *p;
  std::lock_guard<std::mutex> lock(the_pool_m);
  static bool registered = false;
  if (!registered) {
    pthread_atfork(nullptr, nullptr, [] { the_pool.store(nullptr); });
    registered = true;
  }
  if (the_pool.load() == nullptr) the_pool.store(new Pool());
  return *the_pool.load();
}

}  // namespace

OwnPoolScope::OwnPoolScope(bool on) : previous_(own_pool) { own_pool = on; }
OwnPoolScope::~OwnPoolScope() { own_pool = previous_; }

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
  if (begin >= end) return;
  if (in_region) return f(begin, end);   // called from a chunk of ours
  if (!own_pool) return at::parallel_for(begin, end, grain, f);
  const int64_t n = end - begin;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  const bool ran = chunks > 1 && chunks <= 0xFFFF && !at::in_parallel_region() &&
                   pool().run(chunks, begin, end, (n + chunks - 1) / chunks, f);
  if (!ran) f(begin, end);   // one chunk, or the pool is busy with another thread's region
}

}  // namespace allspark
