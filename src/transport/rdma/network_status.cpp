#include "transport/rdma/network_status.h"

#include <arpa/inet.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>

#include "common/text.h"
#include "common/json_limits.h"

namespace rdmig::transport::rdma {

namespace {

using nlohmann::json;

Error invalid(const std::string& message) { return Error{Errc::kInvalidArgument, message}; }

// What a kernel interface name may be (IFNAMSIZ - 1 bytes, no '/', no whitespace).
bool is_interface_name(const std::string& s) {
  if (s.empty() || s.size() > 15 || s == "." || s == "..") return false;
  for (const unsigned char c : s) {
    if (c <= ' ' || c == '/' || c == ':' || c >= 0x7f) return false;
  }
  return true;
}

// An RDMA device name as the kernel allows it (IB_DEVICE_NAME_MAX 64), no path characters.
bool is_rdma_device_name(const std::string& s) {
  if (s.empty() || s.size() > 63) return false;
  for (const unsigned char c : s) {
    if (!std::isalnum(c) && c != '_' && c != '-' && c != '.') return false;
  }
  return s != "." && s != "..";
}

// dddd:bb:dd.f
bool is_pci_address(const std::string& s) {
  if (s.size() != 12 || s[4] != ':' || s[7] != ':' || s[10] != '.') return false;
  for (const int i : {0, 1, 2, 3, 5, 6, 8, 9, 11}) {
    if (!std::isxdigit(static_cast<unsigned char>(s[static_cast<size_t>(i)]))) return false;
  }
  return true;
}

bool is_ipv4(const std::string& s) {
  in_addr a{};
  return inet_pton(AF_INET, s.c_str(), &a) == 1;
}

bool is_ipv6(const std::string& s, bool* link_local) {
  in6_addr a{};
  if (inet_pton(AF_INET6, s.c_str(), &a) != 1) return false;
  *link_local = IN6_IS_ADDR_LINKLOCAL(&a);
  return true;
}

// The fields rdmig uses of the matching entry; errors name the field.
Result<NetworkAttachment> read_entry(const json& e, const std::string& name) {
  const std::string where = "its entry '" + name + "'";
  NetworkAttachment a;
  a.name = name;
  const auto iface = e.find("interface");
  if (iface == e.end() || !iface->is_string()) {
    return invalid(where + " has no \"interface\" (is the network attached by Multus 3.7 or later?)");
  }
  a.interface = iface->get<std::string>();
  if (!is_interface_name(a.interface)) {
    return invalid(where + ": \"interface\" is not an interface name: '" + a.interface.substr(0, 64) + "'");
  }
  if (const auto ips = e.find("ips"); ips != e.end() && !ips->is_null()) {
    if (!ips->is_array()) return invalid(where + ": \"ips\" is not a list");
    if (ips->size() > 64) return invalid(where + ": \"ips\" lists more than 64 addresses");
    for (const auto& ip : *ips) {
      if (!ip.is_string()) return invalid(where + ": \"ips\" holds something that is not a string");
      a.ips.push_back(ip.get<std::string>());
    }
  }
  if (const auto di = e.find("device-info"); di != e.end() && !di->is_null()) {
    if (!di->is_object()) return invalid(where + ": \"device-info\" is not an object");
    if (const auto pci = di->find("pci"); pci != di->end() && !pci->is_null()) {
      if (!pci->is_object()) return invalid(where + ": \"device-info\".\"pci\" is not an object");
      if (const auto rd = pci->find("rdma-device"); rd != pci->end() && !rd->is_null()) {
        if (!rd->is_string() || (!rd->get<std::string>().empty() && !is_rdma_device_name(rd->get<std::string>()))) {
          return invalid(where + ": \"device-info\".\"pci\".\"rdma-device\" is not an RDMA device name");
        }
        a.rdma_device = rd->get<std::string>();
      }
      if (const auto pa = pci->find("pci-address"); pa != pci->end() && !pa->is_null()) {
        if (!pa->is_string() || (!pa->get<std::string>().empty() && !is_pci_address(pa->get<std::string>()))) {
          return invalid(where + ": \"device-info\".\"pci\".\"pci-address\" is not a PCI address (dddd:bb:dd.f)");
        }
        a.pci_address = pa->get<std::string>();
      }
    }
  }
  if (preferred_address(a).empty()) {
    return Error{Errc::kUnavailable, where + " (interface " + a.interface + ") has no usable IP address" +
                   (a.ips.empty() ? std::string(": the NetworkAttachmentDefinition needs an \"ipam\" section "
                                                "(e.g. whereabouts or host-local) so that Multus lists the VF's address")
                                  : " (ips: " + join(a.ips) + "; link-local IPv6 cannot be used)")};
  }
  return a;
}

}  // namespace

std::string qualified_network(const std::string& network, const std::string& pod_namespace) {
  if (network.find('/') != std::string::npos || pod_namespace.empty()) return network;
  return pod_namespace + "/" + network;
}

std::string preferred_address(const NetworkAttachment& entry) {
  for (const auto& ip : entry.ips) {
    if (is_ipv4(ip)) return ip;
  }
  for (const auto& ip : entry.ips) {
    bool link_local = false;
    if (is_ipv6(ip, &link_local) && !link_local) return ip;
  }
  return {};
}

Result<NetworkAttachment> find_network_attachment(std::string_view text, const std::string& network,
                                                  const std::string& pod_namespace) {
  if (text.size() > kMaxNetworkStatusBytes) {
    return invalid("network-status is " + std::to_string(text.size()) + " bytes, more than the " +
                   std::to_string(kMaxNetworkStatusBytes) + " rdmig reads");
  }
  if (text.find_first_not_of(" \t\r\n") == std::string_view::npos) {
    return Error{Errc::kNotFound, "network-status is empty (Multus has not written the pod's annotation yet, "
                                  "or does not manage this pod's network)"};
  }
  const auto doc = parse_json_bounded(text);
  if (doc.is_discarded()) {
    return invalid("network-status is not JSON (or nested deeper than " + std::to_string(kMaxJsonDepth) + ")");
  }
  if (!doc.is_array()) return invalid("network-status is not a JSON list of attachments");
  if (doc.size() > kMaxNetworkStatusEntries) {
    return invalid("network-status lists " + std::to_string(doc.size()) + " attachments, more than " +
                   std::to_string(kMaxNetworkStatusEntries));
  }
  // Multus writes "<namespace>/<nad>"; a bare name is also accepted as written (older Multus).
  const std::string want = qualified_network(network, pod_namespace);
  std::vector<std::string> names;
  const json* found = nullptr;
  std::vector<std::string> interfaces;
  for (const auto& e : doc) {
    if (!e.is_object()) return invalid("network-status holds an entry that is not an object");
    const auto n = e.find("name");
    if (n == e.end() || !n->is_string()) continue;  // Multus writes "" for some default networks
    const std::string name = n->get<std::string>();
    names.push_back(name.empty() ? "\"\"" : name.substr(0, 256));
    if (name != want && name != network) continue;
    if (const auto i = e.find("interface"); i != e.end() && i->is_string()) interfaces.push_back(i->get<std::string>());
    if (found) {
      return invalid("network-status has '" + want + "' more than once (interfaces " + join(interfaces) +
                     "): attach that network to the agent pod once");
    }
    found = &e;
  }
  if (!found) {
    std::string msg = "network-status has no entry '" + want + "' (it lists: " + (names.empty() ? "none" : join(names)) + ")";
    if (network.find('/') == std::string::npos && pod_namespace.empty()) {
      msg += "; the pod's namespace is unknown (POD_NAMESPACE not set): name the network as <namespace>/<name>";
    }
    return Error{Errc::kNotFound, msg};
  }
  return read_entry(*found, want);
}

RdmaOptions options_for_attachment(const RdmaOptions& base, const NetworkAttachment& entry,
                                   const std::string& network_status_file) {
  RdmaOptions o = base;
  o.device = entry.rdma_device;
  o.pci_address = entry.rdma_device.empty() ? entry.pci_address : "";
  o.netdev = entry.interface;
  o.address = preferred_address(entry);
  o.resource_env.clear();
  o.origin = "config key '" + base.key + ".network' ('" + entry.name + "' in " + network_status_file + ": interface " +
             entry.interface + ", address " + o.address +
             (entry.rdma_device.empty() ? std::string() : ", rdma-device " + entry.rdma_device) +
             (entry.pci_address.empty() ? std::string() : ", pci-address " + entry.pci_address) + ")";
  return o;
}

Result<NetworkAttachment> wait_for_network_attachment(const std::string& path, const std::string& network,
                                                      const std::string& pod_namespace,
                                                      std::chrono::steady_clock::time_point deadline,
                                                      const std::function<bool()>& cancelled,
                                                      const std::string& key) {
  using namespace std::chrono_literals;
  const std::string what =
      "config key '" + key + ".network' ('" + qualified_network(network, pod_namespace) + "'): " + path;
  for (;;) {
    Error last;
    struct stat st{};
    if (::stat(path.c_str(), &st) != 0) {
      last = Error{Errc::kNotFound, std::string("cannot read it: ") + std::strerror(errno) +
                                        " (is the downward API volume with the pod's "
                                        "k8s.v1.cni.cncf.io/network-status annotation mounted there? "
                                        "see rdma.networkStatusFile)"};
    } else if (!S_ISREG(st.st_mode)) {
      return Error{Errc::kInvalidArgument, what + ": not a regular file"};
    } else if (static_cast<uint64_t>(st.st_size) > kMaxNetworkStatusBytes) {
      return Error{Errc::kInvalidArgument, what + ": " + std::to_string(st.st_size) + " bytes, more than the " +
                                               std::to_string(kMaxNetworkStatusBytes) + " rdmig reads"};
    } else {
      std::ifstream in(path, std::ios::binary);
      std::string text(kMaxNetworkStatusBytes + 1, '\0');
      in.read(text.data(), static_cast<std::streamsize>(text.size()));
      text.resize(static_cast<size_t>(in.gcount()));
      auto found = find_network_attachment(text, network, pod_namespace);
      if (found) return found;
      if (found.error().code != Errc::kNotFound) return found.error().with_context(what);
      last = found.error();
    }
    if (std::chrono::steady_clock::now() >= deadline || (cancelled && cancelled())) {
      return last.with_context(what);
    }
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
        250ms, std::max<std::chrono::steady_clock::duration>(1ms, deadline - std::chrono::steady_clock::now())));
  }
}

}  // namespace rdmig::transport::rdma
