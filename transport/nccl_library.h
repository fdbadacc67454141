// NCCL, loaded at run time. conveyor declares the part of NCCL's C ABI it calls (below,
// checked against the toolkit's nccl.h by tests/transport/nccl_test.cc wherever that header
// exists) and opens the library with dlopen the first time an NCCL group is made, so one
// build serves machines with and without a GPU, and the NCCL it runs is the one torch
// already loaded (torch's CUDA wheels bring libnccl.so.2).
//
// Where the library is looked for, first found wins:
//   CONVEYOR_NCCL_LIBRARY      an explicit path (nothing else is tried)
//   libnccl.so.2               already loaded (torch's CUDA build), or on the loader's path
//   <torch>/../nvidia/nccl/lib torch's own copy, next to the torch package
//   /usr/local/cuda/lib64      the CUDA toolkit's
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"

struct ncclComm;     // NCCL's communicator (opaque)
struct CUstream_st;  // a CUDA stream (opaque; c10::Stream::native_handle() on CUDA)

namespace conveyor::transport::nccl_abi {

// Values as nccl.h defines them (ncclResult_t, ncclDataType_t, ncclRedOp_t: C enums, int-sized).
using Result = int;
constexpr Result kSuccess = 0, kInProgress = 7;
using DataType = int;
constexpr DataType kInt8 = 0, kUint8 = 1, kInt32 = 2, kUint32 = 3, kInt64 = 4, kUint64 = 5, kFloat16 = 6, kFloat32 = 7,
                   kFloat64 = 8, kBfloat16 = 9, kFloat8e4m3 = 10, kFloat8e5m2 = 11;
using RedOp = int;
constexpr RedOp kSum = 0;
constexpr std::size_t kUniqueIdBytes = 128;
/// NCCL's unique id, as bytes.
struct UniqueId {
  char internal[kUniqueIdBytes];
};
using Comm = ncclComm*;
using Stream = CUstream_st*;

}  // namespace conveyor::transport::nccl_abi

namespace conveyor::transport {

/// The NCCL functions conveyor calls, resolved from the loaded library.
struct NcclLibrary {
  using R = nccl_abi::Result;
  using T = nccl_abi::DataType;
  using Comm = nccl_abi::Comm;
  using Stream = nccl_abi::Stream;
  R (*GetVersion)(int*);
  R (*GetUniqueId)(nccl_abi::UniqueId*);
  R (*CommInitRank)(Comm*, int, nccl_abi::UniqueId, int);
  R (*CommDestroy)(Comm);
  R (*CommAbort)(Comm);
  R (*CommGetAsyncError)(Comm, R*);
  const char* (*GetErrorString)(R);
  const char* (*GetLastError)(Comm);
  R (*AllReduce)(const void*, void*, std::size_t, T, nccl_abi::RedOp, Comm, Stream);
  R (*Reduce)(const void*, void*, std::size_t, T, nccl_abi::RedOp, int, Comm, Stream);
  R (*Broadcast)(const void*, void*, std::size_t, T, int, Comm, Stream);
  R (*AllGather)(const void*, void*, std::size_t, T, Comm, Stream);
  R (*ReduceScatter)(const void*, void*, std::size_t, T, nccl_abi::RedOp, Comm, Stream);
  R (*Send)(const void*, std::size_t, T, int, Comm, Stream);
  R (*Recv)(void*, std::size_t, T, int, Comm, Stream);
  R (*GroupStart)();
  R (*GroupEnd)();

  std::string path;  ///< the file it was loaded from
  int version = 0;   ///< NCCL_VERSION_CODE of the loaded library (2.28.9: 22809)

  /// "2.28.9".
  std::string version_text() const;
  /// kSuccess as OK; anything else an error naming `what` and NCCL's explanation (and the
  /// communicator's last error, when given).
  Status check(R result, const std::string& what, Comm comm = nullptr) const;
};

/// The process's NCCL (opened once, as the header says), or why it cannot be had.
Result<const NcclLibrary*> nccl_library();

/// Opens the NCCL library at `path` (a file, or a name for the loader to find): tests, and
/// nccl_library() itself. Errors name the path and what the loader said.
Result<NcclLibrary> open_nccl_library(const std::string& path);

/// The oldest NCCL conveyor runs on: 2.18 (every call above, with ncclCommGetAsyncError and
/// ncclGetLastError).
constexpr int kOldestNccl = 21800;

}  // namespace conveyor::transport
