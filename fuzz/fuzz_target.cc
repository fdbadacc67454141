// A libFuzzer target for one reader, chosen when it is built (-DCONVEYOR_FUZZ_READER="plan"):
// any crash, sanitizer report or leak is a bug; an error Status is the right answer to junk.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz/readers.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  (void)conveyor::fuzz::read_as(CONVEYOR_FUZZ_READER, std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
