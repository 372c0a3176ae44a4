// Single-thread throughput and compression ratio of the gradient codecs.
//
//   bazel run -c opt //tests/bench:compression [-- --sizes=1000000,25000000 --reps=7]
//
// For each codec and size, on float32 values drawn from N(0, 1) (fixed seed), prints one
// JSON object per line:
//   codec, elements,
//   encode_gb_per_s, decode_gb_per_s  GB/s (1e9 bytes/s) of float32 input (4 bytes/element),
//                                     median over --reps repetitions (after one warm-up run);
//                                     the payload string and the output vector are reused
//                                     across repetitions, as a worker would reuse them
//   encode_ms, decode_ms              the same medians in milliseconds
//   ratio                             input bytes / payload bytes
// and, for topk_approx (means over the repetitions, each with its own seed):
//   selection_error  |selected - k| / k
//   mass_captured    sum of x_i^2 over the exact top-k elements that the approximation also
//                    selected, divided by the sum of x_i^2 over the exact top-k
//   mass_ratio       sum of x_i^2 over the selected elements / the same over the exact top-k
// "memcpy" is the baseline: a plain copy of the float32 input (both directions).
// Then, for each --error_feedback codec, one line with the cost of a whole worker step of
// ErrorFeedback::Compress (accumulate, encode, decode, residual; DGC momentum 0.9 when
// "momentum" is true): error_feedback, elements, momentum, step_gb_per_s, step_ms.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "compression/compressor.h"
#include "compression/error_feedback.h"
#include "compression/rng.h"
#include "compression/select.h"

ABSL_FLAG(std::string, sizes, "1000000,25000000", "Element counts to measure.");
ABSL_FLAG(std::string, codecs,
          "identity,fp16,bf16,topk:0.01,topk:0.001,topk_approx:0.01,topk_approx:0.001,"
          "randomk:0.01,qsgd:4,topk:0.01+fp16",
          "Codec specs to measure (memcpy is always first).");
ABSL_FLAG(std::string, error_feedback, "topk:0.01,topk:0.01+fp16",
          "Codec specs to time ErrorFeedback::Compress steps with.");
ABSL_FLAG(int, reps, 7, "Timed repetitions per measurement (the median is reported).");

namespace gradmesh {
namespace {

using Clock = std::chrono::steady_clock;

template <typename F>
double MedianSeconds(int reps, F&& f) {
  f(-1);  // warm-up: page faults, buffer growth
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto start = Clock::now();
    f(r);
    t.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void Print(const std::string& codec, size_t n, double enc_s, double dec_s, double ratio,
           const std::string& extra) {
  const double gb = 4.0 * static_cast<double>(n) / 1e9;
  std::printf(
      "{\"codec\": \"%s\", \"elements\": %zu, \"encode_gb_per_s\": %.3f, "
      "\"decode_gb_per_s\": %.3f, \"encode_ms\": %.3f, \"decode_ms\": %.3f, "
      "\"ratio\": %.2f%s}\n",
      codec.c_str(), n, gb / enc_s, gb / dec_s, enc_s * 1e3, dec_s * 1e3, ratio, extra.c_str());
  std::fflush(stdout);
}

int Run() {
  const CompressorRegistry registry = CompressorRegistry::WithBuiltins();
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  for (absl::string_view size_text : absl::StrSplit(absl::GetFlag(FLAGS_sizes), ',')) {
    const size_t n = std::stoul(std::string(size_text));
    std::vector<float> x(n);
    std::mt19937_64 gen(1);
    std::normal_distribution<float> normal;
    for (float& v : x) v = normal(gen);
    std::vector<float> out(n);

    {
      const double s = MedianSeconds(reps, [&](int) { std::memcpy(out.data(), x.data(), 4 * n); });
      Print("memcpy", n, s, s, 1.0, "");
    }

    for (absl::string_view spec : absl::StrSplit(absl::GetFlag(FLAGS_codecs), ',')) {
      absl::StatusOr<std::unique_ptr<Compressor>> made = registry.Create(spec);
      if (!made.ok()) {
        std::fprintf(stderr, "%s\n", made.status().ToString().c_str());
        return 2;
      }
      const Compressor& codec = **made;
      std::string payload;
      bool ok = true;
      const double enc = MedianSeconds(reps, [&](int r) {
        ok &= codec.Encode(x, Rng::Mix(7, static_cast<uint64_t>(r + 1)), &payload).ok();
      });
      const double dec =
          MedianSeconds(reps, [&](int) { ok &= codec.Decode(payload, absl::MakeSpan(out)).ok(); });
      if (!ok) {
        std::fprintf(stderr, "%s failed\n", std::string(spec).c_str());
        return 1;
      }
      const double ratio = 4.0 * static_cast<double>(n) / static_cast<double>(payload.size());

      std::string extra;
      if (absl::StartsWith(spec, "topk_approx:")) {
        const size_t k = static_cast<size_t>(SparseCount(static_cast<int64_t>(n), codec.density()));
        std::vector<uint32_t> exact;
        TopKMagnitude(x, k, &exact);
        std::vector<char> in_exact(n, 0);
        double exact_mass = 0;
        for (uint32_t i : exact) {
          in_exact[i] = 1;
          exact_mass += static_cast<double>(x[i]) * x[i];
        }
        double error = 0, captured = 0, selected_mass = 0;
        for (int r = 0; r < reps; ++r) {
          std::vector<uint32_t> approx;
          ApproxTopKMagnitude(x, k, Rng::Mix(7, static_cast<uint64_t>(r + 1)), &approx);
          error += std::fabs(static_cast<double>(approx.size()) - static_cast<double>(k)) / k;
          for (uint32_t i : approx) {
            const double m = static_cast<double>(x[i]) * x[i];
            selected_mass += m;
            if (in_exact[i]) captured += m;
          }
        }
        char buf[160];
        std::snprintf(buf, sizeof(buf),
                      ", \"selection_error\": %.4f, \"mass_captured\": %.4f, \"mass_ratio\": %.4f",
                      error / reps, captured / reps / exact_mass,
                      selected_mass / reps / exact_mass);
        extra = buf;
      }
      Print(std::string(spec), n, enc, dec, ratio, extra);
    }

    for (absl::string_view spec :
         absl::StrSplit(absl::GetFlag(FLAGS_error_feedback), ',', absl::SkipEmpty())) {
      absl::StatusOr<std::unique_ptr<Compressor>> made = registry.Create(spec);
      if (!made.ok()) {
        std::fprintf(stderr, "%s\n", made.status().ToString().c_str());
        return 2;
      }
      for (bool momentum : {false, true}) {
        ErrorFeedbackOptions options;
        options.momentum = momentum ? 0.9f : 0.0f;
        ErrorFeedback ef(n, options);
        std::string payload;
        bool ok = true;
        const double s = MedianSeconds(reps, [&](int r) {
          ok &= ef.Compress(**made, x, Rng::Mix(9, static_cast<uint64_t>(r + 1)), &payload).ok();
        });
        if (!ok) return 1;
        std::printf(
            "{\"error_feedback\": \"%s\", \"elements\": %zu, \"momentum\": %s, "
            "\"step_gb_per_s\": %.3f, \"step_ms\": %.3f}\n",
            std::string(spec).c_str(), n, momentum ? "true" : "false",
            4.0 * static_cast<double>(n) / 1e9 / s, s * 1e3);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace gradmesh

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return gradmesh::Run();
}
