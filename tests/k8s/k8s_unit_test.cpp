// Unit tests for the pure parts of the Kubernetes side: kubeconfig and in-cluster config,
// quantities in the spec, status mapping from agent JSON, selectors, backoff, time formats,
// agent pod selection, controller config validation.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "controller/agent_client.h"
#include "controller/config.h"
#include "controller/migration_spec.h"
#include "controller/status_mapping.h"
#include "k8s/backoff.h"
#include "k8s/cluster_config.h"
#include "k8s/informer.h"
#include "k8s/selectors.h"
#include "k8s/time_format.h"
#include "source_dir.h"

using nlohmann::json;
using namespace rdmig;

namespace {

const char* kKubeconfig = R"(
apiVersion: v1
kind: Config
current-context: dev
clusters:
- name: prod
  cluster: {server: "https://prod.example:6443"}
- name: devc
  cluster:
    server: https://10.0.0.1:6443
    certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg==
users:
- name: alice
  user: {token: abc123}
- name: bob
  user: {client-certificate: certs/bob.crt, client-key: /abs/bob.key}
contexts:
- name: dev
  context: {cluster: devc, user: alice, namespace: team}
- name: other
  context: {cluster: prod, user: bob}
)";

json base_spec() {
  return json{{"source", {{"qemu", {{"node", "a"}, {"qmpSocket", "/run/a.qmp"}}}}},
              {"target", {{"qemu", {{"node", "b"}, {"qmpSocket", "/run/b.qmp"}}}}}};
}

}  // namespace

TEST(Kubeconfig, ParsesCurrentContextWithTokenAndCaData) {
  auto c = k8s::parse_kubeconfig(kKubeconfig, "/home/u/.kube");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->server, "https://10.0.0.1:6443");
  EXPECT_EQ(c->token, "abc123");
  EXPECT_EQ(c->ca_data, "-----BEGIN CERTIFICATE-----\n");
  EXPECT_EQ(c->namespace_, "team");
}

TEST(Kubeconfig, NamedContextResolvesRelativeCertificatePaths) {
  auto c = k8s::parse_kubeconfig(kKubeconfig, "/home/u/.kube", "other");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->server, "https://prod.example:6443");
  EXPECT_EQ(c->client_cert_file, "/home/u/.kube/certs/bob.crt");
  EXPECT_EQ(c->client_key_file, "/abs/bob.key");
  EXPECT_TRUE(c->token.empty());
}

TEST(Kubeconfig, ErrorsNameWhatIsMissing) {
  auto c = k8s::parse_kubeconfig(kKubeconfig, "", "nope");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("no context named 'nope'"), std::string::npos);
  auto d = k8s::parse_kubeconfig("current-context: x\ncontexts: []\n", "");
  ASSERT_FALSE(d.ok());
  auto e = k8s::parse_kubeconfig(
      "current-context: x\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
      "clusters: [{name: c, cluster: {server: 'ftp://h'}}]\nusers: [{name: u, user: {token: t}}]\n", "");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.error().message.find("http:// or https://"), std::string::npos);
  auto f = k8s::parse_kubeconfig(
      "current-context: x\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
      "clusters: [{name: c, cluster: {server: 'https://h'}}]\nusers: [{name: u, user: {exec: {command: aws}}}]\n", "");
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.error().message.find("exec"), std::string::npos);
}

TEST(Kubeconfig, Base64DecodesAndRejectsGarbage) {
  EXPECT_EQ(k8s::base64_decode("aGVsbG8=", "f").value(), "hello");
  EXPECT_EQ(k8s::base64_decode("aGVs\nbG8h", "f").value(), "hello!");
  EXPECT_FALSE(k8s::base64_decode("a$b", "f").ok());
}

TEST(Kubeconfig, ServerUrlForms) {
  auto a = k8s::parse_server_url("https://[fd00::1]:6443/prefix/");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host, "fd00::1");
  EXPECT_EQ(a->port, 6443);
  EXPECT_EQ(a->base_path, "/prefix");
  auto b = k8s::parse_server_url("http://localhost");
  ASSERT_TRUE(b.ok());
  EXPECT_FALSE(b->tls);
  EXPECT_EQ(b->port, 80);
  EXPECT_FALSE(k8s::parse_server_url("https://h:99999").ok());
}

