// The "tensors" dataset: samples from files written by PyTorch's
//
//   torch.save({"x": X, "y": Y}, "train-00000.pt")
//
// read without LibTorch and without loading the tensors. A .pt file (torch >= 1.6) is a zip
// archive of uncompressed entries: <archive>/data.pkl (a pickle of the dict whose tensors
// refer to storages by key), <archive>/data/<key> (each storage's raw little-endian bytes),
// <archive>/version. OpenTensorFiles reads the zip central directory (zip64 included) and
// runs a minimal pickle machine over data.pkl that builds nothing but the dtype, storage key,
// storage offset, size and stride of each tensor; Read() then preads one sample's bytes at
// the storage entry's data offset.
//
// Requirements on the files, each refused with INVALID_ARGUMENT naming the file:
// * keys "x" and "y" both present and both tensors (other keys are ignored), each with a
//   leading sample dimension, the same length N in x and y, row-major contiguous (a view made
//   with .t(), .permute() or slicing a non-leading dimension must be saved as .contiguous()),
//   and samples of at least one element;
// * dtypes float32/float64/float16/bfloat16/int64/int32/int16/int8/uint8/bool;
// * entries stored, not compressed (torch.save never compresses);
// * every file of the set has the same x and y dtypes and per-sample shapes.
// Hostile input (truncated files, sizes that lie, absurd numbers, other pickles) is refused
// the same way; nothing is allocated on the strength of a size read from the file before it
// has been checked against the file's real size.
#ifndef GRADMESH_WORKER_CORE_TENSOR_FILES_H_
#define GRADMESH_WORKER_CORE_TENSOR_FILES_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/core/examples.h"

namespace gradmesh {

// Opens every regular file <dir>/<prefix>*.pt ("train" or "test"), in byte order of the names,
// as one source: sample i of the concatenation. Keeps one open descriptor per file for the
// source's lifetime; Read() uses pread only and is safe from any number of threads.
//
// Errors: no matching file (or no such directory): NOT_FOUND naming dir and the pattern; a
// file that cannot be opened: its errno's code; any problem with a file's contents:
// INVALID_ARGUMENT naming the file (and the key, the shapes, the lengths where relevant).
// Read() of an index outside [0, size()) is OUT_OF_RANGE; an I/O failure or a file that
// shrank since it was opened names the file and the sample.
absl::StatusOr<std::unique_ptr<ExampleSource>> OpenTensorFiles(const std::string& dir,
                                                               const std::string& prefix);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_CORE_TENSOR_FILES_H_
