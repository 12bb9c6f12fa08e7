"""Constraints whose language is empty for want of a base case, found from their text.

A Lark grammar whose start rule can only ever expand into itself (``a: "x" a``), or a JSON
schema whose required parts refer back to it (``{"$ref": "#"}``, a required property whose
schema is the whole schema), matches no finite output. llguidance compiles both without a
word, then fails mid-answer. The check here is the classic one for context-free grammars:
a symbol is *productive* when one of its alternatives consists of productive symbols only,
found by a fixpoint from the terminals up; a start symbol that never becomes productive
derives nothing. It answers only what it can prove: text it cannot read is ``None``
(undecided), and the engine's own probe of the grammar (``engine/outputs/guided.py``) and
its mid-answer checks remain.
"""

from __future__ import annotations

import json
import re
from collections import deque

# Lark's tokens: a string literal, a regular expression, a name, a number, an operator,
# llguidance's special tokens (``<[128000]>``, ``<|eot|>``). Anything else is unread.
_TOKEN = re.compile(
    r"""\s+|//[^\n]*|(?P<lit>"(?:[^"\\]|\\.)*"i?)
    |(?P<re>/(?:[^/\\\n]|\\.)+/[imslux]*)|(?P<special><[^<>\s]*>)|(?P<name>[?!]?[_A-Za-z][_A-Za-z0-9]*)
    |(?P<num>\d+)|(?P<op>->|\.\.|[|()\[\]?*+~])""",
    re.X,
)
_RULE_HEAD = re.compile(r"^[?!]?(?P<name>[_A-Za-z][_A-Za-z0-9]*)(?:\.-?\d+)?\s*:(?!:)")


MAX_PASSES = 64  # a JSON schema's $ref fixpoint gives up (undecided) past this


class Unread(Exception):
    """Text this reader does not follow: the answer is undecided, never "empty"."""


def lark_empty(text: str, start: str = "start") -> str | None:
    """Why the Lark grammar ``text`` derives no finite string (the rules with no base
    case), or None where it does or where that cannot be read from the text."""
    try:
        rules = _lark_rules(text)
        if start not in rules:
            return None
        productive = _fixpoint(rules)
    except (Unread, RecursionError):
        return None
    if productive.get(start):
        return None
    stuck = sorted(name for name in _reachable(rules, start) if not productive.get(name))
    named = ", ".join(stuck[:8]) + (f" and {len(stuck) - 8} more" if len(stuck) > 8 else "")
    return f"rule(s) {named} refer to themselves with no base case, so no output is ever complete"


def _lark_rules(text: str) -> dict[str, tuple]:
    """rule name -> its expansions as a tree of ("seq"|"alt", items) / ("opt",) /
    ("plus", item) / ("ref", name) / ("t",); terminals are productive leaves (Lark's
    terminals cannot recurse)."""
    bodies: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("//"):
            continue
        if stripped.startswith("%"):  # %import, %ignore, %llguidance: no rule of ours
            current = None
            continue
        head = _RULE_HEAD.match(stripped)
        if not line[:1].isspace() and not stripped.startswith("|"):
            if head is None:
                raise Unread(stripped[:20])  # a template, attributes: not read here
            name = head["name"]
            current = None if name.lstrip("_")[:1].isupper() else name  # a terminal's definition
            if current is not None:
                bodies.setdefault(current, []).append(stripped[head.end() :])
        elif current is not None:
            bodies[current].append(stripped)
    return {name: _parse(" ".join(lines)) for name, lines in bodies.items()}


def _parse(body: str) -> tuple:
    tokens = []
    pos = 0
    while pos < len(body):
        match = _TOKEN.match(body, pos)
        if match is None or match.end() == pos:
            raise Unread(body[pos : pos + 20])
        pos = match.end()
        kind = match.lastgroup
        if kind is not None:
            tokens.append((kind, match.group(kind)))
    tree, rest = _alternatives(tokens)
    if rest:
        raise Unread(str(rest[:3]))
    return tree


def _alternatives(tokens: list) -> tuple[tuple, list]:
    alts = []
    while True:
        seq, tokens = _sequence(tokens)
        alts.append(seq)
        if not tokens or tokens[0] != ("op", "|"):
            return ("alt", alts), tokens
        tokens = tokens[1:]


def _sequence(tokens: list) -> tuple[tuple, list]:
    items = []
    while tokens and tokens[0] not in (("op", "|"), ("op", ")"), ("op", "]")):
        kind, value = tokens[0]
        tokens = tokens[1:]
        if kind in ("lit", "re", "special"):
            item = ("t",)
        elif kind == "name":
            name = value.lstrip("?!")
            item = ("t",) if name.lstrip("_")[:1].isupper() else ("ref", name)
        elif (kind, value) in (("op", "("), ("op", "[")):
            inner, tokens = _alternatives(tokens)
            if not tokens or tokens[0][1] != {"(": ")", "[": "]"}[value]:
                raise Unread(f"unclosed {value}")
            tokens = tokens[1:]
            item = ("opt",) if value == "[" else inner
        elif (kind, value) == ("op", "->"):  # an alias names the tree node: no symbol
            tokens = tokens[1:]
            continue
        else:
            raise Unread(value)
        while tokens and tokens[0] in (("op", "?"), ("op", "*"), ("op", "+"), ("op", "~")):
            op = tokens[0][1]
            tokens = tokens[1:]
            if op == "~":  # item ~ n or item ~ n..m: at least n copies
                if not tokens or tokens[0][0] != "num":
                    raise Unread("~ without a count")
                least = int(tokens[0][1])
                tokens = tokens[1:]
                if tokens[:1] == [("op", "..")] and tokens[1:2] and tokens[1][0] == "num":
                    tokens = tokens[2:]
                item = ("opt",) if least == 0 else item
            else:
                item = ("plus", item) if op == "+" else ("opt",)
        items.append(item)
    return ("seq", items), tokens


def _fixpoint(rules: dict[str, tuple]) -> dict[str, bool]:
    """Each rule's productivity: a worklist from the rules that are productive outright,
    each rule looked at again only when a rule it uses becomes productive (linear in the
    grammar: a chain of 5,000 rules costs one pass, not 5,000)."""
    users: dict[str, set[str]] = {name: set() for name in rules}
    for name, tree in rules.items():
        for ref in _refs(tree):
            users.setdefault(ref, set()).add(name)
    productive = dict.fromkeys(rules, False)
    todo = deque(rules)
    while todo:
        name = todo.popleft()
        if not productive[name] and _productive(rules[name], productive):
            productive[name] = True
            todo.extend(users[name])
    return productive


def _productive(tree: tuple, productive: dict[str, bool]) -> bool:
    kind = tree[0]
    if kind in ("t", "opt"):
        return True
    if kind == "ref":
        if tree[1] not in productive:
            raise Unread(f"undefined rule {tree[1]}")  # the compiler names it
        return productive[tree[1]]
    if kind == "plus":
        return _productive(tree[1], productive)
    parts = (_productive(item, productive) for item in tree[1])
    return all(parts) if kind == "seq" else any(parts)


def _reachable(rules: dict[str, tuple], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in rules:
            continue
        seen.add(name)
        todo.extend(_refs(rules[name]))
    return seen


def _refs(tree: tuple) -> list[str]:
    if tree[0] == "ref":
        return [tree[1]]
    if tree[0] in ("seq", "alt"):
        return [name for item in tree[1] for name in _refs(item)]
    return _refs(tree[1]) if tree[0] == "plus" else []


def schema_empty(text: str) -> str | None:
    """Why the JSON schema ``text`` has no finite instance (a ``$ref`` cycle through parts
    every instance must have), or None where it has one or that cannot be read."""
    try:
        root = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    targets: dict[str, bool] = {"#": False}  # every $ref target, productive so far

    def resolve(ref: str):
        if not ref.startswith("#"):
            raise Unread(ref)  # a remote schema: the compiler's to refuse
        node = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            node = node[int(part)] if isinstance(node, list) else node[part]
        return node

    def finite(node, depth: int = 0) -> bool:
        if depth > 256:
            raise Unread("nesting")
        if not isinstance(node, dict):
            return node is not False
        ok = True
        if "$ref" in node:
            ref = node["$ref"]
            ok = targets.setdefault(ref, False)  # resolved in the fixpoint below
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key]:
                ok = ok and any(finite(sub, depth + 1) for sub in node[key])
        if isinstance(node.get("allOf"), list):
            ok = ok and all(finite(sub, depth + 1) for sub in node["allOf"])
        types = node.get("type")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
        if types is None or not ok:
            return ok
        return any(_finite_as(kind, node, finite, depth) for kind in types)

    try:
        changed, passes = True, 0
        while changed:  # until no target turns productive and no new target is found
            passes += 1
            if passes > MAX_PASSES:
                return None  # undecided: the check is bounded
            known = len(targets)
            changed = False
            for ref in reversed(list(targets)):  # the last found first: a chain in one pass
                if not targets[ref] and finite(resolve(ref)):
                    targets[ref] = changed = True
            changed = changed or len(targets) > known
        if targets["#"]:
            return None
    except (Unread, KeyError, IndexError, ValueError, TypeError, AttributeError, RecursionError):
        return None
    return "it refers to itself with no base case ($ref through parts every instance must have)"


def _finite_as(kind: str, node: dict, finite, depth: int) -> bool:
    """Whether an instance of type ``kind`` can be finite: an object's required properties
    and an array's first ``minItems`` items must be."""
    if kind == "object":
        props = node.get("properties") or {}
        return all(finite(props[name], depth + 1) for name in node.get("required") or () if name in props)
    if kind == "array" and int(node.get("minItems") or 0) > 0:
        least = int(node["minItems"])
        prefix = node.get("prefixItems") or []
        firsts = [finite(sub, depth + 1) for sub in prefix[:least]]
        rest = node.get("items", True) if least > len(prefix) else True
        return all(firsts) and finite(rest, depth + 1)
    return True
