"""The keywords of a CRD's OpenAPI schema, sorted by what the deriver does with each."""

# What a check can use: structure, types, bounds, defaults and the CEL rules.
KEEP = {
    "type", "format", "enum", "default", "nullable", "pattern",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "minLength", "maxLength", "minItems", "maxItems", "uniqueItems",
    "minProperties", "maxProperties", "required",
    "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-embedded-resource", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
}  # fmt: skip
NESTED = {"properties", "items", "additionalProperties", "anyOf", "allOf", "oneOf", "not"}
# Prose and server-side-apply hints: nothing a validator reads.
DROP = {"description", "example", "externalDocs", "title", "x-kubernetes-map-type"}
