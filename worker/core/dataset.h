// Image-classification data for workers: IDX file loading (MNIST, Fashion-MNIST), sharded
// and shuffled mini-batches with a background prefetch thread, and evaluation batches.
//
// This header deliberately does not include LibTorch: batches are plain std::vectors, and the
// worker turns them into tensors (see worker/model.h).
//
// Sharding follows PyTorch's DistributedSampler. Every worker computes the same permutation of
// the training set for each epoch (EpochPermutation), and worker `rank` of `world_size` takes
// the positions p of that permutation with p % world_size == rank. Batches are consecutive
// groups of `batch_size` of those positions, so batch t of worker r in an epoch is
//
//   { perm[(t * B + j) * W + r] : j in [0, B) }
//
// and the union over all ranks of batch t is perm[t*B*W, (t+1)*B*W): exactly batch t of a
// single process running with batch size B*W. Every worker has the same number of steps per
// epoch, floor(size / (B*W)); the remaining size % (B*W) samples at the end of each epoch's
// permutation are dropped (which samples those are changes from epoch to epoch).
//
// Error codes: a missing file is NOT_FOUND; any problem with a file's contents (bad magic
// number, truncated or over-long data, corrupt gzip stream, image/label count mismatch, label
// out of range) is INVALID_ARGUMENT; other I/O failures map errno to a code. Messages name the
// file.
#ifndef GRADMESH_WORKER_DATASET_H_
#define GRADMESH_WORKER_DATASET_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace gradmesh {

// Images with one label each, as stored in IDX files: `size` images of rows x cols bytes.
struct ImageSet {
  int64_t size = 0;
  int32_t rows = 0;
  int32_t cols = 0;
  std::vector<uint8_t> pixels;  // size * rows * cols, image-major then row-major.
  std::vector<uint8_t> labels;  // size.
};

// Reads an IDX image file (magic 0x00000803: count, rows, cols, then pixels) and an IDX label
// file (magic 0x00000801: count, then labels). Header integers are big-endian. Files are read
// through zlib, so each may be gzipped or plain. The two counts must match and each file must
// hold exactly the bytes its header announces.
absl::StatusOr<ImageSet> LoadIdxPair(const std::string& images_path,
                                     const std::string& labels_path);

// The training and test sets of a dataset, with the per-pixel normalisation constants
// (applied to pixel / 255) and the number of classes.
struct DatasetFiles {
  ImageSet train;
  ImageSet test;
  float mean = 0;
  float stddev = 1;
  int num_classes = 0;
};

// Loads dataset `name` ("mnist" or "fashion-mnist"; anything else is INVALID_ARGUMENT) from
// directory `dir`, which must hold train-images-idx3-ubyte, train-labels-idx1-ubyte,
// t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte, each optionally with a ".gz" suffix (the
// plain file wins if both exist). Also checks that train and test images have the same
// dimensions and that every label is below num_classes (INVALID_ARGUMENT otherwise).
absl::StatusOr<DatasetFiles> LoadDataset(const std::string& name, const std::string& dir);

// Names LoadDataset() accepts, sorted.
std::vector<std::string> KnownDatasets();

// A mini-batch, normalised and ready to become tensors.
struct Batch {
  int64_t size = 0;              // Samples in this batch.
  std::vector<float> x;          // size * rows * cols values, (pixel / 255 - mean) / stddev.
  std::vector<int64_t> y;        // size labels.
  std::vector<int64_t> indices;  // size sample indices into the ImageSet, in batch order.
  int64_t epoch = 0;             // Epoch this batch belongs to (0-based).
  int64_t step = 0;              // Step index within the worker's whole run, 0-based.
};

