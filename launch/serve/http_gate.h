// HttpGate: where `kvpipe serve` holds its HTTP connections between requests, without a
// thread each.
//
// cpp-httplib (0.11) gives every connection a thread of its pool from accept to close, and
// bounds only each read, so a few hundred clients that send nothing, or a header a byte at a
// time, hold every thread and /health stops answering. Here the accept thread hands each new
// connection to the gate: one thread waits on all of them (epoll) until a connection has a
// whole request header (peeked, not read), and only then gives it to a worker of the pool,
// which serves that one request through cpp-httplib and hands the connection back to the
// gate to wait for its next one (keep-alive). No packaged library does this for cpp-httplib;
// it is kvpipe's own.
// Guarantees: a request's header must arrive whole within `header_timeout_s` of its first
// byte (a new connection's: of its accept), or the connection gets 408 and is closed; a
// header larger than `max_header_bytes` gets 431; a kept-alive connection that sends nothing
// for `keep_alive_timeout_s` is closed silently; beyond `max_connections` waiting, a new
// connection gets 503. Connections in the gate cost a file descriptor and no thread, so
// /health and real requests keep answering under such loads. Closed connections are read
// out before they close, so the client reads the status rather than a reset.
#pragma once

#include <httplib.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace kvpipe {

struct HttpGateOptions {
  double header_timeout_s = 10.0;
  double keep_alive_timeout_s = 5.0;
  size_t max_header_bytes = 16 * 1024;
  size_t max_connections = 16384;
  // The body of an error response the gate writes (status, message), JSON as the server's.
  std::function<std::string(int, const std::string&)> error_body;
};

class HttpGate {
 public:
  // `dispatch(fd, header_bytes)` gets a connection whose request header (its first
  // `header_bytes` bytes, still unread) has arrived; it owns the connection from then on.
  HttpGate(HttpGateOptions options, std::function<void(int, size_t)> dispatch);
  ~HttpGate();
  HttpGate(const HttpGate&) = delete;
  HttpGate& operator=(const HttpGate&) = delete;

  // Takes `fd` (a connected socket) to wait for its next request; `kept_alive`: it has
  // served one already. After stop(), the connection is closed at once.
  void admit(int fd, bool kept_alive);
  // Closes every connection that waits and ends the gate's thread.
  void stop();
  // Connections waiting now.
  size_t waiting() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Waiting {
    Clock::time_point since;  // accept, or the end of the previous request
    bool kept_alive = false;
    bool started = false;  // a byte of the next request has arrived
    Clock::time_point deadline;
  };
  void run();
  void look(int fd);  // what arrived on `fd`
  void expire(Clock::time_point now);
  void refuse(int fd, int status, const std::string& message);  // writes, drains, closes
  void forget(int fd);  // out of epoll and the table (the caller closes or dispatches)

  HttpGateOptions options_;
  std::function<void(int, size_t)> dispatch_;
  std::vector<char> peeked_;  // the gate thread's buffer for what a connection sent
  int epoll_ = -1;
  int wake_ = -1;  // eventfd: stop()
  mutable std::mutex mutex_;
  std::unordered_map<int, Waiting> waiting_;
  bool stopped_ = false;
  std::thread thread_;
};

// The socket of the request this thread serves (a worker of GatedServer inside a handler),
// or -1: handlers use it to notice a client that went away.
int current_connection_socket();

// A cpp-httplib server whose connections wait in an HttpGate between requests, served by a
// pool of `threads` workers. Set its handlers and timeouts as a httplib::Server's; bind and
// listen_after_bind() as usual; after stop() and the listening thread's end, finish().
class GatedServer final : public httplib::Server {
 public:
  GatedServer(HttpGateOptions options, size_t threads);
  ~GatedServer() override;
  // Closes the connections that wait and lets the requests that run end (joins the workers).
  void finish();

 private:
  bool process_and_close_socket(socket_t sock) override;
  void serve(int fd, size_t header_bytes);

  std::unique_ptr<HttpGate> gate_;
  std::unique_ptr<httplib::ThreadPool> workers_;
  std::once_flag finished_;
};

}  // namespace kvpipe
