#include "k8s/http_kube_client.h"

#include <httplib.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <fstream>
#include <sstream>

#include "common/log.h"
#include "common/text.h"

namespace rdmig::k8s {

using nlohmann::json;

Error api_error(int http_status, const std::string& what, const json& body) {
  std::string reason, message;
  if (body.is_object()) {
    reason = body.value("reason", "");
    message = body.value("message", "");
  }
  const std::string detail = what + ": HTTP " + std::to_string(http_status) +
                             (reason.empty() ? "" : " " + reason) + (message.empty() ? "" : ": " + message);
  switch (http_status) {
    case 401: return Error{Errc::kUnauthenticated, detail};
    case 403: return Error{Errc::kPermissionDenied, detail};
    case 404: return Error{Errc::kNotFound, detail};
    case 409: return Error{reason == "AlreadyExists" ? Errc::kAlreadyExists : Errc::kFailedPrecondition, detail};
    case 410: return Error{Errc::kFailedPrecondition, detail + " (Gone)"};
    case 400:
    case 422: return Error{Errc::kInvalidArgument, detail};
    case 429: return Error{Errc::kResourceExhausted, detail};
    default: return Error{http_status >= 500 ? Errc::kUnavailable : Errc::kInternal, detail};
  }
}

namespace {

using X509Ptr = std::unique_ptr<X509, decltype(&X509_free)>;
using KeyPtr = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;
using BioPtr = std::unique_ptr<BIO, decltype(&BIO_free)>;

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A fresh X509_STORE holding every certificate of a PEM bundle; the SSL context takes it.
X509_STORE* store_from_pem(const std::string& pem, int* count) {
  BioPtr bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), BIO_free);
  X509_STORE* store = X509_STORE_new();
  *count = 0;
  while (X509* cert = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
    X509_STORE_add_cert(store, cert);
    X509_free(cert);
    ++*count;
  }
  return store;
}

}  // namespace

HttpKubeClient::HttpKubeClient(ClusterConfig config, ServerAddress address, HttpOptions options)
    : config_(std::move(config)), address_(std::move(address)), options_(std::move(options)) {}

HttpKubeClient::~HttpKubeClient() { stop_watches(); }

Result<std::unique_ptr<HttpKubeClient>> HttpKubeClient::create(ClusterConfig config, HttpOptions options) {
  auto address = parse_server_url(config.server);
  if (!address) return address.error();
  // Load file-based material once so that mistakes show at start-up, not on the first call.
  if (!config.ca_file.empty() && config.ca_data.empty()) {
    config.ca_data = read_all(config.ca_file);
    if (config.ca_data.empty()) {
      return Error{Errc::kInvalidArgument, "CA bundle '" + config.ca_file + "' is missing or empty"};
    }
  }
  if (!config.ca_data.empty()) {
    int n = 0;
    X509_STORE_free(store_from_pem(config.ca_data, &n));
    if (n == 0) return Error{Errc::kInvalidArgument, "CA bundle holds no PEM certificate"};
  }
  if (!config.client_cert_file.empty()) config.client_cert_data = read_all(config.client_cert_file);
  if (!config.client_key_file.empty()) config.client_key_data = read_all(config.client_key_file);
  if (address->tls && config.ca_data.empty() && !config.insecure_skip_tls_verify) {
    LOG_WARN("k8s") << "no CA bundle configured for " << config.server << ": using the system trust store";
  }
  auto client = std::unique_ptr<HttpKubeClient>(
      new HttpKubeClient(std::move(config), std::move(address.value()), std::move(options)));
  if (auto tok = client->bearer_token(); !tok) return tok.error();
  if (auto c = client->make_client(1); !c) return c.error();
  return client;
}

Result<std::string> HttpKubeClient::bearer_token() const {
  if (!config_.token_file.empty()) {
    auto text = read_text_file(config_.token_file, "token file");
    if (!text) return Error{Errc::kUnauthenticated, text.error().message};
    return trim(text.value());
  }
  return config_.token;
}

