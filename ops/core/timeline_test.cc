// The timeline writes Chrome-trace JSON that parses, with the keys the viewers need, even before
// Close(), from several threads, and costs nothing when disabled.
#include "ops/core/timeline.h"

#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ops/core/testing.h"

namespace prophet {
namespace {

// A strict little JSON reader: enough to prove the file parses and to count what is in it.
class JsonChecker {
 public:
  explicit JsonChecker(const std::string& text) : text_(text) {}
  bool Valid() {
    SkipSpace();
    if (!Value(0)) return false;
    SkipSpace();
    return pos_ == text_.size();
  }
  int objects() const { return objects_; }

 private:
  bool Value(int depth) {
    if (depth > 64 || pos_ >= text_.size()) return false;
    const char c = text_[pos_];
    if (c == '{') return Object(depth);
    if (c == '[') return Array(depth);
    if (c == '"') return String();
    if (c == '-' || std::isdigit(static_cast<unsigned char>(c))) return Number();
    for (const char* word : {"true", "false", "null"}) {
      const std::string w = word;
      if (text_.compare(pos_, w.size(), w) == 0) {
        pos_ += w.size();
        return true;
      }
    }
    return false;
  }
  bool Object(int depth) {
    ++objects_;
    ++pos_;
    SkipSpace();
    if (Peek('}')) return ++pos_, true;
    while (true) {
      SkipSpace();
      if (!String()) return false;
      SkipSpace();
      if (!Peek(':')) return false;
      ++pos_;
      SkipSpace();
      if (!Value(depth + 1)) return false;
      SkipSpace();
      if (Peek('}')) return ++pos_, true;
      if (!Peek(',')) return false;
      ++pos_;
    }
  }
  bool Array(int depth) {
    ++pos_;
    SkipSpace();
    if (Peek(']')) return ++pos_, true;
    while (true) {
      SkipSpace();
      if (!Value(depth + 1)) return false;
      SkipSpace();
      if (Peek(']')) return ++pos_, true;
      if (!Peek(',')) return false;
      ++pos_;
    }
  }
  bool String() {
    if (!Peek('"')) return false;
    ++pos_;
    while (pos_ < text_.size()) {
      const char c = text_[pos_++];
      if (c == '"') return true;
      if (static_cast<unsigned char>(c) < 0x20) return false;
      if (c == '\\') {
        if (pos_ >= text_.size()) return false;
        const char e = text_[pos_++];
        if (e == 'u') {
          for (int i = 0; i < 4; ++i) {
            if (pos_ >= text_.size() || !std::isxdigit(static_cast<unsigned char>(text_[pos_++]))) {
              return false;
            }
          }
        } else if (std::string("\"\\/bfnrt").find(e) == std::string::npos) {
          return false;
        }
      }
    }
    return false;
  }
  bool Number() {
    const size_t start = pos_;
    if (Peek('-')) ++pos_;
    while (pos_ < text_.size() && (std::isdigit(static_cast<unsigned char>(text_[pos_])) ||
                                   std::string(".eE+-").find(text_[pos_]) != std::string::npos)) {
      ++pos_;
    }
    return pos_ > start && std::isdigit(static_cast<unsigned char>(text_[pos_ - 1]));
  }
  bool Peek(char c) const { return pos_ < text_.size() && text_[pos_] == c; }
  void SkipSpace() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }

  const std::string& text_;
  size_t pos_ = 0;
  int objects_ = 0;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

int Count(const std::string& text, const std::string& needle) {
  int count = 0;
  for (size_t pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1)) {
    ++count;
  }
  return count;
}

std::string TempPath(const char* tag) {
  const char* dir = std::getenv("TEST_TMPDIR");  // set by bazel test
  return std::string(dir != nullptr ? dir : "/tmp") + "/prophet_timeline_" + tag + "_" +
         std::to_string(getpid()) + ".json";
}

TEST(WritesParsableChromeTrace) {
  const std::string path = TempPath("basic");
  Timeline timeline;
  std::string error;
  EXPECT_TRUE(timeline.Open(path, 3, &error));
  EXPECT_TRUE(timeline.enabled());
  const int64_t t0 = 5'000'000'123;  // ns
  timeline.Complete("push", "conv1/kernel#7 p0", t0, t0 + 1'500'250, "{\"bytes\":4096,\"peer\":1}");
  timeline.Complete("block", "block 1/2", t0, t0 + 3'000'000);
  timeline.Complete("step", "step 7", t0 - 1000, t0 + 9'000'000, "not json \"quoted\"");
  timeline.Instant("ready", "dense/bias#7", t0 + 10);
  timeline.Counter("bandwidth_MBps", t0 + 20, 1234.5);
  timeline.Counter("bandwidth_MBps", t0 + 30, std::nan(""));  // JSON has no NaN: dropped
  timeline.Complete("weird\ttrack", "name with \"quotes\", \\ and \n newline", t0, t0);
  timeline.Close();
  EXPECT_TRUE(!timeline.enabled());

  const std::string text = ReadFile(path);
  JsonChecker checker(text);
  EXPECT_TRUE(checker.Valid());
  EXPECT_TRUE(text.find("\"traceEvents\"") != std::string::npos);
  EXPECT_EQ(Count(text, "\"ph\":\"X\""), 4);
  EXPECT_EQ(Count(text, "\"ph\":\"i\""), 1);
  EXPECT_EQ(Count(text, "\"ph\":\"C\""), 1);
  // One thread_name per track, one process_name for the worker.
  EXPECT_EQ(Count(text, "\"thread_name\""), 5);
  EXPECT_EQ(Count(text, "\"process_name\""), 1);
  EXPECT_TRUE(text.find("\"name\":\"worker 3\"") != std::string::npos);
  EXPECT_TRUE(text.find("\"pid\":3") != std::string::npos);
  // Microseconds with nanosecond decimals.
  EXPECT_TRUE(text.find("\"ts\":5000000.123,\"dur\":1500.250") != std::string::npos);
  EXPECT_TRUE(text.find("\"args\":{\"bytes\":4096,\"peer\":1}") != std::string::npos);
  EXPECT_TRUE(text.find("\"args\":{\"detail\":\"not json \\\"quoted\\\"\"}") != std::string::npos);
  EXPECT_TRUE(text.find("\"args\":{\"value\":1234.5}") != std::string::npos);
  std::remove(path.c_str());
}

TEST(FileIsValidAfterEveryFlush) {
  const std::string path = TempPath("flush");
  Timeline timeline;
  std::string error;
  EXPECT_TRUE(timeline.Open(path, 0, &error));
  EXPECT_TRUE(JsonChecker(ReadFile(path)).Valid());  // header flushed at Open
  timeline.Complete("push", "a", 1000, 2000);
  timeline.Flush();
  std::string text = ReadFile(path);
  EXPECT_TRUE(JsonChecker(text).Valid());
  EXPECT_EQ(Count(text, "\"ph\":\"X\""), 1);
  timeline.Complete("pull", "b", 3000, 4000);
  timeline.Flush();
  timeline.Flush();  // nothing new: still valid, not duplicated
  text = ReadFile(path);
  EXPECT_TRUE(JsonChecker(text).Valid());
  EXPECT_EQ(Count(text, "\"ph\":\"X\""), 2);
  timeline.Close();
  timeline.Close();  // idempotent
  EXPECT_TRUE(JsonChecker(ReadFile(path)).Valid());
  std::remove(path.c_str());
}

TEST(ConcurrentWritersProduceEveryEvent) {
  const std::string path = TempPath("threads");
  Timeline timeline;
  std::string error;
  EXPECT_TRUE(timeline.Open(path, 1, &error));
  const char* tracks[] = {"push", "pull", "sum", "apply"};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&timeline, &tracks, t]() {
      for (int i = 0; i < 5000; ++i) {
        timeline.Complete(tracks[t], "tensor_" + std::to_string(i), i * 1000, i * 1000 + 500);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  timeline.Close();
  const std::string text = ReadFile(path);  // > 256 KiB: several automatic flushes happened
  EXPECT_TRUE(text.size() > (256u << 10));
  EXPECT_TRUE(JsonChecker(text).Valid());
  EXPECT_EQ(Count(text, "\"ph\":\"X\""), 20000);
  EXPECT_EQ(Count(text, "\"thread_name\""), 4);
  std::remove(path.c_str());
}

TEST(DisabledTimelineDoesNothing) {
  Timeline timeline;
  EXPECT_TRUE(!timeline.enabled());
  timeline.Complete("push", "x", 0, 1);
  timeline.Instant("ready", "x", 0);
  timeline.Counter("bandwidth_MBps", 0, 1.0);
  timeline.Flush();
  timeline.Close();
  EXPECT_TRUE(!timeline.enabled());
}

TEST(OpenReportsErrors) {
  Timeline timeline;
  std::string error;
  EXPECT_TRUE(!timeline.Open("/nonexistent_dir_for_prophet/trace.json", 0, &error));
  EXPECT_TRUE(error.find("/nonexistent_dir_for_prophet/trace.json") != std::string::npos);
  const std::string path = TempPath("twice");
  EXPECT_TRUE(timeline.Open(path, 0, &error));
  EXPECT_TRUE(!timeline.Open(path, 0, &error));
  EXPECT_TRUE(error.find("already open") != std::string::npos);
  timeline.Close();
  std::remove(path.c_str());
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
