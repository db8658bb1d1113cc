#include "kubevirt/flow/libvirt_stats.h"

#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>

#include "common/fd.h"
#include "kubevirt/intercept/netns.h"

namespace rdmig::kubevirt {

using namespace std::chrono_literals;

namespace {
void quiet(void*, virErrorPtr) {}

// KubeVirt's name of a VMI's domain.
std::string domain_of(const VmiRef& vmi) { return vmi.namespace_ + "_" + vmi.name; }

// Why nothing was asked: no launcher daemon of `vmi` here (`refused`: the last process that named
// the VMI but was not in its launcher pod, if any).
std::string no_launcher(const KubevirtConfig& config, const VmiRef& vmi, const std::string& refused = "") {
  return "no " + config.launcher_program + " process with --uid " + vmi.uid + " and a libvirt socket" +
         (refused.empty() ? "" : " (" + refused + ")");
}

// The source domain's state once its migration switched to post-copy: paused for it, or paused
// because post-copy failed (both QEMUs postcopy-paused). nullptr for any other state.
const char* postcopy_state(int state, int reason) {
  if (state != VIR_DOMAIN_PAUSED) return nullptr;
  if (reason == VIR_DOMAIN_PAUSED_POSTCOPY) return "paused, post-copy";
  if (reason == VIR_DOMAIN_PAUSED_POSTCOPY_FAILED) return "paused, post-copy failed";
  return nullptr;
}

std::string last_error() {
  virErrorPtr e = virGetLastError();
  return e && e->message ? e->message : "unknown libvirt error";
}

struct ConnCloser {
  void operator()(virConnectPtr c) const { virConnectClose(c); }
};
struct DomFree {
  void operator()(virDomainPtr d) const { virDomainFree(d); }
};

using Conn = std::unique_ptr<virConnect, ConnCloser>;

// A connection to the launcher's daemon in the mode it runs in: a non-root launcher's daemon
// refuses /system, a root one /session.
Result<Conn> open_daemon(const std::string& socket) {
  auto uid = daemon_uid(socket);
  if (!uid) return uid.error().with_context("libvirt at " + socket);
  const std::string uri = libvirt_uri(socket, uid.value() == 0);
  Conn conn(virConnectOpen(uri.c_str()));
  if (!conn) return Error{Errc::kUnavailable, "libvirt at " + uri + ": " + last_error()};
  return conn;
}

// libvirt's figures of a completed job (virDomainGetJobStats' typed parameters).
LibvirtJobStats completed_job(virTypedParameterPtr params, int n, const std::string& domain) {
  LibvirtJobStats s;
  s.domain = domain;
  unsigned long long v = 0;
  if (virTypedParamsGetULLong(params, n, VIR_DOMAIN_JOB_DOWNTIME, &v) == 1) s.downtime_ms = static_cast<int64_t>(v);
  if (virTypedParamsGetULLong(params, n, VIR_DOMAIN_JOB_TIME_ELAPSED, &v) == 1) s.total_time_ms = static_cast<int64_t>(v);
  if (virTypedParamsGetULLong(params, n, VIR_DOMAIN_JOB_DATA_TOTAL, &v) == 1) s.data_total_bytes = v;
  if (virTypedParamsGetULLong(params, n, VIR_DOMAIN_JOB_MEMORY_POSTCOPY_REQS, &v) == 1) {
    s.postcopy_requests = static_cast<int64_t>(std::min<unsigned long long>(v, INT64_MAX));
  }
  return s;
}

// One attempt on one daemon: the stats when the domain runs here and its job is complete;
// `runs` tells whether the daemon answered with the domain active.
Result<std::optional<LibvirtJobStats>> try_daemon(const std::string& socket, const std::string& domain, bool& runs) {
  runs = false;
  auto opened = open_daemon(socket);
  if (!opened) return opened.error();
  Conn conn = std::move(opened.value());
  std::unique_ptr<virDomain, DomFree> dom(virDomainLookupByName(conn.get(), domain.c_str()));
  if (!dom) return std::optional<LibvirtJobStats>();
  if (virDomainIsActive(dom.get()) != 1) return std::optional<LibvirtJobStats>();  // the source's, after the move
  runs = true;
  int type = 0;
  virTypedParameterPtr params = nullptr;
  int n = 0;
  if (virDomainGetJobStats(dom.get(), &type, &params, &n,
                           VIR_DOMAIN_JOB_STATS_COMPLETED | VIR_DOMAIN_JOB_STATS_KEEP_COMPLETED) != 0) {
    return Error{Errc::kUnavailable, "virDomainGetJobStats: " + last_error()};
  }
  std::optional<LibvirtJobStats> out;
  if (type == VIR_DOMAIN_JOB_COMPLETED) out = completed_job(params, n, domain);
  virTypedParamsFree(params, n);
  return out;
}
}  // namespace

std::string libvirt_uri(const std::string& socket, bool privileged) {
  // The path is a query value: everything but unreserved characters and '/' is
  // percent-encoded, so '&', '#', '?', '%' or a space in it can never add or cut a parameter.
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string escaped;
  for (unsigned char c : socket) {
    if (std::isalnum(c) || c == '/' || c == '-' || c == '.' || c == '_' || c == '~') {
      escaped += static_cast<char>(c);
    } else {
      escaped += '%';
      escaped += kHex[c >> 4];
      escaped += kHex[c & 15];
    }
  }
  return std::string("qemu+unix:///") + (privileged ? "system" : "session") + "?socket=" + escaped;
}

Result<uid_t> daemon_uid(const std::string& socket) {
  sockaddr_un addr{};
  if (socket.size() >= sizeof addr.sun_path) {
    return Error{Errc::kInvalidArgument, "socket path longer than " + std::to_string(sizeof addr.sun_path - 1) + " bytes"};
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, socket.data(), socket.size());
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return errno_error("socket(AF_UNIX)", errno);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    return errno_error("connect", errno);
  }
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return errno_error("SO_PEERCRED", errno);
  return cred.uid;
}

