#include "train/http_endpoint.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/log.h"

namespace dstrain {
namespace {

using Clock = std::chrono::steady_clock;

struct Connection {
  int fd = -1;
  enum class Stage { Reading, Writing, Draining } stage = Stage::Reading;
  std::string in, out;
  size_t sent = 0;
  Clock::time_point opened, deadline;
};

std::string response(int code, const char* reason, const std::string& content_type, const std::string& body,
                     bool head, const char* extra_headers = "") {
  return fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{}Connection: close\r\n\r\n{}",
                     code, reason, content_type, body.size(), extra_headers, head ? "" : body);
}

}  // namespace

HttpEndpoint::HttpEndpoint(const std::string& address, int port, std::string path, std::string content_type,
                           std::function<std::string()> body, HttpEndpointLimits limits)
    : address_(address), path_(std::move(path)), content_type_(std::move(content_type)), body_(std::move(body)),
      limits_(limits) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int gai = ::getaddrinfo(address.c_str(), service.c_str(), &hints, &found);
  if (gai != 0) {
    throw Error(fmt::format("cannot listen on {}:{}: the address does not resolve ({}); give an IP address such as "
                            "127.0.0.1 or 0.0.0.0",
                            address, port, ::gai_strerror(gai)));
  }
  std::string why;
  for (addrinfo* a = found; a && listen_fd_ < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 64) == 0) {
      listen_fd_ = fd;
    } else {
      why = std::strerror(errno);
      ::close(fd);
    }
  }
  ::freeaddrinfo(found);
  if (listen_fd_ < 0) {
    throw Error(fmt::format("cannot listen on {}:{} ({}): the port is in use or not allowed", address, port,
                            why.empty() ? "no usable address" : why));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  port_ = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                      : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  if (::pipe2(wake_fd_, O_CLOEXEC | O_NONBLOCK) != 0) {
    ::close(listen_fd_);
    throw Error(fmt::format("cannot start the HTTP endpoint: pipe2 failed: {}", std::strerror(errno)));
  }
  thread_ = std::thread([this] { serve(); });
}

HttpEndpoint::~HttpEndpoint() {
  const char byte = 1;
  if (::write(wake_fd_[1], &byte, 1) < 0) {
    // The pipe cannot be full (one byte is ever written): nothing to do but join.
  }
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
  ::close(wake_fd_[0]);
  ::close(wake_fd_[1]);
}

void HttpEndpoint::serve() {
  std::vector<Connection> conns;
  auto close_conn = [](Connection& c) {
    ::close(c.fd);
    c.fd = -1;
  };
  // The answer to a complete request head; the body (if any) is never read.
  auto answer = [&](Connection& c) {
    const size_t eol = c.in.find_first_of("\r\n");
    const std::string line = c.in.substr(0, eol);
    const size_t sp1 = line.find(' '), sp2 = line.rfind(' ');
    if (sp1 == std::string::npos || sp2 == sp1 || line.compare(sp2 + 1, 5, "HTTP/") != 0) {
      return response(400, "Bad Request", "text/plain", "bad request line\n", false);
    }
    const std::string method = line.substr(0, sp1);
    std::string target = line.substr(sp1 + 1, sp2 - sp1 - 1);
    target = target.substr(0, target.find('?'));
    const bool head = method == "HEAD";
    if (method != "GET" && !head) {
      return response(405, "Method Not Allowed", "text/plain", "only GET and HEAD\n", false, "Allow: GET, HEAD\r\n");
    }
    if (target != path_) return response(404, "Not Found", "text/plain", "try " + path_ + "\n", head);
    try {
      return response(200, "OK", content_type_, body_(), head);
    } catch (const std::exception& e) {
      return response(500, "Internal Server Error", "text/plain", std::string(e.what()) + "\n", head);
    }
  };
  auto start_writing = [&](Connection& c, std::string out) {
    c.stage = Connection::Stage::Writing;
    c.out = std::move(out);
    c.sent = 0;
    c.deadline = Clock::now() + limits_.response_timeout;
  };
  // Done sending: no more writes, and what the client still sends (an unread body) is drained
  // for a moment, so that closing does not reset the connection before the response is read.
  auto finish = [&](Connection& c) {
    ::shutdown(c.fd, SHUT_WR);
    c.stage = Connection::Stage::Draining;
    c.deadline = Clock::now() + std::chrono::milliseconds(500);
  };

  std::vector<pollfd> fds;
  while (true) {
    conns.erase(std::remove_if(conns.begin(), conns.end(), [](const Connection& c) { return c.fd < 0; }),
                conns.end());
    fds.assign({{wake_fd_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}});
    auto now = Clock::now();
    auto next = now + std::chrono::seconds(1);
    for (const Connection& c : conns) {
      fds.push_back({c.fd, short(c.stage == Connection::Stage::Writing ? POLLOUT : POLLIN), 0});
      next = std::min(next, c.deadline);
    }
    const int timeout_ms =
        int(std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1));
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
      log::warn("metrics endpoint: poll failed ({}); the endpoint stops", std::strerror(errno));
      break;
    }
    if (fds[0].revents) break;  // the destructor's wake-up
    now = Clock::now();
    for (size_t i = 0; i < conns.size(); ++i) {
      Connection& c = conns[i];
      const short ev = fds[i + 2].revents;
      if (c.fd < 0) continue;
      if (ev & (POLLERR | POLLNVAL)) {
        close_conn(c);
        continue;
      }
      if (c.stage == Connection::Stage::Reading && (ev & (POLLIN | POLLHUP))) {
        char buf[4096];
        const ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          close_conn(c);
          continue;
        }
        if (n > 0) c.in.append(buf, size_t(n));
        if (c.in.find("\r\n\r\n") != std::string::npos || c.in.find("\n\n") != std::string::npos) {
          start_writing(c, answer(c));
        } else if (int64_t(c.in.size()) > limits_.max_request_head_bytes) {
          start_writing(c, response(431, "Request Header Fields Too Large", "text/plain", "request head too long\n",
                                    false));
        }
      } else if (c.stage == Connection::Stage::Writing && (ev & POLLOUT)) {
        const ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          close_conn(c);
          continue;
        }
        if (n > 0) c.sent += size_t(n);
        if (c.sent == c.out.size()) finish(c);
      } else if (c.stage == Connection::Stage::Draining && (ev & (POLLIN | POLLHUP))) {
        char buf[4096];
        const ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
        if (n <= 0 && !(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))) close_conn(c);
      }
      if (c.fd >= 0 && now >= c.deadline) close_conn(c);  // too slow to ask, or to take the answer
    }
    if (fds[1].revents & POLLIN) {
      while (true) {
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;  // EAGAIN: none left (or a transient error: the next poll retries)
        std::erase_if(conns, [](const Connection& c) { return c.fd < 0; });
        if (int(conns.size()) >= limits_.max_connections) {
          // Full: the oldest connection that has not finished asking gives way (a client that
          // opens connections and sends nothing cannot starve a scrape), else the oldest.
          auto victim = std::min_element(conns.begin(), conns.end(), [](const Connection& a, const Connection& b) {
            const bool ar = a.stage == Connection::Stage::Reading, br = b.stage == Connection::Stage::Reading;
            return ar != br ? ar : a.opened < b.opened;
          });
          close_conn(*victim);
          conns.erase(victim);
        }
        Connection c;
        c.fd = fd;
        c.opened = Clock::now();
        c.deadline = c.opened + limits_.request_timeout;
        conns.push_back(std::move(c));
      }
    }
  }
  for (Connection& c : conns) {
    if (c.fd >= 0) ::close(c.fd);
  }
}

}  // namespace dstrain
