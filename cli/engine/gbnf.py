"""quill's own reading of a GBNF grammar, before llama.cpp sees it.

llama.cpp's grammar parser (src/llama-grammar.cpp) trusts its input: nested groups recurse in C++
(thirty thousand overflow the stack: SIGSEGV), x{m,n} becomes one rule per repetition and m
copies of x, its left-recursion check recurses along chains of rules, and a grammar that can
match nothing is found out only while sampling, where llama.cpp throws out of a C function
(abort). So every grammar quill hands llama.cpp goes through safe_grammar first, which parses it
as llama.cpp does (same syntax, errors and 2000-repetition limit), refuses what is over the
budget below (counting what llama.cpp would allocate, without allocating it) or cannot be
completed from root, and writes a repetition bounded over COMPACT_ABOVE as rules that count in
powers of two (x{0,1000000}: 40 rules, not a million), the bound still held exactly.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from cli.errors import UsageError

# The budget (stated in docs/run.md and docs/serve.md). Text: a schema's grammar is a few KiB, the
# largest in llama.cpp's grammars/ 4 KiB. Nesting: each group is a C++ recursion in llama.cpp's
# parser. Rules and elements (8 bytes each): what that parser allocates once repetitions are
# expanded, and the rules its left-recursion check recurses through.
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_NESTING = 100
MAX_RULES = 20_000
MAX_ELEMENTS = 1_000_000
MAX_STACKED_REPETITIONS = 8
# llama.cpp's MAX_REPETITION_THRESHOLD: a larger minimum is refused, a larger maximum silently
# becomes unbounded (quill writes such a bound compactly instead).
LLAMA_MAX_REPETITIONS = 2000
COMPACT_ABOVE = 64
_MAX_CODEPOINT = 0x10FFFF
_SPACE = re.compile(r"(?:[ \t]|#[^\r\n\0]*)*")
_SPACE_NEWLINES = re.compile(r"(?:[ \t\r\n]|#[^\r\n\0]*)*")
_WORD = re.compile(r"[a-zA-Z0-9-]*")
_DIGITS = re.compile("[0-9]*")
_ESCAPES = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}
_OPERATORS = {"*": (0, None), "+": (1, None), "?": (0, 1)}


def _match_end(pattern: re.Pattern[str], text: str, pos: int) -> int:
    """Where pattern, matched at pos, ends."""
    match = pattern.match(text, pos)
    assert match is not None  # the patterns above are all starred: they match the empty string
    return match.end()


class GrammarError(UsageError):
    """A grammar llama.cpp cannot take, or that quill refuses before llama.cpp sees it."""


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


Rules = dict[str, list[list[Item]]]  # name -> alternatives, in the order defined


class _Parser:
    """llama.cpp's llama_grammar_parser, with Python's recursion bounded by MAX_NESTING."""

    def __init__(self, text: str) -> None:
        self.src = text + "\0"  # llama.cpp reads a C string: the NUL ends it
        self.rules: Rules = {}
        self.referenced: dict[str, None] = {}

    def fail(self, message: str, pos: int) -> GrammarError:
        where = self.src[pos : pos + 30].split("\n")[0].rstrip("\0")
        return GrammarError(f"the grammar is not GBNF llama.cpp reads: {message} at {where!r}")

    def space(self, pos: int, newline_ok: bool) -> int:
        return _match_end(_SPACE_NEWLINES if newline_ok else _SPACE, self.src, pos)

    def name(self, pos: int) -> int:
        end = _match_end(_WORD, self.src, pos)
        if end == pos:
            raise self.fail("expecting a name", pos)
        return end

    def char(self, pos: int) -> tuple[int, int]:
        c = self.src[pos]
        escape = self.src[pos + 1] if c == "\\" else ""
        if escape and escape in "xuU":
            size = {"x": 2, "u": 4, "U": 8}[escape]
            digits = self.src[pos + 2 : pos + 2 + size]
            if not re.fullmatch(f"[0-9a-fA-F]{{{size}}}", digits):
                raise self.fail(f"expecting {size} hex digits", pos + 2)
            return int(digits, 16), pos + 2 + size
        if c == "\\":
            if escape not in _ESCAPES:
                raise self.fail("unknown escape", pos)
            return _ESCAPES[escape], pos + 2
        if c == "\0":
            raise self.fail("unexpected end of input", pos)
        return ord(c), pos + 1

    def more(self, pos: int, close: str) -> bool:
        """Whether a literal or a class goes on at pos (the input must not end before close)."""
        if self.src[pos] == "\0":
            raise self.fail("unexpected end of input", pos)
        return self.src[pos] != close

    def parse(self) -> Rules:
        pos = self.space(0, True)
        while self.src[pos] != "\0":
            pos = self.rule(pos)
        for name in self.referenced:
            if name not in self.rules:
                raise GrammarError(
                    f"the grammar is not GBNF llama.cpp reads: the rule {name!r} is used but "
                    "never defined"
                )
        return self.rules

    def rule(self, pos: int) -> int:
        end = self.name(pos)
        rule_name = self.src[pos:end]
        pos = self.space(end, False)
        if self.src[pos : pos + 3] != "::=":
            raise self.fail("expecting ::=", pos)
        alternatives, pos = self.alternates(self.space(pos + 3, True), False, 0)
        self.rules[rule_name] = alternatives  # llama.cpp keeps a name's last definition
        if self.src[pos : pos + 2] == "\r\n":
            pos += 2
        elif self.src[pos] in "\r\n":
            pos += 1
        elif self.src[pos] != "\0":
            raise self.fail("expecting newline or end", pos)
        return self.space(pos, True)

    def alternates(self, pos: int, nested: bool, depth: int) -> tuple[list[list[Item]], int]:
        if depth > MAX_NESTING:
            raise GrammarError(
                f"the grammar nests groups deeper than {MAX_NESTING} levels (quill's budget)"
            )
        sequence, pos = self.sequence(pos, nested, depth)
        alternatives = [sequence]
        while self.src[pos] == "|":
            sequence, pos = self.sequence(self.space(pos + 1, True), nested, depth)
            alternatives.append(sequence)
        return alternatives, pos

    def sequence(self, pos: int, nested: bool, depth: int) -> tuple[list[Item], int]:
        src = self.src
        items: list[Item] = []
        while src[pos] != "\0":
            c = src[pos]
            if c == '"':
                item, pos = self.literal(pos)
            elif c == "[":
                item, pos = self.char_class(pos)
            elif c in "<!":
                item, pos = self.token(pos)
            elif (end := _match_end(_WORD, src, pos)) > pos:
                self.referenced[src[pos:end]] = None
                item, pos = Item("ref", name=src[pos:end]), end
            elif c == "(":
                alternatives, pos = self.alternates(self.space(pos + 1, True), True, depth + 1)
                if src[pos] != ")":
                    raise self.fail("expecting ')'", pos)
                item, pos = Item("group", alternatives=alternatives), pos + 1
            elif c == ".":
                item, pos = Item("any"), pos + 1
            elif c in "*+?{":
                if not items or (items[-1].kind == "lit" and not items[-1].codepoints):
                    raise self.fail("expecting an item before */+/?/{", pos)
                repeated, pos = self.repetition(items.pop(), pos, nested)
                items.append(repeated)
                pos = self.space(pos, nested)
                continue
            else:
                break
            items.append(item)
            pos = self.space(pos, nested)
        return items, pos

    def literal(self, pos: int) -> tuple[Item, int]:
        """ "text": its code points, and the position after the closing quote."""
        codepoints = []
        pos += 1
        while self.more(pos, '"'):
            value, pos = self.char(pos)
            codepoints.append(value)
        return Item("lit", codepoints=codepoints), pos + 1

    def char_class(self, pos: int) -> tuple[Item, int]:
        """[a-z0-9_] or [^...]: its ranges, and the position after the closing bracket."""
        src = self.src
        negated = src[pos + 1] == "^"
        pos += 1 + negated
        ranges = []
        while self.more(pos, "]"):
            first, pos = self.char(pos)
            last = first
            if src[pos] == "-" and src[pos + 1] != "]":
                if src[pos + 1] == "\0":
                    raise self.fail("unexpected end of input", pos)
                last, pos = self.char(pos + 1)
            ranges.append((first, last))
        # [] and [^] add no element in llama.cpp: they match the empty string.
        item = Item("cls", negated=negated, ranges=ranges) if ranges else Item("lit")
        return item, pos + 1

    def token(self, pos: int) -> tuple[Item, int]:
        """<token>, <[id]> or their negations !<...>, kept as written for llama.cpp."""
        src, start = self.src, pos
        pos += src[pos] == "!"
        if src[pos] != "<":
            raise self.fail("expecting '<'", pos)
        end = src.find(">", pos)
        if end < 0 or "\0" in src[pos:end]:
            raise self.fail("expecting '>'", pos)
        if src[pos + 1] == "[":
            if not re.fullmatch(r"<\[[0-9]+\]>", src[pos : end + 1]):
                raise self.fail("expecting <[token id]>", pos)
            if int(src[pos + 2 : end - 1]) > 0xFFFFFFFF:
                raise self.fail("the token id is too big", pos)
        return Item("tok", raw=src[start : end + 1]), end + 1

    def repetition(self, inner: Item, pos: int, nested: bool) -> tuple[Item, int]:
        """inner*, inner+, inner? or inner{m,n}, within quill's budget of stacked repetitions."""
        if self.src[pos] == "{":
            low, high, pos = self.braces(pos, nested)
        else:
            low, high = _OPERATORS[self.src[pos]]
            pos += 1
        stacked, innermost = 1, inner
        while innermost.kind == "rep" and innermost.inner is not None:
            stacked, innermost = stacked + 1, innermost.inner
        if stacked > MAX_STACKED_REPETITIONS:
            raise GrammarError(
                f"the grammar repeats a repetition more than {MAX_STACKED_REPETITIONS} "
                "times over (x{2}{3}...: quill's budget)"
            )
        return Item("rep", inner=inner, low=low, high=high), pos

    def braces(self, pos: int, nested: bool) -> tuple[int, int | None, int]:
        """x{m}, x{m,} or x{m,n}: (m, n or None, the position after the closing brace)."""
        src = self.src
        low, pos = self.integer(self.space(pos + 1, nested))
        pos = self.space(pos, nested)
        high: int | None = low
        if src[pos] == ",":
            pos, high = self.space(pos + 1, nested), None
            if "0" <= src[pos] <= "9":
                high, pos = self.integer(pos)
                pos = self.space(pos, nested)
            if src[pos] != "}":
                raise self.fail("expecting '}'", pos)
        elif src[pos] != "}":
            raise self.fail("expecting ','", pos)
        if high is not None and high < low:
            # llama.cpp would count high - low optional copies in an unsigned integer: it wraps,
            # and the parser loops until memory runs out.
            raise self.fail(
                f"the repetition {{{low},{high}}} has its maximum below its minimum", pos
            )
        return low, high, pos + 1

    def integer(self, pos: int) -> tuple[int, int]:
        end = _match_end(_DIGITS, self.src, pos)
        if end == pos:
            raise self.fail("expecting an int", pos)
        if end - pos > 19:
            raise self.fail("the number is too big", pos)
        return int(self.src[pos:end]), end


