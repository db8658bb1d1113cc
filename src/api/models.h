// REST request bodies: parsed and validated at the boundary into a MigrationSpec. Every
// error names the field ("target.token", "chunkSize") so the caller can fix the request.
#pragma once

#include <nlohmann/json.hpp>
#include <string_view>

#include "common/result.h"
#include "config/agent_config.h"
#include "migration/types.h"
#include "pathcheck/check.h"

namespace rdmig::api {

// Body of POST /v1/migrations. Missing tunables take the agent's configured defaults.
Result<migration::MigrationSpec> parse_create_request(const nlohmann::json& body,
                                                      const AgentConfig& defaults);

// Body of POST /v1/pathchecks (docs/pathcheck.md); bounded by the agent's pathCheck keys.
Result<pathcheck::CheckSpec> parse_pathcheck_request(const nlohmann::json& body, const AgentConfig& defaults);

// {"error": {"code": ..., "message": ...}} and the HTTP status for an Error. `reason`, when given,
// is a stable word a program can match instead of the message ({"error": {..., "reason": ...}}).
nlohmann::json error_body(const Error& error, std::string_view reason = {});
int http_status(Errc code);

}  // namespace rdmig::api
