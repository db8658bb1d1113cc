// The one error type of rdmig and the Result<T> that carries a value or an Error.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace rdmig {

// What kind of failure. Kinds are coarse on purpose: they select HTTP statuses, metric
// labels and retry decisions; the message carries the detail a person needs.
enum class Errc {
  kInvalidArgument,   // bad input from outside: names the field
  kNotFound,
  kAlreadyExists,
  kPermissionDenied,  // wrong token
  kUnauthenticated,   // no token
  kFailedPrecondition,
  kResourceExhausted,  // too many migrations at once, or buffers in use by others: retry later
  kUnprocessable,      // a valid request this agent can never run as asked (e.g. over its buffer budget)
  kTimeout,
  kCancelled,
  kUnavailable,       // peer gone, connection refused, device missing
  kProtocol,          // peer spoke something we do not understand
  kIo,                // syscall failure; message carries errno text
  kQemu,              // QEMU answered with an error
  kInternal,
};

const char* errc_name(Errc code);

struct Error {
  Errc code = Errc::kInternal;
  std::string message;

  // Prefixes context ("connecting to 10.0.0.2:7471: ") so errors read outermost-first.
  Error with_context(const std::string& context) const {
    return Error{code, context + ": " + message};
  }
  std::string to_string() const { return std::string(errc_name(code)) + ": " + message; }
};

// Builds an Error from errno for syscall failures: "<what>: <strerror>".
Error errno_error(const std::string& what, int err);

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Error error) : v_(std::move(error)) {}  // NOLINT(google-explicit-constructor)

  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }

  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }

  const Error& error() const { return std::get<1>(v_); }

 private:
  std::variant<T, Error> v_;
};

template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Error error) : error_(std::move(error)), ok_(false) {}  // NOLINT

  bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const Error& error() const { return error_; }

 private:
  Error error_;
  bool ok_ = true;
};

using Status = Result<void>;

inline Status ok_status() { return Status{}; }

}  // namespace rdmig

// Propagates an error from an expression returning Result/Status.
#define RDMIG_TRY(expr)                                   \
  do {                                                    \
    auto&& rdmig_try_result_ = (expr);                    \
    if (!rdmig_try_result_.ok()) return rdmig_try_result_.error(); \
  } while (0)