def parse_gbnf(text: str) -> Rules:
    """The grammar's rules, or GrammarError for what llama.cpp would refuse or cannot take."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(
            f"the grammar has {len(text)} characters; quill takes at most {MAX_GRAMMAR_CHARS}"
        )
    if "\0" in text:
        raise GrammarError("the grammar holds a NUL character (write \\x00 for it)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise GrammarError("the grammar is not valid Unicode (a lone surrogate)") from None
    rules = _Parser(text).parse()
    if "root" not in rules:
        raise GrammarError("the grammar has no 'root ::= ...' rule")
    return rules


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


def _nullable_and_productive(rules: Rules) -> tuple[set[str], set[str]]:
    """The rules that can match the empty string, and those that can match some string: the
    textbook fixpoint, in time linear in the grammar (each group a rule of its own; a
    repetition that may be absent needs nothing)."""
    # symbol -> alternatives, each (the symbols it needs, whether its terminals can be empty,
    # whether its terminals can match).
    flat: dict[str, list[tuple[list[str], bool, bool]]] = {}
    groups = itertools.count()

    def flatten(items: list[Item]) -> tuple[list[str], bool, bool]:
        needs: list[str] = []
        empty = matches = True
        for item in items:
            while item.kind == "rep" and item.low > 0 and item.inner is not None:
                item = item.inner
            if item.kind == "lit":
                empty = empty and not item.codepoints
            elif item.kind in ("cls", "any", "tok"):
                empty = False
                matches = matches and not (item.kind == "cls" and _class_is_empty(item))
            elif item.kind == "ref":
                needs.append(item.name)
            elif item.kind == "group":
                name = f" group {next(groups)}"  # a space: no rule's name
                flat[name] = [flatten(alt) for alt in item.alternatives]
                needs.append(name)
        return needs, empty, matches

    for name, alternatives in rules.items():
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
                for need in needs:
                    waiting.setdefault(need, []).append(len(alternatives))
                alternatives.append((owner, len(needs)))
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
        return {name for name in done if name in rules}

    return fixpoint(0), fixpoint(1)


def _refs(items: list[Item]) -> list[str]:
    found: list[str] = []
    stack = list(items)
    while stack:
        item = stack.pop()
        if item.kind == "ref":
            found.append(item.name)
        stack.extend(i for alt in item.alternatives for i in alt)
        stack.extend([item.inner] if item.inner is not None else [])
    return found


def _refuse_unmatchable(rules: Rules, productive: set[str]) -> None:
    if "root" not in productive:
        raise GrammarError(
            "the grammar can match nothing: every way through 'root' needs a character class "
            "that matches no character, or a rule that never ends"
        )
    seen, todo = {"root"}, ["root"]
    while todo:
        for ref in _refs([i for alt in rules[todo.pop()] for i in alt]):
            if ref not in productive:
                raise GrammarError(
                    f"the grammar's rule {ref!r} can never be completed (each of its "
                    "alternatives needs itself again, or a character class that matches no "
                    "character): a reply that enters it could never end"
                )
            if ref not in seen:
                seen.add(ref)
                todo.append(ref)


class _Compactor:
    """Rewrites x{m,n} with a large bound into rules that count in powers of two:
    p0 ::= x, p(i) ::= p(i-1) p(i-1) (2^i copies of x); exactly m copies are the p(i) of m's
    binary digits; up to r copies is u(r) ::= u(2^k - 1) | p(k) u(r - 2^k) with 2^k <= r, each
    length one way only, so the grammar's stacks stay few (about log2 of the bound)."""

    def __init__(self, rules: Rules, nullable: set[str]) -> None:
        self.rules = rules
        self.nullable = nullable
        self.added: Rules = {}
        self.prefix = "qrep"
        while any(name.startswith(self.prefix) for name in rules):
            self.prefix += "x"

    def run(self) -> Rules:
        rewritten = {name: [[self.item(i) for i in alt] for alt in alternatives]
                     for name, alternatives in self.rules.items()}  # fmt: skip
        return rewritten | self.added

    def item(self, item: Item) -> Item:
        if item.kind == "group":
            return Item(
                "group", alternatives=[[self.item(i) for i in alt] for alt in item.alternatives]
            )
        if item.kind != "rep" or item.inner is None:
            return item
        inner = self.item(item.inner)
        bound = item.low if item.high is None else item.high
        if bound <= COMPACT_ABOVE or self.may_be_empty(inner):
            return Item("rep", inner=inner, low=item.low, high=item.high)
        return self.compact(inner, item.low, item.high)

    def may_be_empty(self, item: Item) -> bool:
        if item.kind in ("lit", "cls", "any", "tok"):
            return item.kind == "lit" and not item.codepoints
        if item.kind == "ref":
            return item.name in self.nullable
        if item.kind == "group":
            return any(all(self.may_be_empty(i) for i in alt) for alt in item.alternatives)
        return item.low == 0 or self.may_be_empty(item.inner)  # type: ignore[arg-type]

    def compact(self, inner: Item, low: int, high: int | None) -> Item:
        base = f"{self.prefix}{len(self.added)}"
        powers = [f"{base}-p0"]
        self.added[powers[0]] = [[inner]]

        def power(i: int) -> str:
            while len(powers) <= i:
                name = f"{base}-p{len(powers)}"
                self.added[name] = [[Item("ref", name=powers[-1]), Item("ref", name=powers[-1])]]
                powers.append(name)
            return powers[i]

        power(max(max(low, high or 0).bit_length() - 1, 0))
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
        if name not in self.added:
            k = r.bit_length() - 1  # 2^k <= r
            below = [Item("ref", name=self.up_to(base, (1 << k) - 1, power))] if k else []
            copies = Item("ref", name=power(k))
            rest = r - (1 << k)
            more = [Item("ref", name=self.up_to(base, rest, power))] if rest else []
            self.added[name] = [below or [Item("lit")], [copies, *more]]
        return name


