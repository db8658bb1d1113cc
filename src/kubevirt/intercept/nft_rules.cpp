#include "kubevirt/intercept/nft_rules.h"

#include <arpa/inet.h>
#include <nftables/libnftables.h>

#include <memory>

namespace rdmig::kubevirt {

Result<int> ip_family(const std::string& ip, const std::string& field) {
  in6_addr a6{};
  in_addr a4{};
  if (::inet_pton(AF_INET, ip.c_str(), &a4) == 1) return 4;
  if (::inet_pton(AF_INET6, ip.c_str(), &a6) == 1) return 6;
  return Error{Errc::kInvalidArgument, field + ": '" + ip.substr(0, 64) + "' is not an IP address"};
}

Result<std::string> NftRules::run(const std::string& commands) const {
  Result<std::string> out = std::string();
  auto st = ns_->run([&]() -> Status {
    // The context's netlink socket is made in this thread, i.e. inside the namespace.
    std::unique_ptr<nft_ctx, void (*)(nft_ctx*)> ctx(nft_ctx_new(NFT_CTX_DEFAULT), nft_ctx_free);
    if (!ctx) return Error{Errc::kInternal, "nft_ctx_new failed"};
    nft_ctx_buffer_output(ctx.get());
    nft_ctx_buffer_error(ctx.get());
    if (nft_run_cmd_from_buffer(ctx.get(), commands.c_str()) != 0) {
      const char* err = nft_ctx_get_error_buffer(ctx.get());
      return Error{Errc::kInternal, "nftables in " + ns_->describe() + ": " + std::string(err ? err : "failed")};
    }
    const char* text = nft_ctx_get_output_buffer(ctx.get());
    out = std::string(text ? text : "");
    return ok_status();
  });
  if (!st) return st.error();
  return out;
}

Result<NftRules> NftRules::install(const NetNs& ns, uint16_t port4, uint16_t port6, PassMark pass) {
  NftRules rules(ns);
  std::string t = "table inet rdmig\ndelete table inet rdmig\n";
  t += "table inet rdmig {\n";
  t += "  set carry4 { type ipv4_addr . inet_service; flags timeout; }\n";
  t += "  set carry6 { type ipv6_addr . inet_service; flags timeout; }\n";
  t += "  set peers4 { type ipv4_addr; flags timeout; }\n";
  t += "  set peers6 { type ipv6_addr; flags timeout; }\n";
  t += "  chain output {\n    type nat hook output priority -100; policy accept;\n";
  t += "    meta mark and " + std::to_string(pass.mask) + " == " + std::to_string(pass.value) + " return\n";
  t += "    meta l4proto tcp ip daddr . tcp dport @carry4 counter redirect to :" + std::to_string(port4) + "\n";
  t += "    meta l4proto tcp ip daddr @peers4 counter redirect to :" + std::to_string(port4) + "\n";
  if (port6 != 0) {
    t += "    meta l4proto tcp ip6 daddr . tcp dport @carry6 counter redirect to :" + std::to_string(port6) + "\n";
    t += "    meta l4proto tcp ip6 daddr @peers6 counter redirect to :" + std::to_string(port6) + "\n";
  }
  t += "  }\n}\n";
  auto r = rules.run(t);
  if (!r) return r.error();
  return rules;
}

namespace {
std::string element(const std::string& ip, uint16_t port) { return ip + " . " + std::to_string(port); }
}  // namespace

Status NftRules::carry(const std::string& ip, uint16_t port, std::chrono::seconds timeout) const {
  auto fam = ip_family(ip, "targetNodeAddress");
  if (!fam) return fam.error();
  const std::string set = fam.value() == 4 ? "carry4" : "carry6";
  const std::string e = element(ip, port);
  // One transaction: make sure it exists, then replace it with a fresh timeout.
  auto r = run("add element inet rdmig " + set + " { " + e + " }\n" + "delete element inet rdmig " + set + " { " + e +
               " }\n" + "add element inet rdmig " + set + " { " + e + " timeout " +
               std::to_string(timeout.count()) + "s }\n");
  if (!r) return r.error();
  return ok_status();
}

Status NftRules::uncarry(const std::string& ip, uint16_t port) const {
  auto fam = ip_family(ip, "targetNodeAddress");
  if (!fam) return fam.error();
  const std::string set = fam.value() == 4 ? "carry4" : "carry6";
  const std::string e = element(ip, port);
  auto r = run("add element inet rdmig " + set + " { " + e + " }\ndelete element inet rdmig " + set + " { " + e + " }\n");
  if (!r) return r.error();
  return ok_status();
}

Status NftRules::peer(const std::string& ip, std::chrono::seconds timeout) const {
  auto fam = ip_family(ip, "peer handler address");
  if (!fam) return fam.error();
  const std::string set = fam.value() == 4 ? "peers4" : "peers6";
  auto r = run("add element inet rdmig " + set + " { " + ip + " }\n" + "delete element inet rdmig " + set + " { " + ip +
               " }\n" + "add element inet rdmig " + set + " { " + ip + " timeout " + std::to_string(timeout.count()) +
               "s }\n");
  if (!r) return r.error();
  return ok_status();
}

Status NftRules::remove() const {
  auto r = run("table inet rdmig\ndelete table inet rdmig\n");
  if (!r) return r.error();
  return ok_status();
}

Result<bool> NftRules::remove_leftover(const NetNs& ns) {
  NftRules rules(ns);
  auto tables = rules.run("list tables inet\n");
  if (!tables) return tables.error();
  if (tables->find(std::string("table inet ") + kNftTable + "\n") == std::string::npos &&
      !tables->ends_with(std::string("table inet ") + kNftTable)) {
    return false;
  }
  RDMIG_TRY(rules.remove());
  return true;
}

Result<std::string> NftRules::list() const { return run("list table inet rdmig\n"); }

}  // namespace rdmig::kubevirt
