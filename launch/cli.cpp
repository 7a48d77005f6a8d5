#include "launch/cli.h"

#include "engine/model/model_config.h"
#include "launch/bench/bench.h"
#include "launch/bench/bench_endpoint.h"
#include "launch/generate.h"
#include "launch/init_model.h"
#include "launch/job_config.h"
#include "launch/job_plan.h"
#include "launch/device_plan.h"
#include "launch/log.h"
#include "launch/model_text.h"
#include "launch/output.h"
#include "launch/serve/serve.h"
#include "launch/signals.h"
#include "launch/slurm_script.h"
#include "launch/tune/tune.h"
#include "parallel/world.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>

namespace kvpipe {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitInternal = 1;
constexpr int kExitBadInput = 2;

std::vector<int64_t> parse_id_list(const std::string& text) {
  std::vector<int64_t> ids;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || v < 0)
      throw std::invalid_argument("--prompt-ids: '" + item + "' is not a token id");
    ids.push_back(v);
  }
  if (ids.empty()) throw std::invalid_argument("--prompt-ids: empty list");
  return ids;
}

// Runs `body` and maps exceptions to the exit-code contract. On more than one rank a
// failure aborts the job, so no rank waits forever on one that has gone.
template <typename F>
int guarded(F&& body, World* world) {
  int code = kExitOk;
  const std::string who =
      world && world->size() > 1 ? "kvpipe: rank " + std::to_string(world->rank()) + ": " : "kvpipe: ";
  try {
    body();
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "%serror: %s\n", who.c_str(), e.what());
    code = kExitBadInput;
  } catch (const JobFailure& e) {
    std::istringstream lines(e.what());
    for (std::string line; std::getline(lines, line);) std::fprintf(stderr, "%serror: %s\n", who.c_str(), line.c_str());
    code = kExitInternal;
  } catch (const std::exception& e) {
    std::string msg = e.what();
    msg = msg.substr(0, msg.find('\n'));  // c10::Error appends a backtrace
    std::fprintf(stderr, "%sinternal error: %s\n", who.c_str(), msg.c_str());
    code = kExitInternal;
  }
  if (code != kExitOk && world && world->size() > 1) {
    std::fprintf(stderr, "kvpipe: rank %d failed, stopping every rank of the job\n", world->rank());
    std::fflush(stderr);
    world->abort(code);
  }
  return code;
}

// Prints every problem, one line each, and says whether there were any.
bool report_problems(const std::vector<ConfigProblem>& problems, const std::string& file) {
  if (problems.empty()) return false;
  if (problems.size() > 1)
    std::fprintf(stderr, "kvpipe: %zu problems in %s:\n", problems.size(), file.c_str());
  for (const ConfigProblem& p : problems) std::fprintf(stderr, "kvpipe: error: %s\n", p.message.c_str());
  return true;
}

// The rank count `validate` plans for when --ranks is not given: the launcher's, else the
// cluster section's, else one.
int default_rank_count(const JobConfig& job) {
  if (const int n = world_size_from_env()) return n;
  if (job.cluster.present) return job.cluster.ranks();
  return 1;
}

std::string absolute_path(const std::string& path) {
  std::error_code ignored;
  const std::filesystem::path absolute = std::filesystem::absolute(path, ignored);
  return (absolute.empty() ? std::filesystem::path(path) : absolute).lexically_normal().string();
}

}  // namespace

