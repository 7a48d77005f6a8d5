#include "launch/serve/http_gate.h"

#include <netdb.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace kvpipe {
namespace {

thread_local int serving_socket = -1;

const char* reason_phrase(int status) {
  switch (status) {
    case 408: return "Request Timeout";
    case 431: return "Request Header Fields Too Large";
    case 503: return "Service Unavailable";
    default: return "Error";
  }
}

// Where the request header that `bytes` start with ends (one past its empty line), or 0.
size_t header_end(const char* bytes, size_t n) {
  static const char kEnd[] = "\r\n\r\n";
  const char* at = std::search(bytes, bytes + n, kEnd, kEnd + 4);
  return at == bytes + n ? 0 : static_cast<size_t>(at - bytes) + 4;
}

std::chrono::steady_clock::duration seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}

// A connection the gate handed over: its header is read in one call (the gate saw it
// arrive), and nothing past what cpp-httplib asks for is read, so the bytes of a next
// request stay in the socket for the gate to wait on.
class GateStream final : public httplib::Stream {
 public:
  GateStream(int fd, size_t header_bytes, time_t read_timeout_s, time_t write_timeout_s)
      : fd_(fd), read_timeout_ms_(static_cast<int>(read_timeout_s * 1000)),
        write_timeout_ms_(static_cast<int>(write_timeout_s * 1000)) {
    header_.resize(header_bytes);
    size_t got = 0;
    while (got < header_bytes) {
      const ssize_t n = ::recv(fd_, &header_[got], header_bytes - got, MSG_DONTWAIT);
      if (n > 0) got += static_cast<size_t>(n);
      else if (n < 0 && errno == EINTR) continue;
      else break;  // peeked bytes are there; anything else is a connection that failed
    }
    header_.resize(got);
  }

  bool is_readable() const override { return at_ < header_.size() || wait(POLLIN, read_timeout_ms_); }
  bool is_writable() const override { return wait(POLLOUT, write_timeout_ms_); }

  ssize_t read(char* ptr, size_t size) override {
    if (at_ < header_.size()) {
      const size_t n = std::min(size, header_.size() - at_);
      std::memcpy(ptr, header_.data() + at_, n);
      at_ += n;
      return static_cast<ssize_t>(n);
    }
    if (!wait(POLLIN, read_timeout_ms_)) return -1;
    for (;;) {
      const ssize_t n = ::recv(fd_, ptr, size, 0);
      if (n < 0 && errno == EINTR) continue;
      return n;
    }
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (!wait(POLLOUT, write_timeout_ms_)) return -1;
    for (;;) {
      const ssize_t n = ::send(fd_, ptr, size, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      return n;
    }
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { address(true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address(false, ip, port); }
  socket_t socket() const override { return fd_; }

 private:
  bool wait(short events, int timeout_ms) const {
    pollfd p{fd_, events, 0};
    for (;;) {
      const int r = ::poll(&p, 1, timeout_ms);
      if (r < 0 && errno == EINTR) continue;
      return r > 0 && (p.revents & events) != 0;
    }
  }

  void address(bool peer, std::string& ip, int& port) const {
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    const int r = peer ? ::getpeername(fd_, reinterpret_cast<sockaddr*>(&addr), &len)
                       : ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    char host[NI_MAXHOST] = "", serv[NI_MAXSERV] = "0";
    if (r == 0) ::getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof host, serv, sizeof serv,
                              NI_NUMERICHOST | NI_NUMERICSERV);
    ip = host;
    port = std::atoi(serv);
  }

  int fd_;
  int read_timeout_ms_, write_timeout_ms_;
  std::string header_;
  size_t at_ = 0;
};

// The accept loop's queue: runs each task on the accept thread, which only hands the
// connection to the gate.
class InlineQueue final : public httplib::TaskQueue {
 public:
  void enqueue(std::function<void()> fn) override { fn(); }
  void shutdown() override {}
};

void close_connection(int fd) {
  ::shutdown(fd, SHUT_RDWR);
  ::close(fd);
}

}  // namespace

int current_connection_socket() { return serving_socket; }

HttpGate::HttpGate(HttpGateOptions options, std::function<void(int, size_t)> dispatch)
    : options_(std::move(options)), dispatch_(std::move(dispatch)) {
  epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
  wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (epoll_ < 0 || wake_ < 0) throw std::runtime_error(std::string("HTTP gate: ") + std::strerror(errno));
  epoll_event e{};
  e.events = EPOLLIN;
  e.data.fd = wake_;
  ::epoll_ctl(epoll_, EPOLL_CTL_ADD, wake_, &e);
  thread_ = std::thread([this] { run(); });
}

HttpGate::~HttpGate() {
  stop();
  ::close(wake_);
  ::close(epoll_);
}

void HttpGate::admit(int fd, bool kept_alive) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (stopped_) {
    lock.unlock();
    close_connection(fd);
    return;
  }
  if (waiting_.size() >= options_.max_connections) {
    lock.unlock();
    refuse(fd, 503, "Too many open connections");
    return;
  }
  const Clock::time_point now = Clock::now();
  Waiting& w = waiting_[fd];
  w = Waiting{now, kept_alive, false,
              now + seconds(kept_alive ? options_.keep_alive_timeout_s : options_.header_timeout_s)};
  epoll_event e{};
  // Edge-triggered: the bytes are only peeked, so a level-triggered wait would fire again at
  // once for a header still incomplete; each new arrival fires once.
  e.events = EPOLLIN | EPOLLRDHUP | EPOLLET;
  e.data.fd = fd;
  if (::epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &e) != 0) {
    waiting_.erase(fd);
    lock.unlock();
    close_connection(fd);
  }
}

