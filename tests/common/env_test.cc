#include "common/env.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>

namespace conveyor::env {
namespace {

// Sets a variable for one test and puts back what was there.
class Variable {
 public:
  Variable(const char* name, const char* value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old, had_ = true;
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~Variable() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(Env, SwitchesAreOnUnlessZero) {
  {
    Variable v("CONVEYOR_UCX_SHM", nullptr);
    EXPECT_TRUE(ucx_shared_memory_allowed());
  }
  {
    Variable v("CONVEYOR_UCX_SHM", "0");
    EXPECT_FALSE(ucx_shared_memory_allowed());
  }
  {
    Variable v("CONVEYOR_MEMORY_METER", "1");
    EXPECT_TRUE(memory_meter_enabled());
  }
  {
    Variable v("CONVEYOR_MESSAGE_POOL", "0");
    EXPECT_FALSE(message_pool_enabled());
  }
  {
    Variable v("CONVEYOR_UCX_CUDA", "0");
    EXPECT_FALSE(ucx_cuda_allowed());
  }
}

TEST(Env, RegionSizeInMebibytesDefault1024NoneWhenNotPositive) {
  {
    Variable v("CONVEYOR_UCX_REGION_MB", nullptr);
    EXPECT_EQ(ucx_region_bytes(), std::size_t{1024} << 20);
  }
  {
    Variable v("CONVEYOR_UCX_REGION_MB", "8");
    EXPECT_EQ(ucx_region_bytes(), std::size_t{8} << 20);
  }
  {
    Variable v("CONVEYOR_UCX_REGION_MB", "0");
    EXPECT_EQ(ucx_region_bytes(), 0u);
  }
}

TEST(Env, UcxSettingsTheUserGaveAndThreadsAsked) {
  {
    Variable v("UCX_TLS", "tcp");
    EXPECT_TRUE(ucx_setting_given("TLS"));
  }
  {
    Variable v("UCX_TLS", nullptr);
    EXPECT_FALSE(ucx_setting_given("TLS"));
  }
  {
    Variable v("OMP_NUM_THREADS", "3");
    EXPECT_EQ(openmp_threads(), 3);
  }
  {
    Variable v("OMP_NUM_THREADS", "many");
    EXPECT_EQ(openmp_threads(), 0);
  }
}

}  // namespace
}  // namespace conveyor::env
