// Label and field selectors and query strings for list/watch calls.
#pragma once

#include <map>
#include <string>

#include "common/result.h"

namespace rdmig::k8s {

// "app.kubernetes.io/name=rdmig-agent,tier=node" from a map (sorted, so stable).
std::string label_selector(const std::map<std::string, std::string>& labels);
// Parses an equality-based selector "k=v,k2==v2" into a map; errors name `field`.
Result<std::map<std::string, std::string>> parse_label_selector(const std::string& text,
                                                                 const std::string& field);
// A value for a field selector term, escaped as the API server's parser expects
// (k8s.io/apimachinery fields.EscapeValue): a backslash, ',' and '=' each get a backslash before them.
// Percent-encode the whole selector afterwards for the query string.
std::string field_selector_value(const std::string& value);
// Percent-encodes a query value (RFC 3986 unreserved characters pass).
std::string url_encode(const std::string& value);

}  // namespace rdmig::k8s