Result<std::unique_ptr<httplib::ClientImpl>> HttpKubeClient::make_client(int read_timeout_seconds) const {
  std::unique_ptr<httplib::ClientImpl> client;
  if (address_.tls) {
    std::unique_ptr<httplib::SSLClient> ssl;
    if (!config_.client_cert_data.empty()) {
      BioPtr cb(BIO_new_mem_buf(config_.client_cert_data.data(), static_cast<int>(config_.client_cert_data.size())),
                BIO_free);
      BioPtr kb(BIO_new_mem_buf(config_.client_key_data.data(), static_cast<int>(config_.client_key_data.size())),
                BIO_free);
      X509Ptr cert(PEM_read_bio_X509(cb.get(), nullptr, nullptr, nullptr), X509_free);
      KeyPtr key(PEM_read_bio_PrivateKey(kb.get(), nullptr, nullptr, nullptr), EVP_PKEY_free);
      if (!cert || !key) return Error{Errc::kInvalidArgument, "client certificate or key is not valid PEM"};
      ssl = std::make_unique<httplib::SSLClient>(address_.host, address_.port, cert.get(), key.get());
    } else {
      ssl = std::make_unique<httplib::SSLClient>(address_.host, address_.port);
    }
    if (!ssl->is_valid()) return Error{Errc::kInternal, "cannot create a TLS client context"};
    if (config_.insecure_skip_tls_verify) {
      ssl->enable_server_certificate_verification(false);
    } else {
      ssl->enable_server_certificate_verification(true);
      if (!config_.ca_data.empty()) {
        int n = 0;
        ssl->set_ca_cert_store(store_from_pem(config_.ca_data, &n));
      }
    }
    client = std::move(ssl);
  } else {
    client = std::make_unique<httplib::ClientImpl>(address_.host, address_.port);
  }
  client->set_connection_timeout(std::chrono::seconds(5));
  client->set_read_timeout(std::chrono::seconds(read_timeout_seconds));
  client->set_write_timeout(std::chrono::seconds(options_.request_timeout_seconds));
  return client;
}

Result<std::unique_ptr<httplib::ClientImpl>> HttpKubeClient::make_call_client() const {
  auto client = make_client(options_.request_timeout_seconds);
  if (!client || options_.call_timeout.count() <= 0) return client;
  (*client)->set_connection_timeout(options_.call_timeout);
  (*client)->set_read_timeout(options_.call_timeout);
  (*client)->set_write_timeout(options_.call_timeout);
  return client;
}

Result<json> HttpKubeClient::call(const char* method, const std::string& path, const json* body) {
  auto client = make_call_client();
  if (!client) return client.error();
  auto token = bearer_token();
  if (!token) return token.error();
  httplib::Headers headers{{"Accept", "application/json"}, {"User-Agent", options_.user_agent}};
  if (!token->empty()) headers.emplace("Authorization", "Bearer " + token.value());
  const std::string full = address_.base_path + path;
  // Replace, never throw: text from outside (node names, agents' messages) may hold invalid UTF-8.
  const std::string payload = body ? body->dump(-1, ' ', false, json::error_handler_t::replace) : std::string();
  const std::string what = std::string(method) + " " + path;
  const std::string m = method;
  auto& c = *client.value();
  httplib::Result res = m == "GET"    ? c.Get(full, headers)
                        : m == "POST" ? c.Post(full, headers, payload, "application/json")
                        : m == "PUT"  ? c.Put(full, headers, payload, "application/json")
                        : body        ? c.Delete(full, headers, payload, "application/json")
                                      : c.Delete(full, headers);
  if (!res) {
    return Error{Errc::kUnavailable, what + ": " + httplib::to_string(res.error()) + " (" + config_.server + ")"};
  }
  json parsed = json::parse(res->body, nullptr, false);
  if (res->status < 200 || res->status >= 300) return api_error(res->status, what, parsed);
  if (parsed.is_discarded()) return Error{Errc::kProtocol, what + ": response is not JSON"};
  return parsed;
}

