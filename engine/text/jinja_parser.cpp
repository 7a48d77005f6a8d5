#include "engine/text/jinja_parser.h"

#include <algorithm>
#include <initializer_list>

#include "engine/text/jinja_builtins.h"

namespace kvpipe::jinja {
namespace {

void check_names(const Body& body, bool soft);

// How deep a template may nest: blocks and parenthesised or unary expressions while parsing,
// any expression tree after. Python refuses 200 nested parentheses; the interpreter's
// recursive walks stay within the stack below these.
constexpr int kMaxParseNesting = 100;
constexpr int kMaxExprDepth = 256;

class Parser {
 public:
  explicit Parser(const std::vector<Token>& tokens) : t_(tokens) {}

  Body parse_template() {
    std::string end;
    Body body = parse_body({}, end);
    check_names(body, false);
    return body;
  }

 private:
  const Token& cur() const { return t_[p_]; }
  const Token& peek(size_t n = 1) const { return t_[std::min(p_ + n, t_.size() - 1)]; }
  const Token& next() { return t_[p_ < t_.size() - 1 ? p_++ : p_]; }

  bool is_op(const char* op) const { return cur().type == TokenType::Operator && cur().text == op; }
  bool is_name(const char* name) const { return cur().type == TokenType::Name && cur().text == name; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(const char* name) {
    if (!is_name(name)) return false;
    next();
    return true;
  }

  static std::string describe(const Token& t) {
    switch (t.type) {
      case TokenType::End: return "end of template";
      case TokenType::VariableEnd: return "end of print statement";
      case TokenType::BlockEnd: return "end of statement block";
      case TokenType::Text: return "template data";
      case TokenType::String: return "string";
      default: return "'" + t.text + "'";
    }
  }

  [[noreturn]] void fail(const std::string& message) const { throw TemplateError(message, cur().line); }
  [[noreturn]] void fail_unexpected(const std::string& expected) const {
    fail("expected " + expected + ", got " + describe(cur()));
  }

  void expect_op(const char* op) {
    if (!skip_op(op)) fail_unexpected(std::string("token '") + op + "'");
  }
  void expect_name(const char* name) {
    if (!skip_name(name)) fail_unexpected(std::string("token '") + name + "'");
  }
  std::string expect_identifier() {
    if (cur().type != TokenType::Name) fail_unexpected("a name");
    return next().text;
  }
  void expect_block_end() {
    if (cur().type != TokenType::BlockEnd) fail_unexpected("end of statement block");
    next();
  }

  // Statements up to a block tag named in `ends`; consumes `{% name` of that tag and
  // reports the name in `end`.
  Body parse_body(std::initializer_list<const char*> ends, std::string& end) {
    const Nest nest(*this);
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == TokenType::End) {
        if (ends.size() == 0) return body;
        std::string names;
        for (const char* e : ends) names += std::string(names.empty() ? "" : " or ") + "'" + e + "'";
        fail("Unexpected end of template. Jinja was looking for the following tags: " + names + ".");
      }
      if (t.type == TokenType::Text) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::Text;
        s->line = t.line;
        s->text = t.text;
        body.push_back(std::move(s));
        next();
      } else if (t.type == TokenType::VariableBegin) {
        next();
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::Output;
        s->line = t.line;
        s->expr = parse_tuple(true, {}, false);
        if (cur().type != TokenType::VariableEnd) fail_unexpected("end of print statement");
        next();
        body.push_back(std::move(s));
      } else if (t.type == TokenType::BlockBegin) {
        const Token& name = peek();
        if (name.type == TokenType::Name)
          for (const char* e : ends)
            if (name.text == e) {
              next();
              next();
              end = e;
              return body;
            }
        next();
        body.push_back(parse_statement());
      } else {
        fail("unexpected " + describe(t));
      }
    }
  }