TEST(InClusterConfig, UsesServiceEnvironmentAndServiceAccountFiles) {
  char dir[] = "/tmp/rdmig-sa-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string d = dir;
  std::map<std::string, std::string> env{{"KUBERNETES_SERVICE_HOST", "fd00::1"}, {"KUBERNETES_SERVICE_PORT", "443"}};
  auto missing = k8s::in_cluster_config(env, d);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().message.find("token"), std::string::npos);
  std::ofstream(d + "/token") << "tok\n";
  std::ofstream(d + "/ca.crt") << "pem";
  std::ofstream(d + "/namespace") << "rdmig-system";
  auto c = k8s::in_cluster_config(env, d);
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->server, "https://[fd00::1]:443");
  EXPECT_EQ(c->token_file, d + "/token");
  EXPECT_EQ(c->ca_file, d + "/ca.crt");
  EXPECT_EQ(c->namespace_, "rdmig-system");
  EXPECT_FALSE(k8s::in_cluster_config({}, d).ok());
  for (const char* f : {"/token", "/ca.crt", "/namespace"}) std::remove((d + f).c_str());
  ::rmdir(dir);
}

TEST(Selectors, BuildsSortedSelectorAndParsesItBack) {
  std::map<std::string, std::string> labels{{"tier", "node"}, {"app.kubernetes.io/name", "rdmig-agent"}};
  const auto text = k8s::label_selector(labels);
  EXPECT_EQ(text, "app.kubernetes.io/name=rdmig-agent,tier=node");
  EXPECT_EQ(k8s::parse_label_selector(text, "s").value(), labels);
  EXPECT_EQ(k8s::parse_label_selector("a==b", "s").value().at("a"), "b");
  EXPECT_FALSE(k8s::parse_label_selector("a!=b", "s").ok());
  EXPECT_FALSE(k8s::parse_label_selector("a=b,,c=d", "s").ok());
  EXPECT_FALSE(k8s::parse_label_selector("a b=c", "s").ok());
  EXPECT_EQ(k8s::url_encode("app.kubernetes.io/name=x,y"), "app.kubernetes.io%2Fname%3Dx%2Cy");
}

TEST(Backoff, GrowsToTheCapAndResets) {
  using ms = std::chrono::milliseconds;
  k8s::Backoff b(ms(100), ms(1000));
  EXPECT_EQ(b.next(), ms(100));
  EXPECT_EQ(b.next(), ms(200));
  EXPECT_EQ(b.next(), ms(400));
  EXPECT_EQ(b.next(), ms(800));
  EXPECT_EQ(b.next(), ms(1000));
  EXPECT_EQ(b.next(), ms(1000));
  b.reset();
  EXPECT_EQ(b.next(), ms(100));
  EXPECT_EQ(b.next(0.5), ms(300));
}

TEST(TimeFormat, RoundTripsRfc3339AndMicroTime) {
  const auto t = k8s::parse_time("2024-05-01T12:34:56.123456Z");
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(k8s::format_micro_time(*t), "2024-05-01T12:34:56.123456Z");
  EXPECT_EQ(k8s::format_time(*t), "2024-05-01T12:34:56Z");
  EXPECT_EQ(k8s::parse_time("2024-05-01T14:34:56+02:00"), k8s::parse_time("2024-05-01T12:34:56Z"));
  EXPECT_FALSE(k8s::parse_time("2024-05-01 12:34:56").has_value());
  EXPECT_FALSE(k8s::parse_time("2024-05-01T12:34:56").has_value());
}

TEST(Informer, ResourceVersionsCompareNumericallyOnly) {
  EXPECT_TRUE(k8s::resource_version_newer("10", "9"));
  EXPECT_FALSE(k8s::resource_version_newer("9", "10"));
  EXPECT_FALSE(k8s::resource_version_newer("abc", "1"));
}

TEST(MigrationSpec, ParsesQuantitiesAndDefaults) {
  json s = base_spec();
  s["chunkSize"] = "16Mi";
  s["maxBandwidth"] = "10Gi";
  s["multifdChannels"] = 4;
  auto r = controller::parse_spec(s);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(*r->chunk_size, 16u << 20);
  EXPECT_EQ(r->max_bandwidth_bytes_per_second, 10ull << 30);
  EXPECT_EQ(r->multifd_channels, 4u);
  EXPECT_EQ(r->max_downtime_ms, 300u);
  EXPECT_EQ(r->transport, "auto");
  EXPECT_FALSE(r->ring_depth.has_value());
  EXPECT_FALSE(r->cancel);
}

