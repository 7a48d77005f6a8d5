#include "launch/serve/serve_http.h"

#include "launch/model_text.h"
#include "launch/serve/http_gate.h"

#include <httplib.h>

#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <thread>

namespace kvpipe {

extern const char* const kServePage;  // launch/serve/serve_page.html, embedded at build time

namespace {

constexpr auto kStreamHeartbeat = std::chrono::milliseconds(1000);

// How often a non-streaming request looks whether its client is still there.
constexpr auto kClientCheck = std::chrono::milliseconds(200);

// The client closed its connection (or reset it): a read finds its end. A client that is
// still there has sent nothing more, or its next request (either way it has not left).
bool client_left(int fd) {
  char c;
  const ssize_t n = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

std::string status_message(int status, const httplib::Request& req, size_t max_body) {
  switch (status) {
    case 404: return "Not found: " + req.method + " " + req.path;
    case 405: return "Method not allowed: " + req.method + " " + req.path;
    case 413: return "The request body is larger than " + std::to_string(max_body) + " bytes";
    default: return "HTTP error " + std::to_string(status);
  }
}

}  // namespace

struct HttpFrontEnd::Impl {
  HttpOptions options;
  const ServedModel& model;
  ServeQueue& queue;
  ServeMetrics& metrics;
  std::unique_ptr<GatedServer> gated;
  GatedServer& server;
  std::thread listener;
  std::atomic<bool> ready{false};
  int listen_socket = -1;
  int port = 0;
  // /v1/models' `created`: when the server started; a response's is when its request came.
  int64_t created = unix_seconds();
  std::mutex seed_mutex;
  std::mt19937_64 seeds{std::random_device{}()};

  static int64_t unix_seconds() {
    return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  }

  Impl(const HttpOptions& o, const ServedModel& m, ServeQueue& q, ServeMetrics& mt)
      : options(o), model(m), queue(q), metrics(mt), gated(make_server(o)), server(*gated) {}

  static std::unique_ptr<GatedServer> make_server(const HttpOptions& o) {
    HttpGateOptions g;
    g.header_timeout_s = o.header_timeout_s;
    g.keep_alive_timeout_s = 5.0;  // what clients such as httpx keep idle connections
    g.error_body = [](int status, const std::string& message) { return error_body(status, message, "", ""); };
    return std::make_unique<GatedServer>(std::move(g), static_cast<size_t>(o.threads));
  }

  uint64_t fresh_seed() {
    std::lock_guard<std::mutex> lock(seed_mutex);
    return seeds();
  }

  static void reply_error(httplib::Response& res, int status, const std::string& message, const std::string& param = "",
                          const std::string& code = "") {
    res.status = status;
    res.set_content(error_body(status, message, param, code), "application/json");
  }

  bool authorized(const httplib::Request& req, httplib::Response& res) const {
    if (options.api_key.empty()) return true;
    if (req.get_header_value("Authorization") == "Bearer " + options.api_key) return true;
    reply_error(res, 401, "Incorrect or missing API key: send the header Authorization: Bearer KEY", "",
                "invalid_api_key");
    return false;
  }

  bool serving(httplib::Response& res) const {
    if (queue.closed()) {
      reply_error(res, 503, "The server is shutting down");
      return false;
    }
    if (!ready) {
      reply_error(res, 503, "The model is still loading");
      return false;
    }
    return true;
  }

  void completion(const httplib::Request& req, httplib::Response& res, bool chat) {
    if (!authorized(req, res) || !serving(res)) return;
    auto request = std::make_shared<const CompletionRequest>(parse_completion_request(req.body, chat, model, fresh_seed()));
    auto channel = std::make_shared<ResponseChannel>(request->choices());
    Submission s;
    s.request = request;
    s.channel = channel;
    s.arrival = std::chrono::steady_clock::now();
    switch (queue.submit(s, request->choices())) {
      case ServeQueue::Admission::kAccepted: break;
      case ServeQueue::Admission::kFull:
        return reply_error(res, 503, "The server has as many unfinished requests as it takes (--max-requests); try again later");
      case ServeQueue::Admission::kClosed: return reply_error(res, 503, "The server is shutting down");
    }
    char id[48];
    std::snprintf(id, sizeof id, "%s-%llx%08llx", chat ? "chatcmpl" : "cmpl", static_cast<unsigned long long>(s.id),
                  static_cast<unsigned long long>(fresh_seed() & 0xffffffffu));
    const Tokenizer* tokenizer = model.text ? model.text->tokenizer() : nullptr;
    auto writer = std::make_shared<ResponseWriter>(*request, id, unix_seconds(), model.name, tokenizer);
    const uint64_t submission = s.id;

    if (!request->stream) {
      // A client that leaves (or times out) before the answer ends its request, as a
      // streaming one does: nothing else would free its blocks before its last token.
      const int client = current_connection_socket();
      std::vector<ChoiceEvent> events;
      std::string error;
      for (;;) {
        events.clear();
        const bool more = channel->wait(events, kClientCheck);
        if (more && client >= 0 && client_left(client)) {
          queue.cancel(submission);
          return;
        }
        for (const ChoiceEvent& e : events) {
          if (!e.error.empty()) error = e.error;
          writer->add(e);
        }
        if (!more) break;
      }
      if (!error.empty()) return reply_error(res, 400, error);
      res.set_content(writer->response(), "application/json");
      return;
    }
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, request, channel, writer, submission](size_t, httplib::DataSink& sink) {
          auto send = [&](const std::string& data) {
            const std::string frame = "data: " + data + "\n\n";
            return sink.write(frame.data(), frame.size());
          };
          auto gone = [&] {
            queue.cancel(submission);
            return false;
          };
          if (request->chat)
            for (int i = 0; i < request->choices(); ++i)
              if (!send(writer->role_chunk(i))) return gone();
          std::vector<ChoiceEvent> events;
          for (;;) {
            events.clear();
            const bool more = channel->wait(events, kStreamHeartbeat);
            if (events.empty() && more) {
              // An SSE comment: clients ignore it; a write to a client that left fails.
              static const char kPing[] = ": ping\n\n";
              if (!sink.write(kPing, sizeof kPing - 1)) return gone();
              continue;
            }
            for (const ChoiceEvent& e : events) {
              if (!e.error.empty()) {
                if (!send(error_body(400, e.error))) return gone();
                continue;
              }
              const std::string chunk = writer->chunk(e);
              if (!chunk.empty() && !send(chunk)) return gone();
            }
            if (!more) break;
          }
          if (request->include_usage && !send(writer->usage_chunk())) return false;
          if (!send("[DONE]")) return false;
          sink.done();
          return true;
        },
        [this, submission](bool success) {
          if (!success) queue.cancel(submission);
        });
  }

