#include "launch/tune/tune_space.h"

#include "launch/job_plan.h"

#include <algorithm>
#include <sstream>

namespace kvpipe {
namespace {

std::string yaml_bool(bool v) { return v ? "true" : "false"; }

std::string yaml_list(const std::vector<int>& values) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < values.size(); ++i) out << (i ? ", " : "") << values[i];
  out << "]";
  return out.str();
}

std::string window_yaml(int sinks, int recent) {
  return "{sinks: " + std::to_string(sinks) + ", recent: " + std::to_string(recent) + "}";
}

// A knob from candidate values, the job's own value added (first among equals) and
// duplicates dropped; ordered knobs are sorted by their numeric value.
TuneKnob make_knob(const std::string& key, const std::string& current, std::vector<TuneValue> values,
                   bool ordered) {
  TuneKnob knob;
  knob.key = key;
  knob.ordered = ordered;
  values.insert(values.begin(), TuneValue{current, false});
  for (const TuneValue& v : values) {
    const bool seen = std::any_of(knob.values.begin(), knob.values.end(),
                                  [&](const TuneValue& k) { return k.yaml == v.yaml; });
    if (!seen) knob.values.push_back(v);
  }
  if (ordered) {
    std::stable_sort(knob.values.begin(), knob.values.end(), [](const TuneValue& a, const TuneValue& b) {
      return std::stod(a.yaml) < std::stod(b.yaml);
    });
  }
  for (size_t i = 0; i < knob.values.size(); ++i)
    if (knob.values[i].yaml == current) knob.current = i;
  return knob;
}

std::vector<TuneValue> lossless(std::initializer_list<int> values) {
  std::vector<TuneValue> out;
  for (int v : values) out.push_back({std::to_string(v), false});
  return out;
}

// The dtype K and V are computed in: what a cache dtype loses precision against.
std::string compute_dtype(const JobConfig& job) {
  if (job.model.dtype != "auto") return job.model.dtype;
  return resolve_device_type(job) == at::kCUDA ? "bfloat16" : "float32";
}

}  // namespace

const std::vector<std::string>& tune_keys() {
  static const std::vector<std::string> keys{
      "cache.prefix_reuse", "scheduler.max_batch", "scheduler.max_tokens_per_step",
      "scheduler.max_prefill_tokens_per_step", "cache.block_size", "cache.cached_layers", "parallel.layers",
      "parallel.micro_batches", "parallel.tensor", "speculative.method", "speculative.num_tokens", "cache.dtype",
      "cache.window"};
  return keys;
}

std::vector<TuneKnob> select_knobs(std::vector<TuneKnob> knobs, const std::vector<std::string>& keys,
                                   bool allow_lossy) {
  if (keys.empty()) return knobs;
  std::vector<TuneKnob> kept;
  for (const std::string& key : keys) {
    const auto& all = tune_keys();
    if (std::find(all.begin(), all.end(), key) == all.end()) {
      std::string list;
      for (const std::string& k : all) list += (list.empty() ? "" : ", ") + k;
      throw std::invalid_argument("--keys: '" + key + "' is not a key tune searches (" + list + ")");
    }
    if (!allow_lossy && (key == "cache.dtype" || key == "cache.window"))
      throw std::invalid_argument("--keys: " + key + " changes the model's outputs: add --allow-lossy");
    const auto it = std::find_if(knobs.begin(), knobs.end(), [&](const TuneKnob& k) { return k.key == key; });
    if (it == knobs.end())
      throw std::invalid_argument("--keys: " + key + " has no other value to try for this job and rank count");
    kept.push_back(*it);
  }
  // The search visits them in the space's order, whatever the order given.
  std::vector<TuneKnob> ordered;
  for (const TuneKnob& k : knobs)
    if (std::any_of(kept.begin(), kept.end(), [&](const TuneKnob& x) { return x.key == k.key; })) ordered.push_back(k);
  return ordered;
}