TEST(MigrationSpec, RejectsChunkSizeThatIsNotPowerOfTwoOrOutOfRange) {
  for (const char* bad : {"3Mi", "32Ki", "2Gi", "4MB"}) {
    json s = base_spec();
    s["chunkSize"] = bad;
    auto r = controller::parse_spec(s);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.error().message.rfind("spec.chunkSize", 0), 0u) << r.error().message;
  }
}

TEST(MigrationSpec, RejectsSameNodeUnknownKindAndUnknownTransport) {
  json same = base_spec();
  same["target"]["qemu"]["node"] = "a";
  EXPECT_NE(controller::parse_spec(same).error().message.find("must differ"), std::string::npos);
  json vmi = base_spec();
  vmi["source"] = {{"vmi", {{"name", "x"}}}};
  EXPECT_NE(controller::parse_spec(vmi).error().message.find("supported: qemu, vmi"), std::string::npos);
  json tr = base_spec();
  tr["transport"] = "ib";
  EXPECT_NE(controller::parse_spec(tr).error().message.find("spec.transport"), std::string::npos);
  json rel = base_spec();
  rel["target"]["qemu"]["qmpSocket"] = "x.sock";
  EXPECT_NE(controller::parse_spec(rel).error().message.find("absolute"), std::string::npos);
  json missing = base_spec();
  missing.erase("target");
  EXPECT_EQ(controller::parse_spec(missing).error().message, "spec.target: required");
}

TEST(MigrationSpec, AgentIdIsDeterministicDnsLabelFromUid) {
  json obj{{"metadata", {{"uid", "0F1E2D3C-aaaa-bbbb-cccc-0123456789ab"}}}};
  EXPECT_EQ(controller::agent_migration_id(obj).value(), "m-0f1e2d3c-aaaa-bbbb-cccc-0123456789ab");
  EXPECT_FALSE(controller::agent_migration_id(json{{"metadata", json::object()}}).ok());
}

TEST(MigrationSpec, AgentBodiesCarryTheTargetHandshake) {
  json s = base_spec();
  s["chunkSize"] = "1Mi";
  auto r = controller::parse_spec(s).value();
  auto t = controller::target_request_body(r, "m-1", "ns/x");
  EXPECT_EQ(t["role"], "target");
  EXPECT_EQ(t["qmpSocket"], "/run/b.qmp");
  EXPECT_EQ(t["chunkSize"], 1u << 20);
  EXPECT_FALSE(t.contains("maxDowntimeMs"));
  auto src = controller::source_request_body(r, "m-1", "ns/x",
                                             json{{"endpoint", "10.0.0.2:7471"}, {"migrationId", "m-1"}, {"token", "t"}});
  EXPECT_EQ(src["role"], "source");
  EXPECT_EQ(src["qmpSocket"], "/run/a.qmp");
  EXPECT_EQ(src["target"], (json{{"endpoint", "10.0.0.2:7471"}, {"migrationId", "m-1"}, {"token", "t"}}));
  EXPECT_EQ(src["maxDowntimeMs"], 300);
}

