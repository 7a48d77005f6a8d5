#include "launch/output.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <utility>

namespace kvpipe {
namespace {

// O_NONBLOCK so that a FIFO nobody reads is refused (ENXIO) instead of hanging the job
// before it starts; the descriptor blocks again afterwards, as a file or a pipe should.
int open_for_writing(const std::string& path, const std::string& option) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NONBLOCK, 0644);
  if (fd < 0) {
    const int error = errno;
    throw std::invalid_argument(option + " " + path + ": cannot open for writing: " +
                                (error == ENXIO ? std::string("a FIFO with no reader") : std::strerror(error)));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

}  // namespace

bool write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n > 0) {
      data += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;  // a stop signal: the line still goes out whole
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, -1) < 0 && errno != EINTR) return false;
      continue;
    }
    if (n == 0) errno = EIO;
    return false;
  }
  return true;
}

LineOutput::LineOutput(int fd, bool owned, std::string name, std::string what)
    : fd_(fd), owned_(owned), name_(std::move(name)), what_(std::move(what)) {}

LineOutput LineOutput::standard_output(const std::string& what) {
  // Whatever went through std::cout before stays in front of our lines.
  std::cout.flush();
  std::fflush(stdout);
  return LineOutput(STDOUT_FILENO, false, "stdout", what);
}

LineOutput LineOutput::open_file(const std::string& path, const std::string& option, const std::string& what) {
  return LineOutput(open_for_writing(path, option), true, option + " " + path, what);
}

LineOutput::LineOutput(LineOutput&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      owned_(std::exchange(other.owned_, false)),
      name_(std::move(other.name_)),
      what_(std::move(other.what_)) {}

LineOutput& LineOutput::operator=(LineOutput&& other) noexcept {
  if (this != &other) {
    if (owned_ && fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    owned_ = std::exchange(other.owned_, false);
    name_ = std::move(other.name_);
    what_ = std::move(other.what_);
  }
  return *this;
}

LineOutput::~LineOutput() {
  if (owned_ && fd_ >= 0) ::close(fd_);
}

void LineOutput::fail(int error) const {
  throw JobFailure("cannot write " + what_ + " to " + name_ + ": " + std::strerror(error));
}

void LineOutput::write_line(std::string_view line) {
  std::string whole;
  whole.reserve(line.size() + 1);
  whole.append(line);
  whole.push_back('\n');
  if (!write_all(fd_, whole.data(), whole.size())) fail(errno);
}

void LineOutput::close() {
  if (!owned_ || fd_ < 0) return;
  const int fd = std::exchange(fd_, -1);
  owned_ = false;
  if (::close(fd) != 0 && errno != EINTR) fail(errno);
}

bool stdout_flushed(std::string& reason) {
  errno = 0;
  std::cout.flush();
  int error = errno;
  const bool stream_ok = static_cast<bool>(std::cout);
  if (std::fflush(stdout) != 0 && error == 0) error = errno;
  if (stream_ok && !std::ferror(stdout)) return true;
  reason = error ? std::strerror(error) : "a write failed";
  // Reported once: the exit-time flush must not find the same error again.
  std::clearerr(stdout);
  std::cout.clear();
  return false;
}

void flush_stdout(const std::string& what) {
  std::string reason;
  if (!stdout_flushed(reason)) throw JobFailure("cannot write " + what + " to stdout: " + reason);
}

void write_text_file(const std::string& path, std::string_view text, const std::string& option,
                     const std::string& what) {
  const int fd = open_for_writing(path, option);
  const bool written = write_all(fd, text.data(), text.size());
  int error = errno;
  const bool closed = ::close(fd) == 0 || errno == EINTR;
  if (written && !closed) error = errno;
  if (!written || !closed) throw JobFailure("cannot write " + what + " to " + path + ": " + std::strerror(error));
}

}  // namespace kvpipe
