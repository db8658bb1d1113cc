#include "pathcheck/manager.h"

#include "common/log.h"
#include "common/net.h"
#include "common/units.h"
#include "session/types.h"
#include "transport/channel_proof.h"
#include "transport/wire.h"
#include "session/protocol.h"

namespace rdmig::pathcheck {

using nlohmann::json;

PathCheckManager::PathCheckManager(const AgentConfig& config, Metrics& metrics, session::DataPlaneServer& server)
    : config_(config), metrics_(metrics), server_(server) {
  server_.add_handler(session::to_string(session::HelloKind::kPathcheckControl), [this](UniqueFd fd, const json& hello) { handle_hello(std::move(fd), hello); });
  server_.add_handler(session::to_string(session::HelloKind::kPathcheckData), [this](UniqueFd fd, const json& hello) { handle_hello(std::move(fd), hello); });
  server_.add_rdma_resolver([this](const transport::rdma::ConnectRequest& request)
                                -> Result<transport::rdma::AcceptPlan> {
    std::vector<std::shared_ptr<PathCheck>> targets;
    {
      std::lock_guard lock(mu_);
      for (auto& [id, c] : checks_) {
        if (c->spec().role == session::Role::kTarget && !c->finished()) targets.push_back(c);
      }
    }
    for (auto& c : targets) {
      auto plan = c->rdma_plan(request);
      if (plan) {
        plan->deliver = [c, inner = std::move(plan->deliver)](Result<std::unique_ptr<transport::Channel>> ch) {
          inner(std::move(ch));
        };
        return plan;
      }
      if (plan.error().code != Errc::kPermissionDenied) return plan.error();
    }
    return Error{Errc::kPermissionDenied, "no path check has this session"};
  });
}

PathCheckManager::~PathCheckManager() { shutdown(); }

void PathCheckManager::shutdown() {
  std::map<std::string, std::shared_ptr<PathCheck>> checks;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    checks.swap(checks_);
    order_.clear();
  }
  for (auto& [id, c] : checks) c->cancel("the agent is shutting down");
  checks.clear();  // joins each worker
}

void PathCheckManager::handle_hello(UniqueFd fd, const json& raw) {
  // A migration hello's fields under the path check's kinds (the codec reads both).
  auto hello = session::Hello::parse(raw, session::Purpose::kPathCheck);
  if (!hello) {
    transport::send_reject(fd.get(), "invalid_argument", hello.error().message);
    LOG_WARN("dataplane") << "refused a path check hello: " << hello.error().message;
    return;
  }
  std::string nonce, proof;
  if (hello->kind == session::HelloKind::kPathcheckControl) {
    // As for migrations: every control hello is challenged, whatever its id.
    nonce = random_hex(16);
    (void)transport::send_message(fd.get(), session::message(session::MessageKind::kChallenge, json{{"nonce", nonce}}));
    auto auth = transport::recv_message(fd.get(), session::kHelloTimeout);
    auto mac = auth ? transport::get_string(auth.value(), "proof", session::to_string(session::MessageKind::kAuth), 64) : Result<std::string>(auth.error());
    if (!auth || !session::is(*auth, session::MessageKind::kAuth) || !mac) {
      transport::send_reject(fd.get(), "permission_denied", session::kHelloRefused);
      return;
    }
    proof = mac.value();
  }
  auto check = find(hello->migration_id);
  if (!check || check->spec().role != session::Role::kTarget) {
    transport::send_reject(fd.get(), "permission_denied", session::kHelloRefused);
    return;
  }
  if (hello->kind == session::HelloKind::kPathcheckControl) {
    check->on_control(std::move(fd), hello.value(), nonce, proof);
    return;
  }
  // A data channel proves the check's channel key before it is admitted (transport/channel_proof.h).
  auto terms = check->channel_terms(hello->session, hello->index);
  if (!terms) {
    transport::send_reject(fd.get(), "permission_denied", session::kHelloRefused);
    return;
  }
  auto welcome_proof = transport::check_channel(fd.get(), terms.value(), hello->nonce, session::kHelloTimeout);
  if (!welcome_proof) {
    metrics_.transport_error("tcp", "auth");
    LOG_WARN("dataplane") << "refused a data channel of path check " << hello->migration_id << ": "
                          << welcome_proof.error().message;
    return;
  }
  check->on_data(std::move(fd), hello.value(), welcome_proof.value());
}

std::shared_ptr<PathCheck> PathCheckManager::find(const std::string& id) const {
  std::lock_guard lock(mu_);
  auto it = checks_.find(id);
  return it == checks_.end() ? nullptr : it->second;
}

void PathCheckManager::evict_finished_locked(std::vector<std::shared_ptr<PathCheck>>& graveyard) {
  size_t finished = 0;
  for (const auto& [id, c] : checks_) finished += c->finished() ? 1 : 0;
  for (auto it = order_.begin(); it != order_.end() && finished > config_.path_check.history_size;) {
    auto c = checks_.find(*it);
    if (c != checks_.end() && c->second->finished()) {
      graveyard.push_back(std::move(c->second));
      checks_.erase(c);
      it = order_.erase(it);
      --finished;
    } else {
      ++it;
    }
  }
}

