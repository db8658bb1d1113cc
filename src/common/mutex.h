// rdmig::Mutex and rdmig::MutexLock: std::mutex and std::unique_lock with Clang's
// thread-safety attributes (common/thread_annotations.h), so that members marked
// GUARDED_BY(mu_) are checked by clang++ -Wthread-safety. Same behaviour and cost as the
// standard types they wrap; waits use std::condition_variable.
//
//   MutexLock lock(mu_);
//   while (!ready_) lock.wait(cv_);  // not cv_.wait(lock, [&] { return ready_; }): the
//                                    // analysis checks a lambda as a function of its own,
//                                    // which does not hold the lock
//
// The predicate overloads below are for predicates that read nothing the lock guards (an
// atomic flag): a predicate that reads a guarded member fails the check, as it should.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <utility>

#include "common/thread_annotations.h"

namespace rdmig {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  bool try_lock() TRY_ACQUIRE(true) { return mu_.try_lock(); }

 private:
  friend class MutexLock;
  std::mutex mu_;
};

// Holds a Mutex from construction to destruction, unless unlock()ed (and lock()ed again) in
// between; waits on a std::condition_variable release it while they wait, as std::unique_lock's.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : lock_(mu.mu_) {}
  ~MutexLock() RELEASE() {}
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void lock() ACQUIRE() { lock_.lock(); }
  void unlock() RELEASE() { lock_.unlock(); }

  void wait(std::condition_variable& cv) { cv.wait(lock_); }
  template <class Clock, class Duration>
  std::cv_status wait_until(std::condition_variable& cv, const std::chrono::time_point<Clock, Duration>& t) {
    return cv.wait_until(lock_, t);
  }
  template <class Rep, class Period>
  std::cv_status wait_for(std::condition_variable& cv, const std::chrono::duration<Rep, Period>& d) {
    return cv.wait_for(lock_, d);
  }
  // For predicates that read no member this lock guards (see above). True when pred() holds.
  template <class Clock, class Duration, class Pred>
  bool wait_until(std::condition_variable& cv, const std::chrono::time_point<Clock, Duration>& t, Pred pred) {
    return cv.wait_until(lock_, t, std::move(pred));
  }
  template <class Rep, class Period, class Pred>
  bool wait_for(std::condition_variable& cv, const std::chrono::duration<Rep, Period>& d, Pred pred) {
    return cv.wait_for(lock_, d, std::move(pred));
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

}  // namespace rdmig
