"""The simulated model's known answers: arithmetic, a RULER needle, a tool call.

"A+B" (also -, *, x) in a short last user message -> the result; a RULER needle ("One of the
special magic numbers for <key> is: <7 digits>.") in the prompt whose <key> the last user
message asks for -> the digits; a tool named (or its name's words) in the last user message
when `tools` are given -> a tool call.
"""

from __future__ import annotations

import json
import re

from .tokenizer import tokenize

SHORT_QUESTION = 64  # arithmetic is answered only in a last user message this short
ARITHMETIC = re.compile(r"(-?\d+)\s*([-+*x×])\s*(-?\d+)")
NEEDLE = re.compile(r"One of the special magic numbers for (.+?) is: (\d{7})\.")
PLACE = re.compile(r"\b(?:in|for|at|of|about|near)\s+([A-Z][\w'-]*(?:\s+[A-Z][\w'-]*)*)")


def arithmetic_answer(question: str) -> str | None:
    """ "19+23" -> "42", in a short question only."""
    if len(tokenize(question)) > SHORT_QUESTION:
        return None
    m = ARITHMETIC.search(question)
    if not m:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def needle_answer(texts: list[str], question: str) -> str | None:
    """The 7-digit value(s) of the needle whose key the question names."""
    values: dict[str, list[str]] = {}
    for text in texts:
        for key, value in NEEDLE.findall(text):
            values.setdefault(key.strip(), []).append(value)
    if not values:
        return None
    asked = NEEDLE.sub(" ", question)
    keys = [k for k in values if k in asked]
    if not keys:
        return None
    return ", ".join(values[max(keys, key=len)])


def tool_named(tools: list[dict], choice: object, question: str) -> dict | None:
    """The function the request calls: the named one, or the one the question mentions."""
    functions = [t.get("function", {}) for t in tools if isinstance(t, dict)]
    functions = [f for f in functions if isinstance(f, dict) and f.get("name")]
    if not functions or choice == "none":
        return None
    if isinstance(choice, dict):
        name = choice.get("function", {}).get("name")
        return next((f for f in functions if f["name"] == name), None)
    low = question.lower()
    for f in functions:
        words = [w for w in re.split(r"[_\W]+", f["name"].lower()) if w and w not in ("get", "set")]
        if f["name"].lower() in low or (words and all(w in low for w in words)):
            return f
    return functions[0] if choice == "required" else None


def tool_arguments(function: dict, question: str) -> str:
    """JSON arguments for a call: each required (or every) parameter, from the question."""
    params = function.get("parameters") or {}
    props = params.get("properties") or {}
    names = params.get("required") or list(props)
    place = PLACE.search(question)
    words = " ".join(tokenize(place.group(1))) if place else "unknown"
    args: dict[str, object] = {}
    for name in names:
        spec = props.get(name, {})
        kind = spec.get("type", "string")
        if spec.get("enum"):
            args[name] = spec["enum"][0]
        elif kind in ("integer", "number"):
            args[name] = 0
        elif kind == "boolean":
            args[name] = False
        else:
            args[name] = words
    return json.dumps(args)