namespace {
// Calls fn(socket path) for each libvirt socket of each launcher of `vmi` on this node; the
// processes that name the VMI but are not in its launcher pod are skipped, the last reason in
// `refused`.
template <typename Fn>
void for_each_daemon(const KubevirtConfig& config, const LauncherIdentity& launchers, const VmiRef& vmi,
                     std::string& refused, Fn fn) {
  for (pid_t pid : processes_with_arg(config.launcher_program, "--uid", vmi.uid)) {
    if (auto why = launchers.refuse(pid, vmi.namespace_, vmi.uid)) {
      refused = *why;
      continue;
    }
    for (const auto& sock : config.libvirt_sockets) {
      auto path = path_in_process_root(pid, sock);
      struct stat st {};
      if (path && ::stat(path->c_str(), &st) == 0) fn(path.value());
    }
  }
}
}  // namespace

std::string qemu_version_string(unsigned long version) {
  return std::to_string(version / 1000000) + "." + std::to_string(version / 1000 % 1000) + "." +
         std::to_string(version % 1000);
}

Result<unsigned long> launcher_qemu_version(const KubevirtConfig& config, const LauncherIdentity& launchers,
                                            const VmiRef& vmi) {
  virSetErrorFunc(nullptr, quiet);
  std::optional<unsigned long> version;
  std::string refused;
  std::string why;
  for_each_daemon(config, launchers, vmi, refused, [&](const std::string& path) {
    if (version) return;
    auto opened = open_daemon(path);
    if (!opened) {
      why = opened.error().message;
      return;
    }
    unsigned long v = 0;
    if (virConnectGetVersion(opened.value().get(), &v) != 0 || v == 0) {
      why = "virConnectGetVersion via " + path + ": " + last_error();
      return;
    }
    version = v;
  });
  if (version) return *version;
  if (why.empty()) why = no_launcher(config, vmi, refused);
  return Error{Errc::kNotFound, why};
}

