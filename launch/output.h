// Checked output: what a command produces reaches its destination, or the command fails
// loudly, naming the output. A full disk, a closed pipe or /dev/full must never end in
// exit 0 with results missing.
//
// LineOutput writes each line with one write(2) of the whole line, straight to the file
// descriptor: nothing waits in a user-space buffer when the process is stopped or killed,
// and a reader of the stream (a user's `tail -f`, or mpirun forwarding a rank's stdout)
// only ever gets whole lines from us. A write that fails throws JobFailure; a path that
// cannot be opened is bad input (std::invalid_argument naming the option and the path).
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace kvpipe {

// The job ran but did not deliver everything it should have: a result that could not be
// written, a request that failed. The command prints `kvpipe: error: LINE` for every line
// of what() and exits 1; unlike an internal error, the message is for the user.
class JobFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class LineOutput {
 public:
  // Standard output. `what` says what the lines are, for messages ("results").
  static LineOutput standard_output(const std::string& what);
  // Creates or truncates `path` (the value of `option`); std::invalid_argument naming both
  // when it cannot be opened for writing.
  static LineOutput open_file(const std::string& path, const std::string& option, const std::string& what);

  LineOutput(LineOutput&& other) noexcept;
  LineOutput& operator=(LineOutput&& other) noexcept;
  LineOutput(const LineOutput&) = delete;
  LineOutput& operator=(const LineOutput&) = delete;
  ~LineOutput();

  // Writes `line` and a newline in one write. JobFailure naming the output when any of it
  // could not be written.
  void write_line(std::string_view line);
  // Closes a file this opened, checking the close too (a network file system may report a
  // lost write only there). Standard output stays open.
  void close();
  // "stdout", or "--output FILE".
  const std::string& name() const { return name_; }

 private:
  LineOutput(int fd, bool owned, std::string name, std::string what);
  [[noreturn]] void fail(int error) const;

  int fd_ = -1;
  bool owned_ = false;
  std::string name_;
  std::string what_;
};

// Writes all of [data, data + size) to `fd`, resuming after signals and partial writes and
// waiting while a non-blocking descriptor is full. False with errno set on failure.
bool write_all(int fd, const char* data, size_t size);

// Flushes std::cout and C's stdout; JobFailure "cannot write WHAT to stdout: REASON" when
// anything written to them so far was lost.
void flush_stdout(const std::string& what);

// The same check for the end of a command: true when std::cout and C's stdout flushed
// cleanly; otherwise false with the reason in `reason`.
bool stdout_flushed(std::string& reason);

// Writes `text` into `path` (created or truncated), checking every byte and the close.
// std::invalid_argument naming `option` and the path when it cannot be opened; JobFailure
// naming the path when a write fails.
void write_text_file(const std::string& path, std::string_view text, const std::string& option,
                     const std::string& what);

}  // namespace kvpipe