// spec.postCopy reaches the source agent only (the target follows the source); its thresholds
// only with auto; a vmi source refuses it (KubeVirt mode does not carry post-copy).
TEST(MigrationSpec, PostCopyIsValidatedAndPassedToTheSourceAgent) {
  json s = base_spec();
  auto plain = controller::parse_spec(s).value();
  EXPECT_FALSE(controller::source_request_body(plain, "m-1", "ns/x", json::object()).contains("postCopy"));
  s["postCopy"] = "auto";
  s["postCopyAfterPasses"] = 4;
  s["postCopyAfterSeconds"] = 90;
  auto r = controller::parse_spec(s);
  ASSERT_TRUE(r.ok()) << r.error().message;
  auto src = controller::source_request_body(r.value(), "m-1", "ns/x", json::object());
  EXPECT_EQ(src["postCopy"], "auto");
  EXPECT_EQ(src["postCopyAfterPasses"], 4);
  EXPECT_EQ(src["postCopyAfterSeconds"], 90);
  EXPECT_FALSE(controller::target_request_body(r.value(), "m-1", "ns/x").contains("postCopy"));
  EXPECT_FALSE(src.contains("postCopyPreempt"));
  // postcopy-preempt: to the source agent only (the target learns it from the source's hello).
  s["postCopyPreempt"] = true;
  r = controller::parse_spec(s);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(controller::source_request_body(r.value(), "m-1", "ns/x", json::object())["postCopyPreempt"], true);
  EXPECT_FALSE(controller::target_request_body(r.value(), "m-1", "ns/x").contains("postCopyPreempt"));
  const std::vector<std::pair<json, std::string>> bad{
      {{{"postCopyPreempt", true}}, "spec.postCopyPreempt: only with spec.postCopy auto or after"},
      {{{"postCopy", "after"}, {"postCopyPreempt", "yes"}}, "spec.postCopyPreempt: must be true or false"},
      {{{"postCopy", "sometimes"}}, "spec.postCopy: must be never, auto or after"},
      {{{"postCopy", 1}}, "spec.postCopy: must be a string"},
      {{{"postCopy", "auto"}, {"postCopyAfterPasses", 1}}, "spec.postCopyAfterPasses"},
      {{{"postCopy", "auto"}, {"postCopyAfterSeconds", 86401}}, "spec.postCopyAfterSeconds"},
      {{{"postCopy", "after"}, {"postCopyAfterPasses", 3}}, "spec.postCopyAfterPasses: only with spec.postCopy auto"},
      {{{"postCopyAfterSeconds", 3}}, "spec.postCopyAfterSeconds: only with spec.postCopy auto"},
  };
  for (const auto& [fields, want] : bad) {
    json b = base_spec();
    b.update(fields);
    auto e = controller::parse_spec(b);
    ASSERT_FALSE(e.ok()) << fields.dump();
    EXPECT_NE(e.error().message.find(want), std::string::npos) << fields.dump() << " -> " << e.error().message;
  }
}

TEST(StatusMapping, CopiesPostCopyFiguresOfTheSource) {
  json status = json::object();
  controller::copy_agent_status(
      status,
      json{{"phase", "Succeeded"},
           {"postCopy", {{"mode", "auto"}, {"switched", true}, {"trigger", "passes"}, {"switchAfterMs", 9000},
                         {"phaseMs", 1200}, {"pageRequests", 77}, {"blocktimeMs", 35}, {"pageLatencyUs", 81.4},
                         {"pageLatencyP50Us", 64.0}, {"pageLatencyP99Us", 1024.0},
                         {"preempt", true}}}},
      json{{"phase", "Succeeded"}});
  EXPECT_EQ(status["postCopy"], (json{{"mode", "auto"}, {"switched", true}, {"trigger", "passes"}, {"switchAfterMs", 9000},
                                      {"phaseMs", 1200}, {"pageRequests", 77}, {"blocktimeMs", 35}, {"pageLatencyUs", 81},
                                      {"pageLatencyP50Us", 64}, {"pageLatencyP99Us", 1024},
                                      {"preempt", true}}));
  json never = json::object();
  controller::copy_agent_status(never, json{{"phase", "Succeeded"}, {"postCopy", {{"mode", "never"}, {"switched", false}}}},
                                json{{"phase", "Succeeded"}});
  EXPECT_FALSE(never.contains("postCopy"));
}

// An agent's page-fault figures outside 0..kMaxPageLatencyUs (an hour), or not numbers, are left out
// of the resource's status rather than shown; the hour itself is kept.
TEST(StatusMapping, LeavesOutPageLatenciesOutsideTheirBound) {
  json status = json::object();
  controller::copy_agent_status(
      status,
      json{{"phase", "Succeeded"},
           {"postCopy", {{"mode", "after"}, {"switched", true}, {"pageLatencyUs", -1.0},
                         {"pageLatencyP50Us", 3.6e9}, {"pageLatencyP99Us", 3.6e9 + 1}}}},
      json{{"phase", "Succeeded"}});
  EXPECT_FALSE(status["postCopy"].contains("pageLatencyUs"));
  EXPECT_EQ(status["postCopy"]["pageLatencyP50Us"], 3600000000);
  EXPECT_FALSE(status["postCopy"].contains("pageLatencyP99Us"));
  json words = json::object();
  controller::copy_agent_status(
      words,
      json{{"phase", "Succeeded"},
           {"postCopy", {{"mode", "after"}, {"switched", true}, {"pageLatencyUs", "81"}, {"pageLatencyP50Us", nullptr},
                         {"pageLatencyP99Us", json::array({1024})}}}},
      json{{"phase", "Succeeded"}});
  EXPECT_EQ(words["postCopy"], (json{{"mode", "after"}, {"switched", true}}));
}

