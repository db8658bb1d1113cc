#include "api/rest_server.h"

#include <httplib.h>

#include "api/models.h"
#include "common/log.h"
#include "common/units.h"

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
  send_json(res, http_status(e.code), error_body(e));
}

}  // namespace

RestServer::RestServer(const AgentConfig& config, std::string token, migration::MigrationManager& manager,
                       kubevirt::KubevirtRelay* kubevirt, Metrics& metrics)
    : config_(config),
      token_(std::move(token)),
      manager_(manager),
      kubevirt_(kubevirt),
      metrics_(metrics),
      server_(std::make_unique<httplib::Server>()) {
  routes();
}

RestServer::~RestServer() { stop(); }

Status RestServer::bind() {
  const int port = config_.api.port == 0
                       ? server_->bind_to_any_port(config_.api.address)
                       : (server_->bind_to_port(config_.api.address, config_.api.port) ? config_.api.port : -1);
  if (port <= 0) {
    return Error{Errc::kUnavailable, "api: cannot listen on " + config_.api.address + ":" +
                                         std::to_string(config_.api.port)};
  }
  port_ = static_cast<uint16_t>(port);
  LOG_INFO("api") << "listening on " << config_.api.address << ":" << port_;
  return ok_status();
}

void RestServer::serve() { server_->listen_after_bind(); }

void RestServer::stop() {
  if (server_) server_->stop();
}

void RestServer::routes() {
  auto& s = *server_;
  s.set_payload_max_length(config_.api.max_body_bytes);
  s.set_read_timeout(10, 0);
  s.set_write_timeout(10, 0);

  // Authentication for /v1: 401 without a bearer token, 403 with a wrong one.
  s.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (req.path.rfind("/v1/", 0) != 0 && req.path != "/v1") return httplib::Server::HandlerResponse::Unhandled;
    const auto auth = req.get_header_value("Authorization");
    const std::string prefix = "Bearer ";
    if (auth.rfind(prefix, 0) != 0) {
      res.set_header("WWW-Authenticate", "Bearer");
      send_error(res, Error{Errc::kUnauthenticated, "Authorization: a bearer token is required"});
      return httplib::Server::HandlerResponse::Handled;
    }
    if (!constant_time_equal(auth.substr(prefix.size()), token_)) {
      send_error(res, Error{Errc::kPermissionDenied, "Authorization: token is not valid"});
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });

  s.Post("/v1/migrations", [this](const httplib::Request& req, httplib::Response& res) {
    json body = json::parse(req.body, nullptr, false);
    if (body.is_discarded()) {
      send_error(res, Error{Errc::kInvalidArgument, "body: not valid JSON"});
      return;
    }
    auto spec = parse_create_request(body, config_);
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

  // KubeVirt migrations this agent saw (carried or not), filtered by KubeVirt migration UID
  // or VMI. 404 when KubeVirt mode is off.
  s.Get("/v1/kubevirt/migrations", [this](const httplib::Request& req, httplib::Response& res) {
    if (!kubevirt_) return send_error(res, Error{Errc::kNotFound, "KubeVirt mode is off on this agent (kubevirt.enabled)"});
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
      msg = "bad request";
    }
    const int status = res.status;
    res.set_content(safe_dump(error_body(Error{code, msg})), "application/json");
    res.status = status;
  });
}

}  // namespace rdmig::api
