// A shared secret read from a file that may be replaced while the program runs (a Kubernetes
// Secret volume swaps its files atomically when the Secret changes). The file is looked at
// again at most once a second; a changed file with a valid token becomes current, and the
// token it replaced is still accepted for a grace period, so the programs that share the
// secret (agents, controller) need not pick up the change at the same moment.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <ctime>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/result.h"

namespace rdmig {

class TokenSource {
 public:
  // Reads the token now (errors name `what`, e.g. "config key 'api.tokenFile'"). A token
  // shorter than `min_length` is refused, at open and at every reload.
  static Result<std::shared_ptr<TokenSource>> open(const std::string& path, const std::string& what,
                                                   size_t min_length, std::chrono::seconds grace);
  // A token that never changes (tests, and programs given a token rather than a file).
  static std::shared_ptr<TokenSource> fixed(std::string token);

  // The token to present now.
  std::string current();
  // Whether `presented` is the current token, or the one before it within the grace period.
  // Constant time in the token's content.
  bool accepts(std::string_view presented);
  // The tokens accepted now, current first (for checking a proof made with either).
  std::vector<std::string> accepted();

 private:
  TokenSource() = default;
  void maybe_reload();  // with mu_ held

  std::string path_, what_;
  size_t min_length_ = 0;
  std::chrono::seconds grace_{0};
  // Guards every member below it (token_, previous_, previous_until_, next_check_ and the file's
  // dev_/ino_/size_/mtime_); path_, what_, min_length_ and grace_ are set in open() and then
  // only read. Taken by whoever checks or presents a token (REST and hook workers, the
  // data-plane accept threads, sessions); held across maybe_reload()'s stat and file read,
  // at most once a second. No other lock is taken under it.
  std::mutex mu_;
  std::string token_, previous_;
  std::chrono::steady_clock::time_point previous_until_{}, next_check_{};
  // What the file was when last read: a replaced file differs in one of these.
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  off_t size_ = 0;
  timespec mtime_{};
};

}  // namespace rdmig
