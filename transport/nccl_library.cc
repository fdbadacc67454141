#include "transport/nccl_library.h"

#include <c10/core/CPUAllocator.h>
#include <dlfcn.h>

#include <filesystem>
#include <mutex>
#include <vector>

#include "common/env.h"

namespace conveyor::transport {
namespace {

// The directory holding torch's libraries (libc10.so), or empty.
std::string torch_library_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&c10::GetCPUAllocator), &info) == 0 || info.dli_fname == nullptr) return "";
  return std::filesystem::path(info.dli_fname).parent_path().string();
}

template <typename F>
Status resolve(void* handle, const char* name, F*& slot, const std::string& path) {
  slot = reinterpret_cast<F*>(dlsym(handle, name));
  if (slot == nullptr) {
    return Status(ErrorCode::kUnsupported, path + " has no " + name + ": it is not NCCL, or an NCCL older than 2.18; "
                                               "set CONVEYOR_NCCL_LIBRARY to a newer libnccl.so.2");
  }
  return Status::ok();
}

}  // namespace

std::string NcclLibrary::version_text() const {
  // NCCL_VERSION(X, Y, Z): X * 10000 + Y * 100 + Z since 2.9 (X * 1000 + Y * 100 + Z before).
  const int major = version >= 10000 ? version / 10000 : version / 1000;
  const int minor = version >= 10000 ? (version % 10000) / 100 : (version % 1000) / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(version % 100);
}

Status NcclLibrary::check(R result, const std::string& what, Comm comm) const {
  if (result == nccl_abi::kSuccess) return Status::ok();
  std::string text = "NCCL " + what + " failed: " + GetErrorString(result);
  if (comm != nullptr) {
    const char* last = GetLastError(comm);
    if (last != nullptr && *last != '\0') text += " (" + std::string(last) + ")";
  }
  return Status(ErrorCode::kExecution, text);
}

Result<NcclLibrary> open_nccl_library(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);  // never closed: NCCL lives as long as the process
  if (handle == nullptr) {
    const char* why = dlerror();
    return Status(ErrorCode::kUnsupported, "cannot open NCCL at " + path + ": " + (why ? why : "unknown error"));
  }
  NcclLibrary lib;
  lib.path = path;
  for (Status s : {resolve(handle, "ncclGetVersion", lib.GetVersion, path),
                   resolve(handle, "ncclGetUniqueId", lib.GetUniqueId, path),
                   resolve(handle, "ncclCommInitRank", lib.CommInitRank, path),
                   resolve(handle, "ncclCommDestroy", lib.CommDestroy, path),
                   resolve(handle, "ncclCommAbort", lib.CommAbort, path),
                   resolve(handle, "ncclCommGetAsyncError", lib.CommGetAsyncError, path),
                   resolve(handle, "ncclGetErrorString", lib.GetErrorString, path),
                   resolve(handle, "ncclGetLastError", lib.GetLastError, path),
                   resolve(handle, "ncclAllReduce", lib.AllReduce, path),
                   resolve(handle, "ncclReduce", lib.Reduce, path),
                   resolve(handle, "ncclBroadcast", lib.Broadcast, path),
                   resolve(handle, "ncclAllGather", lib.AllGather, path),
                   resolve(handle, "ncclReduceScatter", lib.ReduceScatter, path),
                   resolve(handle, "ncclSend", lib.Send, path),
                   resolve(handle, "ncclRecv", lib.Recv, path),
                   resolve(handle, "ncclGroupStart", lib.GroupStart, path),
                   resolve(handle, "ncclGroupEnd", lib.GroupEnd, path)}) {
    CONVEYOR_RETURN_IF_ERROR(s);
  }
  if (lib.GetVersion(&lib.version) != nccl_abi::kSuccess) {
    return Status(ErrorCode::kUnsupported, "NCCL at " + path + " does not report its version");
  }
  if (lib.version < kOldestNccl) {
    return Status(ErrorCode::kUnsupported, "NCCL at " + path + " is version " + lib.version_text() +
                                               "; conveyor needs 2.18 or newer (set CONVEYOR_NCCL_LIBRARY)");
  }
  return lib;
}

Result<const NcclLibrary*> nccl_library() {
  static std::once_flag once;
  static Result<NcclLibrary> loaded = Status(ErrorCode::kUnsupported, "NCCL was not looked for");
  std::call_once(once, [] {
    if (std::string explicit_path = env::nccl_library(); !explicit_path.empty()) {
      loaded = open_nccl_library(explicit_path);
      if (!loaded.is_ok()) loaded = Status(loaded.status().code(), loaded.status().message() + " (from CONVEYOR_NCCL_LIBRARY)");
      return;
    }
    std::vector<std::string> candidates{"libnccl.so.2"};
    if (std::string torch_dir = torch_library_dir(); !torch_dir.empty()) {
      candidates.push_back(torch_dir + "/../../nvidia/nccl/lib/libnccl.so.2");
    }
    candidates.push_back("/usr/local/cuda/lib64/libnccl.so.2");
    std::string tried;
    for (const std::string& path : candidates) {
      loaded = open_nccl_library(path);
      if (loaded.is_ok()) return;
      tried += "\n  " + loaded.status().message();
    }
    loaded = Status(ErrorCode::kUnsupported,
                    "NCCL not found; install torch with CUDA (it brings libnccl.so.2) or set CONVEYOR_NCCL_LIBRARY "
                    "to the library's path. Tried:" + tried);
  });
  if (!loaded.is_ok()) return loaded.status();
  return &*loaded;
}

}  // namespace conveyor::transport