std::string job_value_yaml(const JobConfig& job, const std::string& key) {
  if (key == "cache.prefix_reuse") return yaml_bool(job.cache.prefix_reuse);
  if (key == "cache.block_size") return std::to_string(job.cache.block_size);
  if (key == "cache.dtype") return job.cache.dtype;
  if (key == "cache.cached_layers")
    return job.cache.cached_layers < 0 ? "all" : std::to_string(job.cache.cached_layers);
  if (key == "cache.window") return window_yaml(job.cache.window_sinks, job.cache.window_recent);
  if (key == "scheduler.max_batch") return std::to_string(job.scheduler.max_batch);
  if (key == "scheduler.max_tokens_per_step") return std::to_string(job.scheduler.max_tokens_per_step);
  if (key == "scheduler.max_prefill_tokens_per_step")
    return std::to_string(job.scheduler.max_prefill_tokens_per_step);
  if (key == "parallel.micro_batches")
    return job.parallel.micro_batches == 0 ? "auto" : std::to_string(job.parallel.micro_batches);
  if (key == "parallel.layers") return job.parallel.layers.empty() ? "auto" : yaml_list(job.parallel.layers);
  if (key == "parallel.tensor") return std::to_string(job.parallel.tensor);
  if (key == "speculative.method") return job.speculative.method;
  if (key == "speculative.num_tokens") return std::to_string(job.speculative.num_tokens);
  throw std::logic_error("job_value_yaml: " + key + " is not a tuning knob");
}

std::string run_fingerprint(const JobConfig& job, const JobPlan& plan) {
  std::ostringstream out;
  std::vector<int> layers;
  for (const StagePlan& s : plan.partition.stages) layers.push_back(static_cast<int>(s.num_layers));
  const int64_t micro_batches = resolved_micro_batches(job, plan);
  // The scheduler seats at most ceil(in flight / micro-batches) sequences per micro-batch.
  const int64_t in_flight = std::max(1, job.workload.concurrency);
  const int64_t seats = std::min<int64_t>(job.scheduler.max_batch, (in_flight + micro_batches - 1) / micro_batches);
  const int64_t prefill = job.scheduler.max_prefill_tokens_per_step >= job.scheduler.max_tokens_per_step
                              ? 0
                              : job.scheduler.max_prefill_tokens_per_step;
  out << "dtype=" << static_cast<int>(plan.dtype) << " device=" << static_cast<int>(plan.device_type)
      << " threads=" << job.runtime.threads << " tensor=" << plan.grid.tensor << " layers=" << yaml_list(layers)
      << " micro_batches=" << micro_batches << " backend=" << job.parallel.backend
      << " block_size=" << plan.block_size << " blocks=" << plan.partition.num_blocks
      << " prefix_reuse=" << job.cache.prefix_reuse << " kv_dtype=" << static_cast<int>(plan.kv_dtype)
      << " first_cached_layer=" << plan.first_cached_layer
      << " window=" << (job.cache.window_recent > 0 ? window_yaml(job.cache.window_sinks, job.cache.window_recent)
                                                     : std::string("none"))
      << " seats=" << seats << " max_tokens_per_step=" << job.scheduler.max_tokens_per_step
      << " max_prefill_tokens_per_step=" << prefill << " speculative=" << job.speculative.method;
  if (job.speculative.method != "off")
    out << " num_tokens=" << job.speculative.num_tokens << " ngram=" << job.speculative.ngram_min << ".."
        << job.speculative.ngram_max << " speculative_max_batch=" << job.speculative.max_batch
        << " draft=" << job.speculative.model;
  return out.str();
}

