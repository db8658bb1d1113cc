"""A small OpenAPI v3 structural-schema validator for the subset rdmig's CRD uses.

Keywords: type (object, array, string, integer, number, boolean), properties, required,
items, enum, minimum, maximum, minLength, maxLength, pattern, minProperties, maxProperties,
format (date-time, int64: checked loosely), x-kubernetes-int-or-string,
x-kubernetes-preserve-unknown-fields, default and description (ignored). Unknown fields are
errors (the API server prunes them; a sample carrying one is wrong). Any other keyword is
reported as unsupported, so the validator never silently passes what it does not check.
"""
import re

import yaml

KNOWN = {"type", "properties", "required", "items", "enum", "minimum", "maximum", "minLength",
         "maxLength", "pattern", "minProperties", "maxProperties", "format", "default",
         "description", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields"}
RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")


def load_crd_schema(path, version="v1alpha1"):
    with open(path) as f:
        crd = yaml.safe_load(f)
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError("no version %s in %s" % (version, path))


def _type_ok(value, schema):
    t = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        return (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, str)
    if t is None:
        return True
    if t == "object":
        return isinstance(value, dict)
    if t == "array":
        return isinstance(value, list)
    if t == "string":
        return isinstance(value, str)
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t == "boolean":
        return isinstance(value, bool)
    raise ValueError("unsupported type %r" % t)


def validate(value, schema, path="", top=True):
    """Returns a list of error strings (empty when valid)."""
    errors = []
    for key in schema:
        if key not in KNOWN:
            errors.append("%s: schema keyword %r is not supported by this validator" % (path or "<root>", key))
    if not _type_ok(value, schema):
        return errors + ["%s: expected %s, got %s" % (path or "<root>", schema.get("type"), type(value).__name__)]
    where = path or "<root>"
    if "enum" in schema and value not in schema["enum"]:
        errors.append("%s: %r is not one of %s" % (where, value, schema["enum"]))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append("%s: %s is less than the minimum %s" % (where, value, schema["minimum"]))
        if "maximum" in schema and value > schema["maximum"]:
            errors.append("%s: %s is greater than the maximum %s" % (where, value, schema["maximum"]))
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append("%s: shorter than %d characters" % (where, schema["minLength"]))
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append("%s: longer than %d characters" % (where, schema["maxLength"]))
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append("%s: %r does not match %s" % (where, value, schema["pattern"]))
        if schema.get("format") == "date-time" and not RFC3339.match(value):
            errors.append("%s: %r is not an RFC 3339 date-time" % (where, value))
    if isinstance(value, dict):
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            errors.append("%s: needs at least %d properties" % (where, schema["minProperties"]))
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            errors.append("%s: allows at most %d properties" % (where, schema["maxProperties"]))
        for req in schema.get("required", []):
            if req not in value:
                errors.append("%s: required field %r is missing" % (where, req))
        props = schema.get("properties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields") or props is None
        for k, v in value.items():
            sub = "%s.%s" % (path, k) if path else k
            if props is not None and k in props:
                errors += validate(v, props[k], sub, False)
            elif not preserve:
                errors.append("%s: unknown field" % sub)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += validate(item, schema["items"], "%s[%d]" % (path, i), False)
    return errors