  StmtPtr parse_statement() {
    if (cur().type != TokenType::Name) fail("tag name expected");
    const Token& tag = next();
    auto s = std::make_unique<Stmt>();
    s->line = tag.line;
    std::string end;
    const std::string& n = tag.text;
    if (n == "for") {
      s->kind = Stmt::Kind::For;
      parse_targets(*s, "in");
      expect_name("in");
      s->expr = parse_tuple(false, {"recursive"}, false);
      if (skip_name("if")) s->condition = parse_expression(true);
      if (is_name("recursive")) fail("recursive loops are not supported");
      expect_block_end();
      s->body = parse_body({"endfor", "else"}, end);
      if (end == "else") {
        expect_block_end();
        s->else_body = parse_body({"endfor"}, end);
      }
      expect_block_end();
    } else if (n == "if") {
      s->kind = Stmt::Kind::If;
      while (true) {
        ExprPtr cond = parse_tuple(false, {}, false);
        expect_block_end();
        Body body = parse_body({"elif", "else", "endif"}, end);
        s->branches.emplace_back(std::move(cond), std::move(body));
        if (end == "elif") continue;
        if (end == "else") {
          expect_block_end();
          s->else_body = parse_body({"endif"}, end);
        }
        break;
      }
      expect_block_end();
    } else if (n == "set") {
      s->targets.push_back(expect_identifier());
      if (skip_op(".")) {
        s->attribute = expect_identifier();
      } else {
        while (skip_op(",")) {
          s->unpack = true;
          if (is_op("=")) break;
          s->targets.push_back(expect_identifier());
        }
      }
      if (skip_op("=")) {
        s->kind = Stmt::Kind::Set;
        s->expr = parse_tuple(true, {}, false);
        expect_block_end();
      } else {
        if (s->unpack || !s->attribute.empty()) fail_unexpected("token '='");
        s->kind = Stmt::Kind::SetBlock;
        if (is_op("|")) s->expr = parse_filter(nullptr);
        expect_block_end();
        s->body = parse_body({"endset"}, end);
        expect_block_end();
      }
    } else if (n == "macro") {
      s->kind = Stmt::Kind::Macro;
      s->name = expect_identifier();
      expect_op("(");
      while (!is_op(")")) {
        if (!s->params.empty()) expect_op(",");
        if (is_op(")")) break;
        s->params.push_back(expect_identifier());
        s->defaults.push_back(skip_op("=") ? parse_expression(true) : nullptr);
      }
      expect_op(")");
      expect_block_end();
      s->body = parse_body({"endmacro"}, end);
      if (cur().type == TokenType::Name) next();  // {% endmacro name %}
      expect_block_end();
    } else if (n == "call") {
      s->kind = Stmt::Kind::CallBlock;
      if (is_op("(")) fail("call blocks with caller arguments are not supported");
      s->expr = parse_expression(true);
      if (s->expr->kind != Expr::Kind::Call) fail("expected call");
      expect_block_end();
      s->body = parse_body({"endcall"}, end);
      expect_block_end();
    } else if (n == "filter") {
      s->kind = Stmt::Kind::FilterBlock;
      s->expr = parse_filter(nullptr, true);
      expect_block_end();
      s->body = parse_body({"endfilter"}, end);
      expect_block_end();
    } else if (n == "generation") {
      s->kind = Stmt::Kind::Generation;
      expect_block_end();
      s->body = parse_body({"endgeneration"}, end);
      expect_block_end();
    } else if (n == "break" || n == "continue") {
      s->kind = n == "break" ? Stmt::Kind::Break : Stmt::Kind::Continue;
      expect_block_end();
    } else {
      throw TemplateError("Encountered unknown tag '" + n + "'.", tag.line);
    }
    return s;
  }

  void parse_targets(Stmt& s, const char* end_name) {
    s.targets.push_back(expect_identifier());
    while (skip_op(",")) {
      s.unpack = true;
      if (is_name(end_name)) break;
      s.targets.push_back(expect_identifier());
    }
  }