void HttpGate::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) return;
    stopped_ = true;
  }
  const uint64_t one = 1;
  (void)!::write(wake_, &one, sizeof one);
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [fd, w] : waiting_) close_connection(fd);
  waiting_.clear();
}

size_t HttpGate::waiting() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return waiting_.size();
}

void HttpGate::forget(int fd) {
  ::epoll_ctl(epoll_, EPOLL_CTL_DEL, fd, nullptr);
  waiting_.erase(fd);
}

void HttpGate::refuse(int fd, int status, const std::string& message) {
  const std::string body = options_.error_body ? options_.error_body(status, message) : message;
  const std::string response = "HTTP/1.1 " + std::to_string(status) + " " + reason_phrase(status) +
                               "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
                               "\r\nConnection: close\r\n\r\n" + body;
  (void)!::send(fd, response.data(), response.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  // Unread bytes at close() would reset the connection, and the client could lose the
  // answer: read out what came (bounded), then close the sending side first.
  char sink[16384];
  for (int i = 0; i < 64 && ::recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; ++i) {
  }
  ::shutdown(fd, SHUT_WR);
  ::close(fd);
}

void HttpGate::look(int fd) {
  std::vector<char>& bytes = peeked_;
  bytes.resize(options_.max_header_bytes + 1);
  ssize_t n;
  do n = ::recv(fd, bytes.data(), bytes.size(), MSG_PEEK | MSG_DONTWAIT);
  while (n < 0 && errno == EINTR);
  std::unique_lock<std::mutex> lock(mutex_);
  const auto it = waiting_.find(fd);
  if (it == waiting_.end()) return;
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {  // the client left
    forget(fd);
    lock.unlock();
    close_connection(fd);
    return;
  }
  if (n < 0) return;
  Waiting& w = it->second;
  if (!w.started) {
    // A kept-alive connection's next request has begun: its header now has its own time.
    w.started = true;
    if (w.kept_alive) w.deadline = Clock::now() + seconds(options_.header_timeout_s);
  }
  const size_t end = header_end(bytes.data(), static_cast<size_t>(n));
  if (end > 0) {
    forget(fd);
    lock.unlock();
    dispatch_(fd, end);
  } else if (static_cast<size_t>(n) > options_.max_header_bytes) {
    forget(fd);
    lock.unlock();
    refuse(fd, 431, "The request header is larger than " + std::to_string(options_.max_header_bytes) + " bytes");
  }
}

void HttpGate::expire(Clock::time_point now) {
  std::vector<std::pair<int, bool>> late;  // fd, answer 408
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [fd, w] : waiting_)
      if (now >= w.deadline) late.emplace_back(fd, w.started || !w.kept_alive);
    for (const auto& [fd, answer] : late) forget(fd);
  }
  for (const auto& [fd, answer] : late) {
    if (answer) refuse(fd, 408, "The request header did not arrive whole within the server's header timeout");
    else close_connection(fd);
  }
}

void HttpGate::run() {
  constexpr int kMaxEvents = 256;
  epoll_event events[kMaxEvents];
  Clock::time_point next_expiry = Clock::now();
  for (;;) {
    const int n = ::epoll_wait(epoll_, events, kMaxEvents, 50);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopped_) return;
    }
    for (int i = 0; i < n; ++i)
      if (events[i].data.fd != wake_) look(events[i].data.fd);
    const Clock::time_point now = Clock::now();
    if (now >= next_expiry) {
      expire(now);
      next_expiry = now + std::chrono::milliseconds(50);
    }
  }
}

GatedServer::GatedServer(HttpGateOptions options, size_t threads) {
  // Every waiting connection holds a descriptor: take what the hard limit allows.
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &files);
  }
  workers_ = std::make_unique<httplib::ThreadPool>(threads);
  gate_ = std::make_unique<HttpGate>(std::move(options), [this](int fd, size_t header_bytes) {
    workers_->enqueue([this, fd, header_bytes] { serve(fd, header_bytes); });
  });
  new_task_queue = [] { return new InlineQueue; };
}

GatedServer::~GatedServer() { finish(); }

void GatedServer::finish() {
  std::call_once(finished_, [this] {
    gate_->stop();
    workers_->shutdown();
  });
}

bool GatedServer::process_and_close_socket(socket_t sock) {
  gate_->admit(sock, false);
  return true;
}

void GatedServer::serve(int fd, size_t header_bytes) {
  GateStream stream(fd, header_bytes, read_timeout_sec_, write_timeout_sec_);
  bool closed = false;
  serving_socket = fd;
  const bool ok = process_request(stream, false, closed, nullptr);
  serving_socket = -1;
  if (!ok || closed || !is_running()) {
    close_connection(fd);
    return;
  }
  gate_->admit(fd, true);
}

}  // namespace kvpipe
