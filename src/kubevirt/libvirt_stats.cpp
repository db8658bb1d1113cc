#include "kubevirt/libvirt_stats.h"

#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>
#include <sys/stat.h>

#include <memory>
#include <thread>

#include "kubevirt/netns.h"

namespace rdmig::kubevirt {

using namespace std::chrono_literals;

namespace {
void quiet(void*, virErrorPtr) {}

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

// One attempt on one daemon: the stats when the domain runs here and its job is complete.
Result<std::optional<LibvirtJobStats>> try_daemon(const std::string& socket, const std::string& domain) {
  const std::string uri = "qemu+unix:///system?socket=" + socket;
  std::unique_ptr<virConnect, ConnCloser> conn(virConnectOpen(uri.c_str()));
  if (!conn) return Error{Errc::kUnavailable, "libvirt at " + socket + ": " + last_error()};
  std::unique_ptr<virDomain, DomFree> dom(virDomainLookupByName(conn.get(), domain.c_str()));
  if (!dom) return std::optional<LibvirtJobStats>();
  if (virDomainIsActive(dom.get()) != 1) return std::optional<LibvirtJobStats>();  // the source's, after the move
  int type = 0;
  virTypedParameterPtr params = nullptr;
  int n = 0;
  if (virDomainGetJobStats(dom.get(), &type, &params, &n,
                           VIR_DOMAIN_JOB_STATS_COMPLETED | VIR_DOMAIN_JOB_STATS_KEEP_COMPLETED) != 0) {
    return Error{Errc::kUnavailable, "virDomainGetJobStats: " + last_error()};
  }
  std::optional<LibvirtJobStats> out;
  if (type == VIR_DOMAIN_JOB_COMPLETED) {
    LibvirtJobStats s;
    s.domain = domain;
    unsigned long long v = 0;
    if (virTypedParamsGetULLong(params, n, VIR_DOMAIN_JOB_DOWNTIME, &v) == 1) s.downtime_ms = static_cast<int64_t>(v);
    if (virTypedParamsGetULLong(params, n, VIR_DOMAIN_JOB_TIME_ELAPSED, &v) == 1) s.total_time_ms = static_cast<int64_t>(v);
    if (virTypedParamsGetULLong(params, n, VIR_DOMAIN_JOB_DATA_TOTAL, &v) == 1) s.data_total_bytes = v;
    out = s;
  }
  virTypedParamsFree(params, n);
  return out;
}
}  // namespace

namespace {
// Calls fn(socket path) for each libvirt socket of each launcher of `vmi` on this node.
template <typename Fn>
void for_each_daemon(const KubevirtConfig& config, const VmiRef& vmi, Fn fn) {
  for (pid_t pid : processes_with_arg(config.launcher_program, "--uid", vmi.uid)) {
    for (const auto& sock : config.libvirt_sockets) {
      auto path = path_in_process_root(pid, sock);
      struct stat st {};
      if (path && ::stat(path->c_str(), &st) == 0) fn(path.value());
    }
  }
}
}  // namespace

Result<std::string> abort_outgoing_job(const KubevirtConfig& config, const VmiRef& vmi, int64_t started_by_ms) {
  virSetErrorFunc(nullptr, quiet);
  const std::string domain = vmi.namespace_ + "_" + vmi.name;
  std::string done;
  for_each_daemon(config, vmi, [&](const std::string& path) {
    const std::string uri = "qemu+unix:///system?socket=" + path;
    std::unique_ptr<virConnect, ConnCloser> conn(virConnectOpen(uri.c_str()));
    if (!conn) return;
    std::unique_ptr<virDomain, DomFree> dom(virDomainLookupByName(conn.get(), domain.c_str()));
    if (!dom || virDomainIsActive(dom.get()) != 1) return;
    // On a node the launcher of the VMI is the source (or, when it is being migrated to this
    // node, the target, whose incoming job libvirt refuses to abort: harmless).
    virDomainJobInfo info{};
    if (virDomainGetJobInfo(dom.get(), &info) != 0 || info.type == VIR_DOMAIN_JOB_NONE) return;
    const int64_t job_started_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count() -
        static_cast<int64_t>(info.timeElapsed);
    if (job_started_ms > started_by_ms + 500) {  // slack for the two clocks' reading
      done += (done.empty() ? "" : "; ") + std::string("a newer job of ") + domain + " runs (started " +
              std::to_string(job_started_ms - started_by_ms) + " ms after the failure): not aborted";
      return;
    }
    if (virDomainAbortJob(dom.get()) == 0) {
      done += (done.empty() ? "" : "; ") + std::string("aborted the migration job of ") + domain + " via " + path;
    } else {
      done += (done.empty() ? "" : "; ") + std::string("abort of ") + domain + " via " + path + ": " + last_error();
    }
  });
  if (done.empty()) return Error{Errc::kNotFound, "no migration job of " + domain + " to abort on this node"};
  return done;
}

Result<LibvirtJobStats> read_completed_job(const KubevirtConfig& config, const VmiRef& vmi,
                                           std::chrono::milliseconds wait) {
  virSetErrorFunc(nullptr, quiet);
  const std::string domain = vmi.namespace_ + "_" + vmi.name;
  const auto deadline = std::chrono::steady_clock::now() + wait;
  std::string why = "no " + config.launcher_program + " process with --uid " + vmi.uid + " and a libvirt socket";
  for (;;) {
    std::optional<LibvirtJobStats> found;
    for_each_daemon(config, vmi, [&](const std::string& path) {
      if (found) return;
      auto r = try_daemon(path, domain);
      if (!r) {
        why = r.error().message;
      } else if (r.value()) {
        found = *r.value();
      } else {
        why = "domain " + domain + " has no completed migration job in " + path + " yet";
      }
    });
    if (found) return *found;
    if (std::chrono::steady_clock::now() >= deadline) return Error{Errc::kNotFound, why};
    std::this_thread::sleep_for(200ms);
  }
}

}  // namespace rdmig::kubevirt