TEST(StatusMapping, CopiesProgressAndResultsFromAgentJson) {
  json source{{"phase", "Succeeded"},
              {"transport", "tcp"},
              {"channels", 3},
              {"chunkSize", 1048576},
              {"progress",
               {{"transferredBytes", 600000000},
                {"remainingBytes", 0},
                {"totalBytes", 537000000},
                {"percent", 99.7},
                {"throughputBytesPerSecond", 250000000.6},
                {"dirtyRateBytesPerSecond", 1.5e6},
                {"passes", 4},
                {"chunksSent", 700}}},
              {"result", {{"downtimeMs", 17}, {"switchoverMs", 41}, {"totalTimeMs", 2400}, {"targetState", "running"},
                          {"reason", nullptr}}}};
  json target{{"phase", "Succeeded"}, {"progress", {{"chunksReceived", 700}}}};
  json status;
  controller::copy_agent_status(status, source, target);
  EXPECT_EQ(status["progress"]["transferredBytes"], 600000000);
  EXPECT_EQ(status["progress"]["percent"], 99);
  EXPECT_EQ(status["progress"]["throughputBytesPerSecond"], 250000001);
  EXPECT_EQ(status["progress"]["dirtyRateBytesPerSecond"], 1500000);
  EXPECT_EQ(status["progress"]["passes"], 4);
  EXPECT_EQ(status["progress"]["chunksReceived"], 700);
  EXPECT_EQ(status["transport"], "tcp");
  EXPECT_EQ(status["chunkSize"], "1Mi");
  EXPECT_EQ(status["downtimeMs"], 17);
  EXPECT_EQ(status["switchoverMs"], 41);
  EXPECT_EQ(status["targetState"], "running");
}

TEST(StatusMapping, NullFiguresAreLeftOutAndZeroRateBecomesTheAverage) {
  json source{{"phase", "Succeeded"},
              {"progress", {{"transferredBytes", 1000000}, {"throughputBytesPerSecond", 0}}},
              {"result", {{"downtimeMs", nullptr}, {"switchoverMs", nullptr}, {"totalTimeMs", 2000}}}};
  json status;
  controller::copy_agent_status(status, source, json::object());
  EXPECT_FALSE(status.contains("downtimeMs"));
  EXPECT_FALSE(status.contains("switchoverMs"));
  EXPECT_EQ(status["progress"]["throughputBytesPerSecond"], 500000);
}

