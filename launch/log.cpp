#include "launch/log.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <stdexcept>
#include <vector>

namespace kvpipe {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::string g_prefix;  // set once at start-up, before any worker thread logs

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void write_stderr(const std::string& text) {
  // One write per line: stdio would split long lines of concurrent ranks.
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = ::write(2, text.data() + written, text.size() - written);
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
}

}  // namespace

LogLevel parse_log_level(const std::string& text) {
  if (text == "error") return LogLevel::kError;
  if (text == "warn") return LogLevel::kWarn;
  if (text == "info") return LogLevel::kInfo;
  if (text == "debug") return LogLevel::kDebug;
  throw std::invalid_argument("--log-level: expected error, warn, info or debug, got '" + text + "'");
}

void set_log_level(LogLevel level) { g_level = static_cast<int>(level); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load()); }
bool log_enabled(LogLevel level) { return static_cast<int>(level) <= g_level.load(); }

void set_log_rank(int rank, int world_size) {
  g_prefix = world_size > 1 ? "[rank " + std::to_string(rank) + "] " : "";
}

std::string log_prefix() { return g_prefix; }

void log_line(LogLevel level, const std::string& text) {
  if (!log_enabled(level)) return;
  std::fflush(stderr);  // keep order with anything written through stdio
  write_stderr(g_prefix + text + "\n");
}

void log_printf(LogLevel level, const char* format, ...) {
  if (!log_enabled(level)) return;
  va_list args;
  va_start(args, format);
  va_list copy;
  va_copy(copy, args);
  const int size = std::vsnprintf(nullptr, 0, format, copy);
  va_end(copy);
  std::vector<char> buffer(static_cast<size_t>(std::max(size, 0)) + 1);
  std::vsnprintf(buffer.data(), buffer.size(), format, args);
  va_end(args);
  log_line(level, std::string(buffer.data()));
}

ProgressBar::ProgressBar(int64_t total, bool enabled)
    : total_(std::max<int64_t>(total, 1)),
      active_(enabled && log_enabled(LogLevel::kInfo) && ::isatty(2) == 1),
      start_s_(now_s()) {}

ProgressBar::~ProgressBar() { finish(); }

std::string ProgressBar::render(int64_t done, int64_t total, double seconds, int width) {
  total = std::max<int64_t>(total, 1);
  done = std::min(std::max<int64_t>(done, 0), total);
  const int filled = static_cast<int>(static_cast<double>(width) * static_cast<double>(done) / static_cast<double>(total));
  const double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0.0;
  std::string bar = "[" + std::string(static_cast<size_t>(filled), '#') +
                    std::string(static_cast<size_t>(width - filled), ' ') + "]";
  char tail[128];
  if (rate > 0) {
    const double eta = static_cast<double>(total - done) / rate;
    std::snprintf(tail, sizeof tail, " %lld/%lld tokens, %.1f tokens/s, ETA %.0f s",
                  static_cast<long long>(done), static_cast<long long>(total), rate, std::ceil(eta));
  } else {
    std::snprintf(tail, sizeof tail, " %lld/%lld tokens, -- tokens/s, ETA --",
                  static_cast<long long>(done), static_cast<long long>(total));
  }
  return bar + tail;
}

void ProgressBar::advance(int64_t tokens) {
  done_ += tokens;
  if (!active_) return;
  const double t = now_s();
  if (last_draw_s_ >= 0 && t - last_draw_s_ < 0.1 && done_ < total_) return;
  last_draw_s_ = t;
  draw();
}

void ProgressBar::draw() {
  write_stderr("\r" + g_prefix + render(done_, total_, now_s() - start_s_) + "\033[K");
}

void ProgressBar::finish() {
  if (!active_) return;
  active_ = false;
  write_stderr("\r\033[K");
}

}  // namespace kvpipe
