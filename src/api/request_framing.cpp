#include "api/request_framing.h"

#include <algorithm>
#include <vector>

namespace rdmig::api {

namespace {

bool is_ows(char c) { return c == ' ' || c == '\t'; }

std::string_view trim_ows(std::string_view v) {
  while (!v.empty() && is_ows(v.front())) v.remove_prefix(1);
  while (!v.empty() && is_ows(v.back())) v.remove_suffix(1);
  return v;
}

char lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

// RFC 9110 section 5.6.2: tchar.
bool is_tchar(char c) {
  if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return true;
  for (const char t : std::string_view("!#$%&'*+-.^_`|~")) {
    if (c == t) return true;
  }
  return false;
}

bool is_token(std::string_view s) {
  if (s.empty()) return false;
  for (const char c : s) {
    if (!is_tchar(c)) return false;
  }
  return true;
}

// Text from the request as a message may quote it: printable ASCII, at most 40 bytes.
std::string shown(std::string_view v) {
  std::string out;
  for (const char c : v.substr(0, 40)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  if (v.size() > 40) out += "...";
  return out;
}

std::string over_limit(uint64_t max_body) {
  return "larger than api.maxBodyBytes (" + std::to_string(max_body) + " bytes)";
}

// The head's lines after the request line, each without its LF (and CR), up to the empty line.
// `complete`: the last line was ended by an LF.
struct Line {
  std::string_view text;
  bool complete;
};
std::vector<Line> header_lines(std::string_view head) {
  std::vector<Line> lines;
  size_t pos = head.find('\n');
  if (pos == std::string_view::npos) return lines;
  ++pos;
  while (pos < head.size()) {
    const size_t nl = head.find('\n', pos);
    std::string_view line = head.substr(pos, nl == std::string_view::npos ? std::string_view::npos : nl - pos);
    if (nl != std::string_view::npos && !line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (nl != std::string_view::npos && line.empty()) break;  // the empty line: the end
    lines.push_back({line, nl != std::string_view::npos});
    if (nl == std::string_view::npos) break;
    pos = nl + 1;
  }
  return lines;
}

// The name a message gives a header line: "header 'Name'" when it has a token before ':'.
std::string line_name(std::string_view line) {
  const size_t colon = line.find(':');
  if (colon == std::string_view::npos) return "request head";
  const std::string_view name = trim_ows(line.substr(0, colon));
  return is_token(name) ? "header '" + std::string(name) + "'" : "request head";
}

}  // namespace

size_t find_head_end(std::string_view text, size_t from) {
  for (size_t i = from > 2 ? from - 2 : 0; i < text.size(); ++i) {
    if (text[i] != '\n') continue;
    size_t j = i + 1;
    if (j < text.size() && text[j] == '\r') ++j;
    if (j < text.size() && text[j] == '\n') return j + 1;
  }
  return std::string_view::npos;
}

std::variant<BodyFraming, FramingError> check_request_head(std::string_view head, uint64_t max_body) {
  std::vector<std::string_view> lengths;  // Content-Length values, one per field line
  std::vector<std::string_view> codings;  // Transfer-Encoding list elements, all field lines
  std::string_view previous;              // the header line before (for a folded one)
  bool transfer_encoding = false;
  for (const auto& [line, complete] : header_lines(head)) {
    (void)complete;
    if (line.size() > kMaxHeaderLine) {
      return FramingError{431, line_name(line) + ": line longer than " + std::to_string(kMaxHeaderLine) + " bytes"};
    }
    if (is_ows(line.front())) {
      return FramingError{400, previous.empty() ? std::string("request head: whitespace before the first header")
                                                : line_name(previous) + ": a folded line (obs-fold) is not accepted"};
    }
    previous = line;
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos) return FramingError{400, "request head: a header line without ':'"};
    const std::string_view name = line.substr(0, colon);
    if (!is_token(name)) {
      if (is_token(trim_ows(name))) {
        return FramingError{400, "header '" + std::string(trim_ows(name)) + "': whitespace before ':'"};
      }
      return FramingError{400, "request head: header name '" + shown(name) + "' is not a token"};
    }
    const std::string_view value = trim_ows(line.substr(colon + 1));
    if (iequals(name, "Content-Length")) {
      lengths.push_back(value);
    } else if (iequals(name, "Transfer-Encoding")) {
      transfer_encoding = true;
      for (size_t pos = 0; pos <= value.size();) {
        const size_t comma = value.find(',', pos);
        const std::string_view item =
            trim_ows(value.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos));
        if (!item.empty()) codings.push_back(item);
        if (comma == std::string_view::npos) break;
        pos = comma + 1;
      }
    }
  }

