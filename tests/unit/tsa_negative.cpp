// Deliberately wrong: tests/unit/thread_safety_check.py compiles this file with Clang's
// -Wthread-safety -Werror=thread-safety and passes only when Clang rejects it with an error on
// exactly the lines marked below. It proves the check can fail. Not built into any target.
#include <condition_variable>

#include "common/mutex.h"

namespace {

class Counter {
 public:
  int read_unlocked() const {
    return value_;  // expect: thread-safety error
  }
  void bump_unlocked() {
    bump_locked();  // expect: thread-safety error
  }
  bool wait_with_predicate_lambda() {
    rdmig::MutexLock lock(mu_);
    // The predicate is a function of its own that does not hold the lock.
    return lock.wait_for(cv_, std::chrono::milliseconds(1), [&] {
      return value_ > 0;  // expect: thread-safety error
    });
  }
  int read_locked() const {
    rdmig::MutexLock lock(mu_);
    return value_;  // fine: the lock is held
  }
  void write_after_unlock() {
    rdmig::MutexLock lock(mu_);
    lock.unlock();
    value_ = 1;  // expect: thread-safety error
  }

 private:
  void bump_locked() REQUIRES(mu_) { ++value_; }

  mutable rdmig::Mutex mu_;
  std::condition_variable cv_;
  int value_ GUARDED_BY(mu_) = 0;
};

}  // namespace

int tsa_negative_sample() {
  Counter c;
  c.bump_unlocked();
  c.write_after_unlock();
  return c.read_unlocked() + c.read_locked() + (c.wait_with_predicate_lambda() ? 1 : 0);
}
