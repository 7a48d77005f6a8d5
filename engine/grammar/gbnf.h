// GBNF to regular expression: the pattern (RegexDfa's syntax) whose matches are texts of a
// llama.cpp grammar (GBNF, the `grammar` of llama.cpp-style requests), for structured outputs.
//
// kvpipe's own (no packaged library fits: llama.cpp's grammar engine is part of llama.cpp and
// walks pushdown stacks code point by code point, while kvpipe's constrained decoding is a
// byte automaton). The syntax is llama.cpp's (grammars/README.md, src/llama-grammar.cpp):
// rules `name ::= alternatives` with names of letters, digits, `-` (and `_`, as the README
// allows); a rule ends at the end of its line, except inside parentheses and after `|` or
// `::=`; `#` comments to the end of a line; string literals "..." and classes [...] / [^...]
// (ranges a-z) with the escapes \n \r \t \\ \" \[ \] \- \xHH \uHHHH \UHHHHHHHH and UTF-8
// text; `.` (any character, a newline included); rule references, groups ( ), alternation |,
// quantifiers * + ? {m} {m,} {m,n} (m, n at most 1000).
//
// Guarantees: every string the pattern matches is in the language of the rule `root` (sound),
// and for a grammar without recursion the pattern's language is exactly root's (but for the
// negated classes below). So it is for a rule that recurs into itself only at the end of its
// texts or only at their start, through no other rule: right recursion such as `ws ::=
// ([ \t\n] ws)?` or `items ::= item ("," items)?`, and left recursion (`list ::= list ","
// item | item`, which llama.cpp refuses), are regular and become repetitions (R ::= A R | B
// is A* B). Other recursion (a rule that reaches itself through other rules, or in its
// middle) can describe more than a regular language, so it is unrolled: a rule nests inside
// itself at most `max_depth` times (depth 1 is its first expansion), and at the deepest level
// the alternatives that need it once more are dropped (an optional part that needs it becomes
// empty). With max_depth 3, `root ::= "(" root ")" | "x"` matches x, (x), ((x)) and not
// (((x))). Characters outside ASCII are exact
// in literals and in classes, negated or not (a class becomes RegexDfa's ranges of characters).
//
// Refused with std::invalid_argument, one line naming the place ("line 2, column 7: undefined
// rule 'value'"): syntax errors (unterminated strings, classes and groups, unknown escapes,
// a quantifier with nothing to repeat or counts above 1000), a rule defined twice (llama.cpp
// keeps the last), "no rule 'root'", a rule reachable from root whose every expansion needs itself
// again ("rule 'x' recurses without an end"), classes that take no character, parentheses nested deeper
// than 100, llama.cpp's token syntax (<[id]>, <name>, !<...>), and a grammar whose pattern would
// exceed 256 KB or nest groups deeper than 256 once unrolled ("the grammar is too large once its
// recursion is unrolled to depth 3"). RegexDfa itself then caps the automaton's states.
#pragma once

#include <string>

namespace kvpipe {

// The pattern of `grammar`'s rule `root`, recursion unrolled to `max_depth` (at least 1).
std::string gbnf_regex(const std::string& grammar, int max_depth = 3);

}  // namespace kvpipe
