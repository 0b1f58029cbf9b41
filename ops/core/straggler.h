// Who is behind when an operation times out.
//
// A worker's own view of a timed-out operation is not enough to name the culprit: in push_pull a
// worker also waits for partition owners that are themselves waiting for the stalled worker, so
// every healthy owner would be named too. When an operation's deadline passes, the engine asks
// every peer whether it has submitted that operation (kProbe); each answers from its own round
// counters (kProbeReply). The ranks that answer "no" are behind; ranks that do not answer within
// the grace period are stopped, hung or unreachable. Every survivor asks the same question and
// gets the same answers, so every survivor names the same ranks; the first verdict is also sent
// to every worker as the operation's error.
#ifndef PROPHET_OPS_CORE_STRAGGLER_H_
#define PROPHET_OPS_CORE_STRAGGLER_H_

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace prophet {

class StragglerProbe {
 public:
  struct Verdict {
    std::vector<int> behind;  // answered: not submitted
    std::vector<int> silent;  // did not answer in time
  };

  // Starts asking `peers` about operation `key`; the verdict is due when all have answered or at
  // `due_ns`.
  void Begin(const std::string& key, const std::vector<int>& peers, int64_t due_ns);
  bool Asking(const std::string& key) const { return asks_.count(key) != 0; }
  // An answer from `peer` (ignored unless it was asked about `key`).
  void OnReply(const std::string& key, int peer, bool submitted);
  // Keys whose verdict is due: everyone answered, or the time is up.
  std::vector<std::string> Due(int64_t now) const;
  // The verdict for `key`; forgets it.
  Verdict Take(const std::string& key);
  // The operation ended otherwise (completed late, or failed by a peer's verdict).
  void Forget(const std::string& key) { asks_.erase(key); }

 private:
  struct Ask {
    std::vector<int> peers;
    std::vector<int> answer;  // per entry of `peers`: -1 none yet, 0 not submitted, 1 submitted
    int64_t due_ns = 0;
    int pending = 0;
  };
  std::unordered_map<std::string, Ask> asks_;
};

// "1, 3"
std::string RankList(const std::vector<int>& ranks);

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_STRAGGLER_H_
