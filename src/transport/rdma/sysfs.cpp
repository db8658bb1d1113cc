#include "transport/rdma/sysfs.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace rdmig::transport::rdma {

namespace fs = std::filesystem;

namespace {

std::string read_first_line(const fs::path& p) {
  std::ifstream in(p);
  std::string line;
  if (in) std::getline(in, line);
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ' || line.back() == '\r')) line.pop_back();
  return line;
}

std::vector<std::string> list_dir(const fs::path& p) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(p, ec)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

void add_unique(std::vector<std::string>& out, const std::string& v) {
  if (!v.empty() && std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
}

fs::path port_dir(const std::string& root, const std::string& device, int port) {
  return fs::path(root) / "class/infiniband" / device / "ports" / std::to_string(port);
}

}  // namespace

std::vector<std::string> SysfsView::devices() const { return list_dir(fs::path(root) / "class/infiniband"); }

std::vector<int> SysfsView::ports(const std::string& device) const {
  std::vector<int> out;
  for (const auto& name : list_dir(fs::path(root) / "class/infiniband" / device / "ports")) {
    if (!name.empty() && std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      out.push_back(std::stoi(name));
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string SysfsView::link_layer(const std::string& device, int port) const {
  return read_first_line(port_dir(root, device, port) / "link_layer");
}

bool SysfsView::port_active(const std::string& device, int port) const {
  return read_first_line(port_dir(root, device, port) / "state").find("ACTIVE") != std::string::npos;
}

std::vector<GidEntry> SysfsView::gids(const std::string& device, int port) const {
  const fs::path dir = port_dir(root, device, port);
  std::vector<std::pair<int, std::string>> indices;
  for (const auto& name : list_dir(dir / "gids")) {
    if (name.empty() || !std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    indices.emplace_back(std::stoi(name), name);
  }
  std::sort(indices.begin(), indices.end());
  std::vector<GidEntry> out;
  for (const auto& [index, name] : indices) {
    GidEntry e;
    e.index = index;
    e.text = read_first_line(dir / "gids" / name);
    const auto bytes = parse_gid(e.text);
    if (!bytes || *bytes == GidBytes{}) continue;  // unused table entry
    e.gid = *bytes;
    // Reading the attributes of an unused entry fails (EINVAL): such entries were skipped above.
    e.type = read_first_line(dir / "gid_attrs/types" / name);
    e.ndev = read_first_line(dir / "gid_attrs/ndevs" / name);
    out.push_back(std::move(e));
  }
  return out;
}

std::vector<std::string> SysfsView::netdevs_of(const std::string& device) const {
  const fs::path dev = fs::path(root) / "class/infiniband" / device;
  std::vector<std::string> out;
  for (int port : ports(device)) {
    for (const auto& g : gids(device, port)) add_unique(out, g.ndev);
  }
  for (const auto& nd : list_dir(dev / "device/net")) add_unique(out, nd);
  add_unique(out, read_first_line(dev / "parent"));
  return out;
}

std::vector<std::string> SysfsView::devices_of_pci(const std::string& pci) const {
  return list_dir(fs::path(root) / "bus/pci/devices" / pci / "infiniband");
}

std::optional<GidBytes> parse_gid(const std::string& text) {
  GidBytes out{};
  if (inet_pton(AF_INET6, text.c_str(), out.data()) != 1) return std::nullopt;
  return out;
}

std::optional<GidBytes> gid_of_address(const std::string& ip) {
  GidBytes out{};
  in_addr v4{};
  if (inet_pton(AF_INET, ip.c_str(), &v4) == 1) {
    out[10] = 0xff;
    out[11] = 0xff;
    std::memcpy(out.data() + 12, &v4, 4);
    return out;
  }
  if (inet_pton(AF_INET6, ip.c_str(), out.data()) == 1) return out;
  return std::nullopt;
}

bool is_roce_v2(const std::string& gid_type) { return gid_type == "RoCE v2"; }

}  // namespace rdmig::transport::rdma
