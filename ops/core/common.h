// Types shared by every part of the framework-free core.
#ifndef PROPHET_OPS_CORE_COMMON_H_
#define PROPHET_OPS_CORE_COMMON_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace prophet {

// Wire-stable dtype codes (they travel in frame headers; never renumber).
enum class DataType : uint8_t {
  kInvalid = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat32 = 3,
  kFloat64 = 4,
  kInt32 = 5,
  kInt64 = 6,
  kUInt8 = 7,   // only moved (broadcast / allgather), never summed
  kBool = 8,    // only moved
};

size_t DataTypeSize(DataType dtype);  // 0 for kInvalid or unknown codes
const char* DataTypeName(DataType dtype);
bool IsSummable(DataType dtype);

enum class Code : int {
  kOk = 0,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kAlreadyExists = 6,
  kFailedPrecondition = 9,
  kAborted = 10,
  kInternal = 13,
  kUnavailable = 14,
};

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status OK() { return Status(); }
  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string ShapeString(const std::vector<int64_t>& shape);
std::string SecondsString(double seconds);  // "0.5 s", "60 s"
// Appends `text` as a JSON string literal (quoted, escaped) to `out`.
void AppendJsonString(const std::string& text, std::string* out);

// Logging to stderr with a rank prefix; the level comes from PROPHET_LOG_LEVEL
// (0 = errors, 1 = warnings (default), 2 = info, 3 = debug).
void SetLogRank(int rank);
int LogLevel();
void LogMessage(int level, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
#define PROPHET_LOG(level, ...)                                              \
  do {                                                                       \
    if ((level) <= ::prophet::LogLevel()) ::prophet::LogMessage(level, __VA_ARGS__); \
  } while (0)
#define PROPHET_ERROR(...) PROPHET_LOG(0, __VA_ARGS__)
#define PROPHET_WARN(...) PROPHET_LOG(1, __VA_ARGS__)
#define PROPHET_INFO(...) PROPHET_LOG(2, __VA_ARGS__)

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_COMMON_H_
