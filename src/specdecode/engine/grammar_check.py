"""Whether every way through a grammar can end: refused before decoding where it cannot.

A grammar such as ``root ::= "a" root``, or a JSON schema whose required property refers back to
the schema itself, has no finite string. xgrammar compiles it and masks by it (a prefix is
allowed while the grammar's syntax can continue it), but its jump-forward search
(``find_jump_forward_string``) then follows the one forced continuation for ever: RSS grew by
gigabytes in seconds, per step. A grammar whose language is empty (``[^\\s\\S]``, or rules that
only refer to each other) lets no first token through, and a rule that cannot end, reached
after a few allowed tokens, does the same later.

All of these are decidable from the grammar before decoding, as in any context-free grammar:
a rule is *productive* when some way through it ends (the least fixpoint: an empty string, bytes,
a non-empty character class, or a sequence of productive parts; a choice of which one is
productive). If every rule the root can reach is productive and no reachable character class is
empty, every prefix the masks allow can still be completed, so no state is a dead end and the
text a state forces is never longer than its shortest completion (which bounds jump-forward).
``check_grammar`` names the first rule that breaks this, or returns None.

The grammar is read from xgrammar's own serialization (``Grammar.serialize_json``: rules, and
expressions stored CSR-style as ``[type, length, data...]``), the same structure its matcher runs;
an expression type this module does not know is taken as productive, so a newer xgrammar can
only make the check miss a problem, never refuse a good grammar.
"""

from __future__ import annotations

import json
from typing import Any

# xgrammar's GrammarExprType, in its order (cpp/grammar_impl.h).
BYTE_STRING, CHAR_CLASS, CHAR_CLASS_STAR, EMPTY, RULE_REF, SEQUENCE, CHOICES, TAG_DISPATCH, REPEAT = range(9)
TAG_DISPATCH_EXTRA = 2  # a tag dispatch's trailing fields: loop_after_dispatch, the excluded strings' expr
MAX_CODEPOINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # not characters: UTF-8 has no encoding for them


class _Grammar:
    def __init__(self, serialized: str) -> None:
        data = json.loads(serialized)
        self.rules: list[list[Any]] = data["rules"]
        self.root: int = data["root_rule_id"]
        # Two flat arrays; which key holds which differs between xgrammar releases, but the
        # offsets are always the shorter (every expression takes at least two entries).
        first, second = data["grammar_expr_data"], data["grammar_expr_indptr"]
        self.data, self.indptr = (first, second) if len(first) >= len(second) else (second, first)

    def name(self, rule: int) -> str:
        return str(self.rules[rule][0])

    def body(self, rule: int) -> int:
        return int(self.rules[rule][1])

    def expr(self, expr_id: int) -> tuple[int, list[int]]:
        start = self.indptr[expr_id]
        kind, length = self.data[start], self.data[start + 1]
        return kind, self.data[start + 2 : start + 2 + length]


def _class_is_empty(data: list[int]) -> bool:
    """Whether a character class (``[negated, lo0, hi0, lo1, hi1, ...]``) matches no character."""
    negated, ranges = bool(data[0]), sorted(zip(data[1::2], data[2::2], strict=False))
    if not negated:
        return all(lo > hi for lo, hi in ranges)
    # A negated class is empty when its ranges, with the surrogates (never a character), cover
    # every code point.
    covered = 0  # code points below this are covered
    for lo, hi in sorted([*ranges, SURROGATES]):
        if lo > covered:
            return False
        covered = max(covered, hi + 1)
    return covered > MAX_CODEPOINT


def _referenced_rules(grammar: _Grammar, expr_id: int) -> list[int]:
    kind, data = grammar.expr(expr_id)
    if kind == RULE_REF or kind == REPEAT:
        return [data[0]]
    if kind == TAG_DISPATCH:
        return list(data[1 : len(data) - TAG_DISPATCH_EXTRA : 2])
    return []


def _sub_exprs(grammar: _Grammar, expr_id: int) -> list[int]:
    kind, data = grammar.expr(expr_id)
    return list(data) if kind in (SEQUENCE, CHOICES) else []


def _productive(grammar: _Grammar, expr_id: int, rules: set[int]) -> bool:
    """Whether the expression can end, given the rules known to be productive."""
    kind, data = grammar.expr(expr_id)
    if kind == CHAR_CLASS:
        return not _class_is_empty(data)
    if kind == RULE_REF:
        return data[0] in rules
    if kind == SEQUENCE:
        return all(_productive(grammar, e, rules) for e in data)
    if kind == CHOICES:
        return any(_productive(grammar, e, rules) for e in data)
    if kind == REPEAT:
        return data[1] == 0 or data[0] in rules
    # Bytes, the empty string, a character class star, a tag dispatch (free text that ends at a
    # stop token), and any type this module does not know.
    return True


def check_grammar(serialized: str) -> str | None:
    """None when every way through the grammar can end; else what is wrong, in a phrase that
    names the rule (``Grammar.serialize_json()``'s output)."""
    grammar = _Grammar(serialized)
    productive: set[int] = set()
    changed = True
    while changed:  # the least fixpoint: at most one pass per rule
        changed = False
        for rule in range(len(grammar.rules)):
            if rule not in productive and _productive(grammar, grammar.body(rule), productive):
                productive.add(rule)
                changed = True
    # The rules the root reaches, and whether one of them cannot end or holds an empty class.
    seen_rules, rule_stack = {grammar.root}, [grammar.root]
    while rule_stack:
        rule = rule_stack.pop()
        if rule not in productive:
            if rule == grammar.root:
                return f"it has no finite string: no way through its root rule '{grammar.name(rule)}' ends"
            return f"its rule '{grammar.name(rule)}' can be entered but never ends"
        expr_stack, seen_exprs = [grammar.body(rule)], set()
        while expr_stack:
            expr_id = expr_stack.pop()
            if expr_id in seen_exprs:
                continue
            seen_exprs.add(expr_id)
            kind, data = grammar.expr(expr_id)
            if kind == CHAR_CLASS and _class_is_empty(data):
                return f"its rule '{grammar.name(rule)}' holds a character class that matches no character"
            expr_stack.extend(_sub_exprs(grammar, expr_id))
            for ref in _referenced_rules(grammar, expr_id):
                if ref not in seen_rules:
                    seen_rules.add(ref)
                    rule_stack.append(ref)
    return None
