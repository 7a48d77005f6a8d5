#include "engine/text/jinja_eval.h"

#include <memory>
#include <utility>

#include "engine/text/jinja_builtins.h"

namespace kvpipe::jinja {
namespace {

struct Scope {
  explicit Scope(Scope* parent) : parent(parent) {}
  Scope* parent;
  std::vector<std::pair<std::string, Value>> vars;

  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent)
      for (const auto& [k, v] : s->vars)
        if (k == name) return &v;
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    for (auto& [k, slot] : vars)
      if (k == name) {
        slot = std::move(v);
        return;
      }
    vars.emplace_back(name, std::move(v));
  }
};

enum class Flow { Normal, Break, Continue };

class Renderer {
 public:
  explicit Renderer(const Value& context) : context_(context) {}

  std::string run(const Body& body) {
    Scope root(nullptr);
    std::string out;
    exec(body, root, out);
    return out;
  }

 private:
  Flow exec(const Body& body, Scope& scope, std::string& out) {
    for (const auto& s : body) {
      const Flow f = exec(*s, scope, out);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

  Flow exec(const Stmt& s, Scope& scope, std::string& out) {
    try {
      count_step();
      const Deeper deeper(*this);
      const Flow flow = exec_statement(s, scope, out);
      check_string_size(out.size());
      return flow;
    } catch (const RenderError& e) {
      throw TemplateError(e.what(), s.line);
    }
  }

  Flow exec_statement(const Stmt& s, Scope& scope, std::string& out) {
    switch (s.kind) {
      case Stmt::Kind::Text: out += s.text; return Flow::Normal;
      case Stmt::Kind::Output: out += py_str(eval(*s.expr, scope)); return Flow::Normal;
      case Stmt::Kind::If:
        for (const auto& [cond, body] : s.branches)
          if (eval(*cond, scope).truthy()) return exec(body, scope, out);
        return exec(s.else_body, scope, out);
      case Stmt::Kind::For: return exec_for(s, scope, out);
      case Stmt::Kind::Set: {
        Value v = eval(*s.expr, scope);
        assign(s, std::move(v), scope);
        return Flow::Normal;
      }
      case Stmt::Kind::SetBlock: {
        std::string text;
        exec(s.body, scope, text);
        Value v = Value::string(text);
        if (s.expr) v = apply_filters(*s.expr, v, scope);
        scope.set(s.targets[0], std::move(v));
        return Flow::Normal;
      }
      case Stmt::Kind::Macro: scope.set(s.name, make_macro(s, scope)); return Flow::Normal;
      case Stmt::Kind::CallBlock: {
        const Expr& call = *s.expr;
        Value callee = eval(*call.children[0], scope);
        Args args = eval_args(call, 1, scope);
        const Stmt* block = &s;
        Scope* caller_scope = &scope;
        args.kw.emplace_back("caller", Value::function([this, block, caller_scope](Args&) {
                               Scope inner(caller_scope);
                               std::string text;
                               exec(block->body, inner, text);
                               return Value::string(text);
                             }));
        out += py_str(call_value(callee, args));
        return Flow::Normal;
      }
      case Stmt::Kind::FilterBlock: {
        std::string text;
        exec(s.body, scope, text);
        out += py_str(apply_filters(*s.expr, Value::string(text), scope));
        return Flow::Normal;
      }
      case Stmt::Kind::Generation: return exec(s.body, scope, out);
      case Stmt::Kind::Break: return Flow::Break;
      case Stmt::Kind::Continue: return Flow::Continue;
    }
    return Flow::Normal;
  }

  void assign(const Stmt& s, Value v, Scope& scope) {
    if (!s.attribute.empty()) {
      Value target = lookup(s.targets[0], scope);
      if (!target.is_dict() || !target.is_namespace) throw RenderError("cannot assign attribute on non-namespace object");
      if (s.attribute[0] == '_')
        throw RenderError("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" +
                          s.attribute + "'. Please rename the attribute.");
      if (holds(v, target.dict.get()))
        throw RenderError("cannot store a namespace inside itself ('" + s.targets[0] + "." + s.attribute + "')");
      target.dict->set(s.attribute, std::move(v));
      return;
    }
    bind_targets(s, v, scope);
  }

  static void bind_targets(const Stmt& s, const Value& v, Scope& scope) {
    if (!s.unpack) {
      scope.set(s.targets[0], v);
      return;
    }
    List items = py_iterate(v);
    if (items.size() != s.targets.size())
      throw RenderError(items.size() > s.targets.size()
                            ? "too many values to unpack (expected " + std::to_string(s.targets.size()) + ")"
                            : "not enough values to unpack (expected " + std::to_string(s.targets.size()) + ", got " +
                                  std::to_string(items.size()) + ")");
    for (size_t k = 0; k < items.size(); ++k) scope.set(s.targets[k], items[k]);
  }

  Flow exec_for(const Stmt& s, Scope& scope, std::string& out) {
    const Value iterable = eval(*s.expr, scope);
    if (iterable.is_none()) throw RenderError("'NoneType' object is not iterable");
    List items = py_iterate(iterable);
    if (s.condition) {
      List kept;
      for (auto& item : items) {
        Scope probe(&scope);
        bind_targets(s, item, probe);
        if (eval(*s.condition, probe).truthy()) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < n; ++k) {
      count_step();
      Scope iteration(&scope);
      Value loop = Value::make_dict();
      Dict& d = *loop.dict;
      d.set("index", Value::integer(k + 1));
      d.set("index0", Value::integer(k));
      d.set("revindex", Value::integer(n - k));
      d.set("revindex0", Value::integer(n - k - 1));
      d.set("first", Value::boolean(k == 0));
      d.set("last", Value::boolean(k == n - 1));
      d.set("length", Value::integer(n));
      d.set("depth", Value::integer(1));
      d.set("depth0", Value::integer(0));
      d.set("previtem", k > 0 ? items[static_cast<size_t>(k - 1)] : Value::undefined("there is no previous item"));
      d.set("nextitem", k + 1 < n ? items[static_cast<size_t>(k + 1)] : Value::undefined("there is no next item"));
      d.set("cycle", Value::function([k](Args& a) {
              if (a.pos.empty()) throw RenderError("no items for cycling given");
              return a.pos[static_cast<size_t>(k) % a.pos.size()];
            }));
      iteration.set("loop", loop);
      bind_targets(s, items[static_cast<size_t>(k)], iteration);
      if (exec(s.body, iteration, out) == Flow::Break) break;
    }
    if (n == 0) return exec(s.else_body, scope, out);
    return Flow::Normal;
  }

  Value make_macro(const Stmt& s, Scope& scope) {
    const Stmt* macro = &s;
    Scope* defined_in = &scope;
    return Value::function([this, macro, defined_in](Args& args) {
      Scope frame(defined_in);
      const size_t np = macro->params.size();
      List varargs;
      for (size_t k = 0; k < args.pos.size(); ++k) {
        if (k < np)
          frame.set(macro->params[k], args.pos[k]);
        else
          varargs.push_back(args.pos[k]);
      }
      Value kwargs = Value::make_dict();
      for (const auto& [key, v] : args.kw) {
        bool is_param = false;
        for (const auto& p : macro->params) is_param |= p == key;
        if (is_param || key == "caller")
          frame.set(key, v);
        else
          kwargs.dict->set(key, v);
      }
      for (size_t k = 0; k < np; ++k) {
        bool bound = k < args.pos.size();
        for (const auto& kw : args.kw) bound |= kw.first == macro->params[k];
        if (bound) continue;
        frame.set(macro->params[k], macro->defaults[k] ? eval(*macro->defaults[k], frame)
                                                       : Value::undefined("parameter '" + macro->params[k] + "' was not provided"));
      }
      frame.set("varargs", Value::make_list(std::move(varargs)));
      frame.set("kwargs", kwargs);
      std::string text;
      exec(macro->body, frame, text);
      return Value::string(text);
    });
  }

  Value lookup(const std::string& name, Scope& scope) {
    if (const Value* v = scope.find(name)) return *v;
    if (const Value* v = context_.dict->find(name)) return *v;
    return global_value(name);
  }

  Args eval_args(const Expr& e, size_t first, Scope& scope) {
    Args args;
    for (size_t k = first; k < e.children.size(); ++k) args.pos.push_back(eval(*e.children[k], scope));
    for (const auto& [key, v] : e.kwargs) args.kw.emplace_back(key, eval(*v, scope));
    return args;
  }

  // A filter chain whose innermost operand is null (filter blocks, set blocks) applied to `v`.
  Value apply_filters(const Expr& e, const Value& v, Scope& scope) {
    const Value operand = e.children[0] ? apply_filters(*e.children[0], v, scope) : v;
    Args args = eval_args(e, 1, scope);
    return apply_filter(e.name, operand, args);
  }

  Value eval(const Expr& e, Scope& scope) {
    try {
      const Deeper deeper(*this);
      return eval_expression(e, scope);
    } catch (const RenderError& err) {
      throw TemplateError(err.what(), e.line);
    }
  }

  Value eval_expression(const Expr& e, Scope& scope) {
    switch (e.kind) {
      case Expr::Kind::Const: return e.value;
      case Expr::Kind::Name: {
        Value v = lookup(e.name, scope);
        return v;
      }
      case Expr::Kind::List:
      case Expr::Kind::Tuple: {
        List items;
        for (const auto& c : e.children) items.push_back(eval(*c, scope));
        return e.kind == Expr::Kind::Tuple ? Value::make_tuple(std::move(items)) : Value::make_list(std::move(items));
      }
      case Expr::Kind::Dict: {
        Value d = Value::make_dict();
        for (size_t k = 0; k + 1 < e.children.size(); k += 2) {
          const Value key = eval(*e.children[k], scope);
          d.dict->set(dict_key(key), eval(*e.children[k + 1], scope));
        }
        return d;
      }
      case Expr::Kind::GetAttr: return get_attr(eval(*e.children[0], scope), e.name);
      case Expr::Kind::GetItem: return get_item(eval(*e.children[0], scope), eval(*e.children[1], scope));
      case Expr::Kind::Slice: {
        const Value obj = eval(*e.children[0], scope);
        Value parts[3];
        for (size_t k = 0; k < 3; ++k)
          if (e.children[k + 1]) parts[k] = eval(*e.children[k + 1], scope);
        return get_slice(obj, parts[0], parts[1], parts[2]);
      }
      case Expr::Kind::Call: {
        const Value callee = eval(*e.children[0], scope);
        Args args = eval_args(e, 1, scope);
        return call_value(callee, args);
      }
      case Expr::Kind::Filter: {
        const Value operand = eval(*e.children[0], scope);
        Args args = eval_args(e, 1, scope);
        return apply_filter(e.name, operand, args);
      }
      case Expr::Kind::Test: {
        const Value operand = eval(*e.children[0], scope);
        Args args = eval_args(e, 1, scope);
        return Value::boolean(apply_test(e.name, operand, args) != e.negated);
      }
      case Expr::Kind::Negate: return py_negate(eval(*e.children[0], scope));
      case Expr::Kind::Plus: {
        Value v = eval(*e.children[0], scope);
        if (!v.is_number()) throw RenderError("bad operand type for unary +: '" + v.type_name() + "'");
        return v;
      }
      case Expr::Kind::Binary: {
        const Value a = eval(*e.children[0], scope);
        const Value b = eval(*e.children[1], scope);
        if (e.name == "~") return Value::string(py_str(a) + py_str(b));
        return py_binary(e.name, a, b);
      }
      case Expr::Kind::And: {
        Value a = eval(*e.children[0], scope);
        return a.truthy() ? eval(*e.children[1], scope) : a;
      }
      case Expr::Kind::Or: {
        Value a = eval(*e.children[0], scope);
        return a.truthy() ? a : eval(*e.children[1], scope);
      }
      case Expr::Kind::Not: return Value::boolean(!eval(*e.children[0], scope).truthy());
      case Expr::Kind::Compare: {
        Value left = eval(*e.children[0], scope);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.children[k + 1], scope);
          const std::string& op = e.ops[k];
          bool ok;
          if (op == "==")
            ok = py_equal(left, right);
          else if (op == "!=")
            ok = !py_equal(left, right);
          else if (op == "in")
            ok = py_contains(right, left);
          else if (op == "notin")
            ok = !py_contains(right, left);
          else {
            const int c = py_compare(left, right, op.c_str());
            ok = op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0;
          }
          if (!ok) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case Expr::Kind::Condition:
        if (eval(*e.children[1], scope).truthy()) return eval(*e.children[0], scope);
        if (e.children[2]) return eval(*e.children[2], scope);
        return Value::undefined("the inline if-expression evaluated to false and no else section was defined.");
    }
    return Value();
  }

  const Value& context_;
  uint64_t steps_ = 0;  // statements and loop iterations so far
  int depth_ = 0;       // statements and expressions being evaluated, one inside the other

  // Macros may call themselves; Python stops them at its recursion limit, kvpipe here, well
  // before the stack's end.
  static constexpr int kMaxDepth = 400;
  class Deeper {
   public:
    explicit Deeper(Renderer& r) : renderer_(r) {
      if (++renderer_.depth_ > kMaxDepth) {
        --renderer_.depth_;
        throw RenderError("maximum recursion depth exceeded (" + std::to_string(kMaxDepth) + " nested calls)");
      }
    }
    ~Deeper() { --renderer_.depth_; }
    Deeper(const Deeper&) = delete;
    Deeper& operator=(const Deeper&) = delete;

   private:
    Renderer& renderer_;
  };

  void count_step() {
    if (++steps_ > kMaxRenderSteps)
      throw RenderError("the template ran more than " + std::to_string(kMaxRenderSteps) +
                        " statements and loop iterations");
  }
};

}  // namespace

std::string render(const Body& body, const Value& context) {
  const RenderScope scope;
  return Renderer(context).run(body);
}

}  // namespace kvpipe::jinja
