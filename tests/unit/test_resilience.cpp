// The watchdog's deadline, the loss-spike detector and the resilience configuration.
#include <gtest/gtest.h>

#include <thread>

#include "comm/watchdog.h"
#include "core/error.h"
#include "train/resilience.h"

namespace dstrain {
namespace {

TEST(Watchdog, ReportsTheOperationPastItsDeadline) {
  Watchdog& w = Watchdog::instance();
  std::mutex m;
  std::string reported;
  w.set_on_timeout([&](const std::string& msg) {
    std::lock_guard lock(m);
    reported = msg;
  });
  w.start(0.2);
  {
    WatchScope quick("data", "all_reduce", 7);  // finishes in time: nothing reported
  }
  {
    WatchScope slow("data", "all_gather", 41);
    std::this_thread::sleep_for(std::chrono::milliseconds(700));
  }
  w.stop();
  w.set_on_timeout(nullptr);
  std::lock_guard lock(m);
  EXPECT_NE(reported.find("all_gather #41 on communicator 'data'"), std::string::npos) << reported;
  EXPECT_NE(reported.find("deadline of 0 s"), std::string::npos) << reported;
  EXPECT_NE(reported.find("exit status 76"), std::string::npos) << reported;
}

TEST(SpikeDetector, FlagsOutliersOnlyWithAFullWindow) {
  SpikeDetector d(5, 3.0);
  for (double l : {2.0, 2.1, 1.9, 2.05}) {
    EXPECT_FALSE(d.is_spike(100.0)) << "window not full yet";
    d.accept(l);
  }
  d.accept(1.95);
  EXPECT_TRUE(d.is_spike(5.0));
  EXPECT_FALSE(d.is_spike(2.2));
  EXPECT_FALSE(d.is_spike(-10.0)) << "only upward spikes are skipped";
}

TEST(ResilienceConfig, ValidatesItsKeys) {
  json j = {{"collective_timeout_s", 30}, {"fault", {{"rank", 1}, {"kill_at_step", 4}}}};
  const ResilienceConfig c = ResilienceConfig::from_json(JsonReader(j, "resilience", "test"));
  EXPECT_EQ(c.collective_timeout_s, 30);
  EXPECT_EQ(c.fault.kill_at_step, 4);
  json bad = {{"spike_window", 1}};
  EXPECT_THROW(ResilienceConfig::from_json(JsonReader(bad, "resilience", "test")), Error);
  json unknown = {{"fault", {{"rank", 0}, {"explode_at_step", 3}}}};
  EXPECT_THROW(ResilienceConfig::from_json(JsonReader(unknown, "resilience", "test")), Error);
}

}  // namespace
}  // namespace dstrain
