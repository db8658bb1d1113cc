#include "qemu/guest_ram.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <optional>

#include "common/fd.h"

namespace rdmig::qemu {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

std::optional<uint64_t> parse_u64(std::string_view s, int base) {
  uint64_t v = 0;
  const auto* end = s.data() + s.size();
  const auto r = std::from_chars(s.data(), end, v, base);
  if (r.ec != std::errc() || r.ptr != end || s.empty()) return std::nullopt;
  return v;
}

// "7f0a00000000-7f0a08000000 rw-p 00000000 00:00 0  [path]": the mapping's size, or nullopt when
// the line is not a mapping header (a field line: "Rss:   1234 kB").
std::optional<std::optional<uint64_t>> header_size(std::string_view line) {
  const auto sp = line.find(' ');
  const std::string_view range = line.substr(0, sp);
  const auto dash = range.find('-');
  if (dash == std::string_view::npos || range.find(':') != std::string_view::npos) return std::nullopt;
  const auto lo = parse_u64(range.substr(0, dash), 16), hi = parse_u64(range.substr(dash + 1), 16);
  if (!lo || !hi || *hi < *lo) return std::optional<uint64_t>{};  // a header that does not read
  return std::optional<uint64_t>{*hi - *lo};
}

// Takes the next line off `text` (without its newline).
std::string_view next_line(std::string_view& text) {
  const auto nl = text.find('\n');
  const std::string_view line = text.substr(0, nl);
  text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
  return line;
}

// The value of a "<key>:   1234 kB" line of a /proc file, in bytes; `where` names the file and line.
Result<uint64_t> kb_field(std::string_view line, std::string_view key, const std::string& where) {
  std::string_view v = trim(line.substr(key.size() + 1));
  if (v.size() < 3 || v.substr(v.size() - 3) != " kB") return Error{Errc::kProtocol, where + ": " + std::string(key) + " not in kB"};
  const auto kb = parse_u64(trim(v.substr(0, v.size() - 3)), 10);
  if (!kb || *kb > UINT64_MAX / 1024) return Error{Errc::kProtocol, where + ": " + std::string(key) + " does not read"};
  return *kb * 1024;
}

}  // namespace

Result<uint64_t> ram_resident_from_smaps(std::string_view smaps, uint64_t ram_size) {
  if (ram_size == 0) return Error{Errc::kInvalidArgument, "guest RAM size 0"};
  const uint64_t most = ram_size > UINT64_MAX - kRamMappingSlack ? UINT64_MAX : ram_size + kRamMappingSlack;
  std::optional<uint64_t> size;  // of the mapping whose fields follow
  uint64_t best_size = 0;
  std::optional<uint64_t> best_rss;
  size_t line_no = 0;
  while (!smaps.empty()) {
    const std::string_view line = next_line(smaps);
    ++line_no;
    if (line.empty()) continue;
    if (const auto h = header_size(line)) {
      if (!*h) return Error{Errc::kProtocol, "smaps line " + std::to_string(line_no) + ": a mapping's range does not read"};
      size = **h;
      continue;
    }
    if (line.rfind("Rss:", 0) != 0 || !size || *size < ram_size || *size > most) continue;
    auto rss = kb_field(line, "Rss", "smaps line " + std::to_string(line_no));
    if (!rss) return rss.error();
    if (!best_rss || *size > best_size) {
      best_size = *size;
      best_rss = rss.value();
    }
  }
  if (!best_rss) {
    return Error{Errc::kNotFound, "no mapping of the guest RAM's size (" + std::to_string(ram_size >> 20) + " MiB) in smaps"};
  }
  return std::min(*best_rss, ram_size);
}

Result<uint64_t> resident_from_status(std::string_view status) {
  uint64_t total = 0;
  int seen = 0;
  size_t line_no = 0;
  while (!status.empty()) {
    const std::string_view line = next_line(status);
    ++line_no;
    for (const std::string_view key : {std::string_view("RssAnon"), std::string_view("RssShmem")}) {
      if (line.rfind(key, 0) != 0 || line.size() <= key.size() || line[key.size()] != ':') continue;
      const std::string where = "status line " + std::to_string(line_no);
      auto bytes = kb_field(line, key, where);
      if (!bytes) return bytes.error();
      if (bytes.value() > UINT64_MAX - total) return Error{Errc::kProtocol, where + ": " + std::string(key) + " does not read"};
      total += bytes.value();
      ++seen;
    }
  }
  if (seen == 0) return Error{Errc::kNotFound, "no RssAnon or RssShmem in status"};
  return total;
}

namespace {
// The whole of a /proc file, at most kMaxSmapsBytes; the errno of a failed open or read.
Result<std::string> read_proc(const std::string& path, int& err) {
  err = 0;
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    err = errno;
    return Error{Errc::kUnavailable, path + ": " + std::strerror(err)};
  }
  std::string text;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      err = errno;
      return Error{Errc::kUnavailable, path + ": " + std::strerror(err)};
    }
    if (n == 0) break;
    if (text.size() + static_cast<size_t>(n) > kMaxSmapsBytes) {
      return Error{Errc::kResourceExhausted, path + ": larger than " + std::to_string(kMaxSmapsBytes >> 20) + " MiB"};
    }
    text.append(buf, static_cast<size_t>(n));
  }
  return text;
}
}  // namespace

Result<GuestRam> guest_ram(QmpClient& qmp) {
  auto summary = qmp.execute("query-memory-size-summary", {}, std::chrono::seconds(5));
  if (!summary) return summary.error().with_context("query-memory-size-summary");
  const auto base = summary->is_object() ? summary->find("base-memory") : summary->end();
  if (!summary->is_object() || base == summary->end() || !base->is_number_unsigned() || base->get<uint64_t>() == 0) {
    return Error{Errc::kProtocol, "query-memory-size-summary: no base-memory"};
  }
  GuestRam ram;
  ram.size = base->get<uint64_t>();
  const int pid = qmp.peer_pid();
  if (pid <= 0) return Error{Errc::kUnavailable, "QEMU's pid is unknown (no peer credentials on its QMP socket)"};
  const std::string proc = "/proc/" + std::to_string(pid);
  int err = 0;
  auto smaps = read_proc(proc + "/smaps", err);
  if (smaps) {
    auto resident = ram_resident_from_smaps(smaps.value(), ram.size);
    if (!resident) return resident.error().with_context(proc + "/smaps");
    ram.resident = resident.value();
    ram.source = "smaps";
    return ram;
  }
  if (err != EACCES && err != EPERM) return smaps.error();
  // Not allowed to read QEMU's smaps (the kernel's ptrace rule): its status is readable by all.
  auto status = read_proc(proc + "/status", err);
  if (!status) return status.error();
  auto resident = resident_from_status(status.value());
  if (!resident) return resident.error().with_context(proc + "/status");
  ram.resident = std::min(resident.value(), ram.size);
  ram.source = "status";
  return ram;
}

}  // namespace rdmig::qemu
