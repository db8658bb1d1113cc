#include "kubevirt/intercept/netns.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/netfilter_ipv4.h>
#include <linux/netfilter_ipv6/ip6_tables.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "common/text.h"

namespace rdmig::kubevirt {

Result<NetNs> NetNs::of_pid(pid_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/ns/net";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno_error("open " + path, errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return errno_error("stat " + path, e);
  }
  return NetNs(UniqueFd(fd), static_cast<uint64_t>(st.st_ino), pid);
}

std::string NetNs::describe() const {
  return "netns:[" + std::to_string(inode_) + "] of pid " + std::to_string(pid_);
}

Status NetNs::run(const std::function<Status()>& fn) const {
  Status result = ok_status();
  std::thread t([&] {
    if (::setns(fd_.get(), CLONE_NEWNET) != 0) {
      result = errno_error("setns into " + describe(), errno);
      return;
    }
    result = fn();
  });
  t.join();
  return result;
}

Result<UniqueFd> NetNs::make_socket(const std::function<Result<UniqueFd>()>& fn) const {
  Result<UniqueFd> out = Error{Errc::kInternal, "not run"};
  auto st = run([&]() -> Status {
    out = fn();
    return ok_status();
  });
  if (!st) return st.error();
  return out;
}

uint64_t netns_inode(pid_t pid) {
  struct stat st {};
  const std::string path = "/proc/" + std::to_string(pid) + "/ns/net";
  if (::stat(path.c_str(), &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

namespace {
template <typename Fn>
void for_each_pid(Fn fn) {
  DIR* d = ::opendir("/proc");
  if (!d) return;
  while (dirent* e = ::readdir(d)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (pid <= 0 || *end != '\0') continue;
    fn(static_cast<pid_t>(pid));
  }
  ::closedir(d);
}

std::string read_small(const std::string& path, size_t limit = 64 * 1024) {
  std::ifstream in(path, std::ios::binary);
  std::string s;
  s.resize(limit);
  in.read(s.data(), static_cast<std::streamsize>(limit));
  s.resize(static_cast<size_t>(in.gcount()));
  return s;
}
}  // namespace

std::vector<pid_t> processes_named(const std::string& comm) {
  std::vector<pid_t> out;
  for_each_pid([&](pid_t pid) {
    if (trim(read_small("/proc/" + std::to_string(pid) + "/comm", 64)) == comm) out.push_back(pid);
  });
  return out;
}

std::vector<pid_t> processes_with_arg(const std::string& program, const std::string& flag, const std::string& value) {
  std::vector<pid_t> out;
  for_each_pid([&](pid_t pid) {
    const std::string raw = read_small("/proc/" + std::to_string(pid) + "/cmdline");
    std::vector<std::string> args;
    std::stringstream ss(raw);
    for (std::string a; std::getline(ss, a, '\0');) args.push_back(a);
    bool named = false, flagged = false;
    for (size_t i = 0; i < args.size(); ++i) {
      const auto slash = args[i].rfind('/');
      const std::string base = slash == std::string::npos ? args[i] : args[i].substr(slash + 1);
      if (base.rfind(program, 0) == 0 && i < 2) named = true;
      if (args[i] == flag && i + 1 < args.size() && args[i + 1] == value) flagged = true;
    }
    if (named && flagged) out.push_back(pid);
  });
  return out;
}

Result<std::string> path_in_process_root(pid_t pid, const std::string& path) {
  const std::string root = "/proc/" + std::to_string(pid) + "/root";
  std::vector<std::string> todo;  // components still to walk, last first
  auto push_path = [&](const std::string& p) {
    std::vector<std::string> parts;
    std::stringstream ss(p);
    for (std::string c; std::getline(ss, c, '/');) {
      if (!c.empty() && c != ".") parts.push_back(c);
    }
    for (auto it = parts.rbegin(); it != parts.rend(); ++it) todo.push_back(*it);
  };
  push_path(path);
  std::vector<std::string> done;  // resolved components under the root
  for (int hops = 0; !todo.empty();) {
    const std::string c = todo.back();
    todo.pop_back();
    if (c == "..") {
      if (!done.empty()) done.pop_back();
      continue;
    }
    std::string here = root;
    for (const auto& d : done) here += "/" + d;
    here += "/" + c;
    char target[4096];
    const ssize_t n = ::readlink(here.c_str(), target, sizeof target - 1);
    if (n < 0) {
      done.push_back(c);  // not a link (or absent: stat decides later)
      continue;
    }
    if (++hops > 40) return Error{Errc::kInvalidArgument, "too many symbolic links in " + path};
    const std::string t(target, static_cast<size_t>(n));
    if (!t.empty() && t.front() == '/') done.clear();
    push_path(t);
  }
  std::string out = root;
  for (const auto& d : done) out += "/" + d;
  return out;
}

namespace {
// Inodes of the TCP sockets listening on `port` in the network namespace of `pid`.
std::set<uint64_t> listening_inodes(pid_t pid, uint16_t port) {
  std::set<uint64_t> out;
  for (const char* table : {"tcp", "tcp6"}) {
    std::ifstream f("/proc/" + std::to_string(pid) + "/net/" + table);
    std::string line;
    std::getline(f, line);  // header
    while (std::getline(f, line)) {
      // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
      std::istringstream in(line);
      std::string sl, local, remote, st, txrx, trwhen, retr, uid, timeout;
      uint64_t inode = 0;
      if (!(in >> sl >> local >> remote >> st >> txrx >> trwhen >> retr >> uid >> timeout >> inode)) continue;
      const auto colon = local.rfind(':');
      if (st != "0A" || colon == std::string::npos) continue;  // 0A: TCP_LISTEN
      unsigned long p = 0;
      try {
        p = std::stoul(local.substr(colon + 1), nullptr, 16);
      } catch (...) {
        continue;
      }
      if (p == port && inode != 0) out.insert(inode);
    }
  }
  return out;
}
}  // namespace

bool listens_on(const std::vector<pid_t>& pids, const NetNs& ns, uint16_t port) {
  for (pid_t pid : pids) {
    if (netns_inode(pid) != ns.inode()) continue;
    const auto inodes = listening_inodes(pid, port);
    if (inodes.empty()) continue;
    std::error_code ec;
    for (const auto& fd : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
      std::error_code lec;
      const std::string target = std::filesystem::read_symlink(fd.path(), lec).string();
      if (lec || target.rfind("socket:[", 0) != 0) continue;
      uint64_t inode = 0;
      try {
        inode = std::stoull(target.substr(8));
      } catch (...) {
        continue;
      }
      if (inodes.contains(inode)) return true;
    }
  }
  return false;
}

bool address_is_local(const NetNs& ns, const std::string& ip) {
  bool local = false;
  (void)ns.run([&]() -> Status {
    sockaddr_storage ss{};
    socklen_t len = 0;
    int family = AF_INET;
    if (auto* a4 = reinterpret_cast<sockaddr_in*>(&ss); ::inet_pton(AF_INET, ip.c_str(), &a4->sin_addr) == 1) {
      a4->sin_family = AF_INET;
      len = sizeof(sockaddr_in);
    } else if (auto* a6 = reinterpret_cast<sockaddr_in6*>(&ss); ::inet_pton(AF_INET6, ip.c_str(), &a6->sin6_addr) == 1) {
      a6->sin6_family = AF_INET6;
      family = AF_INET6;
      len = sizeof(sockaddr_in6);
    } else {
      return ok_status();
    }
    UniqueFd fd(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd.valid()) return ok_status();
    local = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) == 0;
    return ok_status();
  });
  return local;
}

Result<net::Endpoint> original_destination(int fd) {
  sockaddr_storage local{};
  socklen_t len = sizeof local;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) return errno_error("getsockname", errno);
  char text[INET6_ADDRSTRLEN] = {};
  if (local.ss_family == AF_INET6) {
    sockaddr_in6 dst{};
    socklen_t dl = sizeof dst;
    if (::getsockopt(fd, SOL_IPV6, IP6T_SO_ORIGINAL_DST, &dst, &dl) != 0) {
      return errno_error("getsockopt(IP6T_SO_ORIGINAL_DST)", errno);
    }
    if (IN6_IS_ADDR_V4MAPPED(&dst.sin6_addr)) {
      ::inet_ntop(AF_INET, &dst.sin6_addr.s6_addr[12], text, sizeof text);
    } else {
      ::inet_ntop(AF_INET6, &dst.sin6_addr, text, sizeof text);
    }
    return net::Endpoint{text, ntohs(dst.sin6_port)};
  }
  sockaddr_in dst{};
  socklen_t dl = sizeof dst;
  if (::getsockopt(fd, SOL_IP, SO_ORIGINAL_DST, &dst, &dl) != 0) {
    return errno_error("getsockopt(SO_ORIGINAL_DST)", errno);
  }
  ::inet_ntop(AF_INET, &dst.sin_addr, text, sizeof text);
  return net::Endpoint{text, ntohs(dst.sin_port)};
}

void arm_reset(int fd) {
  linger l{1, 0};
  (void)::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
}

Status set_pass_mark(int fd, PassMark pass) {
  const uint32_t mark = pass.value;
  if (::setsockopt(fd, SOL_SOCKET, SO_MARK, &mark, sizeof mark) != 0) return errno_error("setsockopt(SO_MARK)", errno);
  return ok_status();
}

}  // namespace rdmig::kubevirt
