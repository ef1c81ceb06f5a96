"""Twenty JSON schemas for the structured-output tests: nested objects, enums, arrays, bounded numbers.

Strings and arrays carry length bounds so a random model, which never chooses
to close a string on its own, still finishes inside max_tokens.
"""

S = {"type": "string", "maxLength": 6}

SCHEMAS = [
    {"type": "object", "properties": {"name": S}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}}, "required": ["tags"],
     "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -10, "maximum": 10}, "y": {"type": "integer", "minimum": -10,
                                                                      "maximum": 10}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"],
     "additionalProperties": False},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}},
     "required": ["status", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": S, "roles": {
        "type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 2}},
        "required": ["name", "roles"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 100, "maximum": 200},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 50}, "qty": {
            "type": "integer", "minimum": 1, "maximum": 5}}, "required": ["id", "qty"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": ["integer", "null"], "minimum": 0, "maximum": 3}},
     "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 4},
                                      "name": S}, "required": ["kind", "legs"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"temp": {"type": "number", "minimum": -40, "maximum": 60},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["temp", "unit"],
     "additionalProperties": False},
    {"anyOf": [{"type": "object", "properties": {"circle": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["circle"], "additionalProperties": False},
               {"type": "object", "properties": {"square": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["square"], "additionalProperties": False}]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 1,
                                                                                      "maximum": 3},
                                                                                "flags": {"type": "array", "items": {
                                                                                    "type": "boolean"}, "maxItems": 3}},
                                               "required": ["v", "flags"], "additionalProperties": False},
                                      "note": S}, "required": ["meta", "note"], "additionalProperties": False},
]
assert len(SCHEMAS) == 20
