// jinja::parse: the syntax tree of a chat template, built once from jinja::lex's tokens with
// jinja2's grammar and operator precedence (conditional expression < or < and < not <
// comparisons/in < + - < ~ < * / // % < ** < unary -/+ < filters and `is` tests < postfix).
//
// Guarantees: the tree is immutable after parse() and holds no per-render state, so one tree
// can be rendered from many threads; a construct outside the supported subset, or a syntax
// error, throws TemplateError with the line, as jinja2's TemplateSyntaxError would.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/text/jinja_lexer.h"
#include "engine/text/jinja_value.h"

namespace kvpipe::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    Const,     // value
    Name,      // name
    List,      // children
    Tuple,     // children
    Dict,      // children: key, value, key, value, ...
    GetAttr,   // children[0].name
    GetItem,   // children[0][children[1]]
    Slice,     // children[0][children[1]:children[2]:children[3]] (null parts omitted)
    Call,      // children[0](children[1..], kwargs)
    Filter,    // children[0] | name(children[1..], kwargs); children[0] null in a filter block
    Test,      // children[0] is [not] name(children[1..], kwargs)
    Negate,    // -children[0]
    Plus,      // +children[0]
    Binary,    // children[0] name children[1]: + - * / // % ** ~
    And,
    Or,
    Not,
    Compare,   // children[0] ops[0] children[1] ops[1] children[2] ...
    Condition  // children[0] if children[1] else children[2] (children[2] may be null)
  };
  Kind kind;
  int line = 0;
  Value value;
  std::string name;
  std::vector<ExprPtr> children;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
  bool negated = false;

  Expr() = default;
  ~Expr();
  Expr(const Expr&) = delete;
  Expr& operator=(const Expr&) = delete;
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  enum class Kind {
    Text,         // text
    Output,       // {{ expr }}
    If,           // branches (condition, body); else_body
    For,          // for targets in expr [if condition]: body; else_body
    Set,          // set targets = expr, or set targets[0].attribute = expr (namespace)
    SetBlock,     // set targets[0] [| filter]: body; endset
    Macro,        // macro name(params = defaults): body
    CallBlock,    // call expr: body (the body is the macro's caller())
    FilterBlock,  // filter expr (a Filter with no operand): body
    Generation,   // generation: body (transformers' AssistantTracker renders it unchanged)
    Break,
    Continue
  };
  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr condition;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body, else_body;
  std::vector<std::string> targets;
  bool unpack = false;  // for a, b in ... / set a, b = ...
  std::string attribute;
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // one per param, null when it has none
};

Body parse(const std::vector<Token>& tokens);

}  // namespace kvpipe::jinja