std::vector<TuneKnob> tune_space(const TuneSpaceInputs& in) {
  const JobConfig& job = *in.job;
  const int64_t layers = in.model.num_layers;
  std::vector<TuneKnob> knobs;
  auto add = [&](const std::string& key, std::vector<TuneValue> values, bool ordered) {
    TuneKnob knob = make_knob(key, job_value_yaml(job, key), std::move(values), ordered);
    if (knob.values.size() > 1) knobs.push_back(std::move(knob));
  };

  // Token-level reuse first: on conversations it decides more than any size.
  add("cache.prefix_reuse", {{"true", false}, {"false", false}}, false);

  // Batch sizes "until latency plateaus": beyond the requests in flight a larger limit
  // changes nothing, so the ladder stops at the first power of two that covers them (the
  // search measures only one of the limits that run alike: run_fingerprint).
  std::vector<TuneValue> batches;
  const int in_flight = std::max(1, job.workload.concurrency);
  for (int b = 1; b <= 1024; b *= 2) {
    batches.push_back({std::to_string(b), false});
    if (b >= in_flight) break;
  }
  add("scheduler.max_batch", batches, true);
  add("scheduler.max_tokens_per_step", lossless({256, 512, 1024, 2048, 4096}), true);
  add("scheduler.max_prefill_tokens_per_step", lossless({0, 64, 256}), false);
  add("cache.block_size", lossless({8, 16, 32, 64}), true);

  // Layer-level reuse: only the last N layers cached, the others recomputed every step.
  std::vector<TuneValue> cached{{"all", false}};
  for (int64_t n : {layers / 2, layers / 4})
    if (n > 0 && n < layers) cached.push_back({std::to_string(n), false});
  add("cache.cached_layers", cached, false);

  if (in.ranks > 1) {
    const int tensor = std::max(1, job.parallel.tensor);
    const int stages = in.ranks / tensor;
    if (stages > 1 && layers >= 2 * stages) {
      // The even split, and one stage lighter by an eighth of a stage's layers: rank 0 also
      // embeds, schedules and samples, the last stage holds the LM head.
      std::vector<int> even(static_cast<size_t>(stages), static_cast<int>(layers / stages));
      for (int64_t i = 0; i < layers % stages; ++i) even[static_cast<size_t>(stages - 1 - i)] += 1;
      const int shift = std::max(1, static_cast<int>(layers / stages / 8));
      std::vector<int> first_light = even, last_light = even;
      first_light.front() -= shift;
      first_light.back() += shift;
      last_light.back() -= shift;
      last_light.front() += shift;
      add("parallel.layers", {{"auto", false}, {yaml_list(even), false}, {yaml_list(first_light), false},
                              {yaml_list(last_light), false}}, false);
    }
    std::vector<TuneValue> micro{{"auto", false}};
    for (int m : {1, 2, 4}) micro.push_back({std::to_string(m), false});
    add("parallel.micro_batches", micro, false);
    std::vector<TuneValue> tensors;
    for (int t = 1; t <= in.ranks; ++t)
      if (in.ranks % t == 0) tensors.push_back({std::to_string(t), false});
    add("parallel.tensor", tensors, false);
    knobs.back().reset_key = "parallel.layers";
    knobs.back().reset_value = "auto";
    knobs.back().reset_job = job_value_yaml(job, "parallel.layers");
  }

  // Greedy verification keeps the outputs: speculative decoding is lossless.
  add("speculative.method", {{"off", false}, {"ngram", false}}, false);
  add("speculative.num_tokens", lossless({2, 4, 8}), true);
  if (!knobs.empty() && knobs.back().key == "speculative.num_tokens") {
    knobs.back().unless_key = "speculative.method";
    knobs.back().unless_value = "off";
    knobs.back().unless_job = job_value_yaml(job, "speculative.method");
  }

  if (in.allow_lossy) {
    const std::string compute = compute_dtype(job);
    // `auto` is the compute dtype: the two names are one candidate.
    const std::string own = job.cache.dtype == "auto" ? compute : job.cache.dtype;
    std::vector<TuneValue> dtypes;
    for (const char* d : {"float32", "float16", "bfloat16", "q8_0"}) {
      const std::string name = d;
      if (name != own) dtypes.push_back({name, !(name == "float32" || name == compute)});
    }
    add("cache.dtype", dtypes, false);
    // A window that keeps the first 4 tokens and a recent span shorter than the longest
    // request (otherwise it would never drop anything).
    std::vector<TuneValue> windows{{window_yaml(0, 0), false}};
    for (int recent : {256, 1024})
      if (recent + 4 < in.longest_request) windows.push_back({window_yaml(4, recent), true});
    add("cache.window", windows, false);
  }
  // The job's own value is never lossy against itself; others keep their mark.
  for (TuneKnob& knob : knobs) knob.values[knob.current].lossy = false;
  return knobs;
}

}  // namespace kvpipe