TEST(StatusMapping, RailsFromBothAgentsAreMatchedByIndexAndBounded) {
  auto rail = [](int i, const char* dev, const char* addr, const char* peer, json channels, uint64_t sent,
                 uint64_t received) {
    return json{{"rail", i},
                {"device", dev},
                {"gid", std::string("::ffff:") + addr},
                {"address", addr},
                {"peerAddress", peer},
                {"channels", std::move(channels)},
                {"bytesSent", sent},
                {"bytesReceived", received},
                {"chunksSent", sent / 100},
                {"chunksReceived", received / 100},
                {"throughputBytesPerSecond", (sent + received) / 2}};
  };
  json source{{"phase", "Succeeded"},
              {"rails", {rail(0, "rxea", "10.0.0.1", "10.0.0.2", {0, 2}, 700, 3),
                         rail(1, "rxea2", "10.1.0.1", "10.1.0.2", {1}, 300, 1)}},
              {"railsLeftOut", json::array()}};
  json target{{"phase", "Succeeded"},
              {"rails", {rail(1, "rxeb2", "10.1.0.2", "10.1.0.1", {1}, 1, 300),
                         rail(0, "rxeb", "10.0.0.2", "10.0.0.1", {0, 2}, 3, 700)}},
              {"railsLeftOut", {{{"rail", 2}, {"reason", "no-device"}, {"message", "RDMA device mlx5_2 port 1 is not active"}}}}};
  json status;
  controller::copy_agent_status(status, source, target);
  ASSERT_EQ(status["rails"].size(), 2u);
  EXPECT_EQ(status["rails"][0], (json{{"rail", 0}, {"channels", {0, 2}}, {"bytes", 700}, {"chunks", 7},
                                      {"throughputBytesPerSecond", 351}, {"sourceDevice", "rxea"},
                                      {"sourceGid", "::ffff:10.0.0.1"}, {"sourceAddress", "10.0.0.1"},
                                      {"targetAddress", "10.0.0.2"}, {"targetDevice", "rxeb"},
                                      {"targetGid", "::ffff:10.0.0.2"}}));
  EXPECT_EQ(status["rails"][1]["targetDevice"], "rxeb2");
  EXPECT_EQ(status["rails"][1]["bytes"], 300);
  EXPECT_EQ(status["railsLeftOut"], (json{{{"side", "target"}, {"rail", 2}, {"reason", "no-device"},
                                           {"message", "RDMA device mlx5_2 port 1 is not active"}}}));

  // Over TCP: no rails, no field.
  json tcp;
  controller::copy_agent_status(tcp, json{{"phase", "Migrating"}, {"rails", json::array()}}, json::object());
  EXPECT_FALSE(tcp.contains("rails"));
  EXPECT_FALSE(tcp.contains("railsLeftOut"));

  // A broken or hostile agent: wrong types, duplicate and out-of-range rails, huge arrays and
  // strings. What the CRD would refuse never reaches the status; the rest is bounded.
  json junk = json::array();
  junk.push_back("rail");
  junk.push_back(json{{"rail", -1}});
  junk.push_back(json{{"rail", 16}});
  junk.push_back(json{{"rail", 3}, {"device", std::string(65, 'x')}, {"bytesSent", -5}, {"channels", "0,1"}});
  junk.push_back(json{{"rail", 3}, {"device", "second-entry-ignored"}});
  json many_channels = json::array();
  for (int i = 0; i < 1000; ++i) many_channels.push_back(i % 70);
  junk.push_back(json{{"rail", 4}, {"channels", many_channels}, {"address", 7}});
  for (int i = 0; i < 100; ++i) junk.push_back(json{{"rail", i % 20}});
  json left_junk = json::array();
  for (int i = 0; i < 100; ++i) left_junk.push_back(json{{"rail", i % 16}, {"message", std::string(600, 'm')}});
  json hostile;
  controller::copy_agent_status(hostile, json{{"rails", junk}, {"railsLeftOut", left_junk}}, json{{"rails", 42}});
  ASSERT_TRUE(hostile["rails"].is_array());
  EXPECT_LE(hostile["rails"].size(), controller::kMaxStatusRails);
  for (const auto& r : hostile["rails"]) {
    EXPECT_LT(r["rail"].get<int64_t>(), 16);
    EXPECT_GE(r["rail"].get<int64_t>(), 0);
    EXPECT_FALSE(r.contains("sourceAddress"));
    if (r.contains("channels")) {
      EXPECT_LE(r["channels"].size(), controller::kMaxStatusRailChannels);
      for (const auto& c : r["channels"]) EXPECT_LE(c.get<int64_t>(), 64);
    }
  }
  const auto three = std::find_if(hostile["rails"].begin(), hostile["rails"].end(),
                                  [](const json& r) { return r["rail"] == 3; });
  ASSERT_NE(three, hostile["rails"].end());
  EXPECT_EQ(*three, (json{{"rail", 3}}));  // over-long device, negative bytes, channels not an array
  EXPECT_EQ(hostile["railsLeftOut"].size(), controller::kMaxStatusRails);
  for (const auto& r : hostile["railsLeftOut"]) EXPECT_FALSE(r.contains("message"));
}

