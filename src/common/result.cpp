#include "common/result.h"

#include <cstring>

namespace rdmig {

const char* errc_name(Errc code) {
  switch (code) {
    case Errc::kInvalidArgument: return "invalid_argument";
    case Errc::kNotFound: return "not_found";
    case Errc::kAlreadyExists: return "already_exists";
    case Errc::kPermissionDenied: return "permission_denied";
    case Errc::kUnauthenticated: return "unauthenticated";
    case Errc::kFailedPrecondition: return "failed_precondition";
    case Errc::kResourceExhausted: return "resource_exhausted";
    case Errc::kUnprocessable: return "unprocessable";
    case Errc::kTimeout: return "timeout";
    case Errc::kCancelled: return "cancelled";
    case Errc::kUnavailable: return "unavailable";
    case Errc::kProtocol: return "protocol";
    case Errc::kIo: return "io";
    case Errc::kQemu: return "qemu";
    case Errc::kInternal: return "internal";
  }
  return "unknown";
}

Error errno_error(const std::string& what, int err) {
  char buf[256];
  const char* text = strerror_r(err, buf, sizeof buf);  // GNU variant returns the text
  return Error{Errc::kIo, what + ": " + text};
}

}  // namespace rdmig