def _llama_cost(rules: Rules) -> tuple[int, int]:
    """The rules and elements llama.cpp's parser makes of the grammar, counted the way its
    handle_repetitions expands x{m,n} (m copies in the rule, n - m rules of x each), without
    making them; GrammarError where llama.cpp itself would refuse the repetition."""
    rule_count = len(rules)
    elements = 0

    def symbol(item: Item) -> tuple[int, int]:
        """(elements it puts in the rule it is in, llama.cpp's n_prev_rules for it); the rules
        and elements it makes elsewhere are added to the totals."""
        nonlocal rule_count, elements
        if item.kind == "lit":
            return len(item.codepoints), 1
        if item.kind == "cls":
            return sum(1 + (lo != hi) for lo, hi in item.ranges), 1
        if item.kind in ("any", "tok", "ref"):
            return 1, 1
        if item.kind == "group":
            before = rule_count
            rule_count += 1
            for alt in item.alternatives:
                elements += sum(symbol(i)[0] for i in alt) + 1
            return 1, max(1, rule_count - before)
        size, prev = symbol(item.inner)  # type: ignore[arg-type]
        low, high = item.low, item.high
        if low > LLAMA_MAX_REPETITIONS:
            raise GrammarError(
                f"the grammar repeats an item at least {low} times: llama.cpp takes at most "
                f"{LLAMA_MAX_REPETITIONS} where the item can be empty"
            )
        if high is not None and high > LLAMA_MAX_REPETITIONS:
            high = None  # llama.cpp's reading: unbounded
        if prev * (high or low or 1) > LLAMA_MAX_REPETITIONS:
            raise GrammarError(
                "the grammar repeats a group of rules more often than llama.cpp takes (the "
                f"rules repeated times the repetitions must stay within {LLAMA_MAX_REPETITIONS})"
            )
        optional = 1 if high is None else high - low
        rule_count += optional
        elements += optional * (size + 3)
        return size * low + (1 if optional else 0), prev * (high or low or 1)

    for alternatives in rules.values():
        for alt in alternatives:
            elements += sum(symbol(i)[0] for i in alt) + 1
    return rule_count, elements