TEST(StatusMapping, JudgeCombinesBothSides) {
  using controller::Outcome;
  auto side = [](const char* phase, const char* reason = nullptr) {
    return json{{"phase", phase}, {"result", {{"reason", reason ? json(reason) : json(nullptr)}}}};
  };
  EXPECT_EQ(controller::judge(side("Succeeded"), side("Succeeded")).outcome, Outcome::kSucceeded);
  EXPECT_EQ(controller::judge(side("Succeeded"), side("Migrating")).outcome, Outcome::kRunning);
  EXPECT_EQ(controller::judge(side("Migrating"), side("Migrating")).outcome, Outcome::kRunning);
  auto f = controller::judge(side("Failed", "peer closed"), side("Failed", "QEMU error: x"));
  EXPECT_EQ(f.outcome, Outcome::kFailed);
  EXPECT_NE(f.reason.find("source agent: migration failed: peer closed"), std::string::npos);
  EXPECT_NE(f.reason.find("target agent: migration failed: QEMU error: x"), std::string::npos);
  EXPECT_EQ(controller::judge(side("Cancelled", "api"), side("Migrating")).outcome, Outcome::kCancelled);
  EXPECT_EQ(controller::judge(side("Migrating"), side("Failed", "x")).outcome, Outcome::kFailed);
}

TEST(StatusMapping, ConditionTransitionTimeChangesOnlyWithStatus) {
  json status;
  controller::set_condition(status, "Admitted", "False", "WaitingForNodeSlot", "busy", 1, "T1");
  controller::set_condition(status, "Admitted", "False", "WaitingForNodeSlot", "still busy", 1, "T2");
  ASSERT_EQ(status["conditions"].size(), 1u);
  EXPECT_EQ(status["conditions"][0]["lastTransitionTime"], "T1");
  EXPECT_EQ(status["conditions"][0]["message"], "still busy");
  controller::set_condition(status, "Admitted", "True", "Admitted", "ok", 2, "T3");
  EXPECT_EQ(status["conditions"][0]["lastTransitionTime"], "T3");
  EXPECT_EQ(status["conditions"][0]["observedGeneration"], 2);
}

TEST(AgentDiscovery, PicksTheReadyPodOnTheNodeAndItsNamedPort) {
  auto pod = [](const char* name, const char* node, const char* phase, bool ready, int port) {
    json p;
    p["metadata"]["name"] = name;
    p["spec"]["nodeName"] = node;
    p["spec"]["containers"] = json::array({json{{"name", "agent"}, {"ports", json::array({json{{"name", "api"}, {"containerPort", port}}})}}});
    p["status"]["phase"] = phase;
    p["status"]["podIP"] = "10.0.0.9";
    p["status"]["conditions"] = json::array({json{{"type", "Ready"}, {"status", ready ? "True" : "False"}}});
    return p;
  };
  json list;
  list["items"] = json::array({pod("old", "n1", "Running", false, 1), pod("good", "n1", "Running", true, 7555),
                               pod("elsewhere", "n2", "Running", true, 7470)});
  auto a = controller::select_agent_pod(list, "n1", "api", 7470);
  ASSERT_TRUE(a.ok()) << a.error().message;
  EXPECT_EQ(a->pod, "good");
  EXPECT_EQ(a->address(), "10.0.0.9:7555");
  EXPECT_EQ(controller::AgentAddress::from_json(a->to_json()).port, 7555);
  auto fallback = controller::select_agent_pod(list, "n1", "web", 7470);
  EXPECT_EQ(fallback->port, 7470) << "no port with that name: the default";
  json pending;
  pending["items"] = json::array({pod("old", "n1", "Pending", false, 1)});
  auto none = controller::select_agent_pod(pending, "n1", "api", 1);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().message.find("old (Pending, not ready)"), std::string::npos);
  EXPECT_FALSE(controller::agent_draining(none.error()));
  // The node's agent drains (SIGTERM in a rollout: deleting, not ready, still Running): new work
  // waits for its replacement (kUnavailable, not kNotFound); reading its records still reaches it.
  json draining;
  auto old = pod("rdmig-agent-old", "n1", "Running", false, 7470);
  old["metadata"]["deletionTimestamp"] = "2026-12-05T03:00:00Z";
  draining["items"] = json::array({old});
  auto wait = controller::select_agent_pod(draining, "n1", "api", 1);
  ASSERT_FALSE(wait.ok());
  EXPECT_EQ(wait.error().code, Errc::kUnavailable);
  EXPECT_TRUE(controller::agent_draining(wait.error())) << wait.error().message;
  EXPECT_NE(wait.error().message.find("rdmig-agent-old on node 'n1' is terminating"), std::string::npos);
  auto read = controller::select_agent_pod(draining, "n1", "api", 1, /*draining_ok=*/true);
  ASSERT_TRUE(read.ok()) << read.error().message;
  EXPECT_EQ(read->pod, "rdmig-agent-old");
  // Its replacement, once Ready, is the one picked for new work.
  draining["items"].push_back(pod("rdmig-agent-new", "n1", "Running", true, 7470));
  auto next = controller::select_agent_pod(draining, "n1", "api", 1);
  ASSERT_TRUE(next.ok()) << next.error().message;
  EXPECT_EQ(next->pod, "rdmig-agent-new");
  EXPECT_FALSE(controller::agent_draining(Error{Errc::kUnavailable, "listing agent pods: connection refused"}));
}

