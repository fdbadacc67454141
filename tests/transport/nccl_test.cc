// The NCCL backend without a GPU: the C ABI conveyor declares against the toolkit's nccl.h
// (where the header exists), loading the library and what it says when it cannot, unique
// ids, and the errors for groups that cannot be made. Groups on a GPU are tested from
// Python (tests/python/test_nccl.py), where torch's CUDA is loaded.
#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <gtest/gtest.h>

#include <iostream>
#include <type_traits>

#include "transport/nccl.h"
#include "transport/nccl_library.h"

#ifdef CONVEYOR_HAVE_NCCL_H
#include <nccl.h>
#endif

namespace conveyor::transport {
namespace {

#ifdef CONVEYOR_HAVE_NCCL_H
// Every value and size conveyor declares (nccl_library.h) is nccl.h's.
static_assert(sizeof(ncclResult_t) == sizeof(nccl_abi::Result));
static_assert(sizeof(ncclDataType_t) == sizeof(nccl_abi::DataType));
static_assert(sizeof(ncclRedOp_t) == sizeof(nccl_abi::RedOp));
static_assert(sizeof(ncclUniqueId) == sizeof(nccl_abi::UniqueId));
static_assert(std::is_same_v<ncclComm_t, nccl_abi::Comm>);
static_assert(std::is_same_v<cudaStream_t, nccl_abi::Stream>);
static_assert(ncclSuccess == nccl_abi::kSuccess && ncclInProgress == nccl_abi::kInProgress);
static_assert(ncclSum == nccl_abi::kSum);
static_assert(ncclInt8 == nccl_abi::kInt8 && ncclUint8 == nccl_abi::kUint8 && ncclInt32 == nccl_abi::kInt32 &&
              ncclUint32 == nccl_abi::kUint32 && ncclInt64 == nccl_abi::kInt64 && ncclUint64 == nccl_abi::kUint64 &&
              ncclFloat16 == nccl_abi::kFloat16 && ncclFloat32 == nccl_abi::kFloat32 &&
              ncclFloat64 == nccl_abi::kFloat64 && ncclBfloat16 == nccl_abi::kBfloat16 &&
              ncclFloat8e4m3 == nccl_abi::kFloat8e4m3 && ncclFloat8e5m2 == nccl_abi::kFloat8e5m2);

// The function pointers conveyor resolves have nccl.h's parameter lists, value for value
// (enums as the ints they are).
using R = nccl_abi::Result;
using T = nccl_abi::DataType;
using C = nccl_abi::Comm;
using S = nccl_abi::Stream;
static_assert(std::is_same_v<decltype(NcclLibrary::AllReduce), R (*)(const void*, void*, std::size_t, T, int, C, S)>);
static_assert(std::is_same_v<decltype(&ncclAllReduce),
                             ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t)>);
static_assert(std::is_same_v<decltype(&ncclSend),
                             ncclResult_t (*)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t)>);
static_assert(std::is_same_v<decltype(&ncclReduceScatter), ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t,
                                                                            ncclRedOp_t, ncclComm_t, cudaStream_t)>);
static_assert(std::is_same_v<decltype(&ncclCommInitRank), ncclResult_t (*)(ncclComm_t*, int, ncclUniqueId, int)>);
constexpr bool kCheckedAgainstHeader = true;
#else
constexpr bool kCheckedAgainstHeader = false;
#endif

TEST(NcclAbi, DeclarationsMatchTheToolkitHeader) {
  if (!kCheckedAgainstHeader) GTEST_SKIP() << "no nccl.h under /usr/local/cuda/include: the ABI was not checked";
  SUCCEED() << "checked at compile time against nccl.h";
}

TEST(NcclLibrary, AMissingLibraryIsNamed) {
  auto lib = open_nccl_library("/nonexistent/libnccl.so.2");
  ASSERT_FALSE(lib.is_ok());
  EXPECT_EQ(lib.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(lib.status().message().find("/nonexistent/libnccl.so.2"), std::string::npos) << lib.status().message();
}

TEST(NcclLibrary, ALibraryThatIsNotNcclIsNamed) {
  auto lib = open_nccl_library("libc.so.6");
  ASSERT_FALSE(lib.is_ok());
  EXPECT_NE(lib.status().message().find("has no ncclGetVersion"), std::string::npos) << lib.status().message();
}

TEST(NcclLibrary, LoadsWithVersionAndUniqueIds) {
  auto lib = nccl_library();
  if (!lib.is_ok()) GTEST_SKIP() << lib.status().message();
  EXPECT_GE((*lib)->version, kOldestNccl);
  EXPECT_EQ((*lib)->check(nccl_abi::kSuccess, "nothing").is_ok(), true);
  Status invalid = (*lib)->check(4, "ncclAllReduce");  // ncclInvalidArgument
  EXPECT_NE(invalid.message().find("NCCL ncclAllReduce failed: invalid argument"), std::string::npos)
      << invalid.message();
  auto described = nccl_description();
  ASSERT_TRUE(described.is_ok());
  std::cout << "loaded " << *described << "\n";
  EXPECT_NE(described->find("NCCL " + (*lib)->version_text()), std::string::npos);

  // Ids name a bootstrap address: fresh ones differ. NCCL needs a network interface for
  // them; tests use loopback.
  setenv("NCCL_SOCKET_IFNAME", "lo", /*overwrite=*/0);
  auto a = nccl_unique_id(), b = nccl_unique_id();
  ASSERT_TRUE(a.is_ok()) << a.status().message();
  ASSERT_TRUE(b.is_ok()) << b.status().message();
  EXPECT_EQ(a->size(), 128u);
  EXPECT_NE(*a, *b);
}

TEST(NcclGroup, RefusesWhatCannotHoldAMember) {
  const std::vector<std::uint8_t> id(128, 0);
  auto cpu = make_nccl_group(0, 1, id, c10::Device(c10::kCPU));
  ASSERT_FALSE(cpu.is_ok());
  EXPECT_NE(cpu.status().message().find("CUDA devices, not cpu"), std::string::npos) << cpu.status().message();

  auto rank = make_nccl_group(2, 2, id, c10::Device(c10::kCUDA, 0));
  ASSERT_FALSE(rank.is_ok());
  EXPECT_NE(rank.status().message().find("rank 2 of 2"), std::string::npos) << rank.status().message();

  auto short_id = make_nccl_group(0, 1, std::vector<std::uint8_t>(16), c10::Device(c10::kCUDA, 0));
  ASSERT_FALSE(short_id.is_ok());
  EXPECT_NE(short_id.status().message().find("not 16"), std::string::npos) << short_id.status().message();

  // Without a GPU (or without torch's CUDA) the group says so instead of failing inside NCCL.
  if (c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA) &&
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->deviceCount() > 0) {
    GTEST_SKIP() << "this machine has a GPU: groups on it are tested in tests/python/test_nccl.py";
  }
  auto no_cuda = make_nccl_group(0, 1, id, c10::Device(c10::kCUDA, 0));
  ASSERT_FALSE(no_cuda.is_ok());
  EXPECT_EQ(no_cuda.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(no_cuda.status().message().find("NCCL needs a GPU"), std::string::npos) << no_cuda.status().message();
}

}  // namespace
}  // namespace conveyor::transport
