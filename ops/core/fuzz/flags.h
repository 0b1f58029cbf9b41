// "--name=value" command-line flags for the fuzz drivers (later flags win, so that `bazel run` can
// override the short run a test target's `args` set).
#ifndef PROPHET_OPS_CORE_FUZZ_FLAGS_H_
#define PROPHET_OPS_CORE_FUZZ_FLAGS_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

namespace prophet {
namespace fuzz {

class Flags {
 public:
  // Exits with a usage message on anything but --name=value for a name in `defaults`.
  Flags(int argc, char** argv, std::map<std::string, std::string> defaults) : values_(std::move(defaults)) {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      const size_t eq = arg.find('=');
      if (arg.rfind("--", 0) != 0 || eq == std::string::npos || values_.count(arg.substr(2, eq - 2)) == 0) {
        std::fprintf(stderr, "unknown argument '%s'; flags:", arg.c_str());
        for (const auto& kv : values_) std::fprintf(stderr, " --%s=%s", kv.first.c_str(), kv.second.c_str());
        std::fprintf(stderr, "\n");
        std::exit(2);
      }
      values_[arg.substr(2, eq - 2)] = arg.substr(eq + 1);
    }
  }
  uint64_t U64(const std::string& name) const { return std::strtoull(values_.at(name).c_str(), nullptr, 10); }
  const std::string& Str(const std::string& name) const { return values_.at(name); }

 private:
  std::map<std::string, std::string> values_;
};

}  // namespace fuzz
}  // namespace prophet

#endif  // PROPHET_OPS_CORE_FUZZ_FLAGS_H_