TEST(ControllerConfig, DefaultsAndValidationNameTheKey) {
  auto def = controller::parse_controller_config("");
  ASSERT_TRUE(def.ok());
  EXPECT_EQ(def->agents.port, 7470);
  EXPECT_EQ(def->max_concurrent_per_node, 2u);
  EXPECT_EQ(def->metrics.port, 8443);
  EXPECT_TRUE(def->metrics.secure) << "/metrics is authenticated unless a config says otherwise";
  EXPECT_EQ(def->metrics.address, "0.0.0.0");
  EXPECT_EQ(def->probes.port, 8081);
  EXPECT_EQ(def->agents.labels.at("app.kubernetes.io/name"), "rdmig-agent");
  auto bad = [](const char* yaml) { return controller::parse_controller_config(yaml).error().message; };
  EXPECT_NE(bad("agents: {prot: 1}").find("'agents.prot': unknown key"), std::string::npos);
  EXPECT_NE(bad("maxConcurrentPerNode: 0").find("'maxConcurrentPerNode'"), std::string::npos);
  EXPECT_NE(bad("agents: {labelSelector: 'a!=b'}").find("agents.labelSelector"), std::string::npos);
  EXPECT_NE(bad("leaderElection: {leaseDurationSeconds: 5, renewDeadlineSeconds: 6}").find("renewDeadlineSeconds"),
            std::string::npos);
  EXPECT_NE(bad("logLevel: loud").find("'logLevel'"), std::string::npos);
  EXPECT_NE(bad("leaderElection: {enabled: maybe}").find("leaderElection.enabled"), std::string::npos);
}

TEST(ControllerConfig, PlainMetricsListenOnLoopbackOnly) {
  auto local = controller::parse_controller_config("metrics: {secure: false}");
  ASSERT_TRUE(local.ok()) << local.error().message;
  EXPECT_EQ(local->metrics.address, "127.0.0.1") << "secure false without an address: loopback";
  for (const char* a : {"127.0.0.1", "127.1.2.3", "::1", "localhost"}) {
    auto c = controller::parse_controller_config(std::string("metrics: {secure: false, address: '") + a + "'}");
    EXPECT_TRUE(c.ok()) << a;
  }
  auto bad = [](const std::string& yaml) { return controller::parse_controller_config(yaml).error().message; };
  for (const char* a : {"0.0.0.0", "10.0.0.1", "::", "128.0.0.1", "127.0.0.1.5", "localhost.example"}) {
    EXPECT_NE(bad(std::string("metrics: {secure: false, address: '") + a + "'}").find("'metrics.address'"),
              std::string::npos) << a;
  }
  EXPECT_NE(bad("metrics: {tls: {certFile: /c.pem}}").find("'metrics.tls.keyFile'"), std::string::npos);
  EXPECT_NE(bad("metrics: {secure: false, tls: {certFile: /c, keyFile: /k}}").find("'metrics.tls'"), std::string::npos);
  EXPECT_NE(bad("metrics: {authCacheEntries: 0}").find("'metrics.authCacheEntries'"), std::string::npos);
  EXPECT_NE(bad("probes: {port: 8443}").find("'probes.port'"), std::string::npos);
  EXPECT_NE(bad("metrics: {secure: sometimes}").find("'metrics.secure'"), std::string::npos);
}

TEST(ControllerConfig, ShippedExampleParses) {
  auto c = controller::load_controller_config_file(rdmig_test::source_dir() + "/controller/controller.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_TRUE(c->leader_election.enabled);
}
