#include <gtest/gtest.h>

#include "common/net.h"
#include "common/units.h"

using namespace rdmig;

TEST(Units, ParsesBinaryAndDecimalQuantities) {
  EXPECT_EQ(parse_bytes("4Mi", "x").value(), 4 * kMiB);
  EXPECT_EQ(parse_bytes("64Ki", "x").value(), 64 * kKiB);
  EXPECT_EQ(parse_bytes("1Gi", "x").value(), kGiB);
  EXPECT_EQ(parse_bytes("1048576", "x").value(), kMiB);
  EXPECT_EQ(parse_bytes("2k", "x").value(), 2000u);
}

TEST(Units, RejectsMalformedQuantitiesNamingTheField) {
  for (const char* bad : {"", "Mi", "4MB", "4 Mi", "-1", "99999999999999999999999"}) {
    auto r = parse_bytes(bad, "spec.chunkSize");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.error().message.find("spec.chunkSize"), std::string::npos) << r.error().message;
  }
}

TEST(Units, ChunkSizeRule) {
  EXPECT_TRUE(validate_chunk_size(64 * kKiB, "c").ok());
  EXPECT_TRUE(validate_chunk_size(kGiB, "c").ok());
  EXPECT_FALSE(validate_chunk_size(32 * kKiB, "c").ok());
  EXPECT_FALSE(validate_chunk_size(2 * kGiB, "c").ok());
  EXPECT_FALSE(validate_chunk_size(3 * kMiB, "c").ok());
  EXPECT_EQ(format_quantity(4 * kMiB), "4Mi");
  EXPECT_EQ(format_quantity(1000), "1000");
}

TEST(Units, TokensAreRandomAndCompareExactly) {
  const auto a = random_hex(16);
  const auto b = random_hex(16);
  EXPECT_EQ(a.size(), 32u);
  EXPECT_NE(a, b);
  EXPECT_TRUE(constant_time_equal(a, a));
  EXPECT_FALSE(constant_time_equal(a, b));
  EXPECT_FALSE(constant_time_equal(a, a.substr(0, 31)));
}

TEST(Net, ParsesEndpoints) {
  auto e = net::parse_endpoint("10.0.0.2:7471", "target.endpoint");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->host, "10.0.0.2");
  EXPECT_EQ(e->port, 7471);
  auto v6 = net::parse_endpoint("[fd00::1]:7471", "f");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "fd00::1");
  for (const char* bad : {"host", "host:", ":80", "host:0", "host:65536", "host:8a"}) {
    auto r = net::parse_endpoint(bad, "target.endpoint");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.error().message.find("target.endpoint"), std::string::npos);
  }
}

// Every endpoint an agent writes (its data-plane endpoint in a create answer, a welcome's
// rdmaEndpoint and rails, status.peer, logs) puts an IPv6 address in brackets, and reads back.
TEST(Net, WritesIpv6EndpointsInBracketsAndReadsThemBack) {
  EXPECT_EQ(net::format_endpoint("10.0.0.2", 7471), "10.0.0.2:7471");
  EXPECT_EQ(net::format_endpoint("fd00:100::2", 46755), "[fd00:100::2]:46755");
  EXPECT_EQ(net::format_endpoint("[fd00::1]", 7471), "[fd00::1]:7471");  // already bracketed
  EXPECT_EQ((net::Endpoint{"fe80::1", 1}.to_string()), "[fe80::1]:1");
  for (const auto& [host, port] : {std::pair<std::string, uint16_t>{"10.1.2.3", 1}, {"fd00:100::2", 65535},
                                   {"::1", 7471}, {"node-a.example", 80}}) {
    auto back = net::parse_endpoint(net::format_endpoint(host, port), "f");
    ASSERT_TRUE(back.ok()) << host;
    EXPECT_EQ(back->host, host);
    EXPECT_EQ(back->port, port);
  }
}