namespace {

int run_subcommand(int argc, char** argv) {
  CLI::App app{"kvpipe: pipeline-parallel LLM inference with a paged, tunable KV cache"};
  app.require_subcommand(1);

  // init-model
  InitModelOptions init;
  std::string preset = "tiny";
  std::string architecture;
  int64_t hidden = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0, vocab = 0,
          max_position = 0;
  double rope_theta = 0, rms_eps = 0;
  bool tie = false;
  // 0 stands for "the preset's value" below, so a 0 (or less) given on the command line is refused.
  const CLI::Validator positive(
      [](std::string& value) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(value.c_str(), &end);
        if (end != value.c_str() && *end == '\0' && v > 0) return {};
        return "must be a number greater than 0 (leave the option out for the preset's value)";
      },
      "POSITIVE");
  auto* init_cmd = app.add_subcommand("init-model", "Write a random-weight model (HF layout or one GGUF file)");
  init_cmd->add_option("--out", init.out, "Output directory (hf) or file (gguf)")->required();
  init_cmd->add_option("--format", init.format, "hf (config.json + model.safetensors) or gguf (one file)")->check(CLI::IsMember({"hf", "gguf"}));
  init_cmd->add_option("--preset", preset, "Base shape: tiny or small")->check(CLI::IsMember({"tiny", "small"}));
  init_cmd->add_option("--architecture", architecture, "LlamaForCausalLM or Qwen2ForCausalLM")
      ->check(CLI::IsMember({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}));
  init_cmd->add_option("--hidden", hidden, "Hidden size")->check(positive);
  init_cmd->add_option("--layers", layers, "Decoder layers")->check(positive);
  init_cmd->add_option("--heads", heads, "Attention heads")->check(positive);
  init_cmd->add_option("--kv-heads", kv_heads, "Key/value heads")->check(positive);
  init_cmd->add_option("--head-dim", head_dim, "Head dimension (default hidden / heads)")->check(positive);
  init_cmd->add_option("--intermediate", intermediate, "MLP intermediate size")->check(positive);
  init_cmd->add_option("--vocab", vocab, "Vocabulary size")->check(positive);
  init_cmd->add_option("--max-position", max_position, "Context length")->check(positive);
  init_cmd->add_option("--rope-theta", rope_theta, "RoPE base")->check(positive);
  init_cmd->add_option("--rms-eps", rms_eps, "RMSNorm epsilon")->check(positive);
  init_cmd->add_flag("--tie-embeddings", tie, "Share the embedding with the LM head");
  init_cmd->add_option("--dtype", init.dtype, "float32, float16 or bfloat16")
      ->check(CLI::IsMember({"float32", "float16", "bfloat16"}));
  init_cmd->add_option("--seed", init.seed, "Random seed");
  init_cmd->add_option("--std", init.std, "Standard deviation of the weights");

  // generate
  GenerateOptions gen;
  std::string prompt_ids;
  int max_new = 0;
  auto* gen_cmd = app.add_subcommand("generate", "Run the job's requests; one JSON line per request on stdout");
  gen_cmd->add_option("--config", gen.config, "Job YAML file")->required();
  gen_cmd->add_option("--set", gen.overrides, "Override a config key: key.path=value (repeatable)");
  auto* prompt_ids_opt = gen_cmd->add_option("--prompt-ids", prompt_ids, "One request with these comma-separated token ids");
  std::string prompt_text, chat_text;
  auto* prompt_text_opt = gen_cmd->add_option("--prompt", prompt_text, "One request with this text as its prompt");
  auto* chat_text_opt = gen_cmd->add_option(
      "--chat", chat_text, "One request: this text as a user message, through the model's chat template");
  prompt_ids_opt->excludes(prompt_text_opt)->excludes(chat_text_opt);
  prompt_text_opt->excludes(chat_text_opt);
  auto* max_new_opt = gen_cmd->add_option(
      "--max-new-tokens", max_new,
      "Tokens to generate per request (default: each request's max_new_tokens, 32 where the job file sets none)");
  gen_cmd->add_option("--logprobs-out", gen.logprobs_out,
                      "Write each generated token's full-vocabulary log-probabilities (JSON lines)");
  gen_cmd->add_option("--output", gen.output,
                      "Also write each request's JSON line to this file, as the request finishes");
  std::string log_level = "info";
  const auto log_levels = CLI::IsMember({"error", "warn", "info", "debug"});
  gen_cmd->add_option("--log-level", log_level, "error, warn, info (default) or debug")->check(log_levels);

  // bench
  BenchOptions bench_opts;
  auto* bench_cmd = app.add_subcommand(
      "bench", "Run the config's workload: and write report.json, requests.csv and trace.json to --out");
  bench_cmd->add_option("--config", bench_opts.config, "Job YAML file (its workload: section is the load)")->required();
  bench_cmd->add_option("--set", bench_opts.overrides, "Override a config key: key.path=value (repeatable)");
  bench_cmd->add_option("--out", bench_opts.out_dir, "Directory for report.json, requests.csv, trace.json")->required();
  bench_cmd->add_flag("--profile", bench_opts.profile,
                      "Also profile LibTorch operators on rank 0 (profile_rank0.json)");
  bench_cmd->add_option("--log-level", log_level, "error, warn, info (default) or debug")->check(log_levels);
  auto* endpoint_opt = bench_cmd->add_option(
      "--endpoint", bench_opts.endpoint,
      "Send the workload to this OpenAI-compatible server (http://host:port) instead of running it");
  bench_cmd->add_option("--api-key", bench_opts.api_key, "Bearer token for --endpoint")->needs(endpoint_opt);
  bench_cmd->add_option("--model", bench_opts.model, "Model name for --endpoint (default: its first /v1/models)")
      ->needs(endpoint_opt);
  bench_cmd
      ->add_option("--goodput", bench_opts.goodput,
                   "SLO for goodput with --endpoint: ttft:MS, tpot:MS or e2el:MS (repeatable)")
      ->needs(endpoint_opt);

