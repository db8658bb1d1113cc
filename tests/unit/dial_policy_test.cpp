// net::DialPolicy: the one rule for every dial the agent makes on someone else's word (issue 38).
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "common/dial_policy.h"
#include "common/net.h"

using namespace rdmig;
using namespace std::chrono_literals;

namespace {

const net::DialPolicy kNode = net::DialPolicy::peer_agents(false);
const net::DialPolicy kLab = net::DialPolicy::peer_agents(true);
const net::DialPolicy kPods = net::DialPolicy::pod_addresses();

std::string refusal(const net::DialPolicy& policy, const std::string& host) {
  auto st = policy.check(host, "target.endpoint");
  return st ? std::string() : st.error().message;
}

}  // namespace

TEST(DialPolicy, AllowsUnicastAddressLiterals) {
  for (const char* ok : {"10.244.1.7", "192.0.2.1", "8.8.8.8", "100.64.0.1", "172.16.0.1", "223.255.255.254",
                         "fd52:4d49:4b56:1::2", "2001:db8::1", "fe00::1", "::ffff:10.0.0.1", "::ffff:0:10.0.0.1",
                         "64:ff9b::10.0.0.1", "64:ff9b:1::a00:1", "2002:a00:1::1", "::10.0.0.1"}) {
    for (const auto* policy : {&kNode, &kLab, &kPods}) EXPECT_EQ(refusal(*policy, ok), "") << ok;
  }
}

// The unspecified address connects to the host itself on Linux; link-local is where cloud
// metadata answers; none of these is a peer agent, in a lab or not.
TEST(DialPolicy, RefusesUnspecifiedLinkLocalMulticastBroadcastAndReservedEverywhere) {
  const std::pair<const char*, const char*> cases[] = {
      {"0.0.0.0", "unspecified"},          {"0.1.2.3", "0.0.0.0/8"},
      {"169.254.169.254", "link-local"},   {"169.254.0.1", "link-local"},
      {"224.0.0.1", "multicast"},          {"239.255.255.250", "multicast"},
      {"255.255.255.255", "broadcast"},    {"240.0.0.1", "reserved"},
      {"::", "unspecified"},               {"fe80::1", "link-local"},
      {"febf:ffff::1", "link-local"},      {"ff02::1", "multicast"},
      {"ff05::1:3", "multicast"}};
  for (const auto& [host, why] : cases) {
    for (const auto* policy : {&kNode, &kLab, &kPods}) {
      const auto msg = refusal(*policy, host);
      EXPECT_NE(msg.find(why), std::string::npos) << host << ": " << msg;
      EXPECT_EQ(msg.rfind("target.endpoint: '", 0), 0u) << msg;
      EXPECT_NE(msg.find("dial policy"), std::string::npos) << msg;
    }
  }
}

// An IPv6 address that stands for a refused IPv4 one is judged as that IPv4 address.
TEST(DialPolicy, RefusesEveryIpv6FormThatEmbedsARefusedIpv4Address) {
  const std::pair<const char*, const char*> cases[] = {
      {"::ffff:169.254.169.254", "IPv4-mapped"},       {"::ffff:a9fe:a9fe", "IPv4-mapped"},
      {"::FFFF:A9FE:A9FE", "IPv4-mapped"},             {"0:0:0:0:0:ffff:169.254.169.254", "IPv4-mapped"},
      {"::ffff:0.0.0.0", "IPv4-mapped"},               {"::ffff:224.0.0.1", "IPv4-mapped"},
      {"::ffff:255.255.255.255", "IPv4-mapped"},       {"::ffff:0:169.254.169.254", "IPv4-translated"},
      {"::169.254.169.254", "IPv4-compatible"},        {"::0.0.0.2", "IPv4-compatible"},
      {"64:ff9b::169.254.169.254", "NAT64"},           {"64:ff9b::a9fe:a9fe", "NAT64"},
      {"64:ff9b:1::a9fe:a9fe", "local-use NAT64"},     {"2002:a9fe:a9fe::1", "6to4"},
      {"64:ff9b::0.0.0.0", "NAT64"}};
  for (const auto& [host, form] : cases) {
    for (const auto* policy : {&kNode, &kLab, &kPods}) {
      const auto msg = refusal(*policy, host);
      EXPECT_NE(msg.find("embeds"), std::string::npos) << host << ": " << msg;
      EXPECT_NE(msg.find(form), std::string::npos) << host << ": " << msg;
    }
  }
  EXPECT_NE(refusal(kNode, "::ffff:169.254.169.254").find("embeds 169.254.169.254 (IPv4-mapped"), std::string::npos);
}

