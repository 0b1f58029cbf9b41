// One replay worker (replay.h) as a process, started by `python -m prophet_tf.bench.replay`:
//
//   replay_worker --request=FILE --rank=R --addresses=HOST:PORT,... --token=T [--out=FILE]
//       [--link_gbps=G] [--heartbeat_s=S] [--timeout_s=S] [--launched_at=EPOCH_S] [--check_all] [--probe]
//       [--fusion_scale=F] [--byte_scale=F]
//
// FILE is the predictor's request (ops/sim/simulation_request.h): the profile as this run plays
// it, the schedule and the runtime's options, warm-up and measured steps. Writes its result
// (ReplayResultJson) to --out, or stdout; exits 1 naming the error when the run fails.
// --link_gbps: the rate automatic fusion sizes for (else the start-up probe's); --probe: run the
// probe (timed as start-up) even where fusion does not need it; --fusion_scale: the automatic
// bucket size times F (a replay of F of the model's bytes); --byte_scale: the engine's sizes
// times F (ScaleRuntimeBytes), and the probe's where fusion does not need its rate.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "ops/replay/replay.h"

namespace prophet {
namespace {

std::vector<std::string> Split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(item);
  return out;
}

int Usage(const std::string& why) {
  std::fprintf(stderr,
               "replay_worker: %s\nusage: replay_worker --request=FILE --rank=R --addresses=HOST:PORT,... "
               "--token=T [--out=FILE] [--link_gbps=G] [--heartbeat_s=S] [--timeout_s=S] [--launched_at=EPOCH_S] "
               "[--check_all] [--probe] [--fusion_scale=F] [--byte_scale=F]\n",
               why.c_str());
  return 2;
}

int Main(int argc, char** argv) {
  std::string request_path, addresses, token, out_path;
  int rank = -1;
  double link_gbps = 0, heartbeat_s = 0, timeout_s = 60, launched_at = 0, fusion_scale = 1, byte_scale = 1;
  bool check_all = false, probe = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    const std::string key = a.substr(0, eq), value = eq == std::string::npos ? "" : a.substr(eq + 1);
    if (key == "--request") request_path = value;
    else if (key == "--rank") rank = std::atoi(value.c_str());
    else if (key == "--addresses") addresses = value;
    else if (key == "--token") token = value;
    else if (key == "--out") out_path = value;
    else if (key == "--link_gbps") link_gbps = std::atof(value.c_str());
    else if (key == "--heartbeat_s") heartbeat_s = std::atof(value.c_str());
    else if (key == "--timeout_s") timeout_s = std::atof(value.c_str());
    else if (key == "--launched_at") launched_at = std::atof(value.c_str());
    else if (key == "--check_all") check_all = true;
    else if (key == "--probe") probe = true;
    else if (key == "--fusion_scale") fusion_scale = std::atof(value.c_str());
    else if (key == "--byte_scale") byte_scale = std::atof(value.c_str());
    else return Usage("unknown flag '" + a + "'");
  }
  if (request_path.empty()) return Usage("--request is required");
  std::ifstream file(request_path);
  if (!file) return Usage("cannot read the request " + request_path);
  std::stringstream text;
  text << file.rdbuf();
  ReplayConfig config;
  Status s = ReplayConfigFromRequest(text.str(), &config);
  if (!s.ok()) {
    std::fprintf(stderr, "replay_worker: %s: %s\n", request_path.c_str(), s.message().c_str());
    return 2;
  }
  config.engine.addresses = Split(addresses);
  config.engine.world_size = static_cast<int>(config.engine.addresses.size());
  if (rank < 0 || rank >= config.engine.world_size) {
    return Usage("--rank must be in [0, " + std::to_string(config.engine.world_size) + ") for the " +
                 std::to_string(config.engine.world_size) + " addresses");
  }
  config.engine.rank = rank;
  config.engine.token = token;
  config.engine.heartbeat_s = heartbeat_s;
  config.engine.timeout_s = timeout_s;
  config.engine.connect_timeout_s = timeout_s;
  config.link_Bps = link_gbps * 1e9 / 8;
  config.launched_at_s = launched_at;
  config.check_all = check_all;
  config.probe = probe;
  if (!(fusion_scale > 0)) return Usage("--fusion_scale must be positive");
  config.fusion_scale = fusion_scale;
  if (!(byte_scale > 0)) return Usage("--byte_scale must be positive");
  if (byte_scale != 1) ScaleRuntimeBytes(byte_scale, &config.engine);
  config.probe_scale = byte_scale;
  SetLogRank(rank);
  // A peer that closed its connection must fail the operations that needed it, not kill this
  // process on the next write (the engine's writev has no MSG_NOSIGNAL; Python, which runs the
  // op library, ignores SIGPIPE for the same reason).
  std::signal(SIGPIPE, SIG_IGN);
  ReplayResult result;
  s = RunReplay(config, &result);
  if (!s.ok()) {
    std::fprintf(stderr, "replay_worker rank %d: %s\n", rank, s.message().c_str());
    return 1;
  }
  const std::string json = ReplayResultJson(result) + "\n";
  if (out_path.empty()) {
    std::fputs(json.c_str(), stdout);
  } else {
    std::ofstream out(out_path);
    out << json;
    if (!out) {
      std::fprintf(stderr, "replay_worker rank %d: cannot write %s\n", rank, out_path.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace prophet

int main(int argc, char** argv) { return prophet::Main(argc, argv); }