Result<std::string> abort_outgoing_job(const KubevirtConfig& config, const LauncherIdentity& launchers,
                                       const VmiRef& vmi, int64_t armed_at_ms, int64_t failed_at_ms) {
  virSetErrorFunc(nullptr, quiet);
  const std::string domain = domain_of(vmi);
  std::string done;
  std::string refused;
  for_each_daemon(config, launchers, vmi, refused, [&](const std::string& path) {
    auto opened = open_daemon(path);
    if (!opened) {
      done += (done.empty() ? "" : "; ") + opened.error().message;
      return;
    }
    Conn conn = std::move(opened.value());
    std::unique_ptr<virDomain, DomFree> dom(virDomainLookupByName(conn.get(), domain.c_str()));
    if (!dom || virDomainIsActive(dom.get()) != 1) return;
    // On a node the launcher of the VMI is the source (or, when it is being migrated to this
    // node, the target, whose incoming job libvirt refuses to abort: harmless).
    // After the switch to post-copy the guest runs on the target: libvirt refuses a plain abort
    // then, and the flag that forces one (VIR_DOMAIN_ABORT_JOB_POSTCOPY) would pause the
    // migration, never bring the VM back. rdmig does neither.
    int state = 0;
    int reason = 0;
    if (virDomainGetState(dom.get(), &state, &reason, 0) == 0 && postcopy_state(state, reason)) {
      done += (done.empty() ? "" : "; ") + std::string("the migration of ") + domain + " had switched to post-copy (" +
              postcopy_state(state, reason) + "): not aborted (the guest runs on the target; KubeVirt has no post-copy "
              "recovery)";
      return;
    }
    virDomainJobInfo info{};
    if (virDomainGetJobInfo(dom.get(), &info) != 0 || info.type == VIR_DOMAIN_JOB_NONE) return;
    const int64_t job_started_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count() -
        static_cast<int64_t>(info.timeElapsed);
    // 500 ms of slack for reading the two clocks (libvirt's elapsed time and ours).
    if (job_started_ms > failed_at_ms + 500) {
      done += (done.empty() ? "" : "; ") + std::string("a newer job of ") + domain + " runs (started " +
              std::to_string(job_started_ms - failed_at_ms) + " ms after the failure): not aborted";
      return;
    }
    if (job_started_ms < armed_at_ms - 500) {
      done += (done.empty() ? "" : "; ") + std::string("the job of ") + domain + " started " +
              std::to_string(armed_at_ms - job_started_ms) + " ms before the session was armed: not ours, not aborted";
      return;
    }
    if (virDomainAbortJob(dom.get()) == 0) {
      done += (done.empty() ? "" : "; ") + std::string("aborted the migration job of ") + domain + " via " + path;
    } else {
      done += (done.empty() ? "" : "; ") + std::string("abort of ") + domain + " via " + path + ": " + last_error();
    }
  });
  if (done.empty()) {
    return Error{Errc::kNotFound, "no migration job of " + domain + " to abort on this node" +
                                      (refused.empty() ? "" : " (" + refused + ")")};
  }
  return done;
}

Result<bool> outgoing_switched_to_postcopy(const KubevirtConfig& config, const LauncherIdentity& launchers,
                                           const VmiRef& vmi) {
  virSetErrorFunc(nullptr, quiet);
  const std::string domain = domain_of(vmi);
  std::optional<bool> switched;
  std::string refused;
  std::string why;
  for_each_daemon(config, launchers, vmi, refused, [&](const std::string& path) {
    if (switched && *switched) return;
    auto opened = open_daemon(path);
    if (!opened) {
      why = opened.error().message;
      return;
    }
    std::unique_ptr<virDomain, DomFree> dom(virDomainLookupByName(opened.value().get(), domain.c_str()));
    if (!dom) {
      why = "domain " + domain + " is not defined in " + path;
      return;
    }
    int state = 0;
    int reason = 0;
    if (virDomainGetState(dom.get(), &state, &reason, 0) != 0) {
      why = "virDomainGetState via " + path + ": " + last_error();
      return;
    }
    switched = postcopy_state(state, reason) != nullptr;
  });
  if (switched) return *switched;
  if (why.empty()) why = no_launcher(config, vmi, refused);
  return Error{Errc::kNotFound, why};
}