Result<json> HttpKubeClient::get(const std::string& path) { return call("GET", path, nullptr); }
Result<json> HttpKubeClient::create(const std::string& path, const json& body) { return call("POST", path, &body); }
Result<json> HttpKubeClient::replace(const std::string& path, const json& body) { return call("PUT", path, &body); }
Result<json> HttpKubeClient::remove(const std::string& path, const json& options) {
  return call("DELETE", path, options.is_null() ? nullptr : &options);
}

Result<WatchEnd> HttpKubeClient::watch(const std::string& path,
                                       const std::function<bool(const WatchEvent&)>& on_event) {
  auto made = make_client(options_.watch_timeout_seconds + 30);
  if (!made) return made.error();
  std::unique_ptr<httplib::ClientImpl> client = std::move(made.value());
  {
    std::lock_guard lock(watches_mu_);
    if (stopping_) return WatchEnd::kStopped;
    watches_.insert(client.get());
  }
  struct Unregister {
    HttpKubeClient* self;
    httplib::ClientImpl* c;
    ~Unregister() {
      std::lock_guard lock(self->watches_mu_);
      self->watches_.erase(c);
    }
  } unregister{this, client.get()};

  auto token = bearer_token();
  if (!token) return token.error();
  httplib::Headers headers{{"Accept", "application/json"}, {"User-Agent", options_.user_agent}};
  if (!token->empty()) headers.emplace("Authorization", "Bearer " + token.value());
  const std::string full = address_.base_path + path + (path.find('?') == std::string::npos ? "?" : "&") +
                           "timeoutSeconds=" + std::to_string(options_.watch_timeout_seconds);

  std::string buffer, error_body;
  WatchEnd end = WatchEnd::kClosed;
  bool handler_stopped = false;
  int status = 0;
  auto res = client->Get(
      full, headers,
      [&](const httplib::Response& response) {
        status = response.status;
        return true;
      },
      [&](const char* data, size_t len) {
        if (status != 200) {
          error_body.append(data, len);
          return error_body.size() < 65536;
        }
        buffer.append(data, len);
        size_t nl;
        while ((nl = buffer.find('\n')) != std::string::npos) {
          const std::string line = buffer.substr(0, nl);
          buffer.erase(0, nl + 1);
          if (trim(line).empty()) continue;
          json ev = json::parse(line, nullptr, false);
          if (ev.is_discarded() || !ev.is_object()) {
            LOG_WARN("k8s") << "watch " << path << ": skipping a line that is not JSON";
            continue;
          }
          WatchEvent we{ev.value("type", ""), ev.value("object", json::object())};
          if (we.type == "ERROR") {
            const int code = we.object.value("code", 0);
            LOG_INFO("k8s") << "watch " << path << ": ERROR event code=" << code << " "
                            << we.object.value("message", "");
            end = code == 410 ? WatchEnd::kExpired : WatchEnd::kClosed;
            return false;
          }
          if (!on_event(we)) {
            handler_stopped = true;
            return false;
          }
        }
        return true;
      });
  {
    std::lock_guard lock(watches_mu_);
    if (stopping_) return WatchEnd::kStopped;
  }
  if (handler_stopped) return WatchEnd::kStopped;
  if (status == 410) return WatchEnd::kExpired;
  if (status != 0 && status != 200) {
    return api_error(status, "watch " + path, json::parse(error_body, nullptr, false));
  }
  if (!res && status == 0) {
    return Error{Errc::kUnavailable, "watch " + path + ": " + httplib::to_string(res.error())};
  }
  return end;
}

void HttpKubeClient::stop_watches() {
  std::lock_guard lock(watches_mu_);
  stopping_ = true;
  for (auto* c : watches_) c->stop();
}

}  // namespace rdmig::k8s
