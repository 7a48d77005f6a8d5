// What structured outputs cost per token: for each JSON Schema of a corpus (a JSON list of
// {name, schema}), the time to compile it (schema -> pattern -> automaton -> constraint), then the mask's
// time per token along answers drawn at random among the tokens it allows (with a budget of
// max_tokens, as a request has), over a real model's vocabulary.
//
//   kvpipe_grammar_bench MODEL.gguf CORPUS.json [--answers N] [--max-tokens N] [--seed S]
//
// Prints one line per schema and a summary: compile ms (median, max), mask us per token
// (median, p99), automaton states, and the masks cached per answer.
#include "engine/grammar/json_schema.h"
#include "engine/grammar/regex_dfa.h"
#include "engine/grammar/token_constraint.h"
#include "launch/model_text.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(std::min<double>(v.size() - 1, std::floor(q * (v.size() - 1) + 0.5)));
  return v[i];
}

double us_since(Clock::time_point t0) { return std::chrono::duration<double, std::micro>(Clock::now() - t0).count(); }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s MODEL.gguf CORPUS.json [--answers N] [--max-tokens N] [--seed S]\n", argv[0]);
    return 2;
  }
  int answers = 4, max_tokens = 200;
  uint64_t seed = 1;
  for (int i = 3; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--answers") answers = std::atoi(argv[i + 1]);
    else if (flag == "--max-tokens") max_tokens = std::atoi(argv[i + 1]);
    else if (flag == "--seed") seed = std::strtoull(argv[i + 1], nullptr, 10);
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  const kvpipe::ModelText text(argv[1]);
  if (!text.tokenizer()) {
    std::fprintf(stderr, "%s has no tokenizer\n", argv[1]);
    return 2;
  }
  const auto vocabulary = kvpipe::TokenVocabulary::of(*text.tokenizer(), text.tokenizer()->eos_ids());
  const int64_t vocab = static_cast<int64_t>(vocabulary->bytes.size());
  std::ifstream in(argv[2]);
  const nlohmann::ordered_json corpus = nlohmann::ordered_json::parse(in);

  std::mt19937_64 rng(seed);
  std::vector<double> compile_ms, mask_us, cold_us, warm_us;
  std::vector<float> logits(static_cast<size_t>(vocab));
  std::printf("%-24s %10s %8s %8s %10s %10s %8s\n", "schema", "compile_ms", "states", "tokens", "mask_p50_us",
              "mask_p99_us", "cached");
  for (const auto& entry : corpus) {
    const auto t0 = Clock::now();
    auto dfa = std::make_shared<const kvpipe::RegexDfa>(kvpipe::json_schema_regex(entry["schema"]), 50000);
    // One constraint for all the answers, as the server's ConstraintCache shares it between
    // requests with the same schema: the first answer meets every state cold.
    const kvpipe::TokenConstraint constraint(dfa, vocabulary);
    compile_ms.push_back(us_since(t0) / 1000.0);
    std::vector<double> mine;
    size_t cached = 0;
    int64_t tokens = 0;
    for (int a = 0; a < answers; ++a) {
      std::vector<int64_t> output;
      for (int step = 0; step < max_tokens; ++step) {
        std::fill(logits.begin(), logits.end(), 0.0f);
        const auto m0 = Clock::now();
        constraint.mask(logits.data(), vocab, output.data(), static_cast<int64_t>(output.size()), max_tokens - step);
        const double us = us_since(m0);
        (a == 0 ? cold_us : warm_us).push_back(us);
        mine.push_back(us);
        std::vector<int64_t> allowed;
        for (int64_t id = 0; id < vocab; ++id)
          if (std::isfinite(logits[id])) allowed.push_back(id);
        if (allowed.empty()) break;
        const int64_t pick = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
        if (std::find(vocabulary->eos_ids.begin(), vocabulary->eos_ids.end(), pick) != vocabulary->eos_ids.end()) break;
        output.push_back(pick);
      }
      tokens += static_cast<int64_t>(output.size());
    }
    cached = constraint.cached_states();
    mask_us.insert(mask_us.end(), mine.begin(), mine.end());
    std::printf("%-24s %10.1f %8d %8lld %10.1f %10.1f %8zu\n", entry["name"].get<std::string>().c_str(),
                compile_ms.back(), dfa->num_states(), static_cast<long long>(tokens), percentile(mine, 0.5),
                percentile(mine, 0.99), cached);
  }
  std::printf("summary: %zu schemas, vocabulary %lld; compile ms median %.1f p99 %.1f max %.1f; mask us per token "
              "median %.1f p99 %.1f over %zu tokens (first answers: median %.1f p99 %.1f; later answers, masks "
              "shared: median %.1f p99 %.1f)\n",
              compile_ms.size(), static_cast<long long>(vocab), percentile(compile_ms, 0.5), percentile(compile_ms, 0.99),
              *std::max_element(compile_ms.begin(), compile_ms.end()), percentile(mask_us, 0.5),
              percentile(mask_us, 0.99), mask_us.size(), percentile(cold_us, 0.5), percentile(cold_us, 0.99),
              percentile(warm_us, 0.5), percentile(warm_us, 0.99));
  return 0;
}