  BodyFraming framing;
  framing.head_bytes = head.size();
  if (transfer_encoding) {
    if (!lengths.empty()) {
      return FramingError{400, "header 'Content-Length': not allowed together with Transfer-Encoding"};
    }
    if (codings.size() != 1 || !iequals(codings.front(), "chunked")) {
      std::string all;
      for (const auto& c : codings) all += (all.empty() ? "" : ", ") + std::string(c);
      return FramingError{400, "header 'Transfer-Encoding': '" + shown(all) + "' is not accepted (only 'chunked', once)"};
    }
    framing.kind = BodyFraming::Kind::kChunked;
    return framing;
  }
  if (lengths.empty()) return framing;  // no body
  if (lengths.size() > 1) return FramingError{400, "header 'Content-Length': given more than once"};
  const std::string_view v = lengths.front();
  if (v.empty()) return FramingError{400, "header 'Content-Length': empty"};
  for (const char c : v) {
    if (c < '0' || c > '9') {
      return FramingError{400, "header 'Content-Length': '" + shown(v) + "' is not a length (digits only, one value)"};
    }
  }
  // Digits only: a length, however many there are (RFC 9110 section 8.6); too large is 413.
  uint64_t n = 0;
  bool over = false;
  for (const char c : v) {
    const auto d = static_cast<uint64_t>(c - '0');
    if (n > (max_body - d) / 10) {
      over = true;
      break;
    }
    n = n * 10 + d;
  }
  if (over || n > max_body) {
    return FramingError{413, "header 'Content-Length': " + shown(v) + " bytes is " + over_limit(max_body)};
  }
  framing.kind = BodyFraming::Kind::kLength;
  framing.length = n;
  return framing;
}

FramingError head_too_large(std::string_view partial, size_t limit) {
  const std::string too_large = "request head larger than " + std::to_string(limit) + " bytes";
  if (partial.find('\n') == std::string_view::npos) {
    return FramingError{414, "request line: longer than " + std::to_string(limit) + " bytes"};
  }
  const auto lines = header_lines(partial);
  for (const auto& [line, complete] : lines) {
    if (complete && line.size() > kMaxHeaderLine) {
      return FramingError{431, line_name(line) + ": line longer than " + std::to_string(kMaxHeaderLine) + " bytes"};
    }
  }
  if (lines.empty()) return FramingError{431, too_large};
  return FramingError{431, line_name(lines.back().text) + ": " + too_large};
}

std::optional<FramingError> ChunkedBody::line_byte() {
  if (++line_ > kMaxChunkLine) {
    return FramingError{400, "body (chunked): a chunk-size or trailer line longer than " +
                                 std::to_string(kMaxChunkLine) + " bytes"};
  }
  return std::nullopt;
}

std::optional<FramingError> ChunkedBody::size_digit(char c) {
  uint64_t d = 0;
  if (c >= '0' && c <= '9') {
    d = static_cast<uint64_t>(c - '0');
  } else if (c >= 'a' && c <= 'f') {
    d = static_cast<uint64_t>(c - 'a' + 10);
  } else if (c >= 'A' && c <= 'F') {
    d = static_cast<uint64_t>(c - 'A' + 10);
  } else {
    return FramingError{400, "body (chunked): chunk size is not hexadecimal (byte '" + shown(std::string_view(&c, 1)) + "')"};
  }
  ++digits_;
  // The chunk would take the body past the limit: refused now, before its data.
  const uint64_t room = max_body_ - total_;
  if (size_ > (room - d) / 16 || size_ * 16 + d > room) {
    return FramingError{413, "body (chunked): " + over_limit(max_body_)};
  }
  size_ = size_ * 16 + d;
  return std::nullopt;
}

std::variant<size_t, FramingError> ChunkedBody::feed(std::string_view data) {
  size_t i = 0;
  auto end_size_line = [&] {
    line_ = 0;
    digits_ = 0;
    total_ += size_;
    state_ = size_ == 0 ? State::kTrailer : State::kData;
  };
  while (i < data.size() && state_ != State::kDone) {
    const char c = data[i];
    switch (state_) {
      case State::kData: {
        const auto take = static_cast<size_t>(std::min<uint64_t>(size_, data.size() - i));
        size_ -= take;
        i += take;
        if (size_ == 0) state_ = State::kDataCr;
        continue;
      }
      case State::kSize:
        if (auto e = line_byte()) return *e;
        if (c == '\r' || c == '\n' || c == ';' || is_ows(c)) {
          if (digits_ == 0) return FramingError{400, "body (chunked): a chunk-size line without a size"};
          state_ = c == '\r' ? State::kSizeLf : State::kExtension;
          if (c == '\n') end_size_line();
        } else if (auto e = size_digit(c)) {
          return *e;
        }
        break;
      case State::kExtension:
        if (auto e = line_byte()) return *e;
        if (c == '\r') state_ = State::kSizeLf;
        if (c == '\n') end_size_line();
        break;
      case State::kSizeLf:
        if (c != '\n') return FramingError{400, "body (chunked): CR not followed by LF in a chunk-size line"};
        end_size_line();
        break;
      case State::kDataCr:
      case State::kDataLf:
        if (c != (state_ == State::kDataCr ? '\r' : '\n')) {
          return FramingError{400, "body (chunked): chunk data longer than its size (no CRLF after it)"};
        }
        state_ = state_ == State::kDataCr ? State::kDataLf : State::kSize;
        break;
      case State::kTrailer:
        if (c == '\n') {
          if (line_ == 0) state_ = State::kDone;
          line_ = 0;
        } else if (c != '\r') {
          if (auto e = line_byte()) return *e;
        }
        break;
      case State::kDone:
        break;
    }
    ++i;
  }
  return i;
}

}  // namespace rdmig::api
