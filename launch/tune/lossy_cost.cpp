#include "launch/tune/lossy_cost.h"

#include "launch/bench/dataset_workload.h"
#include "launch/bench/workload.h"
#include "launch/job_plan.h"
#include "launch/tune/candidate_runner.h"

#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

namespace kvpipe {

std::vector<std::vector<int64_t>> probe_prompts(const JobConfig& job, int64_t context, int count,
                                                int64_t max_tokens) {
  std::vector<std::vector<int64_t>> prompts;
  if (job.workload.dataset == "random") {
    const ModelConfig model = load_job_model_config(job);
    for (WorkloadRequest& r : make_workload(job.workload, model.vocab_size, job.workload.warmup, count))
      prompts.push_back(std::move(r.prompt));
  } else {
    const DatasetWorkload data = load_dataset_workload(job, context);
    for (const WorkloadRequest& r : data.requests) prompts.push_back(r.prompt);
    // multi_turn: a conversation's whole history (the data set's own replies), cut to the
    // turns that fit: the longest prompts the workload sends, where a window drops the most.
    for (const Conversation& c : data.conversations) {
      std::vector<RequestMessage> history = c.system;
      for (const auto& [question, reply] : c.turns) {
        history.push_back({"user", question});
        history.push_back({"assistant", reply});
      }
      history.pop_back();
      while (history.size() > c.system.size() + 1) {
        const std::vector<int64_t> ids =
            data.text->tokenizer()->encode(data.text->render_chat(history, "workload.dataset"), false);
        if (static_cast<int64_t>(ids.size()) <= max_tokens) {
          prompts.push_back(ids);
          break;
        }
        history.resize(history.size() - 2);  // drop the last question and the reply before it
      }
    }
    if (prompts.size() > static_cast<size_t>(job.workload.warmup))
      prompts.erase(prompts.begin(), prompts.begin() + job.workload.warmup);
  }
  for (std::vector<int64_t>& p : prompts)
    if (static_cast<int64_t>(p.size()) > max_tokens) p.resize(static_cast<size_t>(max_tokens));
  if (prompts.size() > static_cast<size_t>(count)) prompts.resize(static_cast<size_t>(count));
  return prompts;
}

std::vector<std::pair<int64_t, std::vector<ProbeToken>>> read_probe_logprobs(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument(path + ": cannot read");
  std::map<int64_t, std::map<int64_t, ProbeToken>> by_id;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    ProbeToken t;
    t.token = j.at("token").get<int64_t>();
    t.logprobs = j.at("logprobs").get<std::vector<double>>();
    by_id[j.at("id").get<int64_t>()][j.at("step").get<int64_t>()] = std::move(t);
  }
  std::vector<std::pair<int64_t, std::vector<ProbeToken>>> out;
  for (auto& [id, steps] : by_id) {
    std::vector<ProbeToken> tokens;
    for (auto& [step, t] : steps) tokens.push_back(std::move(t));
    out.push_back({id, std::move(tokens)});
  }
  return out;
}

LossyCost compare_generations(const std::vector<std::pair<int64_t, std::vector<ProbeToken>>>& job,
                              const std::vector<std::pair<int64_t, std::vector<ProbeToken>>>& candidate) {
  LossyCost cost;
  std::map<int64_t, const std::vector<ProbeToken>*> theirs;
  for (const auto& [id, tokens] : candidate) theirs[id] = &tokens;
  double kl_sum = 0.0, kl_max = 0.0;
  int64_t agreed = 0, total = 0;
  for (const auto& [id, mine] : job) {
    total += static_cast<int64_t>(mine.size());
    const auto it = theirs.find(id);
    if (it == theirs.end()) continue;
    const std::vector<ProbeToken>& other = *it->second;
    // Step s has the same context in both runs while every earlier token agreed.
    for (size_t s = 0; s < mine.size() && s < other.size(); ++s) {
      const std::vector<double>& p = mine[s].logprobs;
      const std::vector<double>& q = other[s].logprobs;
      if (p.size() != q.size()) throw std::invalid_argument("probe: vocabularies of different sizes");
      double kl = 0.0;
      for (size_t v = 0; v < p.size(); ++v)
        if (std::isfinite(p[v])) kl += std::exp(p[v]) * (p[v] - (std::isfinite(q[v]) ? q[v] : -1e30));
      kl = std::max(0.0, kl);
      kl_sum += kl;
      kl_max = std::max(kl_max, kl);
      ++cost.tokens;
      if (mine[s].token != other[s].token) break;
      ++agreed;
    }
  }
  if (cost.tokens > 0) {
    cost.kl_mean = kl_sum / static_cast<double>(cost.tokens);
    cost.kl_max = kl_max;
  }
  if (total > 0) cost.token_agreement = static_cast<double>(agreed) / static_cast<double>(total);
  return cost;
}

