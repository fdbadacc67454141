// Transport bandwidth and latency between two processes of this host (forked; shared memory
// unless CONVEYOR_UCX_SHM=0, then loopback tcp): the UCX Endpoint's point-to-point
// throughput (a stream of messages, 64 MB or more, acknowledged at the end; the median of
// several streams) against a plain memcpy of the same bytes, alternated round by round,
// from 1 KB to 256 MB; small-message latency (half an 8-byte round trip); allreduce over UCX
// (transport/endpoint_group.h) between the two processes, and among --group members
// (threads of one process, as a stage's replicas): its bus bandwidth (bytes x 2(n-1)/n per
// second, what each member's link carries) against the ring bound: a member's link cannot
// beat point-to-point bandwidth, measured above at the same size.
//
// With `--device cuda` (a GPU machine), the stream's tensors are CUDA tensors, moved from
// device memory into the receiver's by UCX's CUDA transports (cuda_ipc between the processes
// of one GPU), against a device-to-device copy (cudaMemcpy through torch's copy_).
//
//   ./run bench transport [--min-kb 1] [--max-mb 256] [--iters 20] [--group 4] [--device cpu|cuda]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sys/wait.h>
#include <unistd.h>

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

#include "transport/cuda_memory.h"
#include "transport/endpoint_group.h"
#include "transport/ucx.h"

using namespace conveyor;
using namespace conveyor::transport;
using Clock = std::chrono::steady_clock;

