// Runs requests through a one-rank Engine and keeps every generated token and its logits.
#pragma once

#include "cache/block_pool.h"
#include "engine/engine.h"
#include "engine/model_shard.h"

#include <ATen/ATen.h>

#include <map>
#include <utility>
#include <vector>

namespace kvpipe::testing {

struct Generated {
  std::map<int64_t, std::vector<int64_t>> tokens;
  std::map<int64_t, std::vector<at::Tensor>> logits;
  int64_t preemptions = 0;
  SchedulerStats scheduler;
  PrefixCacheStats prefix;
};

// A greedy request that generates exactly `max_new` tokens (EOS ignored).
inline Request make_request(int64_t id, std::vector<int64_t> prompt, int64_t max_new, int64_t arrival = 0) {
  Request r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.max_new_tokens = max_new;
  r.arrival_step = arrival;
  r.ignore_eos = true;
  return r;
}

// `options.max_context` is taken from the model; the pool lives where the shard computes,
// in its dtype.
inline Generated run_engine(const ModelShard& shard, SchedulerOptions options, int64_t num_blocks,
                            const std::vector<Request>& requests) {
  BlockPool pool(shard.kv_shape(options.block_size), num_blocks, shard.weights().dtype, shard.device());
  LocalExecutor executor(shard, pool);
  EngineOptions o;
  o.scheduler = options;
  o.scheduler.max_context = shard.config().max_position;
  o.keep_logits = true;
  Engine engine(executor, shard.config(), num_blocks, o);
  for (const Request& r : requests) engine.add(r);
  Generated g;
  engine.run([&](const TokenEvent& ev) {
    g.tokens[ev.request_id].push_back(ev.token);
    g.logits[ev.request_id].push_back(at::from_blob(const_cast<float*>(ev.logits), {ev.vocab}).clone());
  });
  g.preemptions = engine.scheduler().stats().preemptions;
  g.scheduler = engine.scheduler().stats();
  g.prefix = engine.scheduler().blocks().stats();
  return g;
}

}  // namespace kvpipe::testing
