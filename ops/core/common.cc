#include "ops/core/common.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace prophet {

size_t DataTypeSize(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return 2;
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
    case DataType::kUInt8:
    case DataType::kBool:
      return 1;
    default:
      return 0;
  }
}

const char* DataTypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kUInt8: return "uint8";
    case DataType::kBool: return "bool";
    default: return "invalid";
  }
}

bool IsSummable(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat16:
    case DataType::kBFloat16:
    case DataType::kFloat32:
    case DataType::kFloat64:
    case DataType::kInt32:
    case DataType::kInt64:
      return true;
    default:
      return false;
  }
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

std::string SecondsString(double seconds) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g s", seconds);
  return buf;
}

namespace {
// Set by every engine start and read by every log line, possibly on other threads (the in-process
// engine tests start several engines at once: a data race found by --config=tsan).
std::atomic<int> g_log_rank{-1};
int ReadLogLevel() {
  const char* env = std::getenv("PROPHET_LOG_LEVEL");
  return env ? std::atoi(env) : 1;
}
}  // namespace

void SetLogRank(int rank) { g_log_rank.store(rank, std::memory_order_relaxed); }

int LogLevel() {
  static const int level = ReadLogLevel();
  return level;
}

void LogMessage(int level, const char* fmt, ...) {
  static const char* kNames[] = {"ERROR", "WARNING", "INFO", "DEBUG"};
  char buf[2048];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  std::fprintf(stderr, "prophet_tf %s [rank %d]: %s\n", kNames[level < 0 ? 0 : (level > 3 ? 3 : level)],
               g_log_rank.load(std::memory_order_relaxed), buf);
}

void AppendJsonString(const std::string& text, std::string* out) {
  out->push_back('"');
  for (const char c : text) {
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buffer[8];
          std::snprintf(buffer, sizeof(buffer), "\\u%04x", static_cast<unsigned>(c));
          out->append(buffer);
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

}  // namespace prophet