Result<json> PathCheckManager::create(CheckSpec spec) {
  if (draining_.load()) {
    return Error{Errc::kUnavailable, "agent draining: it is shutting down (an upgrade or a node drain) and takes no new "
                                     "path check. Retry on its replacement"};
  }
  const uint64_t need = buffer_bytes(spec);
  const uint64_t budget = config_.migration.buffer_budget;
  if (need > budget) {
    return Error{Errc::kUnprocessable, "buffers: chunkSize " + format_quantity(spec.chunk_size) + " x ringDepth " +
                                           std::to_string(spec.ring_depth) + " x " + std::to_string(spec.channels) +
                                           " channels x 2 = " + format_quantity(need) + ", budget " +
                                           format_quantity(budget) + " (migration.bufferBudget)"};
  }
  // Outside mu_: these take the migration registries' own locks.
  const size_t migrations = running_migrations_ ? running_migrations_() : 0;
  const uint64_t migration_buffers = migration_buffers_ ? migration_buffers_() : 0;
  if (migrations > 0 && !spec.allow_during_migrations) {
    return Error{Errc::kFailedPrecondition, "this agent runs " + std::to_string(migrations) +
                                                " migration(s): a path check would compete with them "
                                                "(set allowDuringMigrations to run it anyway)"};
  }
  std::vector<std::shared_ptr<PathCheck>> graveyard;
  std::unique_lock lock(mu_);
  if (stopping_) return Error{Errc::kUnavailable, "agent is shutting down"};
  evict_finished_locked(graveyard);
  size_t active = 0;
  uint64_t in_use = migration_buffers;
  for (const auto& [id, c] : checks_) {
    if (c->finished()) continue;
    ++active;
    in_use += buffer_bytes(c->spec());
  }
  if (active >= config_.path_check.max_concurrent) {
    return Error{Errc::kResourceExhausted, "this agent already runs " + std::to_string(active) +
                                               " path checks (at most " +
                                               std::to_string(config_.path_check.max_concurrent) +
                                               ", pathCheck.maxConcurrent)"};
  }
  if (in_use + need > budget) {
    return Error{Errc::kResourceExhausted, "buffers: the check needs " + format_quantity(need) + ", " +
                                               format_quantity(in_use) + " of the budget " + format_quantity(budget) +
                                               " (migration.bufferBudget) are held by migrations and checks"};
  }
  auto taken = [&](const std::string& id) { return checks_.contains(id); };
  if (spec.id.empty() && spec.role == session::Role::kSource && !taken(spec.target.migration_id)) {
    spec.id = spec.target.migration_id;
  }
  if (spec.id.empty()) {
    do spec.id = "pc-" + random_hex(6);
    while (taken(spec.id));
  }
  if (taken(spec.id)) return Error{Errc::kAlreadyExists, "id: path check '" + spec.id + "' exists"};
  auto check = std::make_shared<PathCheck>(spec, CheckContext{config_, metrics_, server_.rdma()});
  checks_.emplace(spec.id, check);
  order_.push_back(spec.id);
  json body{{"id", spec.id}, {"role", session::role_name(spec.role)}};
  if (spec.role == session::Role::kTarget) {
    body["endpoint"] = net::format_endpoint(server_.advertise_host(), server_.port());
    body["checkId"] = spec.id;
    body["token"] = check->token();
  }
  check->start();
  lock.unlock();
  LOG_INFO("pathcheck") << "pathcheck=" << spec.id << " role=" << session::role_name(spec.role)
                        << " created bytes=" << format_quantity(spec.bytes) << " channels=" << spec.channels
                        << " chunkSize=" << format_quantity(spec.chunk_size) << " buffers=" << format_quantity(need);
  body["phase"] = session::phase_name(session::Phase::kPending);
  return body;
}

std::vector<CheckStatus> PathCheckManager::list() {
  std::vector<std::shared_ptr<PathCheck>> graveyard;  // joined after mu_ is released
  std::vector<std::shared_ptr<PathCheck>> checks;
  {
    std::lock_guard lock(mu_);
    evict_finished_locked(graveyard);
    for (const auto& id : order_) checks.push_back(checks_.at(id));
  }
  std::vector<CheckStatus> out;
  for (auto& c : checks) out.push_back(c->status());
  return out;
}

Result<CheckStatus> PathCheckManager::get(const std::string& id) {
  std::vector<std::shared_ptr<PathCheck>> graveyard;  // joined after mu_ is released
  {
    std::lock_guard lock(mu_);
    evict_finished_locked(graveyard);
  }
  auto c = find(id);
  if (!c) return Error{Errc::kNotFound, "path check '" + id + "' not found"};
  return c->status();
}

Result<CheckStatus> PathCheckManager::cancel(const std::string& id) {
  auto c = find(id);
  if (!c) return Error{Errc::kNotFound, "path check '" + id + "' not found"};
  c->cancel("cancelled through the API");
  // The worker lets go of its channels within moments; answer with where it stands then.
  (void)c->wait_finished(std::chrono::seconds(5));
  return c->status();
}

uint64_t PathCheckManager::buffer_bytes_in_use() const {
  std::lock_guard lock(mu_);
  uint64_t n = 0;
  for (const auto& [id, c] : checks_) n += c->finished() ? 0 : buffer_bytes(c->spec());
  return n;
}

size_t PathCheckManager::active_count() const {
  std::lock_guard lock(mu_);
  size_t n = 0;
  for (const auto& [id, c] : checks_) n += c->finished() ? 0 : 1;
  return n;
}

}  // namespace rdmig::pathcheck
