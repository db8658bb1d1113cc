#include "api/rest_server.h"

#include <httplib.h>

#include <mutex>
#include <optional>
#include <string_view>

#include "api/http_front.h"
#include "api/models.h"
#include "common/json_limits.h"
#include "common/log.h"
#include "common/units.h"
#include "qemu/dirty_rate.h"
#include "qemu/guest_ram.h"

namespace rdmig::api {

using nlohmann::json;

namespace {

// Never throws: text from outside (a path with %ff, a field cut inside a UTF-8 character)
// is written with U+FFFD in place of invalid bytes instead of aborting the agent.
std::string safe_dump(const json& body) {
  return body.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
}

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(safe_dump(body), "application/json");
}

void send_error(httplib::Response& res, const Error& e) {
  const bool draining = e.code == Errc::kUnavailable && e.message.starts_with("agent draining");
  send_json(res, http_status(e.code), error_body(e, draining ? "AgentDraining" : ""));
  // 503 here means "not now" (the agent drains or shuts down): when to ask again, as RFC 9110
  // 10.2.3 lets a server say; a draining agent's replacement is typically up within this.
  if (res.status == 503) res.set_header("Retry-After", "30");
}

// The client whose request this worker thread is serving, counted in client_requests_; empty
// when the request was not counted (refused by the per-client cap, or none).
thread_local std::string tl_counted_client;

// Strict UTF-8 (no overlongs, no surrogates, nothing past U+10FFFF).
bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, cp = c & 0x07;
    } else {
      return false;
    }
    for (size_t k = 1; k <= n; ++k) {
      if (i + k >= s.size()) return false;
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

// Text from the request line and headers that the handlers and the logs will read: it must be
// UTF-8 without control characters (a NUL cannot hide the rest of a header from a comparison).
std::optional<Error> check_request_text(const httplib::Request& req) {
  auto bad = [](std::string_view v) {
    if (!valid_utf8(v)) return "not valid UTF-8";
    for (const char c : v) {
      if (static_cast<unsigned char>(c) < 0x20 && c != '\t') return "contains a control character";
    }
    return static_cast<const char*>(nullptr);
  };
  if (const char* why = bad(req.path)) return Error{Errc::kInvalidArgument, std::string("path: ") + why};
  for (const auto& [name, value] : req.params) {
    if (const char* why = bad(name); why || (why = bad(value))) {
      return Error{Errc::kInvalidArgument, std::string("query parameter: ") + why};
    }
  }
  for (const auto& [name, value] : req.headers) {
    if (const char* why = bad(value)) {
      return Error{Errc::kInvalidArgument, "header " + (valid_utf8(name) ? name : std::string("?")) + ": " + why};
    }
  }
  return std::nullopt;
}

// The request's body as JSON, read here bounded whatever its framing (a chunked body would
// otherwise be read whole before any check). The front has already refused a Content-Length
// over the limit and a chunk size that takes the body past it (HttpFront, request_framing.h),
// before a byte of the body was read; this bound is the same limit, for the bytes themselves.
// nullopt: the error answer is already in `res`.
std::optional<json> read_json_body(httplib::Response& res, const httplib::ContentReader& content_reader,
                                   size_t limit) {
  std::string text;
  bool too_large = false;
  const bool read = content_reader([&](const char* data, size_t len) {
    if (text.size() + len > limit) {
      too_large = true;
      return false;  // stop reading; the connection is closed after the answer
    }
    text.append(data, len);
    return true;
  });
  if (too_large) {
    send_json(res, 413, error_body(Error{Errc::kInvalidArgument, "body: larger than api.maxBodyBytes (" +
                                                                     std::to_string(limit) + " bytes)"}));
    return std::nullopt;
  }
  if (!read) {
    // The body's framing was checked by the front: it ended short, or not within the deadline.
    send_error(res, Error{Errc::kInvalidArgument, "body: not complete (the connection ended, or " +
                                                      std::to_string(HttpFront::kRequestDeadline.count()) +
                                                      " s after connecting)"});
    return std::nullopt;
  }
  if (json_nesting_depth(text) > kMaxJsonDepth) {
    send_error(res, Error{Errc::kInvalidArgument, "body: nested deeper than " + std::to_string(kMaxJsonDepth) + " levels"});
    return std::nullopt;
  }
  json body = json::parse(text, nullptr, false);
  if (body.is_discarded()) {
    send_error(res, Error{Errc::kInvalidArgument, valid_utf8(text) ? "body: not valid JSON" : "body: not valid UTF-8"});
    return std::nullopt;
  }
  return body;
}

}  // namespace

