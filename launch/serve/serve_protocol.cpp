#include "launch/serve/serve_protocol.h"

#include "engine/grammar/gbnf.h"
#include "engine/grammar/json_schema.h"
#include "engine/grammar/regex_dfa.h"
#include "engine/grammar/token_constraint.h"
#include "engine/text/tokenizer.h"
#include "launch/job_config.h"
#include "launch/model_text.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <set>

namespace kvpipe {

using json = nlohmann::json;

namespace {

// OpenAI's log-probabilities are finite: -inf (a token the model rules out) is written as
// vLLM writes it.
constexpr float kMinLogprob = -9999.0f;

const char* error_type(int status) {
  switch (status) {
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 413: return "invalid_request_error";
    case 429:
    case 503: return "service_unavailable_error";
    default: return status >= 500 ? "internal_server_error" : "invalid_request_error";
  }
}

ApiError bad(const std::string& param, const std::string& message) { return ApiError(400, param + ": " + message, param); }

// A field that is present and not null.
const json* field(const json& body, const char* key) {
  const auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

int64_t integer_field(const json& body, const char* key, int64_t fallback, int64_t lo, int64_t hi) {
  const json* v = field(body, key);
  if (!v) return fallback;
  if (!v->is_number_integer()) throw bad(key, "must be an integer");
  const int64_t x = v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi) ? hi + 1 : v->get<int64_t>();
  if (x < lo || x > hi)
    throw bad(key, "must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", got " + v->dump());
  return x;
}

double number_field(const json& body, const char* key, double fallback, double lo, double hi, bool lo_open = false) {
  const json* v = field(body, key);
  if (!v) return fallback;
  if (!v->is_number()) throw bad(key, "must be a number");
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || (lo_open && x == lo) || x > hi)
    throw bad(key, std::string("must be in ") + (lo_open ? "(" : "[") + json(lo).dump() + ", " + json(hi).dump() +
                       "], got " + v->dump());
  return x;
}

bool bool_field(const json& body, const char* key, bool fallback) {
  const json* v = field(body, key);
  if (!v) return fallback;
  if (!v->is_boolean()) throw bad(key, "must be true or false");
  return v->get<bool>();
}

std::string text_of_content(const json& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (content.is_null()) return "";
  if (!content.is_array()) throw bad(where, "must be a string or a list of content parts");
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string at = where + "[" + std::to_string(i) + "]";
    if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
      throw bad(at, "only parts of type \"text\" with a string \"text\" are supported");
    text += part["text"].get<std::string>();
  }
  return text;
}

std::vector<int64_t> ids_of(const json& list, const std::string& where, const ServedModel& model) {
  std::vector<int64_t> ids;
  for (const json& v : list) {
    if (!v.is_number_integer()) throw bad(where, "token ids must be integers");
    const int64_t id = v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(model.vocab_size)
                           ? model.vocab_size : v.get<int64_t>();
    if (id < 0 || id >= model.vocab_size)
      throw bad(where, "token id " + v.dump() + " is outside the vocabulary (0.." + std::to_string(model.vocab_size - 1) + ")");
    ids.push_back(id);
  }
  return ids;
}

const Tokenizer& need_tokenizer(const ServedModel& model, const std::string& param) {
  if (!model.text || !model.text->tokenizer())
    throw bad(param, "the model " + model.name + " has no tokenizer: send the prompt as token ids");
  return *model.text->tokenizer();
}

std::vector<int64_t> text_ids(const ServedModel& model, const std::string& text, const std::string& param) {
  try {
    RequestSpec spec;
    spec.prompt = text;
    need_tokenizer(model, param);
    return model.text->prompt_ids(spec, param);
  } catch (const ApiError&) {
    throw;
  } catch (const std::exception& e) {
    throw bad(param, e.what());
  }
}

std::vector<std::vector<int64_t>> completion_prompts(const json& body, const ServedModel& model) {
  const json* p = field(body, "prompt");
  if (!p) throw bad("prompt", "is required");
  if (p->is_string()) return {text_ids(model, p->get<std::string>(), "prompt")};
  if (!p->is_array() || p->empty()) throw bad("prompt", "must be a string, a list of token ids, or a non-empty list of those");
  if ((*p)[0].is_number()) return {ids_of(*p, "prompt", model)};
  std::vector<std::vector<int64_t>> prompts;
  for (size_t i = 0; i < p->size(); ++i) {
    const json& one = (*p)[i];
    const std::string where = "prompt[" + std::to_string(i) + "]";
    if (one.is_string()) prompts.push_back(text_ids(model, one.get<std::string>(), where));
    else if (one.is_array()) prompts.push_back(ids_of(one, where, model));
    else throw bad(where, "must be a string or a list of token ids");
  }
  return prompts;
}

// The fields a request may carry: those kvpipe honours, and a few that change nothing in
// the answer (OpenAI's bookkeeping) and may be ignored. Any other is refused by name.
void refuse_unknown_fields(const json& body, bool chat) {
  static const std::set<std::string> common = {
      "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "best_of", "stream", "stream_options",
      "stop", "seed", "logprobs", "ignore_eos", "return_token_ids", "presence_penalty", "frequency_penalty",
      "repetition_penalty", "min_tokens", "logit_bias", "bad_words", "structured_outputs", "guided_regex",
      "guided_choice", "guided_json", "guided_grammar", "grammar", "response_format",
      "user", "metadata", "store", "service_tier"};
  static const std::set<std::string> chat_only = {"messages", "max_completion_tokens", "top_logprobs",
                                                  "tools", "tool_choice", "parallel_tool_calls"};
  static const std::set<std::string> completion_only = {"prompt", "echo", "suffix"};
  for (const auto& [key, value] : body.items()) {
    if (common.count(key) || (chat ? chat_only : completion_only).count(key)) continue;
    throw bad(key, "is not supported by kvpipe (refused rather than ignored)");
  }
}

// logit_bias: OpenAI's {"token id": bias} or llama.cpp's [[id, bias or false], ...] (false
// bans the token), each bias in [-100, 100].
std::vector<std::pair<int64_t, float>> logit_bias_of(const json& v, const ServedModel& model) {
  std::vector<std::pair<int64_t, float>> out;
  auto add = [&](int64_t id, const json& bias, const std::string& where) {
    if (id < 0 || id >= model.vocab_size)
      throw bad("logit_bias", where + ": token id outside the vocabulary (0.." + std::to_string(model.vocab_size - 1) + ")");
    if (bias.is_boolean() && !bias.get<bool>()) {
      out.emplace_back(id, -std::numeric_limits<float>::infinity());
      return;
    }
    if (!bias.is_number() || !std::isfinite(bias.get<double>()) || std::abs(bias.get<double>()) > 100.0)
      throw bad("logit_bias", where + ": a bias must be a number in [-100, 100], got " + bias.dump());
    out.emplace_back(id, static_cast<float>(bias.get<double>()));
  };
  if (v.is_object()) {
    for (const auto& [key, bias] : v.items()) {
      int64_t id = -1;
      size_t used = 0;
      try {
        id = std::stoll(key, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != key.size()) throw bad("logit_bias", "keys must be token ids, got \"" + key + "\"");
      add(id, bias, key);
    }
  } else if (v.is_array()) {
    for (size_t i = 0; i < v.size(); ++i) {
      const json& pair = v[i];
      if (!pair.is_array() || pair.size() != 2 || !pair[0].is_number_integer())
        throw bad("logit_bias", "[" + std::to_string(i) + "] must be [token id, bias]");
      add(pair[0].get<int64_t>(), pair[1], "[" + std::to_string(i) + "]");
    }
  } else {
    throw bad("logit_bias", "must be an object of token ids to biases");
  }
  return out;
}

// The pattern of a `choice` list: exactly one of the strings.
std::string choice_pattern(const json& v, const std::string& key) {
  if (!v.is_array() || v.empty() || v.size() > 4096) throw bad(key, "must be a non-empty list of at most 4096 strings");
  std::string pattern;
  for (const json& c : v) {
    if (!c.is_string() || c.get<std::string>().empty()) throw bad(key, "must be a list of non-empty strings");
    if (!pattern.empty()) pattern += '|';
    pattern += regex_escape(c.get<std::string>());
  }
  return pattern;
}

// The pattern of a JSON Schema (an object, or its JSON text as vLLM also takes it). `v` is
// read from the body parsed again with its keys in order (a schema's properties are
// written in the order it gives them).
std::string schema_pattern(const nlohmann::ordered_json& v, const std::string& key) {
  nlohmann::ordered_json schema = v;
  if (v.is_string()) {
    try {
      schema = nlohmann::ordered_json::parse(v.get<std::string>());
    } catch (const nlohmann::ordered_json::exception& e) {
      throw bad(key, std::string("is not valid JSON: ") + e.what());
    }
  }
  if (!schema.is_object() && !schema.is_boolean()) throw bad(key, "must be a JSON Schema (an object)");
  try {
    return json_schema_regex(schema);
  } catch (const std::invalid_argument& e) {
    throw bad(key, e.what());
  }
}

// The pattern of a grammar in llama.cpp's GBNF (engine/grammar/gbnf.h says what is
// supported, and how recursion is bounded).
std::string grammar_pattern(const json& v, const std::string& key) {
  if (!v.is_string() || v.get<std::string>().empty()) throw bad(key, "must be a grammar in GBNF (a non-empty string)");
  try {
    return gbnf_regex(v.get<std::string>());
  } catch (const std::invalid_argument& e) {
    throw bad(key, e.what());
  }
}

// The pattern of the calls `tool_choice` asks for. A function whose parameters use what
// kvpipe cannot constrain is named (the whole schema's path would say less).
std::string tool_schema_pattern(const ToolRequest& tools) {
  try {
    return json_schema_regex(*tools.schema);
  } catch (const std::invalid_argument& whole) {
    const ToolChoice& c = tools.choice;
    for (size_t i = 0; i < c.names.size(); ++i) {
      if (c.kind == ToolChoice::Kind::kNamed && c.names[i] != c.function) continue;
      const std::string key = "tools[" + std::to_string(i) + "].function.parameters";
      const nlohmann::ordered_json& fn = (*tools.tools)[i]["function"];
      if (!fn.contains("parameters")) continue;
      try {
        json_schema_regex(fn["parameters"]);
      } catch (const std::invalid_argument& e) {
        throw bad(key, e.what());
      }
    }
    throw bad("tools", whole.what());
  }
}

// A request body with its keys in the order written (a schema's properties, a template's
// tools and messages keep it), parsed on first use and at most once.
class OrderedBody {
 public:
  explicit OrderedBody(const std::string& text) : text_(text) {}
  const nlohmann::ordered_json& get() const {
    if (!parsed_) parsed_ = nlohmann::ordered_json::parse(text_);
    return *parsed_;
  }

 private:
  const std::string& text_;
  mutable std::optional<nlohmann::ordered_json> parsed_;
};

// The structured-output constraint a request asks for, or null: vLLM's
// `structured_outputs: {regex | choice | json | json_object | grammar}`, its older
// `guided_regex`, `guided_choice`, `guided_json` and `guided_grammar`, llama-server's
// `grammar`, OpenAI's `response_format` (json_object, json_schema), and the call schema of
// `tool_choice` required or named.
std::shared_ptr<const TokenConstraint> constraint_of(const json& body, const OrderedBody& ordered,
                                                     const ServedModel& model, const ToolRequest& tools) {
  // The schemas' places, from the body with its keys in order.
  auto in_order = [&ordered](std::initializer_list<const char*> path) {
    const nlohmann::ordered_json* node = &ordered.get();
    for (const char* key : path) node = &node->at(key);
    return *node;
  };
  std::string where, pattern;
  auto take = [&](const std::string& key, std::string p) {
    if (!where.empty()) throw bad(key, "one constraint per request (" + where + " is another)");
    where = key;
    pattern = std::move(p);
  };
  auto regex_of = [](const json& v, const std::string& key) {
    if (!v.is_string()) throw bad(key, "must be a string");
    return v.get<std::string>();
  };
  if (const json* so = field(body, "structured_outputs")) {
    if (!so->is_object()) throw bad("structured_outputs", "must be an object");
    for (const auto& [k, v] : so->items()) {
      if (v.is_null()) continue;
      const std::string key = "structured_outputs." + k;
      if (k == "regex") take(key, regex_of(v, key));
      else if (k == "choice") take(key, choice_pattern(v, key));
      else if (k == "json") take(key, schema_pattern(in_order({"structured_outputs", "json"}), key));
      else if (k == "json_object" && v == true) take(key, json_object_regex());
      else if (k == "grammar") take(key, grammar_pattern(v, key));
      else throw bad(key, "is not supported by kvpipe (regex, choice, json, json_object, grammar)");
    }
    if (where.empty()) throw bad("structured_outputs", "names no constraint (regex, choice, json, json_object or grammar)");
  }
  if (const json* v = field(body, "guided_regex")) take("guided_regex", regex_of(*v, "guided_regex"));
  if (const json* v = field(body, "guided_choice")) take("guided_choice", choice_pattern(*v, "guided_choice"));
  if (field(body, "guided_json")) take("guided_json", schema_pattern(in_order({"guided_json"}), "guided_json"));
  if (const json* v = field(body, "guided_grammar")) take("guided_grammar", grammar_pattern(*v, "guided_grammar"));
  if (const json* v = field(body, "grammar")) take("grammar", grammar_pattern(*v, "grammar"));
  if (const json* rf = field(body, "response_format")) {
    if (!rf->is_object() || !rf->contains("type") || !(*rf)["type"].is_string())
      throw bad("response_format", "must be an object with a string \"type\"");
    const std::string type = (*rf)["type"].get<std::string>();
    if (type == "json_object") {
      take("response_format", json_object_regex());
    } else if (type == "json_schema") {
      const json* js = field(*rf, "json_schema");
      if (!js || !js->is_object() || !js->contains("schema"))
        throw bad("response_format.json_schema", "must be an object with a \"schema\"");
      for (const auto& [k, v] : js->items())
        if (k != "name" && k != "description" && k != "schema" && k != "strict")
          throw bad("response_format.json_schema." + k, "is not supported by kvpipe (name, description, schema, strict)");
      take("response_format.json_schema.schema",
           schema_pattern(in_order({"response_format", "json_schema", "schema"}), "response_format.json_schema.schema"));
    } else if (type != "text") {
      throw bad("response_format", "type \"" + type + "\" is not supported by kvpipe (text, json_object, json_schema)");
    }
  }
  if (tools.schema) take("tool_choice", tool_schema_pattern(tools));
  if (where.empty()) return nullptr;
  if (!model.vocabulary) throw bad(where, "the model " + model.name + " has no tokenizer to match text with");
  if (bool_field(body, "ignore_eos", false)) throw bad("ignore_eos", "cannot be combined with " + where);
  try {
    constexpr int32_t kMaxStates = 50000;
    if (model.constraints) return model.constraints->get(pattern, kMaxStates);
    return std::make_shared<const TokenConstraint>(std::make_shared<const RegexDfa>(pattern, kMaxStates), model.vocabulary);
  } catch (const std::invalid_argument& e) {
    throw bad(where, e.what());
  }
}

LogitsProcessing processing_of(const json& body, const OrderedBody& ordered, const ServedModel& model,
                               const ToolRequest& tools) {
  LogitsProcessing p;
  p.constraint = constraint_of(body, ordered, model, tools);
  p.presence_penalty = number_field(body, "presence_penalty", 0.0, -2.0, 2.0);
  p.frequency_penalty = number_field(body, "frequency_penalty", 0.0, -2.0, 2.0);
  p.repetition_penalty = number_field(body, "repetition_penalty", 1.0, 0.0, 10.0, true);
  p.min_tokens = integer_field(body, "min_tokens", 0, 0, std::numeric_limits<int32_t>::max());
  if (const json* bias = field(body, "logit_bias")) p.logit_bias = logit_bias_of(*bias, model);
  if (const json* words = field(body, "bad_words")) {
    std::vector<std::string> list;
    if (!words->is_array() || words->size() > 256) throw bad("bad_words", "must be a list of at most 256 strings");
    for (const json& w : *words) {
      if (!w.is_string()) throw bad("bad_words", "must be a list of strings");
      list.push_back(w.get<std::string>());
    }
    need_tokenizer(model, "bad_words");
    try {
      p.bad_words = model.text->bad_word_ids(list, "bad_words");
    } catch (const std::exception& e) {
      throw bad("bad_words", e.what());
    }
  }
  return p;
}

// A chat body's tools, tool_choice and parallel_tool_calls.
ToolRequest tool_request_of(const OrderedBody& ordered, const ServedModel& model) {
  try {
    return parse_tool_request(ordered.get(), model.tool_syntax, model.renders_tools);
  } catch (const ToolRequestError& e) {
    throw bad(e.param, e.what());
  }
}

// The prompt of a chat body: its messages (and tools) rendered through the chat template.
// Messages reach the template as transformers passes them: role and content, and a
// message's name, tool_calls (arguments as objects) and tool_call_id when it has them.
std::vector<int64_t> chat_prompt(const json& body, const OrderedBody& ordered, const ServedModel& model,
                                 const ToolRequest& tools) {
  const json* m = field(body, "messages");
  if (!m) throw bad("messages", "is required");
  if (!m->is_array() || m->empty()) throw bad("messages", "must be a non-empty list of messages");
  const nlohmann::ordered_json& in_order = ordered.get().at("messages");
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  for (size_t i = 0; i < m->size(); ++i) {
    const json& msg = (*m)[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!msg.is_object()) throw bad(where, "must be an object with role and content");
    const json* role = field(msg, "role");
    if (!role || !role->is_string()) throw bad(where + ".role", "must be a string");
    const auto content = msg.find("content");
    nlohmann::ordered_json out{{"role", role->get<std::string>()},
                               {"content", text_of_content(content == msg.end() ? json() : *content, where + ".content")}};
    for (const char* key : {"name", "tool_call_id"}) {
      const json* v = field(msg, key);
      if (!v) continue;
      if (!v->is_string()) throw bad(where + "." + key, "must be a string");
      out[key] = v->get<std::string>();
    }
    if (field(msg, "tool_calls")) {
      try {
        out["tool_calls"] = template_tool_calls(in_order[i]["tool_calls"], where + ".tool_calls");
      } catch (const ToolRequestError& e) {
        throw bad(e.param, e.what());
      }
    }
    messages.push_back(std::move(out));
  }
  need_tokenizer(model, "messages");
  try {
    return model.text->chat_prompt_ids(messages, tools.tools.get(), "messages");
  } catch (const std::exception& e) {
    throw bad("messages", e.what());
  }
}

std::string piece_of(const Tokenizer* tokenizer, int64_t id) {
  if (!tokenizer) return "token_id:" + std::to_string(id);
  try {
    return tokenizer->token_bytes(id);
  } catch (const std::exception&) {
    return "";
  }
}

json bytes_of(const std::string& s) {
  json out = json::array();
  for (unsigned char c : s) out.push_back(static_cast<int>(c));
  return out;
}

float finite_logprob(float x) { return std::isfinite(x) ? x : kMinLogprob; }

// A request body: a JSON object.
json parse_body(const std::string& text) {
  json body;
  try {
    body = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number like 1e999
    throw ApiError(400, std::string("the body is not valid JSON: ") + e.what());
  }
  if (!body.is_object()) throw ApiError(400, "the body must be a JSON object");
  return body;
}

}  // namespace

std::string dump_json(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string error_body(int status, const std::string& message, const std::string& param, const std::string& code) {
  json e;
  e["message"] = message;
  e["type"] = error_type(status);
  e["param"] = param.empty() ? json() : json(param);
  e["code"] = code.empty() ? json(status) : json(code);
  return dump_json(json{{"error", e}});
}

CompletionRequest parse_completion_request(const std::string& text, bool chat, const ServedModel& model,
                                           uint64_t random_seed) {
  const json body = parse_body(text);
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) throw bad("model", "must be a string");
    if (m->get<std::string>() != model.name)
      throw ApiError(404, "The model `" + m->get<std::string>() + "` does not exist (this server serves `" +
                              model.name + "`)", "model", "model_not_found");
  }
  refuse_unknown_fields(body, chat);
  CompletionRequest r;
  r.chat = chat;
  const OrderedBody ordered(text);
  const ToolRequest tools = chat ? tool_request_of(ordered, model) : ToolRequest();
  r.tools = tools.choice;
  if (chat) r.prompts = {chat_prompt(body, ordered, model, tools)};
  else r.prompts = completion_prompts(body, model);