  ExprPtr make(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  bool tuple_end(const std::vector<const char*>& extra) const {
    const Token& t = cur();
    if (t.type == TokenType::VariableEnd || t.type == TokenType::BlockEnd || t.type == TokenType::End) return true;
    if (t.type == TokenType::Operator && t.text == ")") return true;
    if (t.type == TokenType::Name)
      for (const char* e : extra)
        if (t.text == e) return true;
    return false;
  }

  ExprPtr parse_tuple(bool with_condexpr, const std::vector<const char*>& extra, bool explicit_parentheses) {
    const int line = cur().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (tuple_end(extra)) break;
      items.push_back(parse_expression(with_condexpr));
      if (is_op(","))
        is_tuple = true;
      else
        break;
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parentheses) fail("Expected an expression, got " + describe(cur()));
    }
    auto e = make(Expr::Kind::Tuple, line);
    e->children = std::move(items);
    return e;
  }

  ExprPtr parse_expression(bool with_condexpr) { return with_condexpr ? parse_condexpr() : parse_or(); }

  ExprPtr parse_condexpr() {
    const int line = cur().line;
    ExprPtr e = parse_or();
    while (skip_name("if")) {
      auto c = make(Expr::Kind::Condition, line);
      ExprPtr cond = parse_or();
      ExprPtr otherwise = skip_name("else") ? parse_condexpr() : nullptr;
      c->children.push_back(std::move(e));
      c->children.push_back(std::move(cond));
      c->children.push_back(std::move(otherwise));
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(Expr::Kind kind, const std::string& op, ExprPtr a, ExprPtr b) {
    auto e = make(kind, a->line);
    e->name = op;
    e->children.push_back(std::move(a));
    e->children.push_back(std::move(b));
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr e = parse_and();
    while (skip_name("or")) e = binary(Expr::Kind::Or, "or", std::move(e), parse_and());
    return e;
  }

  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (skip_name("and")) e = binary(Expr::Kind::And, "and", std::move(e), parse_not());
    return e;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      auto e = make(Expr::Kind::Not, next().line);
      e->children.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const int line = cur().line;
    ExprPtr first = parse_math1();
    std::vector<std::string> ops;
    std::vector<ExprPtr> operands;
    while (true) {
      if (cur().type == TokenType::Operator &&
          (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == ">" ||
           cur().text == "<=" || cur().text == ">=")) {
        ops.push_back(next().text);
      } else if (is_name("in")) {
        next();
        ops.push_back("in");
      } else if (is_name("not") && peek().type == TokenType::Name && peek().text == "in") {
        next();
        next();
        ops.push_back("notin");
      } else {
        break;
      }
      operands.push_back(parse_math1());
    }
    if (ops.empty()) return first;
    auto e = make(Expr::Kind::Compare, line);
    e->children.push_back(std::move(first));
    for (auto& o : operands) e->children.push_back(std::move(o));
    e->ops = std::move(ops);
    return e;
  }

  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = next().text;
      e = binary(Expr::Kind::Binary, op, std::move(e), parse_concat());
    }
    return e;
  }

  ExprPtr parse_concat() {
    ExprPtr e = parse_math2();
    while (skip_op("~")) e = binary(Expr::Kind::Binary, "~", std::move(e), parse_math2());
    return e;
  }

  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = next().text;
      e = binary(Expr::Kind::Binary, op, std::move(e), parse_pow());
    }
    return e;
  }

  ExprPtr parse_pow() {
    ExprPtr e = parse_unary(true);
    while (skip_op("**")) e = binary(Expr::Kind::Binary, "**", std::move(e), parse_unary(true));
    return e;
  }

  ExprPtr parse_unary(bool with_filter) {
    const Nest nest(*this);
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const Token& t = next();
      e = make(t.text == "-" ? Expr::Kind::Negate : Expr::Kind::Plus, t.line);
      e->children.push_back(parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr constant(Value v, int line) {
    auto e = make(Expr::Kind::Const, line);
    e->value = std::move(v);
    return e;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    switch (t.type) {
      case TokenType::Name: {
        next();
        if (t.text == "true" || t.text == "True") return constant(Value::boolean(true), t.line);
        if (t.text == "false" || t.text == "False") return constant(Value::boolean(false), t.line);
        if (t.text == "none" || t.text == "None") return constant(Value::none(), t.line);
        auto e = make(Expr::Kind::Name, t.line);
        e->name = t.text;
        return e;
      }
      case TokenType::String: {
        std::string s;
        const int line = t.line;
        while (cur().type == TokenType::String) s += next().text;
        return constant(Value::string(s), line);
      }
      case TokenType::Integer: next(); return constant(Value::integer(t.integer), t.line);
      case TokenType::Float: next(); return constant(Value::number(t.number), t.line);
      case TokenType::Operator:
        if (t.text == "(") {
          next();
          ExprPtr e = parse_tuple(true, {}, true);
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          next();
          auto e = make(Expr::Kind::List, t.line);
          while (!is_op("]")) {
            if (!e->children.empty()) expect_op(",");
            if (is_op("]")) break;
            e->children.push_back(parse_expression(true));
          }
          expect_op("]");
          return e;
        }
        if (t.text == "{") {
          next();
          auto e = make(Expr::Kind::Dict, t.line);
          while (!is_op("}")) {
            if (!e->children.empty()) expect_op(",");
            if (is_op("}")) break;
            e->children.push_back(parse_expression(true));
            expect_op(":");
            e->children.push_back(parse_expression(true));
          }
          expect_op("}");
          return e;
        }
        break;
      default: break;
    }
    fail("unexpected " + describe(t));
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (is_op(".") || is_op("["))
        e = parse_subscript(std::move(e));
      else if (is_op("("))
        e = parse_call(std::move(e));
      else
        return e;
    }
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (is_op("|"))
        e = parse_filter(std::move(e));
      else if (is_name("is"))
        e = parse_test(std::move(e));
      else if (is_op("("))
        e = parse_call(std::move(e));
      else
        return e;
    }
  }

  ExprPtr parse_subscript(ExprPtr obj) {
    const Token& t = next();
    if (t.text == ".") {
      const Token& attr = next();
      if (attr.type == TokenType::Name) {
        auto e = make(Expr::Kind::GetAttr, t.line);
        e->name = attr.text;
        e->children.push_back(std::move(obj));
        return e;
      }
      if (attr.type == TokenType::Integer) {
        auto e = make(Expr::Kind::GetItem, t.line);
        e->children.push_back(std::move(obj));
        e->children.push_back(constant(Value::integer(attr.integer), attr.line));
        return e;
      }
      throw TemplateError("expected name or number", attr.line);
    }
    // [index] or [start:stop:step]
    ExprPtr parts[3];
    bool slice = false;
    if (!is_op(":")) parts[0] = parse_expression(true);
    if (skip_op(":")) {
      slice = true;
      if (!is_op("]") && !is_op(":")) parts[1] = parse_expression(true);
      if (skip_op(":") && !is_op("]")) parts[2] = parse_expression(true);
    }
    if (is_op(",")) fail("tuple subscripts are not supported");
    expect_op("]");
    auto e = make(slice ? Expr::Kind::Slice : Expr::Kind::GetItem, t.line);
    e->children.push_back(std::move(obj));
    if (slice)
      for (auto& part : parts) e->children.push_back(std::move(part));
    else
      e->children.push_back(std::move(parts[0]));
    return e;
  }

  void parse_call_args(Expr& e) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) fail("*args and **kwargs are not supported");
      if (cur().type == TokenType::Name && peek().type == TokenType::Operator && peek().text == "=") {
        std::string key = next().text;
        next();
        e.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!e.kwargs.empty()) fail("positional argument follows keyword argument");
        e.children.push_back(parse_expression(true));
      }
    }
    expect_op(")");
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto e = make(Expr::Kind::Call, cur().line);
    e->children.push_back(std::move(callee));
    parse_call_args(*e);
    return e;
  }

  std::string dotted_name() {
    std::string name = expect_identifier();
    while (is_op(".") && peek().type == TokenType::Name) {
      next();
      name += "." + next().text;
    }
    return name;
  }

  // `| name(args)` filters; `start_inline` parses the first one without its pipe, as in
  // {% filter upper %}.
  ExprPtr parse_filter(ExprPtr operand, bool start_inline = false) {
    while (start_inline || is_op("|")) {
      if (!start_inline) next();
      start_inline = false;
      auto e = make(Expr::Kind::Filter, cur().line);
      e->name = dotted_name();
      e->children.push_back(std::move(operand));
      if (is_op("(")) parse_call_args(*e);
      operand = std::move(e);
    }
    return operand;
  }

  ExprPtr parse_test(ExprPtr operand) {
    auto e = make(Expr::Kind::Test, next().line);
    e->negated = skip_name("not");
    e->name = dotted_name();
    e->children.push_back(std::move(operand));
    const Token& t = cur();
    if (is_op("(")) {
      parse_call_args(*e);
    } else if ((t.type == TokenType::Name || t.type == TokenType::String || t.type == TokenType::Integer ||
                t.type == TokenType::Float || (t.type == TokenType::Operator && (t.text == "[" || t.text == "{"))) &&
               !(t.type == TokenType::Name && (t.text == "else" || t.text == "or" || t.text == "and"))) {
      if (is_name("is")) fail("You cannot chain multiple tests with is");
      e->children.push_back(parse_postfix(parse_primary()));
    }
    return e;
  }

  // Counts one level of parser recursion for as long as it lives.
  class Nest {
   public:
    explicit Nest(Parser& parser) : parser_(parser) {
      if (++parser_.nesting_ > kMaxParseNesting)
        parser_.fail("the template nests deeper than " + std::to_string(kMaxParseNesting) + " levels");
    }
    ~Nest() { --parser_.nesting_; }
    Nest(const Nest&) = delete;
    Nest& operator=(const Nest&) = delete;

   private:
    Parser& parser_;
  };

  const std::vector<Token>& t_;
  size_t p_ = 0;
  int nesting_ = 0;
};