def _char(value: int) -> str:
    # ^ escaped too: first in a class it would negate it.
    if 0x20 <= value < 0x7F and chr(value) not in '"\\[]-^':
        return chr(value)
    if value in (34, 92, 91, 93, 45):
        return "\\" + chr(value)
    if value <= 0xFF:
        return f"\\x{value:02X}"
    return f"\\u{value:04X}" if value <= 0xFFFF else f"\\U{value:08X}"


def literal(text: str) -> str:
    """A GBNF literal matching text exactly."""
    return '"' + "".join(_char(ord(c)) for c in text) + '"'


def char_class(ranges: list[tuple[int, int]], negated: bool) -> str:
    """A GBNF character class of the codepoint ranges (or of all others, negated)."""
    body = "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in ranges)
    return "[" + ("^" if negated else "") + body + "]"


def repetition(low: int, high: int | None) -> str:
    """GBNF's operator for low to high copies (None: no upper bound)."""
    for operator, bounds in _OPERATORS.items():
        if (low, high) == bounds:
            return operator
    if high is None:
        return f"{{{low},}}"
    return f"{{{low}}}" if low == high else f"{{{low},{high}}}"


def _write_item(item: Item) -> str:
    if item.kind == "lit":
        return literal("".join(map(chr, item.codepoints)))
    if item.kind == "cls":
        return char_class(item.ranges, item.negated)
    if item.kind == "group":
        return "(" + " | ".join(_write_sequence(alt) for alt in item.alternatives) + ")"
    if item.kind == "rep" and item.inner is not None:
        inner = _write_item(item.inner)
        return (f"({inner})" if item.inner.kind == "rep" else inner) + repetition(
            item.low, item.high
        )
    return {"any": ".", "tok": item.raw, "ref": item.name}[item.kind]


def _write_sequence(items: list[Item]) -> str:
    return " ".join(_write_item(i) for i in items) if items else '""'


def safe_grammar(text: str) -> str:
    """The grammar as quill hands it to llama.cpp, or GrammarError saying why not."""
    rules = parse_gbnf(text)
    nullable, productive = _nullable_and_productive(rules)
    _refuse_unmatchable(rules, productive)
    compacted = _Compactor(rules, nullable).run()
    limits = (("rules", MAX_RULES), ("elements", MAX_ELEMENTS))
    for count, (what, limit) in zip(_llama_cost(compacted), limits, strict=True):
        if count > limit:
            raise GrammarError(
                f"the grammar makes over {limit} {what} in llama.cpp once its repetitions are "
                "expanded (quill's budget): use fewer or smaller bounded repetitions"
            )
    written = "\n".join(
        f"{name} ::= " + " | ".join(_write_sequence(alt) for alt in alternatives)
        for name, alternatives in compacted.items()
    )
    if len(written) > MAX_GRAMMAR_CHARS:
        raise GrammarError(
            f"the grammar is over {MAX_GRAMMAR_CHARS} characters once written out (quill's budget)"
        )
    return written