namespace {

bool on_cuda = false;  // --device cuda: the point-to-point stream moves CUDA tensors
std::int64_t min_kb = 1;  // --min-kb: the smallest size measured (1 KB; powers of 4 from there)

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Writes and reads whole buffers over a pipe (the two processes' address exchange): `io`
// is write or read, called until all `n` bytes went.
template <class Io, class Byte>
bool whole(Io io, int fd, Byte* p, std::size_t n) {
  while (n > 0) {
    const ssize_t k = io(fd, p, n);
    if (k <= 0) return false;
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}
bool write_all(int fd, const void* data, std::size_t n) { return whole(::write, fd, static_cast<const char*>(data), n); }
bool read_all(int fd, void* data, std::size_t n) { return whole(::read, fd, static_cast<char*>(data), n); }

// This process's member `rank` of two, connected to the other through the pipes.
std::shared_ptr<UcxEndpoint> member_of_two(int rank, int out, int in) {
  auto made = make_ucx_endpoint(rank, 2, "process", "lo");
  if (!made.is_ok()) {
    std::fprintf(stderr, "UCX cannot run here: %s\n", made.status().to_string().c_str());
    std::exit(1);
  }
  auto me = *made;
  const std::vector<std::uint8_t> mine = me->address();
  const std::uint64_t n = mine.size();
  std::uint64_t m = 0;
  if (!write_all(out, &n, sizeof n) || !write_all(out, mine.data(), mine.size()) || !read_all(in, &m, sizeof m)) std::exit(1);
  std::vector<std::uint8_t> theirs(m);
  if (!read_all(in, theirs.data(), m)) std::exit(1);
  if (Status s = me->connect(1 - rank, theirs); !s) {
    std::fprintf(stderr, "connecting: %s\n", s.to_string().c_str());
    std::exit(1);
  }
  return me;
}

// Messages in one size's stream: `iters`, and below 64 MB enough for 64 MB in all (at most
// 2,000), so that the stream's one acknowledgement and the threads' wake-ups are a small part
// of it, as in ucx_perftest's 2,000-message runs; from 64 MB a quarter of `iters`.
int messages_per_stream(std::int64_t bytes, int iters) {
  if (bytes >= (64 << 20)) return std::max(3, iters / 4);
  return static_cast<int>(std::clamp<std::int64_t>((std::int64_t{64} << 20) / bytes, iters, std::max(iters, 2000)));
}

// Streams measured per size, after one that warms up: the median is reported, with the
// slowest and fastest (two processes' copies on two shared cores: some streams get the
// cores together, some do not).
int measured_streams(std::int64_t bytes) { return bytes >= (64 << 20) ? 3 : 5; }

// Receives a stream's receiver has posted at a time: two below 64 MB; one from there, where
// a message dwarfs the wait between two and a second one posted holds (and reads into)
// another such buffer at once (2 of 24 runs read 256 MB at 2 GB/s with two; posting a whole
// stream's receives at once made large messages slower still).
int window_for(std::int64_t bytes) { return bytes >= (64 << 20) ? 1 : 2; }

Result<std::vector<at::Tensor>> receive_from(Endpoint& e, int peer, Tag tag) {
  auto got = receive_within(e, peer, tag, std::chrono::seconds(60));
  if (!got.is_ok()) std::fprintf(stderr, "receiving: %s\n", got.status().to_string().c_str());
  return got;
}

// Receives the `n` messages `peer` sends under tags `first` on, with `window` receives
// posted at a time, as a consumer that asks ahead does (the runtime posts a step's receives
// as it schedules them): each completion posts the next receive, on the transport's thread.
Status receive_stream(Endpoint& e, int peer, Tag first, int n, int window) {
  struct Stream {
    Stream(Endpoint& e, int peer, Tag first, int n, int window) : e(e), peer(peer), n(n), window(window), first(first), left(n) {}
    Endpoint& e;
    const int peer, n, window;
    const Tag first;
    std::atomic<int> left;
    std::promise<Status> finished;
    std::atomic<bool> failed{false};
    void post(int k, const std::shared_ptr<Stream>& self) {
      e.recv(peer, first + static_cast<Tag>(k), [this, k, self](Result<std::vector<at::Tensor>> got) {
        if (!got.is_ok()) {
          if (!failed.exchange(true)) finished.set_value(got.status());
          return;
        }
        got->clear();  // the buffer goes back to the pool before the next receive takes one
        if (k + window < n) post(k + window, self);
        if (--left == 0 && !failed) finished.set_value(Status::ok());
      });
    }
  };
  auto stream = std::make_shared<Stream>(e, peer, first, n, window);
  auto finished = stream->finished.get_future();
  for (int k = 0; k < std::min(window, n); ++k) stream->post(k, stream);
  if (finished.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    return Status(ErrorCode::kExecution, "a stream of " + std::to_string(n) + " messages did not arrive within 60 s");
  }
  return finished.get();
}

// The allreduce sizes: the point-to-point sizes (--min-kb times powers of 4) from 1 MB to
// 64 MB; and the rounds measured at each, after one that warms up.
std::vector<std::int64_t> allreduce_sizes(std::int64_t max_mb) {
  std::vector<std::int64_t> out;
  for (std::int64_t b = min_kb << 10; b <= std::min<std::int64_t>(max_mb, 64) << 20; b *= 4) {
    if (b >= (1 << 20)) out.push_back(b);
  }
  return out;
}
int allreduce_rounds(std::int64_t bytes, int iters) { return bytes >= (16 << 20) ? std::max(3, iters / 4) : iters; }

void print_allreduce_head(const std::string& members, int iters) {
  std::printf("\nallreduce over UCX, %s; median of %d\n", members.c_str(), iters);
  std::printf("%10s %12s %14s %16s %10s\n", "bytes", "time ms", "bus GB/s", "p2p bound GB/s", "ratio");
}

// One size's row: the median time of `n` members' allreduce, its bus bandwidth (bytes x
// 2(n-1)/n per second) and its ratio to the point-to-point bandwidth at that size.
void print_allreduce_row(std::int64_t bytes, int n, const std::vector<double>& times,
                         const std::map<std::int64_t, double>& p2p) {
  const double t = median(times), bus = static_cast<double>(bytes) * 2 * (n - 1) / n / t / 1e9;
  auto bound = p2p.find(bytes);
  const double b = bound == p2p.end() ? 0 : bound->second;
  std::printf("%10lld %12.3f %14.3f %16.3f %9.3fx\n", static_cast<long long>(bytes), t * 1e3, bus, b, b > 0 ? bus / b : 0);
}

// Allreduce of float32 tensors between the two processes (rank 0 prints), as
// conveyor.distributed's processes of one host run it: bus bandwidth (for two members the
// tensor's bytes per second) against the point-to-point bound at the same size, which a
// member's link cannot beat.
bool allreduce_of_two(const std::shared_ptr<UcxEndpoint>& me, int iters, std::int64_t max_mb,
                      const std::map<std::int64_t, double>* p2p) {
  auto group = make_endpoint_group(me, {0, 1}, 1);
  if (!group.is_ok()) return false;
  if (p2p != nullptr) print_allreduce_head("the 2 processes", iters);
  for (const std::int64_t bytes : allreduce_sizes(max_mb)) {
    at::Tensor t = at::ones({bytes / 4}, at::kFloat);
    std::vector<double> times;
    for (int k = 0; k <= allreduce_rounds(bytes, iters); ++k) {  // the first round warms up
      const auto start = Clock::now();
      // As conveyor.distributed waits (ProcessGroup::wait): advancing the endpoint a while itself.
      auto done = wait_within([&](Done d) { (*group)->allreduce(t, d); }, std::chrono::seconds(60), me.get());
      if (!done || !done->is_ok()) return false;
      if (k > 0) times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
    if (p2p != nullptr) print_allreduce_row(bytes, 2, times, *p2p);
  }
  return true;
}

// Process 1 (forked): receives each size's stream and acknowledges it, then echoes the pings.
void receiver(int out, int in, int iters, std::int64_t max_mb) {
  auto me = member_of_two(1, out, in);
  Tag tag = 1;
  for (std::int64_t bytes = min_kb << 10; bytes <= max_mb << 20; bytes *= 4) {
    const int n = messages_per_stream(bytes, iters);
    for (int round = 0; round <= measured_streams(bytes); ++round) {  // a warm-up stream, then the measured ones
      if (Status s = receive_stream(*me, 0, tag, n, window_for(bytes)); !s) {
        std::fprintf(stderr, "receiving: %s\n", s.to_string().c_str());
        std::exit(1);
      }
      tag += static_cast<Tag>(n);
      me->send(0, tag++, {at::zeros({1}, at::kLong)}, [](Status) {});
    }
  }
  const int pings = 10 * iters;
  for (int k = 0; k < pings; ++k) {
    auto got = receive_from(*me, 0, tag);
    if (!got.is_ok()) std::exit(1);
    me->send(0, tag++, *got, [](Status) {});
  }
  if (!on_cuda && !allreduce_of_two(me, iters, max_mb, nullptr)) std::exit(1);
  me->close_gracefully();
}

// Process 0: streams of messages to process 1 per size against memcpy, then ping-pong.
int two_process_point_to_point(int iters, std::int64_t max_mb, std::map<std::int64_t, double>& p2p) {
  int to_child[2], to_parent[2];
  if (pipe(to_child) != 0 || pipe(to_parent) != 0) return 1;
  std::fflush(stdout);
  const pid_t child = fork();
  if (child < 0) return 1;
  if (child == 0) {  // a fresh process (torch is not safe to use across fork): this program again
    const std::string fds = std::to_string(to_parent[1]) + "," + std::to_string(to_child[0]);
    const std::string mb = std::to_string(max_mb), kb = std::to_string(min_kb), n = std::to_string(iters);
    execl("/proc/self/exe", "transport", "--receiver", fds.c_str(), "--max-mb", mb.c_str(), "--min-kb", kb.c_str(), "--iters", n.c_str(),
          "--device", on_cuda ? "cuda" : "cpu", static_cast<char*>(nullptr));
    std::_Exit(127);
  }
  auto me = member_of_two(0, to_child[1], to_parent[0]);
  const char* shm = std::getenv("CONVEYOR_UCX_SHM");
  std::printf("UCX endpoint, 2 processes of this host over %s; a stream of 64 MB (%d to 2000 messages) per size\n",
              shm != nullptr && std::string(shm) == "0" ? "loopback tcp" : "shared memory", iters);
  if (on_cuda) std::printf("CUDA tensors from device memory to device memory, against a device-to-device copy\n");
  std::printf("%10s %14s %16s %14s %10s\n", "bytes", "ucx GB/s", "(slowest-fastest)", on_cuda ? "copy_ GB/s" : "memcpy GB/s",
              "ratio");
  Tag tag = 1;
  for (std::int64_t bytes = min_kb << 10; bytes <= max_mb << 20; bytes *= 4) {
    at::Tensor t = at::randint(0, 255, {bytes}, at::kByte);
    if (on_cuda) t = t.to(at::kCUDA);
    at::Tensor dst = at::empty_like(t);
    const int n = messages_per_stream(bytes, iters);
    // Each round a stream, then memcpy of the same bytes (A B A B: the slow spells of this
    // shared machine fall on both); the ratio is the median of the rounds' ratios.
    std::vector<double> streams, copies, ratios;  // GB/s of each measured round, and their ratio
    for (int round = 0; round <= measured_streams(bytes); ++round) {
      auto start = Clock::now();
      for (int k = 0; k < n; ++k) me->send(1, tag++, {t}, [](Status) {});
      if (!receive_from(*me, 1, tag++).is_ok()) return 1;
      const double s = std::chrono::duration<double>(Clock::now() - start).count();
      start = Clock::now();
      for (int k = 0; k < n; ++k) {
        if (on_cuda) {
          dst.copy_(t);
        } else {
          std::memcpy(dst.data_ptr(), t.data_ptr(), static_cast<std::size_t>(bytes));
        }
      }
      if (on_cuda) wait_for_current_streams({dst});
      const double c = std::chrono::duration<double>(Clock::now() - start).count();
      if (round == 0) continue;  // the first round warms up
      streams.push_back(static_cast<double>(bytes) * n / s / 1e9);
      copies.push_back(static_cast<double>(bytes) * n / c / 1e9);
      ratios.push_back(c / s);
    }
    const double u = median(streams), c = median(copies);
    const auto [slowest, fastest] = std::minmax_element(streams.begin(), streams.end());
    std::printf("%10lld %14.3f %7.2f-%-8.2f %14.3f %9.3fx\n", static_cast<long long>(bytes), u, *slowest, *fastest, c,
                median(ratios));
    p2p[bytes] = u;
  }
  at::Tensor small = at::zeros({1}, at::kLong);
  std::vector<double> rtt;
  for (int k = 0; k < 10 * iters; ++k) {
    const auto start = Clock::now();
    me->send(1, tag, {small}, [](Status) {});
    if (!receive_from(*me, 1, tag++).is_ok()) {
      int status = 0;
      waitpid(child, &status, 0);
      std::fprintf(stderr, "ping %d: the receiving process ended (status %d%s)\n", k, status,
                   WIFSIGNALED(status) ? ", killed by a signal" : "");
      return 1;
    }
    rtt.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(rtt.begin(), rtt.end());
  auto at = [&](double q) { return rtt[static_cast<std::size_t>(q * static_cast<double>(rtt.size() - 1))] / 2 * 1e6; };
  std::printf("small-message latency (half the round trip of 8 bytes): %.1f us (10%% of round trips under %.1f, 90%% under %.1f)\n",
              at(0.5), at(0.1), at(0.9));
  if (!on_cuda && !allreduce_of_two(me, iters, max_mb, &p2p)) {
    std::fprintf(stderr, "the allreduce of the two processes failed\n");
    return 1;
  }
  int status = 0;
  waitpid(child, &status, 0);
  me.reset();
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
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
  print_allreduce_head(std::to_string(n) + " members (threads of this process)", iters);
  for (const std::int64_t bytes : allreduce_sizes(max_mb)) {
    std::vector<at::Tensor> ts;
    for (int i = 0; i < n; ++i) ts.push_back(at::ones({bytes / 4}, at::kFloat));
    std::vector<double> times;
    for (int k = 0; k <= allreduce_rounds(bytes, iters); ++k) {  // the first round warms up
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
    print_allreduce_row(bytes, n, times, p2p);
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
    if (std::string(argv[i]) == "--min-kb") min_kb = std::max<std::int64_t>(1, std::atoll(argv[i + 1]));
    if (std::string(argv[i]) == "--device") on_cuda = std::string(argv[i + 1]) == "cuda";
  }
  if (on_cuda && !process_sees_a_gpu()) {
    std::fprintf(stderr, "--device cuda: this process sees no GPU (torch without CUDA, or none visible)\n");
    return 2;
  }
  setenv("UCX_NET_DEVICES", "lo", 0);
  // As `conveyor launch` runs its processes (tools/launch.cc): torch's large CPU allocations
  // on transparent huge pages. Set before torch allocates; the receiver inherits it.
  setenv("THP_MEM_ALLOC_ENABLE", "1", 0);
  // And the cores shared out between the two processes (OMP_NUM_THREADS, unless set lower):
  // with each one's intra-op pool sized for the whole machine, its idle workers spin on the
  // cores the other's transfers need (two cores: a 1 MB allreduce took 0.15-0.19 ms against
  // 0.06). The receiver, started afresh, inherits the variable.
  const long cores = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  long threads = std::max(1L, cores / 2);
  if (const char* set = std::getenv("OMP_NUM_THREADS"); set != nullptr && std::atol(set) > 0) {
    threads = std::min(threads, std::atol(set));
  }
  setenv("OMP_NUM_THREADS", std::to_string(threads).c_str(), 1);
  at::set_num_threads(static_cast<int>(threads));
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) != "--receiver") continue;
    int out = -1, in = -1;
    if (std::sscanf(argv[i + 1], "%d,%d", &out, &in) != 2) return 2;
    receiver(out, in, iters, max_mb);
    return 0;
  }
  std::map<std::int64_t, double> p2p;  // bytes -> GB/s
  if (int failed = two_process_point_to_point(iters, max_mb, p2p)) return failed;
  if (on_cuda) return 0;  // the allreduce below is of host tensors
  return allreduce_bus_bandwidth(members, iters, max_mb, p2p);
}
