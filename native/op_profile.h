// Op profiling of the native decode stack (a model installed with profiling on: get_op_profiling_info).
//
// An OpProfile accumulates, per op name, how often the op ran and the sum / min / max of its wall time on the
// calling thread (std::chrono::steady_clock). DecodeStack::run makes its profile the thread's active one for the
// step (ActiveProfile) when profiling is on and leaves it null otherwise; each OpTimer then reads that pointer
// once: off, an op costs one thread-local load and a branch, no clock read.
// Op names are string literals (compared by address first, then by text): the table has a few dozen entries.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

namespace allspark {

class OpProfile {
 public:
  void add(const char* name, double seconds) {
    for (auto& op : ops_) {
      if (op.name == name || std::strcmp(op.name, name) == 0) {
        ++op.count;
        op.sum += seconds;
        op.min = seconds < op.min ? seconds : op.min;
        op.max = seconds > op.max ? seconds : op.max;
        return;
      }
    }
    ops_.push_back({name, 1, seconds, seconds, seconds});
  }

  // (name, count, sum, min, max), seconds, in the order the ops first ran
  std::vector<std::tuple<std::string, int64_t, double, double, double>> stats() const {
    std::vector<std::tuple<std::string, int64_t, double, double, double>> out;
    for (const auto& op : ops_) out.emplace_back(op.name, op.count, op.sum, op.min, op.max);
    return out;
  }

  void clear() { ops_.clear(); }

 private:
  struct Op {
    const char* name;
    int64_t count;
    double sum, min, max;
  };
  std::vector<Op> ops_;
};

// the profile the ops of this thread record into; null: profiling is off
inline thread_local OpProfile* active_profile = nullptr;

// makes `profile` (null: none) the thread's active one for a scope
class ActiveProfile {
 public:
  explicit ActiveProfile(OpProfile* profile) : saved_(active_profile) { active_profile = profile; }
  ~ActiveProfile() { active_profile = saved_; }
  ActiveProfile(const ActiveProfile&) = delete;
  ActiveProfile& operator=(const ActiveProfile&) = delete;

 private:
  OpProfile* saved_;
};

// times its scope as one run of op `name` when a profile is active
class OpTimer {
 public:
  explicit OpTimer(const char* name) : profile_(active_profile), name_(name) {
    if (profile_) start_ = std::chrono::steady_clock::now();
  }
  ~OpTimer() {
    if (profile_)
      profile_->add(name_, std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  OpProfile* profile_;
  const char* name_;
  std::chrono::steady_clock::time_point start_;
};

// f() timed as one run of op `name`: `auto y = timed("o_proj", [&] { return project(...); });`
template <typename F>
auto timed(const char* name, F&& f) {
  OpTimer timer(name);
  return f();
}

}  // namespace allspark