  // tune
  TuneOptions tune_opts;
  auto* tune_cmd = app.add_subcommand(
      "tune", "Search the cache and scheduler settings for the config's workload: write tuned.yaml, report.md, "
              "candidates.csv to --out");
  tune_cmd->add_option("--config", tune_opts.config, "Job YAML file (its workload: section is what is measured)")
      ->required();
  tune_cmd->add_option("--set", tune_opts.overrides, "Override a config key: key.path=value (repeatable)");
  tune_cmd->add_option("--out", tune_opts.out_dir, "Directory for tuned.yaml, report.md, plot.svg, candidates.csv, runs/")
      ->required();
  tune_cmd->add_option("--ranks", tune_opts.ranks, "Ranks of every candidate (more than 1: each runs under mpirun)")
      ->check(CLI::PositiveNumber);
  tune_cmd->add_option("--objective", tune_opts.objective,
                       "What to minimise (ttft: p99 TTFT, tpot: p99 TPOT, e2e: mean end-to-end latency) or "
                       "maximise (throughput: output tokens/s); default e2e")
      ->check(CLI::IsMember({"ttft", "tpot", "e2e", "throughput"}));
  tune_cmd->add_option("--slo", tune_opts.slo, "Limits a winner must meet: ttft_p99=MS,tpot_p99=MS,e2e_p99=MS");
  tune_cmd->add_option("--budget", tune_opts.budget_min, "Minutes the whole search may take (default 30)");
  tune_cmd->add_flag("--allow-lossy", tune_opts.allow_lossy,
                     "Also try strategies that change outputs (a window, a narrower cache dtype), with their "
                     "measured cost in log-probability");
  tune_cmd
      ->add_option("--keys", tune_opts.keys,
                   "Search only these keys (comma-separated; default: every cache, scheduler, parallel and "
                   "speculative key tune knows)")
      ->delimiter(',');
  tune_cmd->add_option("--screen-requests", tune_opts.screen_requests,
                       "Requests of a screening run (default: a quarter of the workload's, at least 2 x concurrency)");
  tune_cmd->add_option("--log-level", log_level, "error, warn, info (default) or debug")->check(log_levels);

  // validate
  std::string validate_config;
  std::vector<std::string> validate_overrides;
  int validate_ranks = 1;
  auto* val_cmd = app.add_subcommand("validate", "Check a job file and print the layer split and KV plan");
  val_cmd->add_option("--config", validate_config, "Job YAML file")->required();
  val_cmd->add_option("--set", validate_overrides, "Override a config key: key.path=value");
  auto* ranks_opt = val_cmd->add_option("--ranks", validate_ranks,
                                        "Ranks to plan for (default: the launcher's world size, else "
                                        "cluster.nodes x cluster.gpus_per_node, else 1)")
                        ->check(CLI::PositiveNumber);
  val_cmd->add_option("--log-level", log_level, "error, warn, info (default) or debug")->check(log_levels);

  // tokenize
  std::string tok_config, tok_text, tok_chat;
  std::vector<std::string> tok_overrides;
  auto* tok_cmd = app.add_subcommand("tokenize", "Print the token ids (and pieces) a prompt of this text gets");
  tok_cmd->add_option("--config", tok_config, "Job YAML file (its model: is the tokenizer)")->required();
  tok_cmd->add_option("--set", tok_overrides, "Override a config key: key.path=value (repeatable)");
  auto* tok_text_opt = tok_cmd->add_option("--text", tok_text, "The text of a prompt");
  auto* tok_chat_opt = tok_cmd->add_option("--chat", tok_chat, "A user message, through the chat template");
  tok_text_opt->excludes(tok_chat_opt);

  // slurm
  std::string slurm_config;
  std::vector<std::string> slurm_overrides;
  auto* slurm_cmd = app.add_subcommand("slurm", "Print an sbatch script that runs the job's cluster: section");
  slurm_cmd->add_option("--config", slurm_config, "Job YAML file with a cluster: section")->required();
  slurm_cmd->add_option("--set", slurm_overrides, "Override a config key (passed on to generate)");

