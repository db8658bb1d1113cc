#include "k8s/cluster_config.h"
#include "common/text.h"

#include <yaml-cpp/yaml.h>

#include <optional>

namespace rdmig::k8s {

namespace {

Error bad(const std::string& key, const std::string& what) {
  return Error{Errc::kInvalidArgument, "kubeconfig: " + key + ": " + what};
}

std::string resolve(const std::string& base_dir, const std::string& path) {
  if (path.empty() || path.front() == '/' || base_dir.empty()) return path;
  return base_dir + "/" + path;
}

// Finds the entry named `name` in a kubeconfig list (clusters, users, contexts).
std::optional<YAML::Node> find_named(const YAML::Node& list, const std::string& name) {
  if (!list || !list.IsSequence()) return std::nullopt;
  for (const auto& item : list) {
    if (item.IsMap() && item["name"] && item["name"].as<std::string>() == name) return item;
  }
  return std::nullopt;
}

std::string str(const YAML::Node& n, const char* key) {
  const auto v = n[key];
  return v && v.IsScalar() ? v.as<std::string>() : std::string();
}

}  // namespace

Result<std::string> base64_decode(const std::string& text, const std::string& field) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+' || c == '-') return 62;
    if (c == '/' || c == '_') return 63;
    return -1;
  };
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  bool padding = false;
  for (char c : text) {
    if (c == ' ' || c == '\n' || c == '\r' || c == '\t') continue;
    if (c == '=') {
      padding = true;
      continue;
    }
    const int v = value(c);
    if (v < 0 || padding) return Error{Errc::kInvalidArgument, field + ": not valid base64"};
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  if (bits >= 6) return Error{Errc::kInvalidArgument, field + ": truncated base64"};
  return out;
}

Result<ServerAddress> parse_server_url(const std::string& url) {
  ServerAddress a;
  std::string rest;
  if (url.rfind("https://", 0) == 0) {
    a.tls = true;
    a.port = 443;
    rest = url.substr(8);
  } else if (url.rfind("http://", 0) == 0) {
    a.tls = false;
    a.port = 80;
    rest = url.substr(7);
  } else {
    return Error{Errc::kInvalidArgument, "server: expected an http:// or https:// URL, got '" + url + "'"};
  }
  const auto slash = rest.find('/');
  std::string hostport = rest.substr(0, slash);
  if (slash != std::string::npos) {
    a.base_path = rest.substr(slash);
    while (!a.base_path.empty() && a.base_path.back() == '/') a.base_path.pop_back();
  }
  std::string port_text;
  if (!hostport.empty() && hostport.front() == '[') {
    const auto close = hostport.find(']');
    if (close == std::string::npos) return Error{Errc::kInvalidArgument, "server: bad IPv6 literal in '" + url + "'"};
    a.host = hostport.substr(1, close - 1);
    if (close + 1 < hostport.size()) {
      if (hostport[close + 1] != ':') return Error{Errc::kInvalidArgument, "server: bad address '" + url + "'"};
      port_text = hostport.substr(close + 2);
    }
  } else {
    const auto colon = hostport.rfind(':');
    a.host = hostport.substr(0, colon);
    if (colon != std::string::npos) port_text = hostport.substr(colon + 1);
  }
  if (a.host.empty()) return Error{Errc::kInvalidArgument, "server: no host in '" + url + "'"};
  if (!port_text.empty()) {
    if (port_text.find_first_not_of("0123456789") != std::string::npos || port_text.size() > 5) {
      return Error{Errc::kInvalidArgument, "server: bad port in '" + url + "'"};
    }
    a.port = std::stoi(port_text);
    if (a.port < 1 || a.port > 65535) return Error{Errc::kInvalidArgument, "server: bad port in '" + url + "'"};
  }
  return a;
}