  r.n = static_cast<int>(integer_field(body, "n", 1, 1, 64));
  r.stream = bool_field(body, "stream", false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) throw bad("stream_options", "must be an object");
    if (!r.stream) throw bad("stream_options", "is only allowed with stream: true");
    r.include_usage = bool_field(*so, "include_usage", false);
  }
  r.ignore_eos = bool_field(body, "ignore_eos", false);
  r.return_token_ids = bool_field(body, "return_token_ids", false);
  if (bool_field(body, "echo", false)) throw bad("echo", "is not supported");
  if (field(body, "suffix")) throw bad("suffix", "is not supported");
  if (integer_field(body, "best_of", r.n, r.n, r.n) != r.n) throw bad("best_of", "must equal n");

  r.sampling.temperature = number_field(body, "temperature", 1.0, 0.0, 100.0);
  r.sampling.top_p = number_field(body, "top_p", 1.0, 0.0, 1.0, true);
  const int64_t top_k = integer_field(body, "top_k", 0, -1, std::numeric_limits<int32_t>::max());
  r.sampling.top_k = top_k < 0 ? 0 : static_cast<int>(top_k);
  r.sampling.min_p = number_field(body, "min_p", 0.0, 0.0, 1.0);
  r.processing = processing_of(body, ordered, model, tools);
  if (const json* seed = field(body, "seed")) {
    if (!seed->is_number_integer()) throw bad("seed", "must be an integer");
    r.sampling.seed = seed->is_number_unsigned() ? seed->get<uint64_t>() : static_cast<uint64_t>(seed->get<int64_t>());
  } else {
    r.sampling.seed = random_seed;
  }

  if (chat) {
    if (bool_field(body, "logprobs", false)) r.logprobs = static_cast<int>(integer_field(body, "top_logprobs", 0, 0, 20));
    else if (field(body, "top_logprobs")) throw bad("top_logprobs", "needs logprobs: true");
  } else {
    r.logprobs = static_cast<int>(integer_field(body, "logprobs", -1, 0, 20));
  }

  if (const json* stop = field(body, "stop")) {
    if (stop->is_string()) r.stop = {stop->get<std::string>()};
    else if (stop->is_array()) {
      for (const json& s : *stop) {
        if (!s.is_string()) throw bad("stop", "must be a string or a list of strings");
        r.stop.push_back(s.get<std::string>());
      }
    } else {
      throw bad("stop", "must be a string or a list of strings");
    }
    if (r.stop.size() > 16) throw bad("stop", "at most 16 stop strings");
    for (const std::string& s : r.stop)
      if (s.empty()) throw bad("stop", "stop strings must not be empty");
    if (!r.stop.empty()) need_tokenizer(model, "stop");
  }

  // Every prompt must leave room for at least one token; max_tokens defaults to 16 for
  // completions (OpenAI's default) and to the rest of the context for chat, as vLLM does.
  const int64_t limit = model.max_model_len();
  const std::string limit_note = " (set by " + model.max_model_len_limit() + ")";
  int64_t longest = 0;
  for (const auto& p : r.prompts) longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
  for (const auto& p : r.prompts)
    if (p.empty()) throw bad(chat ? "messages" : "prompt", "the prompt has no tokens");
  const char* max_key = chat && field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  const json* max_given = field(body, max_key);
  if (longest >= limit)
    throw ApiError(400, "This model's maximum context length is " + std::to_string(limit) + " tokens" + limit_note +
                            ". However, your prompt has " +
                            std::to_string(longest) + " tokens.", chat ? "messages" : "prompt", "context_length_exceeded");
  r.max_tokens = integer_field(body, max_key, chat ? limit - longest : std::min<int64_t>(16, limit - longest), 1,
                               std::numeric_limits<int32_t>::max());
  if (max_given && longest + r.max_tokens > limit)
    throw ApiError(400, "This model's maximum context length is " + std::to_string(limit) + " tokens" + limit_note +
                            ". However, you requested " +
                            std::to_string(longest + r.max_tokens) + " tokens (" + std::to_string(longest) +
                            " in the prompt, " + std::to_string(r.max_tokens) + " for the completion).",
                   max_key, "context_length_exceeded");
  if (r.processing.min_tokens > r.max_tokens)
    throw bad("min_tokens", "must not exceed " + std::string(max_key) + " (" + std::to_string(r.max_tokens) + ")");
  return r;
}

