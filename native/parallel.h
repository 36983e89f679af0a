// allspark::parallel_for: how every kernel of this folder splits its work over threads.
//
// The same contract as at::parallel_for (torch's thread count, contiguous chunks of at least `grain`,
// f(begin, end) per chunk, the calling thread takes the first chunk), run on this library's own worker
// threads instead of OpenMP's inside an OwnPoolScope (see the end). Why: a decode step is ~80 short
// parallel regions separated by serial work, so what matters is how fast a sleeping worker starts.
// libgomp lets its workers spin between regions only while it manages no more threads than there are
// CPUs; as soon as a second thread of the process has used OpenMP (the user's main thread loading a
// model, say, next to the engine thread), it "throttles" them to ~1000 spins, so every region waits
// for a futex wake-up, which a decode step's many short regions pay again and again (docs/performance.md,
// "Choices in the code", has the 2-core VM's numbers).
//
// The workers spin for a bounded time after each region (SPIN_US, parallel.cpp), then sleep, so an idle
// engine costs no CPU. One region runs at a time: a call made while another thread's region runs, or
// from inside a region, runs its whole range on the calling thread (same results, kernels never depend on
// the split). An exception thrown by a chunk is rethrown to the caller after all chunks finish.
//
// Only inside an OwnPoolScope(true) on the calling thread; elsewhere parallel_for is at::parallel_for.
// Two sets of spinning workers must not take turns: where native kernels alternate with ATen's OpenMP
// GEMMs (prefill, decode batches above the native GEMV's row limit), each set's spinning workers hold the
// cores the other needs, and both lose throughput. So the decode stack turns the pool on only for steps whose every
// GEMV is native.
#pragma once

#include <cstdint>
#include <functional>

namespace allspark {

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);

// the grain of a weight-streaming kernel (GEMVs, dequantization): rows of `row_bytes` making ~64 KiB per task
inline int64_t weight_rows_grain(int64_t row_bytes) {
  return row_bytes >= 65536 ? 1 : 65536 / (row_bytes > 0 ? row_bytes : 1);
}

// While alive, parallel_for on this thread uses allspark's workers if `on` (restores the previous choice).
class OwnPoolScope {
 public:
  explicit OwnPoolScope(bool on);
  ~OwnPoolScope();
  OwnPoolScope(const OwnPoolScope&) = delete;
  OwnPoolScope& operator=(const OwnPoolScope&) = delete;

 private:
  bool previous_;
};

}  // namespace allspark
