// Small helpers shared by the reconcile paths (reconciler.cpp, reconcile_qemu.cpp,
// reconcile_vmi.cpp). Internal to controller/.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "controller/reconciler.h"
#include "k8s/time_format.h"

namespace rdmig::controller::detail {

inline std::string now_text() { return k8s::format_time(k8s::Clock::now()); }

inline int64_t generation_of(const nlohmann::json& obj) { return obj["metadata"].value("generation", int64_t{0}); }

inline bool has_finalizer(const nlohmann::json& obj) {
  for (const auto& f : obj["metadata"].value("finalizers", nlohmann::json::array())) {
    if (f == kFinalizer) return true;
  }
  return false;
}

// Writes `status` (observedGeneration set) through the status subresource of the object at path;
// on a conflict reads the object again and writes the same status over it (at most 5 tries).
// Keeps the informer's cache in step. Shared by the reconcilers of every kind.
Result<nlohmann::json> write_status(k8s::KubeClient& kube, k8s::Informer& informer, const nlohmann::json& obj,
                                    const std::string& path, nlohmann::json status);

// Adds (present) or removes rdmig's finalizer on the object at path, retrying on conflicts with
// a fresh read; keeps the informer's cache in step (a write that removed the last finalizer of a
// deleted object deleted it). An object already gone counts as removed (empty json).
Result<nlohmann::json> write_finalizer(k8s::KubeClient& kube, k8s::Informer& informer, const nlohmann::json& obj,
                                       const std::string& path, bool present);

// The reason a migration fails with when an agent stayed out of reach: AgentTLSFailed when the
// last failure was a TLS handshake or certificate check, AgentUnreachable otherwise.
inline const char* unreachable_reason(const Error& last) {
  return AgentClient::is_tls_failure(last) ? "AgentTLSFailed" : "AgentUnreachable";
}

// A migration of the vmi kind has been started when status.kubevirt names its VMIM.
inline bool vmi_started(const nlohmann::json& status) {
  return status.is_object() && status.contains("kubevirt") && status["kubevirt"].is_object() &&
         status["kubevirt"].contains("migrationName");
}

}  // namespace rdmig::controller::detail