// Produces one worker's shard of shuffled training batches, epoch after epoch, prepared ahead
// of time by a background thread into a bounded queue.
//
// Thread safety: Next() may be called from any thread (calls are serialised and each batch is
// returned exactly once), the other methods are const and safe anywhere. The ImageSet passed
// to Create() must outlive the loader and must not change while it exists. Destroying the
// loader stops and joins the prefetch thread promptly, even if batches remain unconsumed;
// it must not race with a Next() call in another thread.
class BatchLoader {
 public:
  struct Options {
    int32_t rank = 0;         // This worker, in [0, world_size).
    int32_t world_size = 1;   // Number of workers sharing the data (> 0).
    int64_t batch_size = 64;  // Samples per batch per worker (> 0).
    int64_t epochs = 1;       // Passes over the data (>= 0); ignored when max_steps > 0.
    // 0: produce epochs * steps_per_epoch() batches. > 0: produce exactly max_steps batches,
    // cycling through as many epochs as needed (the last one possibly partial).
    int64_t max_steps = 0;
    uint64_t seed = 1;       // Data-order seed; must be the same on every worker.
    int prefetch_depth = 4;  // Batches prepared ahead (> 0).
    // Resume: the first batch produced is the one of overall step first_step (>= 0); the
    // batches before it are skipped, so a resumed run sees exactly the data it would have.
    int64_t first_step = 0;
  };

  // Validates `options` against `images` (INVALID_ARGUMENT on an out-of-range field, a null
  // or empty image set, a non-positive or non-finite stddev, or a non-empty run in which
  // batch_size * world_size exceeds the image count) and starts the prefetch thread.
  static absl::StatusOr<std::unique_ptr<BatchLoader>> Create(const ImageSet* images, float mean,
                                                             float stddev, const Options& options);

  // The permutation of [0, n) used in `epoch` for data-order `seed`. A std::mt19937_64 is
  // seeded through std::seed_seq with the 32-bit halves of seed and epoch (both fully
  // specified by the C++ standard), then a Fisher-Yates shuffle draws swap position j for
  // index i as rng() % (i + 1). The slight modulo bias is irrelevant here; what matters is
  // that the result is identical on every platform and every worker (unlike
  // std::shuffle / std::uniform_int_distribution, whose algorithms are unspecified).
  static std::vector<int64_t> EpochPermutation(int64_t n, uint64_t seed, int64_t epoch);

  ~BatchLoader();
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  // Returns the next batch, blocking until the prefetch thread has made it, or nullopt once
  // the batches of steps [first_step, total_steps()) have been returned (and on every later
  // call).
  std::optional<Batch> Next();

  // Batches per full epoch for every worker: floor(size / (batch_size * world_size)).
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  // Batches this loader produces in all: max_steps if > 0, else epochs * steps_per_epoch().
  int64_t total_steps() const { return total_steps_; }
  const Options& options() const { return options_; }

 private:
  // Arguments already validated by Create().
  BatchLoader(const ImageSet* images, float mean, float stddev, const Options& options,
              int64_t steps_per_epoch);

  // Body of the prefetch thread.
  void Produce();
  // Builds batch `t` of `epoch` (overall step `step`) from that epoch's permutation.
  Batch MakeBatch(const std::vector<int64_t>& perm, int64_t epoch, int64_t t, int64_t step) const;

  const ImageSet* const images_;
  const Options options_;
  const int64_t steps_per_epoch_;
  const int64_t total_steps_;
  float lut_[256];  // Normalised value of each pixel byte; written only in the constructor.

  absl::Mutex mu_;
  absl::CondVar not_empty_;  // Signalled when a batch is queued or production ends.
  absl::CondVar not_full_;   // Signalled when a batch is taken or stop_ is set.
  std::deque<Batch> queue_ ABSL_GUARDED_BY(mu_);
  bool producer_done_ ABSL_GUARDED_BY(mu_) = false;  // All batches have been queued.
  bool stop_ ABSL_GUARDED_BY(mu_) = false;           // The destructor asks the thread to end.

  std::thread thread_;  // Started last in Create(), joined in the destructor.
};

// Cuts `images` into batches of `batch_size` in index order (no shuffling), keeping the last
// partial batch, normalised like BatchLoader's. Batch i has epoch 0 and step i. Returns no
// batches if batch_size <= 0 or the set is empty. Thread safety: pure function.
std::vector<Batch> MakeEvalBatches(const ImageSet& images, float mean, float stddev,
                                   int64_t batch_size);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_DATASET_H_
