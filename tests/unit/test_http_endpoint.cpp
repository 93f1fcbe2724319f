// The Prometheus endpoint's server (train/http_endpoint.h) against clients that misbehave:
// connections that never ask, bodies that never come, lengths that lie. A scrape gets through
// at once whatever they do.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "core/error.h"
#include "train/http_endpoint.h"

namespace dstrain {
namespace {

using Clock = std::chrono::steady_clock;

int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << std::strerror(errno);
  return fd;
}

// Sends `request` on a new connection and reads until the server closes it (or `limit` passes).
std::string exchange(int port, const std::string& request, std::chrono::milliseconds limit = std::chrono::seconds(5)) {
  const int fd = connect_to(port);
  if (!request.empty()) {
    EXPECT_EQ(::send(fd, request.data(), request.size(), MSG_NOSIGNAL), ssize_t(request.size()));
  }
  std::string out;
  const auto end = Clock::now() + limit;
  while (Clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, size_t(n));
  }
  ::close(fd);
  return out;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

TEST(HttpEndpoint, ServesThePathAndRefusesTheRest) {
  std::atomic<int> calls{0};
  HttpEndpoint e("127.0.0.1", 0, "/metrics", "text/plain; version=0.0.4", [&] {
    ++calls;
    return std::string("dstrain_step 7\n");
  });
  ASSERT_GT(e.port(), 0);
  std::string r = exchange(e.port(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << r;
  EXPECT_NE(r.find("Content-Type: text/plain; version=0.0.4\r\n"), std::string::npos) << r;
  EXPECT_NE(r.find("Content-Length: 15\r\n"), std::string::npos) << r;
  EXPECT_NE(r.find("\r\n\r\ndstrain_step 7\n"), std::string::npos) << r;
  r = exchange(e.port(), "GET /metrics?x=1 HTTP/1.0\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 200 OK", 0), 0u) << r;
  r = exchange(e.port(), "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 200 OK", 0), 0u) << r;
  EXPECT_EQ(r.find("dstrain_step"), std::string::npos) << "a HEAD response has no body";
  EXPECT_EQ(exchange(e.port(), "GET / HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 404", 0), 0u);
  EXPECT_EQ(exchange(e.port(), "garbage\r\n\r\n").rfind("HTTP/1.1 400", 0), 0u);
  EXPECT_EQ(exchange(e.port(), "GET /metrics HTTP/1.1\r\nX: " + std::string(20000, 'a')).rfind("HTTP/1.1 431", 0), 0u);
  EXPECT_EQ(calls.load(), 3);
}

// A body is never waited for: whatever Content-Length says (none, negative, huge), any method
// but GET and HEAD is answered 405 at once, and the connection closed.
TEST(HttpEndpoint, RequestsWithBodiesAreAnsweredAtOnce) {
  HttpEndpoint e("127.0.0.1", 0, "/metrics", "text/plain", [] { return std::string("x\n"); });
  for (const char* req : {"PUT /metrics HTTP/1.1\r\n\r\n", "PUT /metrics HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                          "POST /metrics HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\nabc",
                          "PUT /metrics HTTP/1.1\r\nContent-Length: 1000000\r\n\r\n"}) {
    SCOPED_TRACE(req);
    const auto t0 = Clock::now();
    const std::string r = exchange(e.port(), req);
    EXPECT_LT(seconds_since(t0), 1.0);
    EXPECT_EQ(r.rfind("HTTP/1.1 405 Method Not Allowed\r\n", 0), 0u) << r;
    EXPECT_NE(r.find("Allow: GET, HEAD\r\n"), std::string::npos) << r;
  }
}

// 64 connections that never send a byte (a slow or hostile client) hold no scrape back.
TEST(HttpEndpoint, HalfOpenConnectionsDoNotStarveAScrape) {
  HttpEndpoint e("127.0.0.1", 0, "/metrics", "text/plain", [] { return std::string("dstrain_step 1\n"); });
  std::vector<int> idle;
  for (int i = 0; i < 64; ++i) idle.push_back(connect_to(e.port()));
  for (int round = 0; round < 3; ++round) {
    const auto t0 = Clock::now();
    const std::string r = exchange(e.port(), "GET /metrics HTTP/1.1\r\n\r\n");
    EXPECT_EQ(r.rfind("HTTP/1.1 200 OK", 0), 0u) << r;
    EXPECT_LT(seconds_since(t0), 1.0) << "round " << round;
  }
  // A client that sends half a request and stops is dropped at its deadline.
  HttpEndpointLimits quick;
  quick.request_timeout = std::chrono::milliseconds(200);
  HttpEndpoint f("127.0.0.1", 0, "/metrics", "text/plain", [] { return std::string("x\n"); }, quick);
  const auto t0 = Clock::now();
  const std::string r = exchange(f.port(), "GET /metr", std::chrono::seconds(5));
  EXPECT_TRUE(r.empty()) << r;
  EXPECT_LT(seconds_since(t0), 2.0);
  for (int fd : idle) ::close(fd);
}

TEST(HttpEndpoint, AnAddressInUseOrUnknownIsAnErrorNamingIt) {
  HttpEndpoint e("127.0.0.1", 0, "/metrics", "text/plain", [] { return std::string(); });
  try {
    HttpEndpoint again("127.0.0.1", e.port(), "/metrics", "text/plain", [] { return std::string(); });
    ADD_FAILURE() << "a second endpoint bound the same port";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("cannot listen on 127.0.0.1:" + std::to_string(e.port())),
              std::string::npos)
        << err.what();
  }
  try {
    HttpEndpoint bad("no-such-host.invalid", 0, "/metrics", "text/plain", [] { return std::string(); });
    ADD_FAILURE() << "an unknown host was bound";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("no-such-host.invalid"), std::string::npos) << err.what();
  }
}

}  // namespace
}  // namespace dstrain
