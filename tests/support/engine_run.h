// Runs requests through a one-rank Engine and keeps every generated token and its logits.
#pragma once

#include "cache/block_pool.h"
#include "engine/engine.h"
#include "engine/model_shard.h"

#include <ATen/ATen.h>

#include <map>
#include <vector>

namespace kvpipe::testing {

struct Generated {
  std::map<int64_t, std::vector<int64_t>> tokens;
  std::map<int64_t, std::vector<at::Tensor>> logits;
  int64_t preemptions = 0;
  SchedulerStats scheduler;
  PrefixCacheStats prefix;
};

// `options.max_context` is taken from the model.
inline Generated run_engine(const ModelShard& shard, SchedulerOptions options, int64_t num_blocks,
                            const std::vector<Request>& requests) {
  BlockPool pool(shard.kv_shape(options.block_size), num_blocks, at::kFloat, at::kCPU);
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