// Names are never resolved (what was checked must be what is dialled), nor are the other
// spellings getaddrinfo would take as an IPv4 address.
TEST(DialPolicy, RefusesNamesAndAnythingButAPlainLiteral) {
  for (const char* bad : {"localhost", "metadata.google.internal", "instance-data", "127.1", "0x7f000001",
                          "2130706433", "017700000001", "10.0.0.1 ", " 10.0.0.1", "", "[::1]", "fe80::1%lo", "1.2.3",
                          "10.0.0.256", "::ffff:169.254.169.254.1"}) {
    for (const auto* policy : {&kNode, &kLab, &kPods}) {
      const auto msg = refusal(*policy, bad);
      EXPECT_NE(msg.find("not an IP address literal"), std::string::npos) << "'" << bad << "': " << msg;
    }
  }
}

// Loopback is the node's own services: only where the agent's config says it is a lab
// (dataPlane.allowLoopbackPeers), and never for a pod address.
TEST(DialPolicy, LoopbackOnlyWhereTheAgentsConfigSaysItIsALab) {
  for (const char* lo : {"127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", "::ffff:127.0.0.1", "64:ff9b::7f00:1",
                         "0:0:0:0:0:0:0:1"}) {
    EXPECT_EQ(refusal(kLab, lo), "") << lo;
    const auto node = refusal(kNode, lo);
    EXPECT_NE(node.find("loopback"), std::string::npos) << lo << ": " << node;
    EXPECT_NE(node.find("dataPlane.allowLoopbackPeers"), std::string::npos) << node;
    const auto pods = refusal(kPods, lo);
    EXPECT_NE(pods.find("loopback"), std::string::npos) << lo << ": " << pods;
    EXPECT_EQ(pods.find("allowLoopbackPeers"), std::string::npos) << "no key allows it there: " << pods;
  }
  EXPECT_TRUE(kLab.allows_loopback());
  EXPECT_FALSE(kNode.allows_loopback());
  EXPECT_FALSE(kPods.allows_loopback());
}

// The KubeVirt flows' check is the same policy (pod addresses: never loopback).
TEST(DialPolicy, TheKubevirtCheckIsThePodAddressPolicy) {
  for (const char* host : {"10.244.1.7", "127.0.0.1", "::ffff:169.254.169.254", "64:ff9b::a9fe:a9fe", "localhost"}) {
    auto a = net::check_unicast_literal(host, "open.host");
    auto b = kPods.check(host, "open.host");
    EXPECT_EQ(a.ok(), b.ok()) << host;
    if (!a) {
      EXPECT_EQ(a.error().message, b.error().message);
    }
  }
}

// The dial itself checks again: a refused address is never connected to, even when the
// request's check was skipped.
TEST(DialPolicy, ConnectRefusesBeforeAnyConnectionIsMade) {
  auto l = net::tcp_listen("127.0.0.1", 0);
  ASSERT_TRUE(l) << l.error().message;
  const uint16_t port = net::local_port(l->get()).value();
  auto refused = kNode.connect({"127.0.0.1", port}, "target.endpoint", 2s);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, Errc::kInvalidArgument);
  EXPECT_NE(refused.error().message.find("target.endpoint"), std::string::npos);
  // Nothing waits in the listener's queue: connect() was never called.
  auto none = net::accept_for(l->get(), 0ms);
  ASSERT_FALSE(none);
  EXPECT_EQ(none.error().code, Errc::kTimeout);
  auto named = kLab.connect({"localhost", port}, "target.endpoint", 2s);
  ASSERT_FALSE(named);
  EXPECT_NE(named.error().message.find("not an IP address literal"), std::string::npos);
  none = net::accept_for(l->get(), 0ms);
  ASSERT_FALSE(none);

  auto allowed = kLab.connect({"127.0.0.1", port}, "target.endpoint", 2s);
  ASSERT_TRUE(allowed) << allowed.error().message;
  EXPECT_TRUE(net::accept_for(l->get(), 2s));
}