LossyProbe::LossyProbe(const JobConfig& job, int64_t context, LossyProbeOptions options) : o_(std::move(options)) {
  const std::vector<std::vector<int64_t>> prompts =
      probe_prompts(job, context, o_.prompts, std::max<int64_t>(1, context - o_.new_tokens));
  if (prompts.empty()) throw std::invalid_argument("--allow-lossy: the workload gave no prompt to measure outputs on");
  YAML::Node root = YAML::Load(job_yaml_with_overrides(o_.config, o_.overrides));
  root.remove("workload");
  root.remove("requests");
  YAML::Node requests(YAML::NodeType::Sequence);
  for (const std::vector<int64_t>& p : prompts) {
    YAML::Node r;
    YAML::Node ids(YAML::NodeType::Sequence);
    for (int64_t id : p) ids.push_back(id);
    ids.SetStyle(YAML::EmitterStyle::Flow);
    r["prompt_ids"] = ids;
    r["max_new_tokens"] = o_.new_tokens;
    requests.push_back(r);
  }
  root["requests"] = requests;
  std::filesystem::create_directories(o_.dir);
  probe_config_ = (std::filesystem::path(o_.dir) / "probe.yaml").string();
  YAML::Emitter emitter;
  emitter << root;
  std::ofstream(probe_config_) << "# The prompts kvpipe tune measures lossy strategies on (greedy, one rank).\n"
                               << emitter.c_str() << "\n";
}

std::string LossyProbe::generate(const TuneSettings& settings, const std::string& name, double timeout_s,
                                 std::string* error) {
  const std::filesystem::path dir(o_.dir);
  const std::string out = (dir / (name + ".logprobs.jsonl")).string();
  std::vector<std::string> cmd{o_.kvpipe, "generate", "--config", probe_config_};
  // Greedy, every request its full length, on one rank: only the cache's strategy differs.
  for (const char* s : {"sampling.temperature=0", "sampling.ignore_eos=true", "sampling.stop=[]",
                        "parallel.layers=auto", "parallel.tensor=1", "parallel.micro_batches=auto",
                        "speculative.method=off"})
    cmd.insert(cmd.end(), {"--set", s});
  for (const auto& [key, value] : settings)
    if (key.rfind("cache.", 0) == 0) cmd.insert(cmd.end(), {"--set", key + "=" + value});
  cmd.insert(cmd.end(), {"--logprobs-out", out, "--log-level", "warn"});
  const ProcessOutcome p = run_process(cmd, (dir / (name + ".stdout.txt")).string(),
                                       (dir / (name + ".stderr.txt")).string(), timeout_s);
  if (!p.started) *error = p.error;
  else if (p.killed) *error = "stopped";
  else if (p.exit_code != 0) *error = "kvpipe generate exited " + std::to_string(p.exit_code) + " (" + name + ".stderr.txt)";
  return error->empty() ? out : "";
}

LossyCost LossyProbe::measure(const TuneCandidate& candidate, double timeout_s) {
  LossyCost cost;
  try {
    if (!job_tokens_) {
      std::string error;
      const std::string path = generate({}, "job", timeout_s, &error);
      if (!error.empty()) {
        cost.error = error;
        return cost;
      }
      job_tokens_ = read_probe_logprobs(path);
    }
    std::string error;
    const std::string path = generate(candidate.settings, "candidate-" + std::to_string(candidate.id), timeout_s, &error);
    if (!error.empty()) {
      cost.error = error;
      return cost;
    }
    cost = compare_generations(*job_tokens_, read_probe_logprobs(path));
  } catch (const std::exception& e) {
    cost.error = e.what();
  }
  return cost;
}

}  // namespace kvpipe