  void routes() {
    server.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      if (!serving(res)) return;
      res.set_content("{\"status\":\"ok\"}", "application/json");
    });
    server.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics.render(), "text/plain; version=0.0.4; charset=utf-8");
    });
    server.Get("/", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(kServePage, "text/html; charset=utf-8");
    });
    server.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
      if (!authorized(req, res)) return;
      res.set_content(models_response(model, created), "application/json");
    });
    server.Post("/v1/completions",
                [this](const httplib::Request& req, httplib::Response& res) { completion(req, res, false); });
    server.Post("/v1/chat/completions",
                [this](const httplib::Request& req, httplib::Response& res) { completion(req, res, true); });
    server.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
      if (!authorized(req, res)) return;
      res.set_content(tokenize_response(req.body, model), "application/json");
    });
    server.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
      if (!authorized(req, res)) return;
      res.set_content(detokenize_response(req.body, model), "application/json");
    });
    server.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      try {
        std::rethrow_exception(ep);
      } catch (const ApiError& e) {
        reply_error(res, e.status, e.what(), e.param, e.code);
      } catch (const std::exception& e) {
        reply_error(res, 500, std::string("internal error: ") + e.what());
      } catch (...) {
        reply_error(res, 500, "internal error");
      }
    });
    const size_t max_body = options.max_body_bytes;
    server.set_error_handler(httplib::Server::HandlerWithResponse(
        [max_body](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
      reply_error(res, res.status, status_message(res.status, req, max_body));
      return httplib::Server::HandlerResponse::Handled;
    }));
  }
};

HttpFrontEnd::HttpFrontEnd(const HttpOptions& options, const ServedModel& model, ServeQueue& queue,
                           ServeMetrics& metrics)
    : impl_(std::make_unique<Impl>(options, model, queue, metrics)) {
  impl_->server.set_payload_max_length(options.max_body_bytes);
  // SO_REUSEADDR only: cpp-httplib's default adds SO_REUSEPORT, which lets a second server
  // bind the same port and silently take half its connections.
  Impl* impl = impl_.get();
  impl_->server.set_socket_options([impl](socket_t sock) {
    const int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    impl->listen_socket = sock;
  });
  // Between requests connections wait in the gate (http_gate.h), which bounds idle and
  // header time; these bound each read of a body and each write of a response.
  impl_->server.set_read_timeout(60);
  impl_->server.set_write_timeout(60);
  impl_->routes();
}

HttpFrontEnd::~HttpFrontEnd() { stop(); }

int HttpFrontEnd::start() {
  Impl& m = *impl_;
  int port = m.options.port;
  if (port == 0) port = m.server.bind_to_any_port(m.options.host);
  else if (!m.server.bind_to_port(m.options.host, port)) port = -1;
  if (port <= 0)
    throw std::invalid_argument("--host/--port: cannot listen on " + m.options.host + ":" +
                                std::to_string(m.options.port) + " (in use, or not an address of this machine)");
  // cpp-httplib listens with a backlog of 5: a burst of clients overflows it and their
  // connections stall for seconds. listen() again on the bound socket raises it.
  if (m.listen_socket >= 0) ::listen(m.listen_socket, SOMAXCONN);
  m.port = port;
  m.listener = std::thread([&m] { m.server.listen_after_bind(); });
  return port;
}

void HttpFrontEnd::set_ready(bool ready) { impl_->ready = ready; }

void HttpFrontEnd::stop() {
  if (!impl_->listener.joinable()) return;
  impl_->server.stop();
  impl_->listener.join();
  impl_->server.finish();
}

}  // namespace kvpipe
