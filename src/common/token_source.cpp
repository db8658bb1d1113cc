#include "common/token_source.h"

#include <sys/stat.h>

#include "common/log.h"
#include "common/text.h"
#include "common/units.h"

namespace rdmig {

namespace {
Result<std::string> read_token(const std::string& path, const std::string& what, size_t min_length) {
  auto text = read_text_file(path, what);
  if (!text) return text.error();
  std::string token = trim(text.value());
  if (token.empty()) return Error{Errc::kInvalidArgument, what + ": '" + path + "' is empty"};
  if (token.size() < min_length) {
    return Error{Errc::kInvalidArgument, what + ": the token in '" + path + "' must be at least " +
                                             std::to_string(min_length) + " characters"};
  }
  return token;
}
}  // namespace

Result<std::shared_ptr<TokenSource>> TokenSource::open(const std::string& path, const std::string& what,
                                                       size_t min_length, std::chrono::seconds grace) {
  std::shared_ptr<TokenSource> t(new TokenSource());
  t->path_ = path;
  t->what_ = what;
  t->min_length_ = min_length;
  t->grace_ = grace;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    t->dev_ = st.st_dev;
    t->ino_ = st.st_ino;
    t->size_ = st.st_size;
    t->mtime_ = st.st_mtim;
  }
  auto token = read_token(path, what, min_length);
  if (!token) return token.error();
  t->token_ = std::move(token.value());
  t->next_check_ = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  return t;
}

std::shared_ptr<TokenSource> TokenSource::fixed(std::string token) {
  std::shared_ptr<TokenSource> t(new TokenSource());
  t->token_ = std::move(token);
  return t;
}

void TokenSource::maybe_reload() {
  if (path_.empty()) return;
  const auto now = std::chrono::steady_clock::now();
  if (now < next_check_) return;
  next_check_ = now + std::chrono::seconds(1);
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0) return;  // mid-swap or gone: keep what we have
  if (st.st_dev == dev_ && st.st_ino == ino_ && st.st_size == size_ && st.st_mtim.tv_sec == mtime_.tv_sec &&
      st.st_mtim.tv_nsec == mtime_.tv_nsec) {
    return;
  }
  auto token = read_token(path_, what_, min_length_);
  if (!token) {
    LOG_ERROR("token") << token.error().message << "; still using the token read before";
    // Look again next second: the writer may not be done.
    return;
  }
  dev_ = st.st_dev;
  ino_ = st.st_ino;
  size_ = st.st_size;
  mtime_ = st.st_mtim;
  if (token.value() == token_) return;
  previous_ = std::move(token_);
  previous_until_ = now + grace_;
  token_ = std::move(token.value());
  LOG_INFO("token") << what_ << ": '" << path_ << "' changed, using the new token (the previous one is accepted for "
                    << grace_.count() << " s more)";
}

std::string TokenSource::current() {
  std::lock_guard lock(mu_);
  maybe_reload();
  return token_;
}

bool TokenSource::accepts(std::string_view presented) {
  std::lock_guard lock(mu_);
  maybe_reload();
  bool ok = constant_time_equal(presented, token_);
  const bool previous_valid = !previous_.empty() && std::chrono::steady_clock::now() < previous_until_;
  // Both comparisons always run: how long this takes says nothing about which one matched.
  const bool ok_previous = constant_time_equal(presented, previous_valid ? previous_ : token_);
  return ok || (previous_valid && ok_previous);
}

std::vector<std::string> TokenSource::accepted() {
  std::lock_guard lock(mu_);
  maybe_reload();
  std::vector<std::string> out{token_};
  if (!previous_.empty() && std::chrono::steady_clock::now() < previous_until_) out.push_back(previous_);
  return out;
}

}  // namespace rdmig
