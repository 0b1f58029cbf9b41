// Fixed predictions of the step simulator on small settings: every schedule, N = 2-16, links with
// and without ingress limits, latency and what the kernel's socket holds. They pin the model, so
// that making the event loop or the link model faster cannot change a prediction: a change of any
// of them is a change of the model, which must be intended and stated in the change that makes
// it, never a side effect of an optimisation. They run with RuntimeModel::small_allreduce off (the
// owner path for every tensor; simulator_test checks the exchange). On a mismatch the test prints
// the whole table as it is now, ready to paste after such an intended change.
#include <cstdio>
#include <string>
#include <vector>

#include "ops/core/testing.h"
#include "ops/sim/simulator.h"

namespace prophet {
namespace {

constexpr int64_t kMs = 1'000'000;

// 24 layers, gradients from 256 bytes to 9 MiB (cut into several 4 MiB partitions, or fewer
// than N small ones), two tensors per layer, plus one control collective.
StepProfile VariedModel() {
  StepProfile profile;
  const int kLayers = 24;
  int64_t at = 0;
  std::vector<int64_t> ready(kLayers);
  for (int i = kLayers - 1; i >= 0; --i) {
    at += (1 + (i * 7) % 5) * kMs / 2;
    ready[i] = at;
  }
  for (int i = 0; i < kLayers; ++i) {
    profile.layers.push_back({"L" + std::to_string(i), (1 + (i * 3) % 4) * kMs / 4, 0});
    const uint64_t kernel = uint64_t{256} << ((i * 5) % 16);  // 256 B .. 8 MiB
    ModelTensor k;
    k.name = "grad/L" + std::to_string(i) + "/kernel";
    k.bytes = kernel + (i % 3 == 0 ? uint64_t{1} << 20 : 0);
    k.priority = 2 * (kLayers - i);
    k.layer = i;
    k.ready_ns = ready[i];
    k.apply_ns = (i % 4) * kMs / 10;
    profile.tensors.push_back(k);
    ModelTensor b = k;
    b.name = "grad/L" + std::to_string(i) + "/bias";
    b.bytes = 4 * static_cast<uint64_t>(64 + 32 * i);
    b.priority = 2 * (kLayers - i) - 1;
    b.apply_ns = kMs / 50;
    profile.tensors.push_back(b);
  }
  ModelTensor loss;
  loss.name = "metrics/loss";
  loss.bytes = 8;
  loss.priority = kControlPriority;
  loss.ready_ns = at;
  profile.tensors.push_back(loss);
  profile.backward_ns = at;
  profile.launch_ns = kMs / 5;
  profile.tail_ns = kMs / 2;
  profile.gap_ns = kMs / 3;
  return profile;
}

struct Setting {
  const char* schedule;
  int workers;
  int network;  // 0: 1 Gbit/s both ways; 1: 10 Gbit/s, 50 us latency; 2: 2 Gbit/s egress only, autotuned socket
};

struct Golden {
  Setting setting;
  int64_t step_ns;         // the median period
  int64_t periods_ns;      // the sum of the measured periods
  int64_t wire_bytes;      // worker 0's bytes on the wire per measured step
};

NetworkModel Network(const Setting& s) {
  NetworkModel n;
  n.workers = s.workers;
  if (s.network == 0) {
    n.link_Bps = 125e6;
  } else if (s.network == 1) {
    n.link_Bps = 1.25e9;
    n.latency_ns = 50'000;
  } else {
    n.link_Bps = 250e6;
    n.ingress_limited = false;
    n.socket_buffer_bytes = 0;
    n.socket_unsent_bytes = 0;
  }
  return n;
}

const Golden kGoldens[] = {
    // GOLDEN-BEGIN
    {{"prophet", 2, 0}, 329595199, 2307166393, 38214568},
    {{"priority", 2, 0}, 329595199, 2307166393, 38214568},
    {{"fifo", 2, 0}, 329595199, 2307166393, 38214568},
    {{"mwms", 2, 0}, 378213741, 2647496187, 38198344},
    {{"prophet", 3, 0}, 438345646, 3068491477, 50926664},
    {{"priority", 3, 0}, 438345646, 3068491477, 50926664},
    {{"fifo", 3, 0}, 438345646, 3068491477, 50926664},
    {{"mwms", 3, 0}, 486410533, 3404873731, 50931516},
    {{"prophet", 5, 0}, 527288741, 3691383390, 61270330},
    {{"priority", 5, 0}, 526865937, 3687959403, 61270060},
    {{"fifo", 5, 0}, 526865937, 3687959403, 61270060},
    {{"mwms", 5, 0}, 572973757, 4010816299, 61118736},
    {{"prophet", 8, 0}, 577456771, 4039269421, 66952168},
    {{"priority", 8, 0}, 576588086, 4034921216, 66952168},
    {{"fifo", 8, 0}, 576588086, 4034921216, 66952168},
    {{"mwms", 8, 0}, 621674751, 4351723257, 66850126},
    {{"prophet", 16, 0}, 619413184, 4333167257, 72289146},
    {{"priority", 16, 0}, 618503501, 4332247872, 72194440},
    {{"fifo", 16, 0}, 618503501, 4332247872, 72194440},
    {{"mwms", 16, 0}, 662261513, 4635830591, 71626590},
    {{"prophet", 2, 1}, 54669130, 384407737, 38214568},
    {{"priority", 2, 1}, 54562166, 381950912, 38214568},
    {{"fifo", 2, 1}, 54562166, 381950912, 38214568},
    {{"mwms", 2, 1}, 86241375, 603689625, 38198344},
    {{"prophet", 3, 1}, 60247319, 421607963, 50926664},
    {{"priority", 3, 1}, 59063548, 413804329, 50751414},
    {{"fifo", 3, 1}, 59063548, 413804329, 50751414},
    {{"mwms", 3, 1}, 97161057, 680127399, 50931516},
    {{"prophet", 5, 1}, 67042711, 469985122, 61223515},
    {{"priority", 5, 1}, 65064932, 458831117, 61176396},
    {{"fifo", 5, 1}, 65064932, 458831117, 61176396},
    {{"mwms", 5, 1}, 106017381, 742121667, 61118736},
    {{"prophet", 8, 1}, 72512489, 498211894, 67083501},
    {{"priority", 8, 1}, 69655928, 487451786, 66952168},
    {{"fifo", 8, 1}, 69655928, 487451786, 66952168},
    {{"mwms", 8, 1}, 111187507, 778312549, 66850126},
    {{"prophet", 16, 1}, 74639122, 524506365, 72436451},
    {{"priority", 16, 1}, 75538145, 525293268, 72325855},
    {{"fifo", 16, 1}, 75538145, 525293268, 72325855},
    {{"mwms", 16, 1}, 117496193, 822473351, 71626590},
    {{"prophet", 2, 2}, 167286913, 1175738008, 38184163},
    {{"priority", 2, 2}, 166170851, 1174621946, 38158326},
    {{"fifo", 2, 2}, 166170851, 1174621946, 38158326},
    {{"mwms", 2, 2}, 215923539, 1511464773, 38198344},
    {{"prophet", 3, 2}, 221659844, 1550524187, 50926664},
    {{"priority", 3, 2}, 221288583, 1550152926, 50926664},
    {{"fifo", 3, 2}, 221288583, 1550152926, 50926664},
    {{"mwms", 3, 2}, 270021937, 1890153559, 50931516},
    {{"prophet", 5, 2}, 273020322, 1893859329, 61275835},
    {{"priority", 5, 2}, 267090066, 1871674638, 61270060},
    {{"fifo", 5, 2}, 267090066, 1871674638, 61270060},
    {{"mwms", 5, 2}, 313303549, 2193124843, 61118736},
    {{"prophet", 8, 2}, 297194058, 2116540314, 66783537},
    {{"priority", 8, 2}, 292101300, 2111447556, 66612237},
    {{"fifo", 8, 2}, 292101300, 2111447556, 66612237},
    {{"mwms", 8, 2}, 337654063, 2363578441, 66850126},
    {{"prophet", 16, 2}, 324954217, 2275427551, 72185064},
    {{"priority", 16, 2}, 324954217, 2275427551, 72185064},
    {{"fifo", 16, 2}, 324954217, 2275427551, 72185064},
    {{"mwms", 16, 2}, 357947453, 2505632171, 71626590},
    // GOLDEN-END
};

TEST(PredictionsAreUnchanged) {
  const StepProfile profile = VariedModel();
  const char* schedules[] = {"prophet", "priority", "fifo", "mwms"};
  const int workers[] = {2, 3, 5, 8, 16};
  std::string table;
  int compared = 0, differ = 0;
  for (int network = 0; network < 3; ++network) {
    for (int n : workers) {
      for (const char* schedule : schedules) {
        const Setting setting{schedule, n, network};
        RuntimeModel runtime;
        runtime.schedule = schedule;
        // The owner path for every tensor: the exchange of small tensors is checked by
        // simulator_test; these pin the rest.
        runtime.small_allreduce = EngineOptions::kSmallAllreduceNever;
        SimulationOptions options;
        options.warmup_steps = 4;
        options.steps = 7;
        StepPrediction p;
        const Status s = Simulate(profile, Network(setting), runtime, options, &p);
        if (!s.ok()) std::fprintf(stderr, "%s N=%d network %d: %s\n", schedule, n, network, s.message().c_str());
        EXPECT_TRUE(s.ok());
        int64_t sum = 0;
        for (double period : p.periods_s) sum += static_cast<int64_t>(period * 1e9 + 0.5);
        const Golden now{setting, static_cast<int64_t>(p.step_s * 1e9 + 0.5), sum,
                         static_cast<int64_t>(p.wire_bytes_per_step + 0.5)};
        char line[200];
        std::snprintf(line, sizeof(line), "    {{\"%s\", %d, %d}, %lld, %lld, %lld},\n", schedule, n, network,
                      static_cast<long long>(now.step_ns), static_cast<long long>(now.periods_ns),
                      static_cast<long long>(now.wire_bytes));
        table += line;
        for (const Golden& g : kGoldens) {
          if (std::string(g.setting.schedule) != schedule || g.setting.workers != n || g.setting.network != network) continue;
          ++compared;
          if (g.step_ns != now.step_ns || g.periods_ns != now.periods_ns || g.wire_bytes != now.wire_bytes) {
            ++differ;
            std::fprintf(stderr, "changed: %s N=%d network %d: step %lld -> %lld ns, periods %lld -> %lld ns, "
                         "wire %lld -> %lld bytes\n", schedule, n, network, static_cast<long long>(g.step_ns),
                         static_cast<long long>(now.step_ns), static_cast<long long>(g.periods_ns),
                         static_cast<long long>(now.periods_ns), static_cast<long long>(g.wire_bytes),
                         static_cast<long long>(now.wire_bytes));
          }
        }
      }
    }
  }
  const int expected = static_cast<int>(sizeof(kGoldens) / sizeof(kGoldens[0]));
  if (differ > 0 || compared != expected || compared == 0) {
    std::fprintf(stderr, "%d of %d settings compared, %d differ; the table as it is now:\n%s", compared, expected,
                 differ, table.c_str());
  }
  EXPECT_TRUE(compared > 0 && compared == expected);
  EXPECT_TRUE(differ == 0);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
