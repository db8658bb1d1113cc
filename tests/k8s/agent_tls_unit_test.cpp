// HTTPS between the controller and the agents: the controller's agents.tls keys and the PEM
// checks both programs run at start (tls/pem_files.h). The handshakes themselves are tested with
// real certificates in test_controller_tls.py and tests/integration/test_agent_tls.py.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "controller/config.h"
#include "tls/pem_files.h"

using namespace rdmig;

namespace {

std::string temp_file(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/rdmig-tls-unit-" + name;
  std::ofstream(path) << text;
  return path;
}

}  // namespace

TEST(AgentsTlsConfig, DefaultsToPlainHttpWithTheChartsServerName) {
  auto c = controller::parse_controller_config("");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_FALSE(c->agents.tls.enabled());
  EXPECT_EQ(c->agents.tls.server_name, "rdmig-agent");
}

TEST(AgentsTlsConfig, ReadsCaFileAndServerName) {
  auto c = controller::parse_controller_config("agents: {tls: {caFile: /etc/rdmig/tls/ca.crt, serverName: agents.example}}");
  ASSERT_TRUE(c) << c.error().message;
  EXPECT_TRUE(c->agents.tls.enabled());
  EXPECT_EQ(c->agents.tls.ca_file, "/etc/rdmig/tls/ca.crt");
  EXPECT_EQ(c->agents.tls.server_name, "agents.example");
}

TEST(AgentsTlsConfig, RefusesTlsWithoutCaFileNamingTheKey) {
  auto c = controller::parse_controller_config("agents: {tls: {serverName: rdmig-agent}}");
  ASSERT_FALSE(c);
  EXPECT_NE(c.error().message.find("agents.tls.caFile"), std::string::npos) << c.error().message;
}

TEST(AgentsTlsConfig, RefusesServerNamesThatAreNotDnsNames) {
  for (const char* name : {"10.0.0.1:7470", "Rdmig-Agent", "-rdmig", "rdmig-.agent", "a..b", "*.rdmig", ""}) {
    auto c = controller::parse_controller_config(std::string("agents: {tls: {caFile: /x, serverName: '") + name + "'}}");
    ASSERT_FALSE(c) << name;
    EXPECT_NE(c.error().message.find("agents.tls.serverName"), std::string::npos) << c.error().message;
  }
  EXPECT_TRUE(controller::parse_controller_config("agents: {tls: {caFile: /x, serverName: a-1.b2.example}}"));
}

TEST(AgentsTlsConfig, RefusesUnknownKeysUnderTls) {
  auto c = controller::parse_controller_config("agents: {tls: {caFile: /x, insecureSkipVerify: true}}");
  ASSERT_FALSE(c);
  EXPECT_NE(c.error().message.find("insecureSkipVerify"), std::string::npos) << c.error().message;
}

TEST(PemFiles, MissingOrEmptyCaBundleNamesTheKeyAndThePath) {
  auto missing = tls::check_ca_bundle("/nonexistent/ca.crt", "agents.tls.caFile");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().message.find("agents.tls.caFile"), std::string::npos);
  EXPECT_NE(missing.error().message.find("/nonexistent/ca.crt"), std::string::npos);
  const std::string junk = temp_file("junk.crt", "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n");
  auto empty = tls::check_ca_bundle(junk, "agents.tls.caFile");
  ASSERT_FALSE(empty);
  EXPECT_NE(empty.error().message.find("holds no PEM certificate"), std::string::npos) << empty.error().message;
  std::remove(junk.c_str());
}

TEST(PemFiles, MissingCertificateOrKeyNamesWhichKey) {
  const std::string junk = temp_file("junk.pem", "hello\n");
  auto no_cert = tls::check_cert_and_key("/nonexistent/tls.crt", "api.tls.certFile", junk, "api.tls.keyFile");
  ASSERT_FALSE(no_cert);
  EXPECT_NE(no_cert.error().message.find("api.tls.certFile"), std::string::npos) << no_cert.error().message;
  auto bad_cert = tls::check_cert_and_key(junk, "api.tls.certFile", junk, "api.tls.keyFile");
  ASSERT_FALSE(bad_cert);
  EXPECT_NE(bad_cert.error().message.find("api.tls.certFile"), std::string::npos) << bad_cert.error().message;
  auto no_key = tls::check_cert_and_key(junk, "api.tls.certFile", "", "api.tls.keyFile");
  ASSERT_FALSE(no_key);
  EXPECT_NE(no_key.error().message.find("api.tls.keyFile"), std::string::npos) << no_key.error().message;
  std::remove(junk.c_str());
}
