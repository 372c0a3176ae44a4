// AutoCodec: picks the push codec for a job whose spec says compression.push: auto.
//
// The job starts dense. After `probe_steps` steps it compares the time spent exchanging
// gradients and parameters with the time spent computing them:
//   comm/compute <  dense_below            -> stay dense (compression would not pay)
//   comm/compute <  sparse_from            -> "fp16" (halves the bytes, keeps accuracy)
//   otherwise                              -> "topk:0.01+fp16" with error feedback
// After switching, it watches the training loss: if the mean loss of a window of
// `window` steps exceeds `diverge_factor` times the mean of the window before the switch, or
// is not finite, it falls back to dense for the rest of the job (once).
//
// Thread safety: not thread-safe; one per trainer, called from the training thread.
#ifndef GRADMESH_WORKER_AUTO_CODEC_H_
#define GRADMESH_WORKER_AUTO_CODEC_H_

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

namespace gradmesh {

struct AutoCodecOptions {
  int64_t probe_steps = 50;     // Dense steps measured before deciding.
  double dense_below = 0.25;    // comm/compute below this: stay dense.
  double sparse_from = 1.0;     // comm/compute from this: top-k.
  int64_t window = 50;          // Steps per loss window.
  double diverge_factor = 1.5;  // Fallback when the window mean exceeds this x the baseline.
};

class AutoCodec {
 public:
  explicit AutoCodec(AutoCodecOptions options = AutoCodecOptions()) : o_(options) {}

  // Records one step. Returns the codec to use from the next step on when it changes ("" is
  // dense), else nullopt.
  std::optional<std::string> Observe(double loss, double compute_s, double comm_s) {
    ++steps_;
    if (state_ == State::kProbing) {
      compute_ += compute_s;
      comm_ += comm_s;
      Accumulate(loss);
      if (steps_ < o_.probe_steps) return std::nullopt;
      ratio_ = compute_ > 0 ? comm_ / compute_ : 0;
      baseline_ = window_n_ > 0 ? window_sum_ / window_n_ : 0;
      ResetWindow();
      if (ratio_ < o_.dense_below) {
        state_ = State::kDone;
        return std::nullopt;
      }
      codec_ = ratio_ < o_.sparse_from ? "fp16" : "topk:0.01+fp16";
      state_ = State::kCompressed;
      return codec_;
    }
    if (state_ != State::kCompressed) return std::nullopt;
    if (!std::isfinite(loss)) return FallBack();
    Accumulate(loss);
    if (window_n_ < o_.window) return std::nullopt;
    const double mean = window_sum_ / window_n_;
    ResetWindow();
    if (mean > o_.diverge_factor * baseline_) return FallBack();
    return std::nullopt;
  }

  double ratio() const { return ratio_; }  // comm/compute measured while probing.
  const std::string& codec() const { return codec_; }
  bool fell_back() const { return fell_back_; }

 private:
  enum class State { kProbing, kCompressed, kDone };

  void Accumulate(double loss) {
    // The loss window before the decision is the last `window` probe steps.
    if (window_n_ == o_.window) ResetWindow();
    window_sum_ += loss;
    ++window_n_;
  }
  void ResetWindow() {
    window_sum_ = 0;
    window_n_ = 0;
  }
  std::optional<std::string> FallBack() {
    state_ = State::kDone;
    fell_back_ = true;
    codec_.clear();
    return std::string();
  }

  const AutoCodecOptions o_;
  State state_ = State::kProbing;
  int64_t steps_ = 0;
  double compute_ = 0, comm_ = 0, ratio_ = 0, baseline_ = 0;
  double window_sum_ = 0;
  int64_t window_n_ = 0;
  std::string codec_;
  bool fell_back_ = false;
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_AUTO_CODEC_H_