  // serve
  ServeOptions serve_opts;
  auto* serve_cmd = app.add_subcommand("serve", "Serve the model over OpenAI's HTTP API (rank 0 listens)");
  serve_cmd->add_option("--config", serve_opts.config, "Job YAML file")->required();
  serve_cmd->add_option("--set", serve_opts.overrides, "Override a config key: key.path=value (repeatable)");
  serve_cmd->add_option("--host", serve_opts.host, "Address to listen on (default 127.0.0.1)");
  serve_cmd->add_option("--port", serve_opts.port, "Port to listen on (default 8000; 0: any free port)");
  serve_cmd->add_option("--api-key", serve_opts.api_key, "Require Authorization: Bearer KEY on /v1/*, /tokenize, /detokenize");
  serve_cmd->add_option("--served-model-name", serve_opts.served_model_name,
                        "The model's name in the API (default: the model file's name)");
  serve_cmd->add_option("--http-threads", serve_opts.http_threads,
                        "HTTP threads (default 512): each open stream holds one");
  serve_cmd->add_option("--max-requests", serve_opts.max_requests,
                        "Unfinished requests (choices) accepted before answering 503 (default 1024)");
  serve_cmd->add_option("--max-body-bytes", serve_opts.max_body_bytes, "Largest request body (default 8 MiB; larger: 413)");
  serve_cmd->add_option("--header-timeout", serve_opts.header_timeout_s,
                        "Seconds a request's header may take to arrive whole (default 10; later: 408, closed)");
  serve_cmd->add_option("--shutdown-timeout", serve_opts.shutdown_timeout_s,
                        "Seconds that requests in flight get to finish after SIGINT/SIGTERM (default 30)");
  serve_cmd->add_option("--chat-template", serve_opts.chat_template,
                        "Jinja chat template file used instead of the model's (for example one that renders tools)");
  serve_cmd->add_option("--tool-call-parser", serve_opts.tool_call_parser,
                        "How tool_choice \"auto\" output is read: hermes, llama3_json or mistral "
                        "(default: the syntax the chat template writes)");
  serve_cmd->add_option("--log-level", log_level, "error, warn, info (default) or debug")->check(log_levels);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "kvpipe: error: %s\n", e.what());
    return kExitBadInput;
  }

  if (init_cmd->parsed()) {
    return guarded([&] {
      ModelConfig c = preset_config(preset);
      if (!architecture.empty()) c.architecture = architecture;
      c.qkv_bias = c.architecture == "Qwen2ForCausalLM";
      if (hidden) c.hidden_size = hidden;
      if (layers) c.num_layers = layers;
      if (heads) c.num_heads = heads;
      if (kv_heads) c.num_kv_heads = kv_heads;
      c.head_dim = head_dim ? head_dim : (c.num_heads ? c.hidden_size / c.num_heads : 0);
      if (intermediate) c.intermediate_size = intermediate;
      if (vocab) c.vocab_size = vocab;
      if (max_position) c.max_position = max_position;
      if (rope_theta) c.rope_theta = rope_theta;
      if (rms_eps) c.rms_eps = rms_eps;
      if (tie) c.tie_embeddings = true;
      for (int64_t& id : c.eos_token_ids) id = std::min(id, c.vocab_size - 1);
      init.config = c;
      init_model(init);
      std::fprintf(stderr, "init-model: wrote %s (%lld parameters)\n", init.out.c_str(),
                   static_cast<long long>(c.total_params()));
    }, nullptr);
  }
  set_log_level(parse_log_level(log_level));
  if (val_cmd->parsed()) {
    const int known_ranks = ranks_opt->count() > 0 ? validate_ranks : world_size_from_env();
    if (report_problems(validate_job_config_file(validate_config, validate_overrides, known_ranks),
                        validate_config))
      return kExitBadInput;
    return guarded([&] {
      const JobConfig job = load_job_config(validate_config, validate_overrides);
      const int ranks = ranks_opt->count() > 0 ? validate_ranks : default_rank_count(job);
      throw_if_problems(check_job_for_ranks(job, ranks));
      const JobPlan plan = plan_job(job, ranks);
      check_job_requests(job, plan);
      print_plan(std::cout, plan);
      std::cout << "validate: " << validate_config << " is a valid job for " << ranks << " rank(s)\n";
    }, nullptr);
  }
  if (tok_cmd->parsed()) {
    if (report_problems(validate_job_config_file(tok_config, tok_overrides), tok_config))
      return kExitBadInput;
    return guarded([&] {
      if (tok_text_opt->count() == 0 && tok_chat_opt->count() == 0)
        throw std::invalid_argument("tokenize: give --text or --chat");
      const JobConfig job = load_job_config(tok_config, tok_overrides);
      const ModelText text(job.model.path);
      RequestSpec spec;
      if (tok_text_opt->count() > 0) spec.prompt = tok_text;
      else spec.messages = {{"user", tok_chat}};
      const std::string who = tok_text_opt->count() > 0 ? "--text" : "--chat";
      const std::vector<int64_t> ids = text.prompt_ids(spec, who);
      nlohmann::ordered_json out;
      out["ids"] = ids;
      nlohmann::ordered_json pieces = nlohmann::ordered_json::array();
      for (int64_t id : ids) pieces.push_back(text.tokenizer()->piece(id));
      out["pieces"] = pieces;
      std::cout << out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) << "\n";
      flush_stdout("the token ids");
    }, nullptr);
  }
  if (slurm_cmd->parsed()) {
    if (report_problems(validate_job_config_file(slurm_config, slurm_overrides), slurm_config))
      return kExitBadInput;
    return guarded([&] {
      const JobConfig job = load_job_config(slurm_config, slurm_overrides);
      if (job.cluster.present) throw_if_problems(check_job_for_ranks(job, job.cluster.ranks()));
      SlurmScriptInputs inputs;
      inputs.config_path = absolute_path(slurm_config);
      inputs.overrides = slurm_overrides;
      inputs.kvpipe_binary = current_executable();
      std::cout << make_slurm_script(job, inputs);
      flush_stdout("the sbatch script");
    }, nullptr);
  }
  if (tune_cmd->parsed()) {  // starts its candidates as processes of their own: no MPI job here
    if (report_problems(validate_job_config_file(tune_opts.config, tune_opts.overrides, tune_opts.ranks),
                        tune_opts.config))
      return kExitBadInput;
    install_stop_handlers();
    for (int i = 0; i < argc; ++i) tune_opts.command += (i ? " " : "") + std::string(argv[i]);
    const int tune_code = guarded([&] { tune(tune_opts); }, nullptr);
    return tune_code == kExitOk && stop_requested() ? stop_exit_code() : tune_code;
  }
  if (bench_cmd->parsed() && !bench_opts.endpoint.empty()) {  // a client: no MPI job
    install_stop_handlers();
    const int bench_code = guarded([&] { bench_endpoint(bench_opts); }, nullptr);
    return bench_code == kExitOk && stop_requested() ? stop_exit_code() : bench_code;
  }
  // generate and bench join the MPI job.
  std::unique_ptr<World> world;
  int code = guarded([&] { world = std::make_unique<World>(&argc, &argv); }, nullptr);
  if (code != kExitOk) return code;
  install_stop_handlers();
  code = guarded([&] {
    if (bench_cmd->parsed()) {
      bench(bench_opts, *world);
      return;
    }
    if (serve_cmd->parsed()) {
      serve(serve_opts, *world);
      return;
    }
    if (!prompt_ids.empty()) gen.prompt_ids = parse_id_list(prompt_ids);
    if (prompt_text_opt->count() > 0) gen.prompt_text = prompt_text;
    if (chat_text_opt->count() > 0) gen.chat_text = chat_text;
    if (max_new_opt->count() > 0) gen.max_new_tokens = max_new;
    generate(gen, *world);
  }, world.get());
  // A job stopped by SIGINT/SIGTERM has printed what finished; it still did not complete.
  // A server stopped by a signal has shut down as asked: that is its normal end.
  return code == kExitOk && stop_requested() && !serve_cmd->parsed() ? stop_exit_code() : code;
}

}  // namespace

int run_cli(int argc, char** argv) {
  const int code = run_subcommand(argc, argv);
  // Whatever a command printed through std::cout may still sit in a buffer: a command whose
  // output is lost has failed, even where its own code did not look.
  std::string reason;
  if (!stdout_flushed(reason) && code == kExitOk) {
    std::fprintf(stderr, "kvpipe: error: cannot write to stdout: %s\n", reason.c_str());
    return kExitInternal;
  }
  return code;
}

}  // namespace kvpipe
