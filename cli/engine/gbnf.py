"""quill's own reading of a GBNF grammar, before llama.cpp sees it.

llama.cpp's grammar parser (src/llama-grammar.cpp) trusts its input: groups nest by recursion in
C++ (thirty thousand nested groups overflow the stack: SIGSEGV), x{m,n} is expanded into one
rule per repetition and m copies of x, a chain of rules is walked by recursion when it looks
for left recursion, and a grammar that can match nothing is only found out while sampling,
where llama.cpp throws out of a C function (abort). Every grammar quill hands llama.cpp (from a
schema, a tool, --format, --grammar, response_format or a request's grammar field) goes
through safe_grammar here first, which:

- parses it the way llama.cpp does (the same syntax, the same errors, llama.cpp's own limits
  of 2000 repetitions), with Python's recursion bounded by the nesting budget;
- refuses what is over the budget (the numbers below, stated in docs/run.md and docs/serve.md)
  counting what llama.cpp would allocate, without allocating it;
- refuses a root that can match nothing, and any rule reachable from it that can never be
  completed (every alternative needs itself again, or a character class that matches nothing);
- rewrites a bounded repetition whose bound is over COMPACT_ABOVE into a few rules that
  count in powers of two (x{0,1000000}: 40 rules, where llama.cpp would write a million), so
  the bound is still held, exactly, by the grammar.

What it returns is the grammar as quill writes it back, which llama.cpp reads into the same
language.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cli.errors import UsageError

# The budget. Text: what quill reads (a schema's grammar is a few KiB; the largest grammar in
# llama.cpp's grammars/ folder is 4 KiB). Nesting: groups inside groups, each a C++ recursion in
# llama.cpp's parser. Rules and elements: what llama.cpp's parser allocates after expanding
# repetitions (an element is 8 bytes), and the rules its left-recursion check recurses through.
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_NESTING = 100
MAX_RULES = 20_000
MAX_ELEMENTS = 1_000_000
MAX_STACKED_REPETITIONS = 8
# llama.cpp's own limit (MAX_REPETITION_THRESHOLD): a larger minimum is refused, a larger
# maximum silently becomes unbounded; quill writes such a bound in compact form instead.
LLAMA_MAX_REPETITIONS = 2000
# A repetition bounded above this is written as rules that count in powers of two.
COMPACT_ABOVE = 64
_MAX_CODEPOINT = 0x10FFFF


class GrammarBudgetError(UsageError):
    """A grammar quill refuses before llama.cpp sees it: over the budget, not GBNF llama.cpp
    reads, or unable to match anything."""


# --- the parse tree ----------------------------------------------------------------------------


@dataclass
class Item:
    """One symbol of a sequence. kind: "lit" (codepoints), "cls" (negated, ranges), "any",
    "ref" (rule name), "group" (alternatives), "tok" (the raw <...> text), "rep" (of inner)."""

    kind: str
    codepoints: list[int] = field(default_factory=list)
    negated: bool = False
    ranges: list[tuple[int, int]] = field(default_factory=list)
    name: str = ""
    alternatives: list[list[Item]] = field(default_factory=list)
    raw: str = ""
    inner: Item | None = None
    low: int = 0
    high: int | None = None  # None: unbounded


@dataclass
class Grammar:
    rules: dict[str, list[list[Item]]]  # name -> alternatives, in the order defined


# --- parsing, as llama.cpp's llama_grammar_parser does --------------------------------------


def _is_word(c: str) -> bool:
    return ("a" <= c <= "z") or ("A" <= c <= "Z") or ("0" <= c <= "9") or c == "-"


class _Parser:
    def __init__(self, text: str) -> None:
        self.src = text + "\0"  # llama.cpp reads a C string: the NUL ends it
        self.rules: dict[str, list[list[Item]]] = {}
        self.referenced: dict[str, None] = {}

    def fail(self, message: str, pos: int) -> GrammarBudgetError:
        where = self.src[pos : pos + 30].split("\n")[0].rstrip("\0")
        return GrammarBudgetError(
            f"the grammar is not GBNF llama.cpp reads: {message} at {where!r}"
        )

    def space(self, pos: int, newline_ok: bool) -> int:
        src = self.src
        while True:
            c = src[pos]
            if c in " \t" or (newline_ok and c in "\r\n"):
                pos += 1
            elif c == "#":
                while src[pos] not in "\0\r\n":
                    pos += 1
            else:
                return pos

    def name(self, pos: int) -> int:
        end = pos
        while _is_word(self.src[end]):
            end += 1
        if end == pos:
            raise self.fail("expecting a name", pos)
        return end

    def hex(self, pos: int, size: int) -> tuple[int, int]:
        digits = self.src[pos : pos + size]
        if len(digits) < size or any(c not in "0123456789abcdefABCDEF" for c in digits):
            raise self.fail(f"expecting {size} hex digits", pos)
        return int(digits, 16), pos + size

    def char(self, pos: int) -> tuple[int, int]:
        src = self.src
        c = src[pos]
        if c == "\\":
            escape = src[pos + 1]
            if escape in "xuU":
                return self.hex(pos + 2, {"x": 2, "u": 4, "U": 8}[escape])
            simple = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}
            if escape in simple:
                return simple[escape], pos + 2
            raise self.fail("unknown escape", pos)
        if c == "\0":
            raise self.fail("unexpected end of input", pos)
        return ord(c), pos + 1

    def parse(self) -> Grammar:
        pos = self.space(0, True)
        while self.src[pos] != "\0":
            pos = self.rule(pos)
        for name in self.referenced:
            if name not in self.rules:
                raise GrammarBudgetError(
                    f"the grammar is not GBNF llama.cpp reads: the rule {name!r} is used but "
                    "never defined"
                )
        return Grammar(self.rules)

    def rule(self, pos: int) -> int:
        end = self.name(pos)
        rule_name = self.src[pos:end]
        pos = self.space(end, False)
        if self.src[pos : pos + 3] != "::=":
            raise self.fail("expecting ::=", pos)
        pos = self.space(pos + 3, True)
        alternatives, pos = self.alternates(pos, False, 0)
        self.rules[rule_name] = alternatives  # llama.cpp keeps a name's last definition
        c = self.src[pos]
        if c == "\r":
            pos += 2 if self.src[pos + 1] == "\n" else 1
        elif c == "\n":
            pos += 1
        elif c != "\0":
            raise self.fail("expecting newline or end", pos)
        return self.space(pos, True)

    def alternates(self, pos: int, nested: bool, depth: int) -> tuple[list[list[Item]], int]:
        if depth > MAX_NESTING:
            raise GrammarBudgetError(
                f"the grammar nests groups deeper than {MAX_NESTING} levels (quill's budget)"
            )
        sequence, pos = self.sequence(pos, nested, depth)
        alternatives = [sequence]
        while self.src[pos] == "|":
            pos = self.space(pos + 1, True)
            sequence, pos = self.sequence(pos, nested, depth)
            alternatives.append(sequence)
        return alternatives, pos

    def sequence(self, pos: int, nested: bool, depth: int) -> tuple[list[Item], int]:
        src = self.src
        items: list[Item] = []
        while src[pos] != "\0":
            c = src[pos]
            if c == '"':
                pos += 1
                codepoints = []
                while src[pos] != '"':
                    if src[pos] == "\0":
                        raise self.fail("unexpected end of input", pos)
                    value, pos = self.char(pos)
                    codepoints.append(value)
                items.append(Item("lit", codepoints=codepoints))
                pos = self.space(pos + 1, nested)
            elif c == "[":
                pos += 1
                negated = src[pos] == "^"
                if negated:
                    pos += 1
                ranges = []
                while src[pos] != "]":
                    if src[pos] == "\0":
                        raise self.fail("unexpected end of input", pos)
                    low, pos = self.char(pos)
                    high = low
                    if src[pos] == "-" and src[pos + 1] != "]":
                        if src[pos + 1] == "\0":
                            raise self.fail("unexpected end of input", pos)
                        high, pos = self.char(pos + 1)
                    ranges.append((low, high))
                # [] and [^] add no element in llama.cpp: they match the empty string.
                if ranges:
                    items.append(Item("cls", negated=negated, ranges=ranges))
                else:
                    items.append(Item("lit"))
                pos = self.space(pos + 1, nested)
            elif c in "<!":
                start = pos
                if c == "!":
                    pos += 1
                if src[pos] != "<":
                    raise self.fail("expecting '<'", pos)
                end = src.find(">", pos)
                if end < 0 or "\0" in src[pos:end]:
                    raise self.fail("expecting '>'", pos)
                if src[pos + 1] == "[":
                    digits = src[pos + 2 : end - 1]
                    if not digits.isdigit() or src[end - 1] != "]" or not digits.isascii():
                        raise self.fail("expecting <[token id]>", pos)
                    if int(digits) > 0xFFFFFFFF:
                        raise self.fail("the token id is too big", pos)
                items.append(Item("tok", raw=src[start : end + 1]))
                pos = self.space(end + 1, nested)
            elif _is_word(c):
                end = self.name(pos)
                name = src[pos:end]
                self.referenced[name] = None
                items.append(Item("ref", name=name))
                pos = self.space(end, nested)
            elif c == "(":
                pos = self.space(pos + 1, True)
                alternatives, pos = self.alternates(pos, True, depth + 1)
                if src[pos] != ")":
                    raise self.fail("expecting ')'", pos)
                items.append(Item("group", alternatives=alternatives))
                pos = self.space(pos + 1, nested)
            elif c == ".":
                items.append(Item("any"))
                pos = self.space(pos + 1, nested)
            elif c in "*+?{":
                if not items or (items[-1].kind == "lit" and not items[-1].codepoints):
                    raise self.fail("expecting an item before */+/?/{", pos)
                if c == "{":
                    low, high, pos = self.braces(pos, nested)
                else:
                    low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
                    pos = self.space(pos + 1, nested)
                stacked = 1
                inner = items[-1]
                while inner.kind == "rep" and inner.inner is not None:
                    stacked, inner = stacked + 1, inner.inner
                if stacked > MAX_STACKED_REPETITIONS:
                    raise GrammarBudgetError(
                        f"the grammar repeats a repetition more than {MAX_STACKED_REPETITIONS} "
                        "times over (x{2}{3}...: quill's budget)"
                    )
                items[-1] = Item("rep", inner=items[-1], low=low, high=high)
            else:
                break
        return items, pos

    def braces(self, pos: int, nested: bool) -> tuple[int, int | None, int]:
        src = self.src
        pos = self.space(pos + 1, nested)
        low, pos = self.integer(pos)
        pos = self.space(pos, nested)
        if src[pos] == "}":
            high: int | None = low
        elif src[pos] == ",":
            pos = self.space(pos + 1, nested)
            high = None
            if "0" <= src[pos] <= "9":
                high, pos = self.integer(pos)
                pos = self.space(pos, nested)
            if src[pos] != "}":
                raise self.fail("expecting '}'", pos)
        else:
            raise self.fail("expecting ','", pos)
        if high is not None and high < low:
            # llama.cpp would count high - low optional copies in an unsigned integer: it wraps,
            # and the parser loops until memory runs out.
            raise self.fail(
                f"the repetition {{{low},{high}}} has its maximum below its minimum", pos
            )
        return low, high, self.space(pos + 1, nested)

    def integer(self, pos: int) -> tuple[int, int]:
        end = pos
        while "0" <= self.src[end] <= "9":
            end += 1
        if end == pos:
            raise self.fail("expecting an int", pos)
        if end - pos > 19:
            raise self.fail("the number is too big", pos)
        return int(self.src[pos:end]), end


def parse_gbnf(text: str) -> Grammar:
    """The grammar's rules, or GrammarBudgetError for what llama.cpp would refuse or cannot
    take (quill's budget)."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarBudgetError(
            f"the grammar has {len(text)} characters; quill takes at most {MAX_GRAMMAR_CHARS}"
        )
    if "\0" in text:
        raise GrammarBudgetError("the grammar holds a NUL character (write \\x00 for it)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise GrammarBudgetError("the grammar is not valid Unicode (a lone surrogate)") from None
    grammar = _Parser(text).parse()
    if "root" not in grammar.rules:
        raise GrammarBudgetError("the grammar has no 'root ::= ...' rule")
    return grammar


# --- what can match ---------------------------------------------------------------------------


def _class_is_empty(item: Item) -> bool:
    """Whether a character class matches no character a token can hold (1 to U+10FFFF)."""
    spans = sorted((max(lo, 1), min(hi, _MAX_CODEPOINT)) for lo, hi in item.ranges)
    spans = [(lo, hi) for lo, hi in spans if lo <= hi]
    if not item.negated:
        return not spans
    reach = 0  # every codepoint up to reach is in the class's set
    for lo, hi in spans:
        if lo > reach + 1:
            return False
        reach = max(reach, hi)
    return reach >= _MAX_CODEPOINT


def _nullable_and_productive(grammar: Grammar) -> tuple[set[str], set[str]]:
    """The rules that can match the empty string, and those that can match some string: the
    textbook fixpoint, in time linear in the grammar (each group a rule of its own; a
    repetition that may be absent needs nothing)."""
    # Flattened: symbol -> alternatives, each (the symbols it needs, whether its terminals can
    # be empty, whether its terminals can match).
    flat: dict[str, list[tuple[list[str], bool, bool]]] = {}
    groups = 0

    def flatten(items: list[Item]) -> tuple[list[str], bool, bool]:
        nonlocal groups
        needs: list[str] = []
        empty = matches = True
        for item in items:
            while item.kind == "rep" and item.low > 0 and item.inner is not None:
                item = item.inner
            kind = item.kind
            if kind == "rep":
                continue  # may be absent
            if kind == "lit":
                empty = empty and not item.codepoints
            elif kind in ("cls", "any", "tok"):
                empty = False
                matches = matches and not (kind == "cls" and _class_is_empty(item))
            elif kind == "ref":
                needs.append(item.name)
            else:
                groups += 1
                name = f" group {groups}"  # a space: no rule's name
                flat[name] = [flatten(alt) for alt in item.alternatives]
                needs.append(name)
        return needs, empty, matches

    for name, alternatives in grammar.rules.items():
        flat[name] = [flatten(alt) for alt in alternatives]

    def fixpoint(terminals_ok: int) -> set[str]:
        waiting: dict[str, list[int]] = {}
        alternatives: list[tuple[str, int]] = []  # (owner, how many needs are not done yet)
        done: set[str] = set()
        ready: list[str] = []
        for owner, alts in flat.items():
            for needs, empty, matches in alts:
                if not (empty, matches)[terminals_ok]:
                    continue
                index = len(alternatives)
                alternatives.append((owner, len(needs)))
                for need in needs:
                    waiting.setdefault(need, []).append(index)
                if not needs:
                    ready.append(owner)
        while ready:
            symbol = ready.pop()
            if symbol in done:
                continue
            done.add(symbol)
            for index in waiting.get(symbol, ()):
                owner, left = alternatives[index]
                alternatives[index] = (owner, left - 1)
                if left == 1:
                    ready.append(owner)
        return {name for name in done if name in grammar.rules}

    return fixpoint(0), fixpoint(1)


def _refs(items: list[Item]) -> list[str]:
    found: list[str] = []
    stack = list(items)
    while stack:
        item = stack.pop()
        if item.kind == "ref":
            found.append(item.name)
        elif item.kind == "group":
            for alt in item.alternatives:
                stack.extend(alt)
        elif item.kind == "rep" and item.inner is not None:
            stack.append(item.inner)
    return found


def _refuse_unmatchable(grammar: Grammar, productive: set[str]) -> None:
    if "root" not in productive:
        raise GrammarBudgetError(
            "the grammar can match nothing: every way through 'root' needs a character class "
            "that matches no character, or a rule that never ends"
        )
    seen = {"root"}
    todo = ["root"]
    while todo:
        name = todo.pop()
        for alt in grammar.rules[name]:
            for ref in _refs(alt):
                if ref not in seen:
                    seen.add(ref)
                    todo.append(ref)
    for name in seen:
        if name not in productive:
            raise GrammarBudgetError(
                f"the grammar's rule {name!r} can never be completed (each of its alternatives "
                "needs itself again, or a character class that matches no character): a reply "
                "that enters it could never end"
            )


# --- compact repetitions --------------------------------------------------------------------


class _Compactor:
    """Rewrites x{m,n} with a large bound into rules that count in powers of two:
    p0 ::= x, p(i) ::= p(i-1) p(i-1) (2^i copies of x); exactly m copies are the p(i) of m's
    binary digits; up to r copies is u(r) ::= u(2^k - 1) | p(k) u(r - 2^k) with 2^k <= r and
    u(2^k - 1) ::= u(2^(k-1) - 1) | p(k-1) u(2^(k-1) - 1), each length one way only, so the
    grammar's stacks stay few (about log2 of the bound)."""

    def __init__(self, grammar: Grammar, nullable: set[str]) -> None:
        self.grammar = grammar
        self.nullable = nullable
        self.added: dict[str, list[list[Item]]] = {}
        prefix = "qrep"
        while any(name.startswith(prefix) for name in grammar.rules):
            prefix += "x"
        self.prefix = prefix
        self.count = 0

    def run(self) -> Grammar:
        rules = {
            name: [[self.item(i) for i in alt] for alt in alternatives]
            for name, alternatives in self.grammar.rules.items()
        }
        rules.update(self.added)
        return Grammar(rules)

    def item(self, item: Item) -> Item:
        if item.kind == "group":
            return Item(
                "group", alternatives=[[self.item(i) for i in alt] for alt in item.alternatives]
            )
        if item.kind != "rep":
            return item
        assert item.inner is not None
        inner = self.item(item.inner)
        bound = item.low if item.high is None else item.high
        if bound <= COMPACT_ABOVE or self.may_be_empty(inner):
            return Item("rep", inner=inner, low=item.low, high=item.high)
        return self.compact(inner, item.low, item.high)

    def may_be_empty(self, item: Item) -> bool:
        kind = item.kind
        if kind == "lit":
            return not item.codepoints
        if kind in ("cls", "any", "tok"):
            return False
        if kind == "ref":
            return item.name in self.nullable
        if kind == "group":
            return any(all(self.may_be_empty(i) for i in alt) for alt in item.alternatives)
        assert item.inner is not None
        return item.low == 0 or self.may_be_empty(item.inner)

    def compact(self, inner: Item, low: int, high: int | None) -> Item:
        self.count += 1
        base = f"{self.prefix}{self.count}"
        powers = [f"{base}-p0"]
        self.added[powers[0]] = [[inner]]
        top = max(low, high or 0)

        def power(i: int) -> str:
            while len(powers) <= i:
                name = f"{base}-p{len(powers)}"
                self.added[name] = [[Item("ref", name=powers[-1]), Item("ref", name=powers[-1])]]
                powers.append(name)
            return powers[i]

        power(max(top.bit_length() - 1, 0))
        sequence = [Item("ref", name=power(i)) for i in reversed(range(low.bit_length()))
                    if low >> i & 1]  # fmt: skip
        if high is None:
            sequence.append(Item("rep", inner=Item("ref", name=powers[0]), low=0, high=None))
        elif high > low:
            sequence.append(Item("ref", name=self.up_to(base, high - low, power)))
        return Item("group", alternatives=[sequence])

    def up_to(self, base: str, r: int, power) -> str:
        """A rule matching 0 to r copies (r >= 1)."""
        name = f"{base}-u{r}"
        if name in self.added:
            return name
        k = r.bit_length() - 1  # 2^k <= r
        if r == (1 << (k + 1)) - 1:  # r = 2^(k+1) - 1: below or at 2^k, then the rest
            smaller = self.up_to(base, (1 << k) - 1, power) if k > 0 else None
            first = [Item("ref", name=smaller)] if smaller else [Item("lit")]
            second = [Item("ref", name=power(k))] + ([Item("ref", name=smaller)] if smaller else [])
            self.added[name] = [first, second]
            return name
        below = self.up_to(base, (1 << k) - 1, power) if k > 0 else None
        first = [Item("ref", name=below)] if below else [Item("lit")]
        rest = r - (1 << k)
        second = [Item("ref", name=power(k))]
        if rest:
            second.append(Item("ref", name=self.up_to(base, rest, power)))
        self.added[name] = [first, second]
        return name


# --- what llama.cpp would allocate ------------------------------------------------------------


def _llama_cost(grammar: Grammar) -> tuple[int, int]:
    """The rules and elements llama.cpp's parser makes of the grammar, counted the way its
    handle_repetitions expands x{m,n} (m copies in the rule, n - m rules of x each), without
    making them; GrammarBudgetError where llama.cpp itself would refuse the repetition."""
    rules = len(grammar.rules)
    elements = 0

    def symbol(item: Item) -> tuple[int, int]:
        """(elements it puts in the rule it is in, llama.cpp's n_prev_rules for it); the rules
        and elements it makes elsewhere are added to the totals."""
        nonlocal rules, elements
        kind = item.kind
        if kind == "lit":
            return len(item.codepoints), 1
        if kind == "cls":
            return sum(1 if lo == hi else 2 for lo, hi in item.ranges), 1
        if kind in ("any", "tok", "ref"):
            return 1, 1
        if kind == "group":
            before = rules
            rules += 1
            for alt in item.alternatives:
                elements += sum(symbol(i)[0] for i in alt) + 1
            return 1, max(1, rules - before)
        assert item.inner is not None
        size, prev = symbol(item.inner)
        low, high = item.low, item.high
        if low > LLAMA_MAX_REPETITIONS:
            raise GrammarBudgetError(
                f"the grammar repeats an item at least {low} times: llama.cpp takes at most "
                f"{LLAMA_MAX_REPETITIONS} where the item can be empty"
            )
        if high is not None and high > LLAMA_MAX_REPETITIONS:
            high = None  # llama.cpp's reading: unbounded
        total = high if high else (low if low else 1)
        if prev * total > LLAMA_MAX_REPETITIONS:
            raise GrammarBudgetError(
                "the grammar repeats a group of rules more often than llama.cpp takes (the "
                f"rules repeated times the repetitions must stay within {LLAMA_MAX_REPETITIONS})"
            )
        optional = 1 if high is None else high - low
        rules += optional
        elements += optional * (size + 3)
        return size * low + (1 if optional else 0), prev * total

    for alternatives in grammar.rules.values():
        for alt in alternatives:
            elements += sum(symbol(i)[0] for i in alt) + 1
    return rules, elements


# --- writing it back ------------------------------------------------------------------------


def _char(value: int) -> str:
    # ^ escaped too: first in a class it would negate it.
    if 0x20 <= value < 0x7F and chr(value) not in '"\\[]-^':
        return chr(value)
    if value in (34, 92, 91, 93, 45):
        return "\\" + chr(value)
    if value <= 0xFF:
        return f"\\x{value:02X}"
    if value <= 0xFFFF:
        return f"\\u{value:04X}"
    return f"\\U{value:08X}"


def literal(text: str) -> str:
    """A GBNF literal matching text exactly."""
    return '"' + "".join(_char(ord(c)) for c in text) + '"'


def char_class(ranges: list[tuple[int, int]], negated: bool) -> str:
    """A GBNF character class of the codepoint ranges (or of all others, negated)."""
    body = "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in ranges)
    return "[" + ("^" if negated else "") + body + "]"


def _write_item(item: Item) -> str:
    kind = item.kind
    if kind == "lit":
        return '"' + "".join(_char(c) for c in item.codepoints) + '"'
    if kind == "cls":
        return char_class(item.ranges, item.negated)
    if kind == "any":
        return "."
    if kind == "tok":
        return item.raw
    if kind == "ref":
        return item.name
    if kind == "group":
        return "(" + " | ".join(_write_sequence(alt) for alt in item.alternatives) + ")"
    assert item.inner is not None
    inner = _write_item(item.inner)
    if item.inner.kind == "rep":
        inner = f"({inner})"
    return inner + repetition(item.low, item.high)


def repetition(low: int, high: int | None) -> str:
    """GBNF's operator for low to high copies (None: no upper bound)."""
    if (low, high) in ((0, None), (1, None), (0, 1)):
        return {(0, None): "*", (1, None): "+", (0, 1): "?"}[(low, high)]
    if high is None:
        return f"{{{low},}}"
    return f"{{{low}}}" if low == high else f"{{{low},{high}}}"


def _write_sequence(items: list[Item]) -> str:
    return " ".join(_write_item(i) for i in items) if items else '""'


def write_gbnf(grammar: Grammar) -> str:
    return "\n".join(
        f"{name} ::= " + " | ".join(_write_sequence(alt) for alt in alternatives)
        for name, alternatives in grammar.rules.items()
    )


# --- the one entry point --------------------------------------------------------------------


def safe_grammar(text: str) -> str:
    """The grammar as quill hands it to llama.cpp, or GrammarBudgetError saying why not: read
    as llama.cpp reads it, large bounds written compactly, within the budget, able to match."""
    grammar = parse_gbnf(text)
    nullable, productive = _nullable_and_productive(grammar)
    _refuse_unmatchable(grammar, productive)
    compacted = _Compactor(grammar, nullable).run()
    rules, elements = _llama_cost(compacted)
    if rules > MAX_RULES:
        raise GrammarBudgetError(
            f"the grammar makes over {MAX_RULES} rules in llama.cpp once its repetitions are "
            "expanded (quill's budget): use fewer or smaller bounded repetitions"
        )
    if elements > MAX_ELEMENTS:
        raise GrammarBudgetError(
            f"the grammar makes over {MAX_ELEMENTS} elements in llama.cpp once its repetitions "
            "are expanded (quill's budget): use fewer or smaller bounded repetitions"
        )
    written = write_gbnf(compacted)
    if len(written) > MAX_GRAMMAR_CHARS:
        raise GrammarBudgetError(
            f"the grammar is over {MAX_GRAMMAR_CHARS} characters once written out (quill's budget)"
        )
    return written
