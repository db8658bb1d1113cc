"""A small OpenAPI v3 structural-schema validator for the subset rdmig's CRD uses.

Keywords: type (object, array, string, integer, number, boolean), properties, required,
items, enum, minimum, maximum, minLength, maxLength, pattern, minProperties, maxProperties, minItems, maxItems,
format (date-time, int64: checked loosely), additionalProperties (a schema for map values), nullable
(null accepted; without it null is a type error),
x-kubernetes-int-or-string, x-kubernetes-preserve-unknown-fields, x-kubernetes-list-type (map:
every item has the x-kubernetes-list-map-keys, which the schema must require, and no two items
share them, as the API server's "Duplicate value"; set: no two items equal; atomic), default
and description (ignored), and x-kubernetes-validations (CEL rules) in the subset the CRD uses: field selection
on self/oldSelf, has(), ==, !=, &&, ||, !, parentheses, string/number/bool literals. A rule that
uses anything else is reported, never skipped. Rules naming oldSelf (transition rules) run only
on updates (validate(..., old=stored)), as the API server runs them. Unknown fields are errors
(the API server prunes them; a sample carrying one is wrong). Any other keyword is reported as
unsupported, so the validator never silently passes what it does not check.
"""
import re

import yaml

KNOWN = {"type", "properties", "required", "items", "enum", "minimum", "maximum", "minLength",
         "maxLength", "pattern", "minProperties", "maxProperties", "minItems", "maxItems", "format", "default",
         "description", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
         "additionalProperties", "x-kubernetes-validations", "x-kubernetes-list-type",
         "x-kubernetes-list-map-keys", "nullable"}
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


class _Missing(Exception):
    pass


class _Obj(dict):
    """A JSON object whose fields are read as attributes (CEL field selection)."""

    def __getattr__(self, name):
        if name not in self:
            raise _Missing(name)
        return _wrap(self[name])


def _wrap(v):
    return _Obj(v) if isinstance(v, dict) and not isinstance(v, _Obj) else v


def _has(thunk):
    try:
        thunk()
        return True
    except _Missing:
        return False


_CEL_TOKEN = re.compile(r"\s*(?:(has\()|(&&)|(\|\|)|(==)|(!=)|(!)|([()])|('[^']*'|\"[^\"]*\")|(true|false)"
                        r"|([0-9]+)|((?:self|oldSelf)(?:\.[A-Za-z_][A-Za-z0-9_]*)*))")


def cel_to_python(rule):
    """Translates a rule of the supported CEL subset to a Python expression; ValueError otherwise."""
    out, pos, depth_has = [], 0, []
    depth = 0
    rule = rule.strip()
    while pos < len(rule):
        m = _CEL_TOKEN.match(rule, pos)
        if not m or m.end() == pos:
            raise ValueError("unsupported CEL at %r" % rule[pos:pos + 20])
        pos = m.end()
        has_, and_, or_, eq, ne, not_, paren, lit, boolean, num, ident = m.groups()
        if has_:
            out.append("_has(lambda: ")
            depth += 1
            depth_has.append(depth)
        elif and_:
            out.append(" and ")
        elif or_:
            out.append(" or ")
        elif eq:
            out.append(" == ")
        elif ne:
            out.append(" != ")
        elif not_:
            out.append(" not ")
        elif paren == "(":
            depth += 1
            out.append("(")
        elif paren == ")":
            if depth_has and depth_has[-1] == depth:
                depth_has.pop()
            depth -= 1
            out.append(")")
        elif lit:
            out.append(repr(lit[1:-1]))
        elif boolean:
            out.append("True" if boolean == "true" else "False")
        elif num:
            out.append(num)
        else:
            out.append(ident)
    return "".join(out)


def eval_rule(rule, value, old=None):
    """Evaluates one CEL rule. Returns True/False, or None for a transition rule without `old`."""
    if "oldSelf" in rule and old is None:
        return None
    code = cel_to_python(rule)
    env = {"_has": _has, "self": _wrap(value), "oldSelf": _wrap(old), "__builtins__": {}}
    try:
        return bool(eval(code, env))  # noqa: S307 - our own translation of the CRD's rules
    except _Missing:
        return False  # CEL: selecting an absent field is an error, which fails the rule


def validate(value, schema, path="", top=True, old=None):
    """Returns a list of error strings (empty when valid). `old`: the stored value (updates)."""
    errors = []
    for key in schema:
        if key not in KNOWN:
            errors.append("%s: schema keyword %r is not supported by this validator" % (path or "<root>", key))
    if value is None and schema.get("nullable"):
        return errors
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
        addl = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields") or (props is None and addl is None)
        for k, v in value.items():
            sub = "%s.%s" % (path, k) if path else k
            sub_old = old.get(k) if isinstance(old, dict) else None
            if props is not None and k in props:
                errors += validate(v, props[k], sub, False, sub_old)
            elif isinstance(addl, dict):
                errors += validate(v, addl, sub, False, sub_old)
            elif not preserve:
                errors.append("%s: unknown field" % sub)
    for r in schema.get("x-kubernetes-validations", []):
        try:
            ok = eval_rule(r["rule"], value, old)
        except ValueError as e:
            errors.append("%s: rule %r: %s" % (where, r["rule"], e))
            continue
        if ok is False:
            errors.append("%s: %s" % (where, r.get("message", "failed rule " + r["rule"])))
    if isinstance(value, list) and "minItems" in schema and len(value) < schema["minItems"]:
        errors.append("%s: needs at least %d items" % (where, schema["minItems"]))
    if isinstance(value, list) and "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append("%s: Too many: %d: must have at most %d items" % (where, len(value), schema["maxItems"]))
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += validate(item, schema["items"], "%s[%d]" % (path, i), False)
    list_type = schema.get("x-kubernetes-list-type")
    if isinstance(value, list) and list_type is not None:
        if list_type == "map":
            keys = schema.get("x-kubernetes-list-map-keys") or []
            if not keys:
                errors.append("%s: x-kubernetes-list-type map needs x-kubernetes-list-map-keys" % where)
            missing = [k for k in keys if k not in schema.get("items", {}).get("required", [])]
            if missing:
                errors.append("%s: list map keys %s must be required in the items' schema" % (where, missing))
            seen = {}
            for i, item in enumerate(value):
                if not isinstance(item, dict):
                    continue
                k = tuple(repr(item.get(key)) for key in keys)
                if k in seen:
                    errors.append("%s[%d]: Duplicate value: %s (as %s[%d])"
                                  % (where, i, dict(zip(keys, k)), where, seen[k]))
                seen.setdefault(k, i)
        elif list_type == "set":
            for i, item in enumerate(value):
                if item in value[:i]:
                    errors.append("%s[%d]: Duplicate value: %r" % (where, i, item))
        elif list_type != "atomic":
            errors.append("%s: x-kubernetes-list-type %r is not map, set or atomic" % (where, list_type))
    return errors