// jinja2 rejects an unknown filter or test when it compiles the template, except where the
// code may not run (directly inside an if/elif/else or a conditional expression: a "soft"
// frame), where the failure waits until the filter is called.
void check_names(const Expr* e, bool soft, int depth = 1) {
  if (!e) return;
  // Long operator and filter chains nest without parser recursion: `a ~ b ~ c ...`.
  if (depth > kMaxExprDepth)
    throw TemplateError("expression nested deeper than " + std::to_string(kMaxExprDepth) + " levels", e->line);
  if (!soft && e->kind == Expr::Kind::Filter && !is_known_filter(e->name))
    throw TemplateError("No filter named '" + e->name + "'.", e->line);
  if (!soft && e->kind == Expr::Kind::Test && !is_known_test(e->name))
    throw TemplateError("No test named '" + e->name + "'.", e->line);
  const bool inner_soft = soft || e->kind == Expr::Kind::Condition;
  for (const auto& c : e->children) check_names(c.get(), inner_soft, depth + 1);
  for (const auto& kw : e->kwargs) check_names(kw.second.get(), inner_soft, depth + 1);
}

void check_names(const Body& body, bool soft) {
  for (const auto& s : body) {
    check_names(s->expr.get(), s->kind == Stmt::Kind::SetBlock || s->kind == Stmt::Kind::FilterBlock ? false : soft);
    check_names(s->condition.get(), false);
    for (const auto& [cond, branch] : s->branches) {
      check_names(cond.get(), true);
      check_names(branch, true);
    }
    const bool body_soft = s->kind == Stmt::Kind::If;
    check_names(s->body, body_soft);
    check_names(s->else_body, body_soft);
    for (const auto& d : s->defaults) check_names(d.get(), false);
  }
}

}  // namespace

Expr::~Expr() {
  // Iterative: a refused template may hold a chain far deeper than the stack allows.
  std::vector<ExprPtr> pending;
  auto adopt = [&pending](Expr& e) {
    for (auto& c : e.children)
      if (c) pending.push_back(std::move(c));
    for (auto& kw : e.kwargs)
      if (kw.second) pending.push_back(std::move(kw.second));
  };
  adopt(*this);
  while (!pending.empty()) {
    ExprPtr e = std::move(pending.back());
    pending.pop_back();
    adopt(*e);
  }
}

Body parse(const std::vector<Token>& tokens) { return Parser(tokens).parse_template(); }

}  // namespace kvpipe::jinja