TokenLogprob token_logprob(const float* logits, int64_t vocab, int64_t token, int top) {
  double max = logits[0];
  for (int64_t i = 1; i < vocab; ++i) max = std::max<double>(max, logits[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - max);
  const double log_z = max + std::log(sum);
  TokenLogprob out;
  out.token = token;
  out.logprob = finite_logprob(static_cast<float>(logits[token] - log_z));
  if (top > 0) {
    std::vector<int64_t> ids(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    const int64_t k = std::min<int64_t>(top, vocab);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                      [&](int64_t a, int64_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
    for (int64_t i = 0; i < k; ++i) out.top.emplace_back(ids[i], finite_logprob(static_cast<float>(logits[ids[i]] - log_z)));
  }
  return out;
}

ResponseWriter::ResponseWriter(const CompletionRequest& request, std::string id, int64_t created, std::string model,
                               const Tokenizer* tokenizer)
    : request_(request), id_(std::move(id)), created_(created), model_(std::move(model)), tokenizer_(tokenizer),
      choices_(request.choices()) {
  if (request.chat && request.tools.kind != ToolChoice::Kind::kNone)
    for (size_t i = 0; i < choices_.size(); ++i) choices_[i].tool_calls.emplace(request.tools, id_ + "/" + std::to_string(i));
}

json ResponseWriter::envelope(const char* object) const {
  return json{{"id", id_}, {"object", object}, {"created", created_}, {"model", model_}};
}

json ResponseWriter::logprobs_json(const std::vector<TokenLogprob>& lps, size_t text_offset) const {
  if (request_.chat) {
    json content = json::array();
    for (const TokenLogprob& lp : lps) {
      const std::string piece = piece_of(tokenizer_, lp.token);
      json top = json::array();
      for (const auto& [id, value] : lp.top) {
        const std::string p = piece_of(tokenizer_, id);
        top.push_back({{"token", p}, {"logprob", value}, {"bytes", bytes_of(p)}});
      }
      content.push_back({{"token", piece}, {"logprob", lp.logprob}, {"bytes", bytes_of(piece)}, {"top_logprobs", top}});
    }
    return json{{"content", content}};
  }
  json tokens = json::array(), values = json::array(), tops = json::array(), offsets = json::array();
  for (const TokenLogprob& lp : lps) {
    const std::string piece = piece_of(tokenizer_, lp.token);
    tokens.push_back(piece);
    values.push_back(lp.logprob);
    json top = json::object();
    for (const auto& [id, value] : lp.top) top[piece_of(tokenizer_, id)] = value;
    tops.push_back(top);
    offsets.push_back(text_offset);
    text_offset += piece.size();
  }
  return json{{"tokens", tokens}, {"token_logprobs", values}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

json ResponseWriter::usage_json() const {
  return json{{"prompt_tokens", prompt_tokens_},
              {"completion_tokens", completion_tokens_},
              {"total_tokens", prompt_tokens_ + completion_tokens_},
              {"prompt_tokens_details", {{"cached_tokens", cached_tokens_}}}};
}

ToolCallStream::Update ResponseWriter::record(const ChoiceEvent& e) {
  Choice& c = choices_.at(e.index);
  c.text += e.text;
  if (e.token) {
    c.tokens.push_back(*e.token);
    ++completion_tokens_;
  }
  if (e.logprob) c.logprobs.push_back(*e.logprob);
  ToolCallStream::Update seen;
  if (c.tool_calls) {
    // Special tokens add no text; the ones a tool-call syntax writes still mark its calls.
    std::string marker;
    if (e.token && tokenizer_ && tokenizer_->is_special(*e.token)) {
      const std::string piece = tokenizer_->piece(*e.token);
      if (is_tool_call_marker(request_.tools.syntax, piece)) marker = piece;
    }
    seen = c.tool_calls->push(e.text, marker);
    if (!e.finish_reason.empty()) {
      ToolCallStream::Update rest = c.tool_calls->finish(e.finish_reason);
      seen.content += rest.content;
      seen.calls.insert(seen.calls.end(), rest.calls.begin(), rest.calls.end());
    }
  } else {
    seen.content = e.text;
  }
  if (!e.finish_reason.empty()) {
    c.finish_reason = c.tool_calls ? c.tool_calls->finish_reason(e.finish_reason) : e.finish_reason;
    // Each prompt counts once, however many choices it has (as OpenAI and vLLM count).
    if (e.index % request_.n == 0) {
      prompt_tokens_ += e.prompt_tokens;
      cached_tokens_ += e.cached_tokens;
    }
  }
  return seen;
}

void ResponseWriter::add(const ChoiceEvent& e) { record(e); }

std::string ResponseWriter::role_chunk(int index) const {
  json j = envelope("chat.completion.chunk");
  j["choices"] = json::array({{{"index", index}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr},
                               {"finish_reason", nullptr}}});
  return dump_json(j);
}

std::string ResponseWriter::chunk(const ChoiceEvent& e) {
  const ToolCallStream::Update seen = record(e);
  const Choice& c = choices_.at(e.index);
  const bool has_token_ids = request_.return_token_ids && e.token;
  if (seen.content.empty() && seen.calls.empty() && !e.logprob && e.finish_reason.empty() && !has_token_ids) return "";
  json choice{{"index", e.index}};
  const size_t offset = c.text.size() - e.text.size();  // where this event's text starts
  json logprobs = e.logprob ? logprobs_json({*e.logprob}, offset) : json();
  if (request_.chat) {
    json delta = json::object();
    if (!seen.content.empty() || (e.finish_reason.empty() && seen.calls.empty())) delta["content"] = seen.content;
    if (!seen.calls.empty()) {
      json calls = json::array();
      for (const ToolCallDelta& d : seen.calls) {
        json call{{"index", d.index}};
        if (!d.id.empty()) call["id"] = d.id, call["type"] = "function";
        json fn = json::object();
        if (!d.name.empty()) fn["name"] = d.name;
        fn["arguments"] = d.arguments;
        call["function"] = fn;
        calls.push_back(call);
      }
      delta["tool_calls"] = calls;
    }
    choice["delta"] = delta;
  } else {
    choice["text"] = e.text;
  }
  choice["logprobs"] = logprobs;
  choice["finish_reason"] = e.finish_reason.empty() ? json() : json(c.finish_reason);
  if (has_token_ids) choice["token_ids"] = json::array({*e.token});
  json j = envelope(request_.chat ? "chat.completion.chunk" : "text_completion");
  j["choices"] = json::array({choice});
  return dump_json(j);
}

std::string ResponseWriter::usage_chunk() const {
  json j = envelope(request_.chat ? "chat.completion.chunk" : "text_completion");
  j["choices"] = json::array();
  j["usage"] = usage_json();
  return dump_json(j);
}

std::string ResponseWriter::response() const {
  json j = envelope(request_.chat ? "chat.completion" : "text_completion");
  json choices = json::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = choices_[i];
    json choice{{"index", i}};
    if (request_.chat && c.tool_calls) {
      json calls = json::array();
      for (const ToolCall& call : c.tool_calls->calls())
        calls.push_back({{"id", call.id}, {"type", "function"},
                         {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
      const std::string& content = c.tool_calls->content();
      choice["message"] = {{"role", "assistant"},
                           {"content", content.empty() && !calls.empty() ? json() : json(content)},
                           {"tool_calls", calls}};
    } else if (request_.chat) {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
    } else {
      choice["text"] = c.text;
    }
    choice["logprobs"] = request_.logprobs >= 0 ? logprobs_json(c.logprobs, 0) : json();
    choice["finish_reason"] = c.finish_reason;
    if (request_.return_token_ids) {
      choice["prompt_token_ids"] = request_.prompts.at(i / request_.n);
      choice["token_ids"] = c.tokens;
    }
    choices.push_back(choice);
  }
  j["choices"] = choices;
  j["usage"] = usage_json();
  return dump_json(j);
}

std::string tokenize_response(const std::string& text, const ServedModel& model) {
  const json body = parse_body(text);
  std::vector<int64_t> ids;
  if (field(body, "messages")) {
    const OrderedBody ordered(text);
    ids = chat_prompt(body, ordered, model, tool_request_of(ordered, model));
  } else {
    const json* p = field(body, "prompt");
    if (!p || !p->is_string()) throw bad("prompt", "must be a string (or send messages)");
    const Tokenizer& tok = need_tokenizer(model, "prompt");
    ids = tok.encode(p->get<std::string>(), bool_field(body, "add_special_tokens", true));
  }
  json token_strs = json::array();
  for (int64_t id : ids) token_strs.push_back(model.text->tokenizer()->piece(id));
  return dump_json(json{{"count", ids.size()}, {"max_model_len", model.max_model_len()}, {"tokens", ids}, {"token_strs", token_strs}});
}

std::string detokenize_response(const std::string& text, const ServedModel& model) {
  const json body = parse_body(text);
  const json* t = field(body, "tokens");
  if (!t || !t->is_array()) throw bad("tokens", "must be a list of token ids");
  const std::vector<int64_t> ids = ids_of(*t, "tokens", model);
  const Tokenizer& tok = need_tokenizer(model, "tokens");
  return dump_json(json{{"prompt", tok.decode(ids)}});
}

std::string models_response(const ServedModel& model, int64_t created) {
  json m{{"id", model.name}, {"object", "model"}, {"created", created}, {"owned_by", "kvpipe"},
         {"root", model.name}, {"max_model_len", model.max_model_len()}};
  return dump_json(json{{"object", "list"}, {"data", json::array({m})}});
}

}  // namespace kvpipe
