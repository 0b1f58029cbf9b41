// A minimal test harness for the framework-free core (no gtest offline).
// Each *_test.cc defines TEST(name) bodies and ends with PROPHET_TEST_MAIN().
#ifndef PROPHET_OPS_CORE_TESTING_H_
#define PROPHET_OPS_CORE_TESTING_H_

#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace prophet {
namespace testing {

struct TestCase {
  const char* name;
  std::function<void()> body;
};

inline std::vector<TestCase>& Registry() {
  static std::vector<TestCase> tests;
  return tests;
}
inline int& Failures() {
  static int failures = 0;
  return failures;
}
struct Registrar {
  Registrar(const char* name, std::function<void()> body) {
    Registry().push_back({name, std::move(body)});
  }
};

// Shared by the tests' own checks: whether `text` contains `part` (error messages, JSON).
inline bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}
// A failure whose message a test builds itself (what came, what was expected).
inline void Fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: %s\n", file, line, what.c_str());
  ++Failures();
}

inline int RunAll() {
  int passed = 0, failed = 0;
  for (const TestCase& t : Registry()) {
    const int before = Failures();
    t.body();
    if (Failures() == before) {
      ++passed;
      std::printf("[ OK ] %s\n", t.name);
    } else {
      ++failed;
      std::printf("[FAIL] %s\n", t.name);
    }
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace testing
}  // namespace prophet

#define FAIL(what) ::prophet::testing::Fail(__FILE__, __LINE__, (what))

#define TEST(name)                                                              \
  static void name();                                                           \
  static ::prophet::testing::Registrar name##_registrar(#name, name);           \
  static void name()

#define EXPECT_TRUE(cond)                                                       \
  do {                                                                          \
    if (!(cond)) {                                                              \
      std::fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);  \
      ++::prophet::testing::Failures();                                         \
    }                                                                           \
  } while (0)

#define EXPECT_EQ(a, b)                                                         \
  do {                                                                          \
    const auto& va_ = (a);                                                      \
    const auto& vb_ = (b);                                                      \
    if (!(va_ == vb_)) {                                                        \
      std::ostringstream os_;                                                   \
      os_ << va_ << " vs " << vb_;                                              \
      std::fprintf(stderr, "%s:%d: expected %s == %s (%s)\n", __FILE__, __LINE__, \
                   #a, #b, os_.str().c_str());                                  \
      ++::prophet::testing::Failures();                                         \
    }                                                                           \
  } while (0)

#define EXPECT_NEAR(a, b, tol)                                                  \
  do {                                                                          \
    const double va_ = (a), vb_ = (b);                                          \
    if (!(va_ - vb_ <= (tol) && vb_ - va_ <= (tol))) {                          \
      std::fprintf(stderr, "%s:%d: expected %s ~= %s (%g vs %g)\n", __FILE__,   \
                   __LINE__, #a, #b, va_, vb_);                                 \
      ++::prophet::testing::Failures();                                         \
    }                                                                           \
  } while (0)

#define PROPHET_TEST_MAIN() \
  int main() { return ::prophet::testing::RunAll(); }

#endif  // PROPHET_OPS_CORE_TESTING_H_
