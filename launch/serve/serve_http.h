// HttpFrontEnd: the HTTP side of `kvpipe serve` (cpp-httplib), on rank 0.
//
// Owns the listening socket and an explicitly sized pool of HTTP threads (each open stream
// holds one; the pool is sized so that hundreds of streams leave threads for /health). The
// threads parse and check requests (ServeProtocol), hand them to the coordinator through
// the ServeQueue and write back what their ResponseChannel receives: whole responses, or
// server-sent events. They never call MPI nor touch the engine. A client that goes away is
// noticed at the next write (tokens, or a comment line sent each second while a stream
// waits) and its request is cancelled. Between requests a connection holds no thread: it
// waits in the HttpGate (http_gate.h), which bounds its idle and header time.
#pragma once

#include "launch/serve/serve_metrics.h"
#include "launch/serve/serve_protocol.h"
#include "launch/serve/serve_queue.h"

#include <cstddef>
#include <memory>
#include <string>

namespace kvpipe {

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8000;             // 0: any free port
  std::string api_key;         // "" : no authentication
  int threads = 512;
  size_t max_body_bytes = 8u << 20;
  double header_timeout_s = 10.0;  // a request's header must arrive whole within this (else 408)
};

class HttpFrontEnd {
 public:
  HttpFrontEnd(const HttpOptions& options, const ServedModel& model, ServeQueue& queue, ServeMetrics& metrics);
  ~HttpFrontEnd();

  // Binds and starts serving (std::invalid_argument naming --host/--port when it cannot);
  // returns the port.
  int start();
  // /health answers 200 from now on (false: 503 again).
  void set_ready(bool ready);
  // Stops accepting connections and waits for the open ones to end.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvpipe
