#include "kubevirt/hook/vmi.h"

#include "common/net.h"
#include "kubevirt/intercept/nft_rules.h"

namespace rdmig::kubevirt {

using nlohmann::json;

namespace {
std::string str(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it != obj.end() && it->is_string() ? it->get<std::string>() : std::string();
}
bool flag(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it != obj.end() && it->is_boolean() && it->get<bool>();
}
const json& object_at(const json& obj, const char* key) {
  static const json empty = json::object();
  auto it = obj.find(key);
  return it != obj.end() && it->is_object() ? *it : empty;
}
bool has_sync_address(const json& state) {
  auto it = state.find("syncAddress");
  return it != state.end() && it->is_string() && !it->get<std::string>().empty();
}
}  // namespace

Result<MigrationIntent> parse_vmi(const json& vmi) {
  if (!vmi.is_object()) return Error{Errc::kInvalidArgument, "vmi: must be a JSON object"};
  MigrationIntent in;
  const json& meta = object_at(vmi, "metadata");
  in.vmi.namespace_ = str(meta, "namespace");
  in.vmi.name = str(meta, "name");
  in.vmi.uid = str(meta, "uid");
  if (in.vmi.name.empty() || in.vmi.namespace_.empty() || in.vmi.uid.empty()) {
    return Error{Errc::kInvalidArgument, "vmi.metadata: name, namespace and uid are required"};
  }
  for (const auto* v : {&in.vmi.name, &in.vmi.namespace_, &in.vmi.uid}) {
    if (v->size() > 253) return Error{Errc::kInvalidArgument, "vmi.metadata: a name longer than 253 characters"};
  }
  const json& status = object_at(vmi, "status");
  auto ms_it = status.find("migrationState");
  if (ms_it == status.end() || !ms_it->is_object()) {
    return Error{Errc::kInvalidArgument, "vmi.status.migrationState: missing"};
  }
  // A reference, not the iterator: GCC's -Wnull-dereference cannot follow the end() check
  // through nlohmann's iterator and warned on every use below.
  const json* ms = &*ms_it;
  in.migration_uid = str(*ms, "migrationUid");
  in.source_node = str(*ms, "sourceNode");
  in.target_node = str(*ms, "targetNode");
  in.target_address = str(*ms, "targetNodeAddress");
  in.mode = str(*ms, "mode");
  const json& cfg = object_at(*ms, "migrationConfiguration");
  in.allow_post_copy = flag(cfg, "allowPostCopy");
  in.disable_tls = flag(cfg, "disableTLS");
  const json& src_state = object_at(*ms, "sourceState");
  const json& dst_state = object_at(*ms, "targetState");
  in.decentralized = ms->contains("sourceState") && ms->contains("targetState") &&
                     (has_sync_address(src_state) != has_sync_address(dst_state));
  if (in.migration_uid.empty()) return Error{Errc::kInvalidArgument, "vmi.status.migrationState.migrationUid: missing"};
  if (in.migration_uid.size() > 128) {
    return Error{Errc::kInvalidArgument, "vmi.status.migrationState.migrationUid: longer than 128"};
  }
  if (!in.target_address.empty()) {
    auto fam = ip_family(in.target_address, "vmi.status.migrationState.targetNodeAddress");
    if (!fam) return fam.error();
  }
  const json& ports_v = object_at(*ms, "targetDirectMigrationNodePorts");
  const json* ports = ports_v.is_object() && !ports_v.empty() ? &ports_v : nullptr;
  if (ports != nullptr) {
    if (ports->size() > 16) {
      return Error{Errc::kInvalidArgument, "vmi.status.migrationState.targetDirectMigrationNodePorts: too many ports"};
    }
    for (const auto& [key, value] : ports->items()) {
      const std::string field = "vmi.status.migrationState.targetDirectMigrationNodePorts[" + key.substr(0, 16) + "]";
      size_t used = 0;
      long port = -1;
      try {
        port = std::stol(key, &used);
      } catch (...) {
        used = 0;
      }
      if (used != key.size() || port < 1 || port > 65535) return Error{Errc::kInvalidArgument, field + ": not a port"};
      if (!value.is_number_integer()) return Error{Errc::kInvalidArgument, field + ": value must be an integer"};
      in.ports.push_back(PublishedPort{static_cast<uint16_t>(port), value.get<int>()});
    }
  }
  return in;
}

std::optional<std::string> skip_reason(const MigrationIntent& in, const std::string& this_node, bool carry_post_copy) {
  if (may_post_copy(in) && !carry_post_copy) {
    return "post-copy is allowed for this migration: kubevirt.carryPostCopy is off on this agent (a transport failure "
           "after the switch could lose the VM)";
  }
  if (in.decentralized) return "cross-cluster (decentralized) migration: not carried";
  if (!in.source_node.empty() && in.source_node == in.target_node) return "same-node migration: nothing to carry";
  if (!this_node.empty() && !in.source_node.empty() && in.source_node != this_node) {
    return "this agent runs on " + this_node + ", not on the migration's source node " + in.source_node;
  }
  if (in.target_address.empty()) return "no targetNodeAddress published yet";
  if (auto st = net::check_unicast_literal(in.target_address, "targetNodeAddress"); !st) return st.error().message;
  if (in.target_node.empty()) return "no targetNode in migrationState";
  if (carried_ports(in).empty()) return "no memory or block port published in targetDirectMigrationNodePorts";
  return std::nullopt;
}

std::vector<uint16_t> carried_ports(const MigrationIntent& in) {
  std::vector<uint16_t> out;
  for (const auto& p : in.ports) {
    if (p.kind == kMemoryPort || p.kind == kBlockPort) out.push_back(p.port);
  }
  return out;
}

}  // namespace rdmig::kubevirt