Result<LibvirtJobStats> read_outgoing_completed_job(const KubevirtConfig& config, const LauncherIdentity& launchers,
                                                    const VmiRef& vmi) {
  virSetErrorFunc(nullptr, quiet);
  const std::string domain = domain_of(vmi);
  std::optional<LibvirtJobStats> found;
  std::string refused;
  std::string why = no_launcher(config, vmi);
  for_each_daemon(config, launchers, vmi, refused, [&](const std::string& path) {
    if (found) return;
    auto opened = open_daemon(path);
    if (!opened) {
      why = opened.error().message;
      return;
    }
    std::unique_ptr<virDomain, DomFree> dom(virDomainLookupByName(opened.value().get(), domain.c_str()));
    // The source's domain after the move: defined, no longer running (a running one is the target's).
    if (!dom || virDomainIsActive(dom.get()) != 0) return;
    int type = 0;
    virTypedParameterPtr params = nullptr;
    int n = 0;
    if (virDomainGetJobStats(dom.get(), &type, &params, &n,
                             VIR_DOMAIN_JOB_STATS_COMPLETED | VIR_DOMAIN_JOB_STATS_KEEP_COMPLETED) != 0) {
      why = "virDomainGetJobStats via " + path + ": " + last_error();
      return;
    }
    if (type == VIR_DOMAIN_JOB_COMPLETED) {
      found = completed_job(params, n, domain);
    } else {
      why = "domain " + domain + " has no completed migration job in " + path;
    }
    virTypedParamsFree(params, n);
  });
  if (found) return *found;
  return Error{Errc::kNotFound, why + (refused.empty() ? "" : " (" + refused + ")")};
}

bool launcher_present(const KubevirtConfig& config, const LauncherIdentity& launchers, const VmiRef& vmi) {
  std::string refused;
  bool found = false;
  for_each_daemon(config, launchers, vmi, refused, [&](const std::string&) { found = true; });
  return found;
}

Result<LibvirtJobStats> read_completed_job(const KubevirtConfig& config, const LauncherIdentity& launchers,
                                           const VmiRef& vmi, std::chrono::milliseconds wait,
                                           bool launcher_was_here) {
  virSetErrorFunc(nullptr, quiet);
  const std::string domain = domain_of(vmi);
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + wait;
  std::string why = no_launcher(config, vmi);
  // Since when the domain has been seen running nowhere on this node while every launcher
  // daemon of the VMI answered (or, when one was here at the start, no launcher of the VMI is
  // left): the incoming migration failed or the target pod is gone.
  constexpr auto kNever = std::chrono::steady_clock::time_point::max();
  auto gone_since = kNever;
  for (;;) {
    std::optional<LibvirtJobStats> found;
    std::string refused;
    bool tried = false;
    bool runs = false;
    bool unanswered = false;
    std::string absent;
    for_each_daemon(config, launchers, vmi, refused, [&](const std::string& path) {
      tried = true;
      if (found) return;
      bool here = false;
      auto r = try_daemon(path, domain, here);
      runs = runs || here;
      if (!r) {
        why = r.error().message;
        unanswered = true;
      } else if (r.value()) {
        found = *r.value();
      } else if (here) {
        why = "domain " + domain + " has no completed migration job in " + path + " yet";
      } else {
        absent = "domain " + domain + " does not run in " + path;
      }
    });
    if (found) return *found;
    if (!tried && !refused.empty()) {
      why = "no " + config.launcher_program + " process with --uid " + vmi.uid + " in a launcher pod of the VMI: " +
            refused;
    }
    if (!tried && !launcher_was_here) {
      // No launcher of the VMI when the session began and none now: the target launcher runs
      // before KubeVirt starts the source, so none will appear; no figures to wait for.
      return Error{Errc::kNotFound, why};
    }
    const auto now = std::chrono::steady_clock::now();
    if (runs || unanswered) {
      gone_since = kNever;
    } else {
      if (gone_since == kNever) gone_since = now;
      if (now - gone_since >= kGoneFor) {
        return Error{Errc::kFailedPrecondition,
                     "the migrated VMI does not run on this node: " + (tried ? absent : why)};
      }
    }
    if (now >= deadline) return Error{Errc::kNotFound, why};
    std::this_thread::sleep_for(200ms);
  }
}

}  // namespace rdmig::kubevirt
