// The Prometheus endpoint's HTTP server: GET (or HEAD) of one path, answered from a callback,
// on one thread that never blocks on a client. A scrape must get through whatever other
// clients do: connections are bounded (the oldest unanswered one is dropped for a new one),
// each has a deadline for its request, request bodies are never read (any method but GET and
// HEAD is answered 405 at once), and every response closes its connection.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

namespace dstrain {

struct HttpEndpointLimits {
  int max_connections = 16;                                  // open at once
  std::chrono::milliseconds request_timeout{2000};           // to send the request head
  std::chrono::milliseconds response_timeout{5000};          // to take the response
  int64_t max_request_head_bytes = 8192;                     // request line and headers
};

class HttpEndpoint {
 public:
  // Binds `address`:`port` (an IPv4 or IPv6 literal, or a host name; port 0: any free port) or
  // throws an Error naming both, then serves `path` with the text `body` returns (called on the
  // server's thread) as `content_type`.
  HttpEndpoint(const std::string& address, int port, std::string path, std::string content_type,
               std::function<std::string()> body, HttpEndpointLimits limits = {});
  ~HttpEndpoint();  // stops the thread and closes every connection
  HttpEndpoint(const HttpEndpoint&) = delete;
  HttpEndpoint& operator=(const HttpEndpoint&) = delete;

  int port() const { return port_; }  // the bound port (the chosen one for port 0)
  const std::string& address() const { return address_; }

 private:
  void serve();

  std::string address_, path_, content_type_;
  std::function<std::string()> body_;
  HttpEndpointLimits limits_;
  int listen_fd_ = -1;
  int wake_fd_[2] = {-1, -1};  // a pipe: a byte on it ends serve()
  int port_ = 0;
  std::thread thread_;
};

}  // namespace dstrain
