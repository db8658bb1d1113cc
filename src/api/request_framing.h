// How a request's body is delimited (RFC 9112 section 6), read by the REST front as soon as a
// request head is there, before any body is read and before a worker takes the request.
//
// A request whose framing is wrong or over the limit is refused at once (then the connection
// closes): the front never waits for a body that cannot be taken. What is refused:
//   - a head not ended within the head limit: 414 (the request line) or 431 (naming the header
//     line at the limit); a header line longer than kMaxHeaderLine: 431 naming it;
//   - a header line that is folded (obs-fold), has no ':' or a name that is not a token: 400;
//   - Content-Length given more than once (even with equal values), as a list, empty, or not
//     digits only (a sign, a space inside): 400; digits over the body limit, however many: 413;
//   - Content-Length together with Transfer-Encoding: 400;
//   - Transfer-Encoding other than exactly one `chunked` (another coding, `chunked` not last or
//     twice, empty): 400;
//   - in a chunked body (ChunkedBody): a chunk-size line that is not hex digits, longer than
//     kMaxChunkLine, or a size that takes the body past the limit (413, answered as soon as the
//     digits show it, not when the chunk would have arrived); chunk data not ended by CRLF.
// A request with neither header has no body (RFC 9112 section 6.3, rule 7): nothing after the
// head is read as one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

namespace rdmig::api {

inline constexpr size_t kMaxHeaderLine = 8 * 1024;  // one header line (httplib's own limit)
inline constexpr size_t kMaxChunkLine = 4 * 1024;   // one chunk-size or trailer line

// Why a request is refused before it is served: its HTTP status and a message naming the
// header (or the body's chunk) at fault.
struct FramingError {
  int status = 400;
  std::string message;
};

// The framing of a request whose head was accepted.
struct BodyFraming {
  enum class Kind { kNone, kLength, kChunked };
  Kind kind = Kind::kNone;
  uint64_t length = 0;    // kLength: the body's bytes
  size_t head_bytes = 0;  // the head's bytes, its final empty line included
};

// Where the head in `text` ends (after its empty line; CR optional before each LF), or npos
// when it has not ended yet. `from`: where the previous look stopped (bytes before it are not
// looked at again, but for the 2 that may begin the end).
size_t find_head_end(std::string_view text, size_t from = 0);

// Reads the framing headers of a whole head (`head` ends with its empty line). `max_body`: the
// largest body the server takes.
std::variant<BodyFraming, FramingError> check_request_head(std::string_view head, uint64_t max_body);

// The refusal for a head that has not ended within `limit` bytes (`partial`: those bytes).
FramingError head_too_large(std::string_view partial, size_t limit);

// Follows a chunked body as its bytes arrive (RFC 9112 section 7.1): chunk sizes, data, the
// CRLF after each, trailer lines, the final empty line. Refuses as soon as a byte shows the
// framing wrong or the body over `max_body`.
class ChunkedBody {
 public:
  explicit ChunkedBody(uint64_t max_body) : max_body_(max_body) {}

  // Scans `data`, the next bytes of the body. Returns how many of them belong to the body (all,
  // unless it ended inside `data`), or the refusal.
  std::variant<size_t, FramingError> feed(std::string_view data);
  bool done() const { return state_ == State::kDone; }
  uint64_t total() const { return total_; }  // chunk data announced so far

 private:
  enum class State { kSize, kExtension, kSizeLf, kData, kDataCr, kDataLf, kTrailer, kDone };
  std::optional<FramingError> size_digit(char c);
  std::optional<FramingError> line_byte();

  uint64_t max_body_;
  State state_ = State::kSize;
  uint64_t size_ = 0;      // the chunk size being read, then the data left of the chunk
  size_t digits_ = 0;      // hex digits of the size line so far
  size_t line_ = 0;        // bytes of the current size or trailer line
  uint64_t total_ = 0;
};

}  // namespace rdmig::api