Result<ClusterConfig> parse_kubeconfig(const std::string& yaml_text, const std::string& base_dir,
                                       const std::string& context) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    return Error{Errc::kInvalidArgument, std::string("kubeconfig: not valid YAML: ") + e.what()};
  }
  if (!root.IsMap()) return bad("<root>", "expected a mapping");
  try {
    const std::string ctx_name = context.empty() ? str(root, "current-context") : context;
    if (ctx_name.empty()) return bad("current-context", "not set and no context given");
    const auto ctx_entry = find_named(root["contexts"], ctx_name);
    if (!ctx_entry) return bad("contexts", "no context named '" + ctx_name + "'");
    const auto ctx = (*ctx_entry)["context"];
    if (!ctx || !ctx.IsMap()) return bad("contexts[" + ctx_name + "].context", "missing");
    const std::string cluster_name = str(ctx, "cluster");
    const std::string user_name = str(ctx, "user");
    const auto cluster_entry = find_named(root["clusters"], cluster_name);
    if (!cluster_entry || !(*cluster_entry)["cluster"] || !(*cluster_entry)["cluster"].IsMap()) {
      return bad("clusters", "no cluster named '" + cluster_name + "' (context '" + ctx_name + "')");
    }
    const auto cluster = (*cluster_entry)["cluster"];
    ClusterConfig c;
    c.namespace_ = str(ctx, "namespace");
    c.server = str(cluster, "server");
    if (c.server.empty()) return bad("clusters[" + cluster_name + "].cluster.server", "required");
    RDMIG_TRY(parse_server_url(c.server));
    c.ca_file = resolve(base_dir, str(cluster, "certificate-authority"));
    if (const auto data = str(cluster, "certificate-authority-data"); !data.empty()) {
      auto pem = base64_decode(data, "kubeconfig: clusters[" + cluster_name + "].cluster.certificate-authority-data");
      if (!pem) return pem.error();
      c.ca_data = pem.value();
    }
    c.insecure_skip_tls_verify = str(cluster, "insecure-skip-tls-verify") == "true";

    if (!user_name.empty()) {
      const auto user_entry = find_named(root["users"], user_name);
      if (!user_entry) return bad("users", "no user named '" + user_name + "' (context '" + ctx_name + "')");
      const auto user = (*user_entry)["user"];
      if (user && user.IsMap()) {
        const std::string up = "users[" + user_name + "].user.";
        if (user["exec"] || user["auth-provider"]) {
          return bad(up + (user["exec"] ? "exec" : "auth-provider"),
                     "credential plugins are not supported; use a token or a client certificate");
        }
        c.token = str(user, "token");
        c.token_file = resolve(base_dir, str(user, "tokenFile"));
        c.client_cert_file = resolve(base_dir, str(user, "client-certificate"));
        c.client_key_file = resolve(base_dir, str(user, "client-key"));
        if (const auto d = str(user, "client-certificate-data"); !d.empty()) {
          auto pem = base64_decode(d, "kubeconfig: " + up + "client-certificate-data");
          if (!pem) return pem.error();
          c.client_cert_data = pem.value();
        }
        if (const auto d = str(user, "client-key-data"); !d.empty()) {
          auto pem = base64_decode(d, "kubeconfig: " + up + "client-key-data");
          if (!pem) return pem.error();
          c.client_key_data = pem.value();
        }
        const bool has_cert = !c.client_cert_file.empty() || !c.client_cert_data.empty();
        const bool has_key = !c.client_key_file.empty() || !c.client_key_data.empty();
        if (has_cert != has_key) return bad(up + "client-key", "a client certificate needs its key (and vice versa)");
      }
    }
    return c;
  } catch (const YAML::Exception& e) {
    return Error{Errc::kInvalidArgument, std::string("kubeconfig: ") + e.what()};
  }
}

Result<ClusterConfig> load_kubeconfig_file(const std::string& path, const std::string& context) {
  auto text = read_text_file(path, "kubeconfig");
  if (!text) return text.error();
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
  return parse_kubeconfig(text.value(), dir, context);
}

Result<ClusterConfig> in_cluster_config(const std::map<std::string, std::string>& env,
                                        const std::string& sa_dir) {
  auto get = [&](const char* k) {
    auto it = env.find(k);
    return it == env.end() ? std::string() : it->second;
  };
  const std::string host = get("KUBERNETES_SERVICE_HOST");
  const std::string port = get("KUBERNETES_SERVICE_PORT");
  if (host.empty() || port.empty()) {
    return Error{Errc::kFailedPrecondition,
                 "in-cluster config: KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not set "
                 "(not running in a pod? pass --kubeconfig)"};
  }
  ClusterConfig c;
  const bool v6 = host.find(':') != std::string::npos;
  c.server = "https://" + (v6 ? "[" + host + "]" : host) + ":" + port;
  RDMIG_TRY(parse_server_url(c.server));
  c.token_file = sa_dir + "/token";
  c.ca_file = sa_dir + "/ca.crt";
  auto token = read_text_file(c.token_file, "in-cluster config: service-account token");
  if (!token) return token.error();
  if (trim(token.value()).empty()) {
    return Error{Errc::kInvalidArgument, "in-cluster config: service-account token '" + c.token_file + "' is empty"};
  }
  auto ca = read_text_file(c.ca_file, "in-cluster config: CA bundle");
  if (!ca) return ca.error();
  if (auto ns = read_text_file(sa_dir + "/namespace", "namespace"); ns) c.namespace_ = trim(ns.value());
  return c;
}

}  // namespace rdmig::k8s
