#include "launch/bench/op_profiler.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <map>
#include <stdexcept>

#if __has_include(<torch/csrc/autograd/profiler_legacy.h>)
#include <torch/csrc/autograd/profiler_legacy.h>
#define KVPIPE_HAVE_OP_PROFILER 1
#endif

namespace kvpipe {

struct OpProfiler::Impl {
#ifdef KVPIPE_HAVE_OP_PROFILER
  // The legacy profiler: present in LibTorch 1.x and 2.x alike, and it needs no Kineto.
  std::unique_ptr<torch::autograd::profiler::RecordProfile> record;
#endif
};

OpProfiler::OpProfiler(std::string path) : path_(std::move(path)), impl_(std::make_unique<Impl>()) {
#ifdef KVPIPE_HAVE_OP_PROFILER
  { std::ofstream probe(path_); if (!probe) throw std::invalid_argument("--profile: cannot write " + path_); }
  impl_->record = std::make_unique<torch::autograd::profiler::RecordProfile>(path_);
#else
  throw std::invalid_argument("--profile: this build's LibTorch has no operator profiler");
#endif
}

OpProfiler::~OpProfiler() {
  try {
    stop();
  } catch (...) {
  }
}

void OpProfiler::stop() {
#ifdef KVPIPE_HAVE_OP_PROFILER
  impl_->record.reset();  // its destructor writes the file
#endif
}

std::vector<OpTotal> top_operators(const std::string& trace_path, size_t top) {
  std::ifstream in(trace_path);
  if (!in) throw std::runtime_error("cannot read the profile " + trace_path);
  const nlohmann::json doc = nlohmann::json::parse(in);
  const nlohmann::json& events = doc.is_array() ? doc : doc.at("traceEvents");
  std::map<std::string, OpTotal> by_name;
  for (const auto& e : events) {
    if (!e.is_object() || e.value("ph", "") != "X" || !e.contains("dur")) continue;
    OpTotal& t = by_name[e.value("name", "?")];
    t.name = e.value("name", "?");
    ++t.calls;
    t.total_ms += e["dur"].get<double>() / 1000.0;
  }
  std::vector<OpTotal> out;
  for (auto& [name, t] : by_name) out.push_back(t);
  std::sort(out.begin(), out.end(), [](const OpTotal& a, const OpTotal& b) { return a.total_ms > b.total_ms; });
  if (out.size() > top) out.resize(top);
  return out;
}

}  // namespace kvpipe