namespace {

// httplib's request handling (parse, route, answer) on a stream the front gives it; the front
// does the accepting, TLS and the deadlines (api/http_front.h).
class Router final : public httplib::Server {
 public:
  void handle(httplib::Stream& strm) {
    bool closed = false;
    process_request(strm, /*close_connection=*/true, closed, nullptr);
  }
};

// HTTPS only when a certificate is given: the front then speaks nothing but TLS.
SSL_CTX* make_tls_context(const std::shared_ptr<tls::ServerCertificate>& cert) {
  if (!cert) return nullptr;
  SSL_CTX* ctx = SSL_CTX_new(TLS_server_method());
  if (ctx && !cert->configure(*ctx)) {
    SSL_CTX_free(ctx);
    return nullptr;
  }
  return ctx;
}

}  // namespace

void RestServer::TlsContextFree::operator()(SSL_CTX* ctx) const { SSL_CTX_free(ctx); }

RestServer::RestServer(const AgentConfig& config, std::shared_ptr<TokenSource> token, migration::MigrationManager& manager,
                       pathcheck::PathCheckManager& pathchecks, kubevirt::KubevirtRelay* kubevirt, Metrics& metrics, std::shared_ptr<tls::ServerCertificate> cert)
    : config_(config),
      token_(std::move(token)),
      manager_(manager),
      pathchecks_(pathchecks),
      kubevirt_(kubevirt),
      metrics_(metrics),
      cert_(std::move(cert)),
      tls_(make_tls_context(cert_)),
      server_(std::make_unique<Router>()),
      front_(std::make_unique<HttpFront>(tls_.get(), config_.api.max_body_bytes, [router = static_cast<Router*>(server_.get())](httplib::Stream& s) {
        router->handle(s);
      })) {
  routes();
}

RestServer::~RestServer() { stop(); }

Status RestServer::bind() {
  if (cert_ && !tls_) return Error{Errc::kInvalidArgument, "config key 'api.tls': cannot set up HTTPS with it"};
  if (auto st = front_->bind(config_.api.address, config_.api.port); !st) {
    return Error{Errc::kUnavailable, "api: cannot listen on " + config_.api.address + ":" +
                                         std::to_string(config_.api.port) + ": " + st.error().message};
  }
  port_ = front_->port();
  LOG_INFO("api") << "listening on " << config_.api.address << ":" << port_ << (cert_ ? " (HTTPS only)" : "");
  return ok_status();
}

void RestServer::serve() { front_->run(); }

void RestServer::stop() {
  if (front_) front_->stop();
}

