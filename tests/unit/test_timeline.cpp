// The schedule timeline (train/timeline.h): which steps metrics.timeline_steps records, the
// recorder's events (nested and overlapping ones, in order of start, an open one carried to a
// later step) and the JSON-lines file validation/plot_pipeline.py reads.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "core/error.h"
#include "train/metrics.h"
#include "train/timeline.h"

namespace dstrain {
namespace {

class TempFile {
 public:
  TempFile()
      : path_(std::filesystem::temp_directory_path() /
              ("dstrain_timeline_" + std::to_string(::getpid()) + "_" +
               ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".jsonl")) {}
  ~TempFile() { std::filesystem::remove(path_); }
  std::string path() const { return path_.string(); }
  std::vector<json> lines() const {
    std::ifstream in(path_);
    std::vector<json> out;
    for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
    return out;
  }

 private:
  std::filesystem::path path_;
};

TimelineSteps steps_of(const json& v) {
  const json metrics = {{"timeline_steps", v}};
  return MetricsConfig::from_json(JsonReader(metrics, "metrics", "test")).timeline_steps;
}

std::string error_of(const json& v) {
  try {
    steps_of(v);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Timeline, StepsAreOffByDefaultAnIntegerCountsAfterTheFirstStepAListNamesSteps) {
  EXPECT_FALSE(MetricsConfig{}.timeline_steps.enabled());
  EXPECT_FALSE(MetricsConfig::from_json(JsonReader(json::object(), "metrics", "test")).timeline_steps.enabled());
  EXPECT_FALSE(steps_of(0).enabled());
  EXPECT_FALSE(steps_of(json::array()).enabled());

  const TimelineSteps n = steps_of(2);
  EXPECT_TRUE(n.enabled());
  // A run from scratch (first step 1) records 2 and 3; one resumed at 10 (first step 11), 12 and 13.
  EXPECT_FALSE(n.contains(1, 1));
  EXPECT_TRUE(n.contains(2, 1));
  EXPECT_TRUE(n.contains(3, 1));
  EXPECT_FALSE(n.contains(4, 1));
  EXPECT_FALSE(n.contains(11, 11));
  EXPECT_TRUE(n.contains(12, 11));
  EXPECT_TRUE(n.contains(13, 11));
  EXPECT_FALSE(n.contains(14, 11));

  const TimelineSteps l = steps_of({5, 1, 5});
  EXPECT_TRUE(l.contains(1, 1));
  EXPECT_TRUE(l.contains(5, 3));
  EXPECT_FALSE(l.contains(2, 1));
  EXPECT_EQ(l.to_json(), json({1, 5}));
  EXPECT_EQ(n.to_json(), json(2));
  // The resolved configuration reads back as itself.
  MetricsConfig c;
  c.timeline_steps = l;
  EXPECT_EQ(MetricsConfig::from_json(JsonReader(c.to_json(), "metrics", "test")).timeline_steps.steps, l.steps);
}

TEST(Timeline, WrongTypesAndStepsBelowOneAreErrorsNamingTheKey) {
  for (const json& bad : {json("3"), json(2.5), json(true), json(-1), json({2, 0}), json({1.5}), json({{"a", 1}})}) {
    const std::string msg = error_of(bad);
    EXPECT_NE(msg.find("metrics.timeline_steps"), std::string::npos) << bad.dump() << ": " << msg;
    EXPECT_NE(msg.find("list of step numbers"), std::string::npos) << msg;
  }
  // A misspelt key is an unknown key, as every other.
  const json metrics = {{"timeline_step", 2}};
  EXPECT_THROW(MetricsConfig::from_json(JsonReader(metrics, "metrics", "test")), Error);
}

TEST(Timeline, WritesAHeaderThenEachRecordedStepsEventsInOrderOfStart) {
  TempFile f;
  TimelineSteps s;
  s.steps = {2, 3};
  {
    Timeline t(s, 1, f.path(), {{"rank", 1}, {"stages", 1}, {"micro_batches", 2}}, Clock::now());
    EXPECT_EQ(f.lines().size(), 1u);  // the header is there before any step
    for (int64_t step = 1; step <= 3; ++step) {
      for (int mb = 0; mb < 2; ++mb) {
        const Timeline::Scope fw(&t, step, ScheduleAction{ScheduleAction::Kind::Forward, mb});
      }
      for (int mb = 0; mb < 2; ++mb) {
        ScheduleAction bi{ScheduleAction::Kind::BackwardInput, mb};
        bi.chunk = 1;
        const Timeline::Scope b(&t, step, bi);
      }
      {
        const Timeline::Scope reduce(&t, "reduce", step, -1);
      }
      t.end_step(step);
      if (step == 2) {
        EXPECT_EQ(f.lines().size(), 6u);  // flushed at the end of the step
      }
    }
  }
  const std::vector<json> lines = f.lines();
  ASSERT_EQ(lines.size(), 1u + 2 * 5);
  EXPECT_EQ(lines[0]["type"], "timeline");
  EXPECT_EQ(lines[0]["version"], 1);
  EXPECT_EQ(lines[0]["rank"], 1);
  EXPECT_EQ(lines[0]["micro_batches"], 2);
  const char* kinds[] = {"F", "F", "BI", "BI", "reduce"};
  const int mbs[] = {0, 1, 0, 1, -1};
  const int chunks[] = {0, 0, 1, 1, 0};
  double last_end = 0;
  for (size_t i = 1; i < lines.size(); ++i) {
    const json& e = lines[i];
    const size_t k = (i - 1) % 5;
    EXPECT_EQ(e["step"], i <= 5 ? 2 : 3);  // step 1 was not asked for
    EXPECT_EQ(e["kind"], kinds[k]);
    EXPECT_EQ(e["micro_batch"], mbs[k]);
    EXPECT_EQ(e["chunk"], chunks[k]);
    EXPECT_EQ(e["peer"], -1);
    EXPECT_GE(e["start"].get<double>(), last_end);  // one after another, none overlapping
    EXPECT_GE(e["end"].get<double>(), e["start"].get<double>());
    last_end = e["end"].get<double>();
  }
}

TEST(Timeline, NestedAndOverlappingEventsAreEachKeptWhole) {
  TempFile f;
  TimelineSteps s;
  s.first_n = 1;
  Timeline t(s, 1, f.path(), json::object(), Clock::now());
  {
    const Timeline::Scope outer(&t, "B", 2, 0);
    const int64_t send = t.begin("send", 2, 0, 0, 3);  // overlaps the backward's end
    {
      const Timeline::Scope inner(&t, "reduce", 2, -1);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    t.end_step(2);  // the backward and the send are still open: nothing of them yet
    EXPECT_EQ(f.lines().size(), 2u);
    t.end(send);
    // What another micro-batch's receive looks like: a peer, a step not recorded.
    const Timeline::Scope ignored(&t, "recv", 3, 0, 0, 1);
  }
  t.end_step(2);
  const std::vector<json> lines = f.lines();
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[1]["kind"], "reduce");  // closed first, so written with the first flush
  EXPECT_EQ(lines[2]["kind"], "B");       // then the rest in order of start
  EXPECT_EQ(lines[3]["kind"], "send");
  EXPECT_EQ(lines[3]["peer"], 3);
  const double b0 = lines[2]["start"], b1 = lines[2]["end"], r0 = lines[1]["start"], r1 = lines[1]["end"];
  const double s0 = lines[3]["start"], s1 = lines[3]["end"];
  EXPECT_LE(b0, s0);
  EXPECT_LE(s0, r0);
  EXPECT_LE(r1, s1);
  EXPECT_LE(s1, b1);  // the scope closed after end(send)
  EXPECT_GE(r1 - r0, 0.001);
}

TEST(Timeline, ScopesAreInertWithoutATimelineOrOutsideTheStepsAndADiscardedStepLeavesNothing) {
  { const Timeline::Scope nothing(nullptr, "F", 2, 0); }
  TempFile f;
  TimelineSteps s;
  s.steps = {2};
  Timeline t(s, 1, f.path(), json::object(), Clock::now());
  EXPECT_FALSE(t.recording(1));
  EXPECT_TRUE(t.recording(2));
  { const Timeline::Scope off(&t, "F", 1, 0); }
  t.end_step(1);
  { const Timeline::Scope retried(&t, "F", 2, 0); }
  t.discard_step(2);  // the step ran out of memory and runs again
  { const Timeline::Scope again(&t, "B", 2, 0); }
  t.end_step(2);
  const std::vector<json> lines = f.lines();
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[1]["kind"], "B");
}

TEST(Timeline, KindsAndChunksOfScheduleActions) {
  EXPECT_STREQ(timeline_kind(ScheduleAction::Kind::Forward), "F");
  EXPECT_STREQ(timeline_kind(ScheduleAction::Kind::Backward), "B");
  EXPECT_STREQ(timeline_kind(ScheduleAction::Kind::BackwardInput), "BI");
  EXPECT_STREQ(timeline_kind(ScheduleAction::Kind::BackwardWeight), "BW");
  struct NoChunk {
    int micro_batch = 4;
  };
  EXPECT_EQ(chunk_of(NoChunk{}), 0);
  struct WithChunk {
    int chunk = 2;
  };
  EXPECT_EQ(chunk_of(WithChunk{}), 2);
}

TEST(Timeline, AnUnwritableFileIsAnErrorThatSaysSo) {
  TimelineSteps s;
  s.first_n = 1;
  try {
    Timeline t(s, 1, "/nonexistent-dir/timeline.rank0.jsonl", json::object(), Clock::now());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/timeline.rank0.jsonl"), std::string::npos);
  }
}

}  // namespace
}  // namespace dstrain
