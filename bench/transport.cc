// Transport bandwidth and latency: the UCX Endpoint between two members of this process
// (loopback tcp, the path two processes on one machine take) against a plain memcpy of the
// same bytes, from 1 KB to 256 MB; small-message round-trip latency; allreduce over UCX
// (transport/endpoint_group.h) among --group members, its bus bandwidth (bytes x 2(n-1)/n
// per second, what each member's link carries) against the ring bound: a member's link
// cannot beat point-to-point bandwidth, measured above at the same size.
//
//   ./run bench transport [--max-mb 256] [--iters 20] [--group 4]
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "transport/endpoint_group.h"
#include "transport/ucx.h"

using namespace conveyor;
using namespace conveyor::transport;
using Clock = std::chrono::steady_clock;

namespace {

// One message from member 0 to member 1, timed until member 1 holds it.
double one_way_s(std::vector<std::shared_ptr<Endpoint>>& w, const at::Tensor& t, Tag tag) {
  const auto start = Clock::now();
  auto pending = std::async(std::launch::async, [&] { return receive_within(*w[1], 0, tag); });
  w[0]->send(1, tag, {t}, [](Status) {});
  auto got = pending.get();
  if (!got.is_ok()) {
    std::fprintf(stderr, "transfer failed: %s\n", got.status().to_string().c_str());
    std::exit(1);
  }
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Allreduce of float32 tensors among `n` members of this process, each on a thread of its
// own (as the replicas of a stage); bus bandwidth against the point-to-point bound.
int allreduce_bus_bandwidth(int n, int iters, std::int64_t max_mb, const std::map<std::int64_t, double>& p2p) {
  auto world = make_ucx_world_in_process(n);
  if (!world.is_ok()) {
    std::fprintf(stderr, "UCX cannot run here: %s\n", world.status().to_string().c_str());
    return 1;
  }
  std::vector<int> ranks(static_cast<std::size_t>(n));
  std::iota(ranks.begin(), ranks.end(), 0);
  std::vector<std::shared_ptr<EndpointGroup>> group;
  for (int i = 0; i < n; ++i) group.push_back(*make_endpoint_group((*world)[i], ranks, 0));
  std::printf("\nallreduce over UCX, %d members (threads of this process); median of %d\n", n, iters);
  std::printf("%10s %12s %14s %16s %10s\n", "bytes", "time ms", "bus GB/s", "p2p bound GB/s", "ratio");
  for (std::int64_t bytes = 1 << 20; bytes <= std::min<std::int64_t>(max_mb, 64) << 20; bytes *= 4) {
    std::vector<at::Tensor> ts;
    for (int i = 0; i < n; ++i) ts.push_back(at::ones({bytes / 4}, at::kFloat));
    std::vector<double> times;
    const int rounds = bytes >= (16 << 20) ? std::max(3, iters / 4) : iters;
    for (int k = 0; k <= rounds; ++k) {  // the first round warms up
      const auto start = Clock::now();
      std::vector<std::thread> threads;
      std::atomic<int> failed{0};
      for (int i = 0; i < n; ++i) {
        threads.emplace_back([&, i] {
          if (!wait_for([&](Done d) { group[i]->allreduce(ts[i], d); }).is_ok()) ++failed;
        });
      }
      for (auto& t : threads) t.join();
      if (failed) {
        std::fprintf(stderr, "allreduce failed\n");
        return 1;
      }
      if (k > 0) times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
    const double t = median(times), bus = static_cast<double>(bytes) * 2 * (n - 1) / n / t / 1e9;
    auto bound = p2p.lower_bound(bytes);
    const double b = bound == p2p.end() ? 0 : bound->second;
    std::printf("%10lld %12.3f %14.3f %16.3f %9.3fx\n", static_cast<long long>(bytes), t * 1e3, bus, b, b > 0 ? bus / b : 0);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t max_mb = 256;
  int iters = 20, members = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--max-mb") max_mb = std::atoll(argv[i + 1]);
    if (std::string(argv[i]) == "--iters") iters = std::atoi(argv[i + 1]);
    if (std::string(argv[i]) == "--group") members = std::max(2, std::atoi(argv[i + 1]));
  }
  setenv("UCX_NET_DEVICES", "lo", 0);
  auto world = make_ucx_world_in_process(2);
  if (!world.is_ok()) {
    std::fprintf(stderr, "UCX cannot run here: %s\n", world.status().to_string().c_str());
    return 1;
  }
  auto& w = *world;
  std::printf("UCX endpoint, 2 members in one process over loopback tcp; median of %d\n", iters);
  std::printf("%10s %14s %14s %10s\n", "bytes", "ucx GB/s", "memcpy GB/s", "ratio");
  Tag tag = 1;
  std::map<std::int64_t, double> p2p;  // bytes -> GB/s
  for (std::int64_t bytes = 1 << 10; bytes <= max_mb << 20; bytes *= 4) {
    at::Tensor t = at::randint(0, 255, {bytes}, at::kByte);
    at::Tensor dst = at::empty_like(t);
    const int n = bytes >= (64 << 20) ? std::max(3, iters / 4) : iters;
    one_way_s(w, t, tag++);  // warm-up: connection, allocator
    std::vector<double> ucx, copy;
    for (int k = 0; k < n; ++k) {
      ucx.push_back(one_way_s(w, t, tag++));
      const auto start = Clock::now();
      std::memcpy(dst.data_ptr(), t.data_ptr(), static_cast<std::size_t>(bytes));
      copy.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
    const double u = static_cast<double>(bytes) / median(ucx) / 1e9, c = static_cast<double>(bytes) / median(copy) / 1e9;
    std::printf("%10lld %14.3f %14.3f %9.3fx\n", static_cast<long long>(bytes), u, c, u / c);
    p2p[bytes] = u;
  }
  // Latency: 8-byte ping-pong with an echo thread, half the round trip.
  at::Tensor small = at::zeros({1}, at::kLong);
  const int pings = 10 * iters;
  const Tag first = tag;
  std::thread echo([&] {
    for (int k = 0; k < pings; ++k) {
      auto got = receive_within(*w[1], 0, first + k);
      w[1]->send(0, first + k, *got, [](Status) {});
    }
  });
  std::vector<double> rtt;
  for (int k = 0; k < pings; ++k) {
    const auto start = Clock::now();
    w[0]->send(1, first + k, {small}, [](Status) {});
    auto back = receive_within(*w[0], 1, first + k);
    rtt.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  echo.join();
  std::printf("small-message latency (half the round trip of 8 bytes): %.1f us\n", median(rtt) / 2 * 1e6);
  world->clear();
  return allreduce_bus_bandwidth(members, iters, max_mb, p2p);
}
