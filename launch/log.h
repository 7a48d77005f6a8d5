// Log lines on standard error for every sub-command.
//
// Owns the level filter (`--log-level error|warn|info|debug`) and the rank prefix: when the
// job has more than one rank, every line a rank writes starts with `[rank R] ` so that the
// interleaved output of mpirun stays readable. Results never go through here: they are JSON
// lines on standard output from rank 0. Error lines (`kvpipe: rank R: error: ...`) are
// printed by the command line whatever the level.
#pragma once

#include <cstdint>
#include <string>

namespace kvpipe {

enum class LogLevel { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

// "error" | "warn" | "info" | "debug"; std::invalid_argument naming --log-level otherwise.
LogLevel parse_log_level(const std::string& text);

void set_log_level(LogLevel level);
LogLevel log_level();
bool log_enabled(LogLevel level);

// The rank prefix is added only when `world_size` > 1.
void set_log_rank(int rank, int world_size);
std::string log_prefix();

// Writes one line (a newline is added) when `level` is enabled, in a single write so that
// lines of different ranks do not mix.
void log_line(LogLevel level, const std::string& text);

// printf-style convenience.
void log_printf(LogLevel level, const char* format, ...) __attribute__((format(printf, 2, 3)));

// A one-line progress bar on standard error, redrawn in place: shown only on a terminal
// (isatty(2)) and at level info or above, so logs and pipes never see carriage returns.
class ProgressBar {
 public:
  // `total` tokens are expected; `enabled` is false on ranks other than 0.
  ProgressBar(int64_t total, bool enabled);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // Adds `tokens` done; redraws at most ten times a second.
  void advance(int64_t tokens);
  // Erases the bar (before the summary lines).
  void finish();
  bool active() const { return active_; }

  // The bar's text for `done` of `total` tokens after `seconds` (tests).
  static std::string render(int64_t done, int64_t total, double seconds, int width = 30);

 private:
  void draw();

  int64_t total_ = 0;
  int64_t done_ = 0;
  bool active_ = false;
  double start_s_ = 0.0;
  double last_draw_s_ = -1.0;
};

}  // namespace kvpipe