void RestServer::routes() {
  auto& s = *server_;
  s.set_payload_max_length(config_.api.max_body_bytes);
  // One request per connection (Router::handle): after a refused body (413) the rest of it is
  // never read as further requests, and no client holds a worker by keeping a connection alive.
  // Timeouts and deadlines are the front's (HttpFront::kHeaderDeadline, kRequestDeadline).

  // Authentication for /v1: 401 without a bearer token, 403 with a wrong one.
  // The per-client cap: a request counts from the end of its headers (pre-routing) to the start
  // of its answer (post-routing). A request that ended without an answer on this worker is
  // uncounted when the worker takes its next request.
  auto uncount = [this] {
    if (tl_counted_client.empty()) return;
    std::lock_guard lock(clients_mu_);
    auto it = client_requests_.find(tl_counted_client);
    if (it != client_requests_.end() && --it->second <= 0) client_requests_.erase(it);
    tl_counted_client.clear();
  };
  s.set_post_routing_handler([uncount](const httplib::Request&, httplib::Response&) { uncount(); });
  s.set_pre_routing_handler([this, uncount](const httplib::Request& req, httplib::Response& res) {
    uncount();
    {
      std::lock_guard lock(clients_mu_);
      int& n = client_requests_[req.remote_addr];
      if (n >= kMaxRequestsPerClient) {
        if (n == 0) client_requests_.erase(req.remote_addr);
        send_error(res, Error{Errc::kResourceExhausted, "too many requests at once from " + req.remote_addr +
                                                            " (at most " + std::to_string(kMaxRequestsPerClient) +
                                                            " per client): retry later"});
        return httplib::Server::HandlerResponse::Handled;
      }
      ++n;
      tl_counted_client = req.remote_addr;
    }
    // Runs before any body is read: bad text and missing credentials cost the agent nothing.
    if (auto e = check_request_text(req)) {
      send_error(res, *e);
      return httplib::Server::HandlerResponse::Handled;
    }
    if (req.path.rfind("/v1/", 0) != 0 && req.path != "/v1") return httplib::Server::HandlerResponse::Unhandled;
    const auto auth = req.get_header_value("Authorization");
    const std::string prefix = "Bearer ";
    if (auth.rfind(prefix, 0) != 0) {
      res.set_header("WWW-Authenticate", "Bearer");
      send_error(res, Error{Errc::kUnauthenticated, "Authorization: a bearer token is required"});
      return httplib::Server::HandlerResponse::Handled;
    }
    if (!token_->accepts(auth.substr(prefix.size()))) {
      send_error(res, Error{Errc::kPermissionDenied, "Authorization: token is not valid"});
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });

  // The body is read here, bounded whatever its framing (read_json_body).
  s.Post("/v1/migrations", [this](const httplib::Request&, httplib::Response& res,
                                  const httplib::ContentReader& content_reader) {
    auto body = read_json_body(res, content_reader, config_.api.max_body_bytes);
    if (!body) return;
    auto spec = parse_create_request(*body, config_);
    if (!spec) {
      send_error(res, spec.error());
      return;
    }
    auto created = manager_.create(std::move(spec.value()));
    if (!created) {
      send_error(res, created.error());
      return;
    }
    res.set_header("Location", "/v1/migrations/" + created.value()["id"].get<std::string>());
    send_json(res, 201, created.value());
  });

  s.Get("/v1/migrations", [this](const httplib::Request&, httplib::Response& res) {
    json items = json::array();
    for (const auto& m : manager_.list()) items.push_back(migration::to_json(m));
    send_json(res, 200, json{{"items", items}});
  });

  s.Get(R"(/v1/migrations/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    auto st = manager_.get(req.matches[1]);
    if (!st) return send_error(res, st.error());
    send_json(res, 200, migration::to_json(st.value()));
  });

  s.Delete(R"(/v1/migrations/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    auto st = manager_.cancel(req.matches[1]);
    if (!st) return send_error(res, st.error());
    send_json(res, 202, migration::to_json(st.value()));
  });

  // Path checks (docs/pathcheck.md): the same authentication and body limits as migrations.
  s.Post("/v1/pathchecks", [this](const httplib::Request&, httplib::Response& res,
                                  const httplib::ContentReader& content_reader) {
    auto body = read_json_body(res, content_reader, config_.api.max_body_bytes);
    if (!body) return;
    auto spec = parse_pathcheck_request(*body, config_);
    if (!spec) return send_error(res, spec.error());
    auto created = pathchecks_.create(std::move(spec.value()));
    if (!created) return send_error(res, created.error());
    res.set_header("Location", "/v1/pathchecks/" + created.value()["id"].get<std::string>());
    send_json(res, 201, created.value());
  });
  s.Get("/v1/pathchecks", [this](const httplib::Request&, httplib::Response& res) {
    json items = json::array();
    for (const auto& c : pathchecks_.list()) items.push_back(pathcheck::to_json(c));
    send_json(res, 200, json{{"items", items}});
  });
  s.Get(R"(/v1/pathchecks/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    auto st = pathchecks_.get(req.matches[1]);
    if (!st) return send_error(res, st.error());
    send_json(res, 200, pathcheck::to_json(st.value()));
  });
  s.Delete(R"(/v1/pathchecks/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    auto st = pathchecks_.cancel(req.matches[1]);
    if (!st) return send_error(res, st.error());
    send_json(res, 202, pathcheck::to_json(st.value()));
  });

  // A bare-QEMU guest's dirty rate, measured by QEMU (docs/api.md, docs/drain.md): the same
  // qmpSocketRoots rule as a migration; the answer comes after calcSeconds; at most
  // kMaxDirtyRateMeasurements at once (429 beyond).
  s.Post("/v1/dirtyrate", [this](const httplib::Request&, httplib::Response& res,
                                 const httplib::ContentReader& content_reader) {
    auto body = read_json_body(res, content_reader, config_.api.max_body_bytes);
    if (!body) return;
    if (!body->is_object()) return send_error(res, Error{Errc::kInvalidArgument, "body: must be a JSON object"});
    for (const auto& [key, value] : body->items()) {
      if (key != "qmpSocket" && key != "calcSeconds" && key != "samplePages") {
        return send_error(res, Error{Errc::kInvalidArgument, "body: unknown field '" + key.substr(0, 64) + "'"});
      }
    }
    const auto sock = body->find("qmpSocket");
    if (sock == body->end() || !sock->is_string() || sock->get<std::string>().empty() ||
        sock->get<std::string>().size() > 4096) {
      return send_error(res, Error{Errc::kInvalidArgument, "qmpSocket: required, a path of at most 4096 bytes"});
    }
    uint32_t seconds = 1;
    if (const auto c = body->find("calcSeconds"); c != body->end()) {
      if (!c->is_number_integer() || c->get<int64_t>() < 1 || c->get<int64_t>() > qemu::kMaxDirtyRateSeconds) {
        return send_error(res, Error{Errc::kInvalidArgument, "calcSeconds: an integer between 1 and " +
                                                                 std::to_string(qemu::kMaxDirtyRateSeconds)});
      }
      seconds = static_cast<uint32_t>(c->get<int64_t>());
    }
    uint32_t sample_pages = qemu::kDefaultSamplePages;
    if (const auto p = body->find("samplePages"); p != body->end()) {
      if (!p->is_number_integer() || p->get<int64_t>() < qemu::kMinSamplePages ||
          p->get<int64_t>() > qemu::kMaxSamplePages) {
        return send_error(res, Error{Errc::kInvalidArgument, "samplePages: an integer between " +
                                                                 std::to_string(qemu::kMinSamplePages) + " and " +
                                                                 std::to_string(qemu::kMaxSamplePages)});
      }
      sample_pages = static_cast<uint32_t>(p->get<int64_t>());
    }
    auto path = migration::resolve_qmp_socket(sock->get<std::string>(), config_.migration.qmp_socket_roots);
    if (!path) return send_error(res, path.error());
    if (dirty_rate_running_.fetch_add(1) >= kMaxDirtyRateMeasurements) {
      dirty_rate_running_.fetch_sub(1);
      return send_error(res, Error{Errc::kResourceExhausted,
                                   std::to_string(kMaxDirtyRateMeasurements) + " dirty-rate measurements already run here"});
    }
    struct Release {
      std::atomic<int>& n;
      ~Release() { n.fetch_sub(1); }
    } release{dirty_rate_running_};
    auto qmp = qemu::QmpClient::connect(path.value(), std::chrono::seconds(5));
    if (!qmp) return send_error(res, qmp.error().with_context("qmpSocket '" + path.value() + "'"));
    auto rate = qemu::measure_dirty_rate(*qmp.value(), seconds, sample_pages);
    if (!rate) return send_error(res, rate.error());
    json out{{"qmpSocket", path.value()},
             {"dirtyRateBytesPerSecond", rate->bytes_per_second},
             {"calcSeconds", rate->calc_seconds},
             {"samplePages", rate->sample_pages},
             {"mode", "page-sampling"}};
    // The guest RAM and the part of it QEMU holds resident (pages ever written), after the
    // measurement: what a migration would send as pages, not zero-page markers (docs/drain.md).
    if (auto ram = qemu::guest_ram(*qmp.value())) {
      out["ramBytes"] = ram->size;
      out["residentRamBytes"] = ram->resident;
      out["residentRamSource"] = ram->source;
    } else {
      out["ramBytes"] = nullptr;
      out["residentRamBytes"] = nullptr;
      out["residentRamError"] = ram.error().message.substr(0, 512);
    }
    send_json(res, 200, out);
  });

  // KubeVirt migrations this agent saw (carried or not), filtered by KubeVirt migration UID
  // or VMI. 404 with reason KubevirtModeOff when KubeVirt mode is off: the controller reads that
  // field (controller/agent_client.cpp); controllers before it matched the message, so it stays.
  s.Get("/v1/kubevirt/migrations", [this](const httplib::Request& req, httplib::Response& res) {
    if (!kubevirt_) {
      const Error off{Errc::kNotFound, "KubeVirt mode is off on this agent (kubevirt.enabled)"};
      return send_json(res, http_status(off.code), error_body(off, "KubevirtModeOff"));
    }
    kubevirt::RecordFilter f;
    for (const auto& [name, target] : {std::pair<const char*, std::string*>{"migrationUid", &f.migration_uid},
                                       {"namespace", &f.namespace_},
                                       {"name", &f.name}}) {
      const std::string v = req.get_param_value(name);
      if (v.size() > 253) return send_error(res, Error{Errc::kInvalidArgument, std::string(name) + ": longer than 253"});
      *target = v;
    }
    json items = json::array();
    for (const auto& r : kubevirt_->list(f)) items.push_back(kubevirt::to_json(r));
    send_json(res, 200, json{{"items", items}});
  });

  s.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, json{{"status", "ok"}});
  });
  s.Get("/readyz", [this](const httplib::Request&, httplib::Response& res) {
    const bool ready = !ready_ || ready_();
    send_json(res, ready ? 200 : 503, json{{"status", ready ? "ready" : "not ready"}});
  });
  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_.serialize(), "text/plain; version=0.0.4; charset=utf-8");
  });

  s.set_exception_handler([](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    LOG_ERROR("api") << req.method << " " << req.path << " failed: " << what;
    send_error(res, Error{Errc::kInternal, "internal error: " + what});
  });
  // Errors httplib produces itself (404 route, 413 body too large, 405) get the JSON shape.
  s.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    Errc code = Errc::kInternal;
    std::string msg = "error";
    if (res.status == 404) {
      code = Errc::kNotFound;
      msg = "no route for " + req.method + " " + req.path;
    } else if (res.status == 413) {
      code = Errc::kInvalidArgument;
      msg = "body: larger than api.maxBodyBytes";
    } else if (res.status == 405) {
      code = Errc::kInvalidArgument;
      msg = "method " + req.method + " not allowed on " + req.path;
    } else if (res.status == 400) {
      code = Errc::kInvalidArgument;
      msg = "bad request: the request line or headers could not be parsed";
    } else if (res.status == 414) {
      code = Errc::kInvalidArgument;
      msg = "URI too long";
    } else if (res.status == 431) {
      code = Errc::kInvalidArgument;
      msg = "request headers too large";
    }
    const int status = res.status;
    res.set_content(safe_dump(error_body(Error{code, msg})), "application/json");
    res.status = status;
  });
}

}  // namespace rdmig::api
